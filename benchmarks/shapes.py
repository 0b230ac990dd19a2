"""The shapes of the performance suites, written once: the benchmarks and `make tune`
(benchmarks/tune.py) read them from here."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from common import Shape

# The forward suite (bench_forward.py), each a class of inputs: reranks of short and long
# docs, ColPali pages, a small head dim, in-batch training batches, few long docs, a corpus.
FORWARD = [
    Shape("colbert-rerank", 1, 1000, 32, 300, 128),
    Shape("text-long", 1, 1000, 32, 1024, 128),
    Shape("colpali-rerank", 1, 1000, 128, 1024, 128),
    Shape("colpali-compute", 1, 500, 1024, 1024, 128),
    Shape("lateon-edge", 1, 1000, 32, 1024, 48),
    Shape("inbatch-256", 256, 256, 32, 300, 128),
    Shape("longdoc", 16, 32, 32, 8192, 128),
    Shape("corpus-100k", 16, 100000, 32, 128, 128),
]
# Forward keys `make tune` also sweeps, which no forward suite row has: the training
# suite's ColPali batch, and a batched rerank (8 queries' candidates in one call), which on
# the default config (4 queries stacked) ran 14% slower than on its tuned one (H200, 0.112
# against 0.096 ms, commit 64e95e3; through lik.maxsim 0.115 -> 0.098 ms on an H100 and
# 0.113 -> 0.096 on an H200: commit a25e1d4).
_FORWARD = {shape.name: shape for shape in FORWARD}
# Cold start (bench_cold_start): (shape, whether its first call is a training step).
COLD_START = [
    (_FORWARD["colbert-rerank"], False),
    (_FORWARD["inbatch-256"], False),
    (Shape("train-inbatch-64", 64, 64, 32, 300, 128), True),
]
TUNED_ONLY = [
    Shape("train-colpali-32", 32, 32, 128, 1024, 128),
    Shape("rerank-8q", 8, 2000, 32, 300, 128),
]
# (name, Nq, Nd or docs per query (kd), Lq, Ld, d, layout): the training suite
# (bench_train.py); `make tune` keys and tunes their forward (argmax saved) and backward.
TRAIN = [
    ("inbatch-256", 256, 256, 32, 300, 128, "dense"),
    ("colpali-32", 32, 32, 128, 1024, 128, "dense"),
    ("kd-64x32", 64, 32, 32, 300, 128, "kd"),
]


# ---------------------------------------------------------------------------------------
# The shape-class grid (bench_forward.py --grid, bench_train.py --grid)


@dataclass(frozen=True)
class Cell:
    """One cell of the grid: a problem, its input dtype, how its tokens are masked, whether
    its docs have ragged lengths, and its layout. In the kd and pairs layouts shape.nd
    counts each query's docs (1 for pairs). benchmarks/grid.py builds the inputs.

    mask: "none"; "prefix" (queries and docs padded, masks from random lengths: ST's and
    colpali-engine's collators); "skiplist" (PyLate: the docs' attention mask with
    punctuation ids masked anywhere, queries unmasked); "multivector" (ST's MultiVectorMask:
    query padding, doc padding and skiplist holes).
    ragged: "" (doc lengths near the padded length); "padded" (lengths spread widely,
    padded with their d_mask); "packed" (the same docs packed, for the entries that take
    packed docs; the others get them padded).
    axes: the grid axes the cell stands for (not part of its identity).
    """

    shape: Shape
    axes: tuple[str, ...] = field(compare=False)
    dtype: str = "bf16"
    mask: str = "none"
    ragged: str = ""
    layout: str = "dense"

    @property
    def name(self) -> str:
        parts = [self.shape.name, f"d{self.shape.d}", self.dtype]
        parts += [self.mask] if self.mask != "none" else []
        parts += [f"ragged-{self.ragged}"] if self.ragged else []
        return "/".join(parts)

    @property
    def holes(self) -> bool:
        """Whether the doc mask has holes (no lengths can say which tokens are valid)."""
        return self.mask in ("skiplist", "multivector")

    @property
    def doc_rows(self) -> int:
        """Docs in the call: each query's own in the kd and pairs layouts."""
        nq, nd = self.shape.nq, self.shape.nd
        return nd if self.layout == "dense" else nq * nd

    @property
    def flops(self) -> int:
        return self.shape.flops  # nq * nd (query, doc) pairs in every layout

    def input_bytes(self, element_size: int = 2) -> int:
        s = self.shape
        return (s.nq * s.lq + self.doc_rows * s.ld) * s.d * element_size

    def bytes_moved(self, element_size: int = 2) -> int:
        """D and Q read once (padded), fp32 scores written once."""
        return self.input_bytes(element_size) + self.shape.nq * self.shape.nd * 4

    def train_bytes_moved(self, element_size: int = 2) -> int:
        """A training step's least traffic: Q and D read once and their gradients written
        once, in the input dtype; the fp32 scores written and their gradient read."""
        return 2 * self.input_bytes(element_size) + 2 * self.shape.nq * self.shape.nd * 4

    def as_dict(self) -> dict:
        return {**self.shape.as_dict(), "name": self.name, "axes": list(self.axes),
                "dtype": self.dtype, "mask": self.mask, "ragged": self.ragged,
                "layout": self.layout}  # fmt: skip


def _vary(base: Shape, **dims) -> Shape:
    """base with some of nq, nd, lq, ld or d changed; the changed lengths and counts (not
    the head dim, which every cell name carries) join its name."""
    named = [f"{key}{value}" for key, value in dims.items()
             if key != "d" and value != getattr(base, key)]  # fmt: skip
    return replace(base, name="-".join([base.name, *named]), **dims)


def _each_once(cells) -> list[Cell]:
    """The cells in order, each once: a cell that several axes share (the same problem under
    another base's name) keeps its first name and stands for each of them."""
    merged: dict[Cell, Cell] = {}
    for cell in cells:
        problem = replace(cell, shape=replace(cell.shape, name=""))
        first = merged.get(problem)
        merged[problem] = cell if first is None else replace(first, axes=first.axes + cell.axes)
    return list(merged.values())


HEAD_DIMS = (32, 48, 64, 96, 128, 256)
MASKS = ("prefix", "skiplist", "multivector")
SHORT_QUERIES, LONG_DOCS = (16, 32), (256, 1024, 4096)
COLPALI_QUERIES = (16, 64, 128)

# Forward bases: a rerank; long docs, 64 MB or more at every head dim (where the read-once
# ceiling applies); an in-batch batch; ColPali pages (1030 patches); kd and pairs.
RERANK = Shape("rerank", 1, 1000, 32, 300, 128)
LONG = Shape("long", 1, 1000, 32, 1024, 128)
SHORT = replace(LONG, name="short")
INBATCH = Shape("inbatch", 256, 256, 32, 300, 128)
COLPALI = Shape("colpali", 1, 1000, 128, 1030, 128)
GRID_FORWARD = _each_once([
    *(Cell(_vary(RERANK, d=d), ("head-dim",)) for d in HEAD_DIMS),
    *(Cell(_vary(RERANK, d=d), ("dtype",), dtype="fp16") for d in HEAD_DIMS),
    *(Cell(_vary(LONG, d=d), ("head-dim-64mb",)) for d in HEAD_DIMS),
    *(Cell(base, ("mask",), mask=mask) for base in (RERANK, INBATCH, COLPALI) for mask in MASKS),
    *(Cell(_vary(LONG, d=d), ("mask-head-dim",), mask=mask)
      for d in (48, 96) for mask in ("prefix", "multivector")),
    *(Cell(base, ("ragged",), ragged=form)
      for base in (RERANK, LONG, INBATCH) for form in ("padded", "packed")),
    *(Cell(_vary(SHORT, lq=lq, ld=ld), ("short-query",))
      for lq in SHORT_QUERIES for ld in LONG_DOCS),
    *(Cell(_vary(COLPALI, lq=lq), ("colpali",)) for lq in COLPALI_QUERIES),
    Cell(INBATCH, ("layout",)),
    Cell(Shape("kd", 64, 32, 32, 300, 128), ("layout",), layout="kd"),
    Cell(Shape("pairs", 1000, 1, 32, 300, 128), ("layout",), layout="pairs"),
])  # fmt: skip

# Training bases: the training suite's in-batch and kd steps, a short-query batch against
# long docs and ColPali pages (32 x 32), and pairs.
TRAIN_INBATCH = Shape("inbatch", 256, 256, 32, 300, 128)
TRAIN_KD = Shape("kd", 64, 32, 32, 300, 128)
TRAIN_SHORT = Shape("short", 32, 32, 32, 1024, 128)
TRAIN_COLPALI = Shape("colpali", 32, 32, 128, 1030, 128)
GRID_TRAIN = _each_once([
    *(Cell(_vary(TRAIN_INBATCH, d=d), ("head-dim",)) for d in HEAD_DIMS),
    *(Cell(_vary(TRAIN_INBATCH, d=d), ("dtype",), dtype="fp16") for d in (96, 128)),
    *(Cell(TRAIN_INBATCH, ("mask",), mask=mask) for mask in MASKS),
    *(Cell(TRAIN_KD, ("mask",), mask=mask, layout="kd") for mask in MASKS),
    *(Cell(TRAIN_INBATCH, ("ragged",), ragged=form) for form in ("padded", "packed")),
    *(Cell(_vary(TRAIN_SHORT, lq=lq, ld=ld), ("short-query",))
      for lq in SHORT_QUERIES for ld in LONG_DOCS),
    *(Cell(_vary(TRAIN_COLPALI, lq=lq), ("colpali",)) for lq in COLPALI_QUERIES),
    Cell(TRAIN_INBATCH, ("layout",)),
    Cell(TRAIN_KD, ("layout",), layout="kd"),
    Cell(Shape("pairs", 256, 1, 32, 300, 128), ("layout",), layout="pairs"),
])  # fmt: skip


def _named(base: Shape, **dims) -> Shape:
    """_vary for shapes outside a Cell: a changed head dim joins the name too."""
    shape = _vary(base, **dims)
    d = dims.get("d", base.d)
    return shape if d == base.d else replace(shape, name=f"{shape.name}-d{d}")


# fp8 reranks: PERF.md's anchor shape (one query against 8192 docs of 256 tokens) and 32768
# docs; the grid moves one axis of the anchor at a time (head dim, query and doc lengths,
# doc count, a few queries).
FP8_RERANK = Shape("fp8-rerank", 1, 8192, 32, 256, 128)
FP8 = [FP8_RERANK, Shape("fp8-rerank-32k", 1, 32768, 32, 256, 128)]
GRID_FP8 = [
    *FP8,
    *(_named(FP8_RERANK, d=d) for d in (64, 96)),
    *(_named(FP8_RERANK, lq=lq) for lq in (16, 64)),
    *(_named(FP8_RERANK, ld=ld) for ld in (128, 512)),
    _named(FP8_RERANK, nd=2048),
    _named(FP8_RERANK, nq=8),
]

# Top-k retrieval over a corpus: 100k docs (both implementations) and 1M (2^31 x 8 doc
# elements, past what late-interaction-kernels indexes). The grid moves one axis of the
# 100k corpus at a time (doc count up to 1M, head dim, doc length, query count) and asks
# for top-10 as well as top-100.
CORPUS = Shape("corpus-100k", 16, 100_000, 32, 128, 128)
RETRIEVE = [CORPUS, Shape("corpus-1m", 16, 1_000_000, 32, 128, 128)]
# (corpus, top_k) pairs.
GRID_RETRIEVE = [
    *((shape, 100) for shape in (*RETRIEVE, _named(CORPUS, nd=10_000),
                                 *(_named(CORPUS, d=d) for d in (64, 96)),
                                 _named(CORPUS, ld=300),
                                 *(_named(CORPUS, nq=nq) for nq in (1, 64)))),
    *((shape, 10) for shape in RETRIEVE),
]  # fmt: skip

# Autotune (bench_autotune): (name, layout, Nq, Nd, Lq, Ld) of calls whose forward keys
# have no committed entry.
AUTOTUNE = [
    ("1 x 10000 docs, Ld 300", "dense", 1, 10000, 32, 300),
    ("4 x 1000, Ld 300", "dense", 4, 1000, 32, 300),
    ("4 x 300, Lq 64, Ld 200", "dense", 4, 300, 64, 200),
    ("KD 16 x 32 docs, Ld 300", "kd", 16, 32, 32, 300),
]

# Autotune: (name, layout, Nq, Nd or docs per query (kd), Lq, Ld) of training steps without entries.
AUTOTUNE_TRAIN = [
    ("in-batch 32 x 32, Ld 300", "dense", 32, 32, 32, 300),
    ("in-batch 64 x 64, Lq 64, Ld 200", "dense", 64, 64, 64, 200),
    ("colpali 8 x 8, Lq 128, Ld 1024", "dense", 8, 8, 128, 1024),
    ("KD 16 x 16 docs, Ld 300", "kd", 16, 16, 32, 300),
]

# Backward strategies (bench_backward): (name, Nq, Nd, Lq, Ld) of in-batch steps, d 128:
# squares, then by docs per query.
BACKWARD = [
    ("4 x 4", 4, 4, 32, 300),
    ("16 x 16", 16, 16, 32, 300),
    ("31 x 31", 31, 31, 32, 300),
    ("16 x 16, Lq 64", 16, 16, 64, 200),
    ("8 x 8, colpali", 8, 8, 128, 1024),
    ("64 x 64", 64, 64, 32, 300),
    ("256 x 2", 256, 2, 32, 300),
    ("256 x 8", 256, 8, 32, 300),
    ("256 x 16", 256, 16, 32, 300),
    ("16 x 1000", 16, 1000, 32, 300),
    ("8 x 1000", 8, 1000, 32, 300),
    ("1 x 250", 1, 250, 32, 300),
    ("1 x 1000", 1, 1000, 32, 300),
]
# (name, Nq, Nd, (shortest, longest) query, (shortest, longest) doc) of ragged steps, d 128.
BACKWARD_RAGGED = [
    ("varlen 16 x 16", 16, 16, (16, 32), (50, 300)),
    ("varlen 32 x 32", 32, 32, (16, 32), (50, 300)),
    ("varlen 64 x 64", 64, 64, (16, 32), (50, 300)),
    ("varlen 128 x 128", 128, 128, (16, 32), (50, 300)),
    ("varlen 256 x 8", 256, 8, (16, 32), (50, 300)),
    ("varlen 1 x 1000", 1, 1000, (16, 32), (50, 300)),
]

# Through PyLate (bench_pylate): (name, PyLate function, Nq, Nd or K per query, Lq, Ld, d, training)
PYLATE = [
    ("rerank", "colbert_scores", 1, 4000, 32, 300, 128, False),
    ("inbatch-train", "colbert_scores", 32, 32, 32, 300, 128, True),
    ("kd-train", "colbert_kd_scores", 32, 16, 32, 300, 128, True),
]

# Token scores (bench_variants): (name, Nq, Nd, Lq, Ld, d) of a ColBERT in-batch step and
# the training suite's ColPali-sized one.
VARIANTS = [
    ("inbatch-128", 128, 128, 32, 300, 128),
    next(row[:6] for row in TRAIN if row[0] == "colpali-32"),
]
