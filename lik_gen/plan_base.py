"""What every planner shares: kernel arguments, launch formulas printed from sympy, the
layouts' shapes and the Triton kernels' argument lists (which the Metal planner reuses).

Planners build on these public names; none imports another planner's private ones.
"""

from __future__ import annotations

import dataclasses
import functools

import sympy
from sympy.printing.pycode import PythonCodePrinter

from lik_gen import plan_fp8
from lik_gen.ir import Backward, Decompression, Layout, Op, Score, Target, Variant
from lik_gen.plan_score import RECOMPUTE_SIZES


@dataclasses.dataclass(frozen=True)
class KernelArg:
    """One runtime argument of a kernel and the launcher expression that supplies it."""

    name: str
    expr: str


@dataclasses.dataclass(frozen=True)
class Formula:
    """A derived launch quantity, printed as a Python function into the glue."""

    name: str
    params: tuple[str, ...]
    expr: str
    doc: str


# Layouts whose forward stacks QUERY_GROUP queries' tokens into one query tile (every
# query scores every doc): in-batch padded (dense) and in-batch packed (varlen).
STACKED_LAYOUTS = ("dense", "varlen")


class PlanError(ValueError):
    pass


class _Printer(PythonCodePrinter):
    """Prints integer formulas without the math module: ceil(a/b) as cdiv(a, b)."""

    def _print_ceiling(self, expr):
        num, den = sympy.fraction(sympy.together(expr.args[0]))
        return f"cdiv({self._print(num)}, {self._print(den)})"


@functools.cache
def pycode(expr: sympy.Expr) -> str:
    # Cached: the same few formulas recur across hundreds of variants, and simplify is slow.
    return _Printer().doprint(sympy.simplify(expr))


def formula(name: str, expr: sympy.Expr, params: tuple[str, ...], doc: str) -> Formula:
    missing = {str(s) for s in expr.free_symbols} - set(params)
    if missing:
        raise PlanError(f"formula {name} uses symbols {sorted(missing)} it does not take")
    return Formula(name, params, pycode(expr), doc)


# Sizes named as the launcher names them.
Nq, Nd, K, B, P, Lq, Ld, n_rows, total_d = sympy.symbols(
    "Nq Nd K B P Lq Ld n_rows total_d", integer=True, positive=True
)
BLOCK_Q, BLOCK_L, BLOCK_K, BLOCK_N, BLOCK_R, QUERY_GROUP, num_stages = sympy.symbols(
    "BLOCK_Q BLOCK_L BLOCK_K BLOCK_N BLOCK_R QUERY_GROUP num_stages", integer=True, positive=True
)
GRAD_Q_TOKENS = sympy.Symbol("GRAD_Q_TOKENS", integer=True, positive=True)
DOCS_PER_PROGRAM, DOC_SPLITS = sympy.symbols(
    "DOCS_PER_PROGRAM DOC_SPLITS", integer=True, positive=True
)
# Sizes as (name, tensor, what of it): "D" stands for the doc source's shape tensor.
_PADDED_Q = (("Nq", "Q", "shape[0]"), ("Lq", "Q", "shape[1]"), ("dim", "Q", "shape[2]"))
_RAGGED = (("Nq", "cu_seqlens_q", "shape[0] - 1"), ("Nd", "cu_seqlens_d", "shape[0] - 1"),
           ("dim", "Q", "shape[1]"), ("total_q", "Q", "shape[0]"),
           ("total_d", "D", "shape[0]"))  # fmt: skip

# Per layout: the launcher's sizes (layout_sizes), the output and argmax shapes,
# queries and docs per query, the tensors that locate ragged sequences, and the stride
# axes of Q, D (and their gradients) and of the per-pair tensors (scores, grad, argmax).
LAYOUT_SHAPES = {
    Layout.DENSE: dict(
        sizes=_PADDED_Q + (("Nd", "D", "shape[0]"), ("Ld", "D", "shape[1]")),
        queries=Nq, docs=Nd, doc_count=Nd, ragged=(),
        q_axes=("b", "s", "k"), doc_axes=("b", "t", "k"), pair_axes=("b", "c"),
        output="[Nq, Nd]", argmax="[Nq, Nd, Lq]",
    ),
    Layout.KD: dict(
        sizes=_PADDED_Q + (("K", "D", "shape[1]"), ("Ld", "D", "shape[2]")),
        queries=Nq, docs=K, doc_count=Nq * K, ragged=(),
        q_axes=("b", "s", "k"), doc_axes=("b", "c", "t", "k"), pair_axes=("b", "c"),
        output="[Nq, K]", argmax="[Nq, K, Lq]",
    ),
    Layout.PAIRS: dict(
        sizes=(("B", "Q", "shape[0]"), ("Lq", "Q", "shape[1]"), ("dim", "Q", "shape[2]"),
               ("Ld", "D", "shape[1]")),
        queries=B, docs=sympy.Integer(1), doc_count=B, ragged=(),
        q_axes=("b", "s", "k"), doc_axes=("b", "t", "k"), pair_axes=("b",),
        output="[B]", argmax="[B, Lq]",
    ),
    Layout.VARLEN: dict(
        sizes=_RAGGED, queries=Nq, docs=Nd, doc_count=Nd,
        ragged=("cu_seqlens_q", "cu_seqlens_d"),
        q_axes=("s", "k"), doc_axes=("t", "k"), pair_axes=("b", "c"),
        output="[Nq, Nd]", argmax="[Nq, Nd, max_seqlen_q]",
    ),
    Layout.PACKED_PAIRS: dict(
        sizes=(("P", "pair_q_idx", "shape[0]"),) + _RAGGED,
        queries=P, docs=sympy.Integer(1), doc_count=P,
        ragged=("cu_seqlens_q", "cu_seqlens_d", "pair_q_idx", "pair_d_idx"),
        q_axes=("s", "k"), doc_axes=("t", "k"), pair_axes=("b",),
        output="[P]", argmax="[P, max_seqlen_q]",
    ),
}  # fmt: skip


def strides(prefix: str, tensor: str, axes: tuple[str, ...]) -> list[KernelArg]:
    return [
        KernelArg(f"stride_{prefix}{axis}", f"{tensor}.stride({i})") for i, axis in enumerate(axes)
    ]


# The sizes each kernel reads, per layout: the count it splits program ids by or loops
# over, then the token counts and the head dim. Anything else would be a dead argument.
KERNEL_SIZES = {
    "fwd": {Layout.DENSE: ("Nq", "Lq", "Ld"), Layout.KD: ("K", "Lq", "Ld"),
            Layout.PAIRS: ("Lq", "Ld"),
            Layout.VARLEN: ("Nq", "Nd", "max_seqlen_q", "total_q", "total_d"),
            Layout.PACKED_PAIRS: ("Nq", "Nd", "max_seqlen_q", "total_q", "total_d")},
    "bwd": {Layout.DENSE: ("Nq", "Nd", "Lq"), Layout.KD: ("K", "Lq"), Layout.PAIRS: ("Lq",),
            Layout.VARLEN: ("Nq", "Nd", "total_q"),
            Layout.PACKED_PAIRS: ("Nq", "Nd", "total_q")},
    "bwd_q": {Layout.DENSE: ("Nd", "Lq"), Layout.KD: ("K", "Lq"), Layout.PAIRS: ("Lq",),
              Layout.VARLEN: ("Nd", "Lq", "total_q")},
    "bwd_d": {Layout.DENSE: ("Nq", "Lq", "Ld"), Layout.KD: ("K", "Lq", "Ld"),
              Layout.PAIRS: ("Lq", "Ld"), Layout.VARLEN: ("Nq", "Nd", "Lq")},
    "bwd_route": {Layout.DENSE: ("Nq", "Lq", "Ld"), Layout.VARLEN: ("Nq", "Nd", "Lq", "total_d")},
}  # fmt: skip
# Ragged launchers have no Lq: the lowmem kernels' query-token bound is max_seqlen_q.
RAGGED_SIZE_EXPR = {"Lq": "max_seqlen_q"}


def layout_sizes(layout: Layout, shape_of: str = "D") -> tuple[KernelArg, ...]:
    """The launcher's sizes of a layout, the doc sizes read from tensor `shape_of`."""
    return tuple(
        KernelArg(name, f"{shape_of if tensor == 'D' else tensor}.{what}")
        for name, tensor, what in LAYOUT_SHAPES[layout]["sizes"]
    )


def kernel_args(
    variant: Variant, docs: DocSource | None = None
) -> dict[str, tuple[KernelArg, ...]]:
    """Exactly the arguments each kernel reads, in order, with their launcher expressions.
    docs: where the forward's docs come from, in place of D (uncompressed by default)."""
    layout, normalize = variant.layout, variant.normalize
    shape = LAYOUT_SHAPES[layout]
    doc_axes, pair_axes, q_axes = shape["doc_axes"], shape["pair_axes"], shape["q_axes"]
    ragged = [KernelArg(name, name) for name in shape["ragged"]]
    size_expr = RAGGED_SIZE_EXPR if ragged else {}

    def sizes(kernel: str) -> list[KernelArg]:
        names = KERNEL_SIZES[kernel].get(layout, ())
        if kernel == "fwd" and (variant.op is Op.TOPK or streams_docs(variant)):
            names = ("Nq", "Nd", "Lq", "Ld")  # blocks of docs end at Nd
        extra = [KernelArg(a.name, a.name) for a in docs.sizes] if docs and kernel == "fwd" else []
        return [KernelArg(s, size_expr.get(s, s)) for s in names + ("dim",)] + extra

    q, q_strides = [KernelArg("Q", "Q")], strides("q", "Q", q_axes)
    d, d_strides = [KernelArg("D", "D")], strides("d", "D", doc_axes)
    if docs is not None:
        d, d_strides = list(docs.tensors), list(docs.strides)
    grad, grad_strides = [KernelArg("Grad", "grad_out")], strides("g", "grad_out", pair_axes)
    argmax = [KernelArg("Argmax", "argmax")]
    argmax_strides = strides("a", "argmax", pair_axes + ("s",))
    gq, gq_strides = [KernelArg("GQ", "GQ")], strides("gq", "GQ", q_axes)
    gd, gd_strides = [KernelArg("GD", "GD")], strides("gd", "GD", doc_axes)

    fwd = q + d
    fwd_strides = q_strides + d_strides
    if plan_fp8.is_scaled(variant):  # dequantization scales, read through their strides
        for name, expr, prefix, axes in plan_fp8.SCALE_TENSORS:
            fwd += [KernelArg(name, expr)]
            fwd_strides += strides(prefix, expr, axes)
    if variant.mask.has_q:
        fwd += [KernelArg("q_mask", "q_mask")]
    if variant.mask.has_d:
        fwd += [KernelArg("d_mask", "d_mask")]
        # Each doc's count of valid tokens, for the flat loop of streamed short docs only:
        # the other loops count them per doc (kernel_lib.doc_extent).
        if variant.target is Target.TRITON and streams_docs(variant):
            fwd += [KernelArg("d_tokens", "valid_tokens(d_mask) if config.flat_docs else None")]
    if variant.mask.has_q:
        fwd_strides += strides("qm", "q_mask", ("b", "s"))
    if variant.mask.has_d:
        fwd_strides += strides("dm", "d_mask", doc_axes[:-1])
    if variant.op is Op.TOPK:
        # Each program writes its doc block's best TOP_K (score, doc) per query.
        fwd += [KernelArg("CandScores", "out"), KernelArg("CandDocs", "cand_docs")]
        fwd_strides += strides("cs", "out", ("b", "c", "k")) + strides(
            "cd", "cand_docs", ("b", "c", "k")
        )
    else:
        fwd += ragged + [KernelArg("Out", "out")]
        fwd_strides += strides("o", "out", pair_axes)
    if streams_docs(variant):  # long docs split: each token range's row maxima, and
        # per (doc, query group) the ranges done (the last one reduces them)
        fwd += [KernelArg("Partial", "partial"), KernelArg("Arrivals", "arrivals")]
    # Hooked token scores: weights w[query, s] (weighted), a temperature (smooth), and
    # what the backward needs instead of an argmax.
    weighted, smooth = variant.score is Score.WEIGHTED, variant.score is Score.SMOOTH
    weights = [KernelArg("W", "W")] if weighted else []
    w_strides = strides("w", "W", ("b", "s")) if weighted else []
    tau = [KernelArg("tau", "tau")] if smooth else []
    saved_axes = pair_axes + ("s",) + (("k",) if variant.score is Score.TOPK_MEAN else ())
    saved, saved_strides = [KernelArg("Saved", "saved")], strides("sv", "saved", saved_axes)
    fwd = fwd[:2] + weights + fwd[2:] + tau
    fwd_strides = fwd_strides + w_strides
    if variant.backward is not Backward.NONE and variant.score is Score.MAX:
        fwd += argmax
        fwd_strides += argmax_strides
    elif variant.backward is not Backward.NONE:
        fwd += saved
        fwd_strides += saved_strides
    # grad_Q reads the raw queries only for the normalization Jacobian; grad_D likewise
    # reads the raw doc tokens only then.
    if variant.score is not Score.MAX:
        return {
            "fwd": tuple(fwd + sizes("fwd") + fwd_strides),
            **recompute_args(variant, weights, tau, saved, saved_strides),
        }
    bwd_q_inputs = (q if normalize else []) + d + ragged + grad + argmax
    bwd_q_strides = (q_strides if normalize else []) + d_strides
    bwd_d_inputs = q + (d if normalize else []) + ragged + grad + argmax
    bwd_d_strides = q_strides + (d_strides if normalize else [])
    # Dense and varlen grad_D read the winner lists a route pass writes (lowmem.py.j2),
    # and each program's facts: where its list starts and its length, and for varlen its
    # doc and first token, which the route pass finds from the doc offsets.
    route, route_args = [], ()
    if routes_grad_d(variant):
        route = [KernelArg("Route", "route"), KernelArg("TileFacts", "tile_facts")]
        route_names = KERNEL_SIZES["bwd_route"][layout]
        route_sizes = [KernelArg(s, size_expr.get(s, s)) for s in route_names]
        doc_offsets = [KernelArg("cu_seqlens_d", "cu_seqlens_d")] if ragged else []
        route_args = tuple(argmax + doc_offsets + route + route_sizes + argmax_strides)
    return {
        "bwd_route": route_args,
        "fwd": tuple(fwd + sizes("fwd") + fwd_strides),
        "bwd": tuple(q + d + ragged + grad + argmax + gq + gd + sizes("bwd") + q_strides + d_strides
                     + grad_strides + argmax_strides + gq_strides + gd_strides),
        "bwd_q": tuple(bwd_q_inputs + gq + sizes("bwd_q") + bwd_q_strides + grad_strides
                       + argmax_strides + gq_strides),
        "bwd_d": tuple(bwd_d_inputs + route + gd + sizes("bwd_d") + bwd_d_strides + grad_strides
                       + argmax_strides + gd_strides),
    }  # fmt: skip


def recompute_args(variant, weights, tau, saved, saved_strides):
    """The recompute backward's kernels: both re-read Q, D, the masks and the weights."""
    layout, mask = variant.layout, variant.mask
    shape = LAYOUT_SHAPES[layout]
    masks = [KernelArg(m, m) for m, has in (("q_mask", mask.has_q), ("d_mask", mask.has_d)) if has]
    input_strides = (
        strides("q", "Q", shape["q_axes"])
        + strides("d", "D", shape["doc_axes"])
        + (strides("qm", "q_mask", ("b", "s")) if mask.has_q else [])
        + (strides("dm", "d_mask", shape["doc_axes"][:-1]) if mask.has_d else [])
        + (strides("w", "W", ("b", "s")) if weights else [])
    )
    grad_strides = strides("g", "grad_out", shape["pair_axes"])
    inputs = [KernelArg("Q", "Q"), KernelArg("D", "D")] + masks + weights
    per_pair = [KernelArg("Grad", "grad_out"), *saved]

    def sizes(kernel: str) -> list[KernelArg]:
        return [KernelArg(s, s) for s in RECOMPUTE_SIZES[kernel][layout] + ("dim",)]

    gq = [KernelArg("GQ", "GQ")] + ([KernelArg("GW", "GW")] if weights else [])
    gq_strides = strides("gq", "GQ", ("b", "s", "k")) + (
        strides("gw", "GW", ("b", "s")) if weights else []
    )
    gd_strides = strides("gd", "GD", shape["doc_axes"])
    return {
        "bwd": (),
        "bwd_q": tuple(inputs + per_pair + gq + tau + sizes("bwd_q") + input_strides
                       + grad_strides + saved_strides + gq_strides),
        "bwd_d": tuple(inputs + per_pair + [KernelArg("GD", "GD")] + tau + sizes("bwd_d")
                       + input_strides + grad_strides + saved_strides + gd_strides),
    }  # fmt: skip


def routes_grad_d(variant: Variant) -> bool:
    """Whether the lowmem grad_D reads winner lists from a route pass (Triton, dense or
    varlen, max): every query scores every doc, so a one-hot tile over whole queries
    would be mostly zeros. Metal keeps its own one-query-at-a-time loop."""
    return (
        variant.target is Target.TRITON
        and variant.backward is Backward.LOWMEM
        and variant.score is Score.MAX
        and variant.layout in KERNEL_SIZES["bwd_route"]
    )


# Layouts whose docs all hold Ld tokens (ragged ones end each doc at its own length).
EVEN_TILE_LAYOUTS = (Layout.DENSE, Layout.KD, Layout.PAIRS)


def streams_docs(variant: Variant) -> bool:
    """Whether each forward program walks a block of docs: dense inference with the plain
    max (no argmax to save, no token-score hook).

    Short docs are one or two tiles (a 128-token corpus doc, a 256-token fp8 rerank doc):
    with one program per doc the load pipeline never fills and every program reloads its
    query tile. Streaming DOCS_PER_PROGRAM docs through one flat (doc, tile) loop keeps
    the next doc's tiles in flight. Longer docs under a stacked query tile walk a few docs
    each, one tile loop per doc, so the tall query tile is loaded once for all of them.
    """
    # fp8 docs do not gain: on an H200 (Nq 1, Nd 8192, Ld 256) one doc per program ran
    # 0.104 ms and blocks of 4-32 docs 0.108-0.124 ms; with the 64-row query tile, 0.088
    # against 0.094-0.103 ms for blocks of 2-16 docs.
    return (
        variant.op is Op.MAXSIM
        and not plan_fp8.is_scaled(variant)
        and variant.layout is Layout.DENSE
        and variant.backward is Backward.NONE
        and variant.score is Score.MAX
        and variant.target is Target.TRITON
    )


def has_even_tiles(variant: Variant) -> bool:
    """Whether every doc holds Ld tokens (uncompressed, padded layouts): the forward takes
    EVEN_LD (BLOCK_L divides Ld) and then, without a doc mask, masks no doc token."""
    return variant.layout in EVEN_TILE_LAYOUTS and variant.decompression is Decompression.NONE


def trains_dense(variant: Variant) -> bool:
    """The dense training forward with the argmax saved, whose docs all hold Ld tokens:
    without a doc mask it peels its partial last tile, and may keep its argmax per tile
    column (COLUMN_ARGMAX)."""
    return (
        variant.layout is Layout.DENSE
        and has_even_tiles(variant)
        and variant.backward is not Backward.NONE
        and variant.score is Score.MAX
    )


def peels_tail(variant: Variant) -> bool:
    """Whether the forward may score a doc's partial last tile after its whole ones, in a
    tile of TAIL_L tokens: streamed dense inference (where dispatch chooses per call),
    and the dense training forward."""
    return streams_docs(variant) or trains_dense(variant)


@dataclasses.dataclass(frozen=True)
class DocSource:
    """Where a kernel's docs come from: the doc-tile hook and what it reads.

    tensors and strides take the place of D and its strides in every argument list;
    launcher names the launcher parameters in place of "D"; shape_of the tensor whose
    shape gives the doc sizes. The hook's call is _load_doc_tile(*tile_inputs, offs_t,
    offs_k, d_len, dim, *tile_params); bases name each doc tensor's first-token offset
    and its stride prefix. With `ahead` (argument names) the hook also defines
    _doc_tile_ahead(*ahead, offs_t, d_len), a part of the tile the loops load one tile
    ahead. token_rows: the forward scores tile @ q^T (doc tokens as rows), so a decoded
    tile feeds the MMA as its left operand without a transpose.
    """

    hook: str
    tensors: tuple[KernelArg, ...]
    strides: tuple[KernelArg, ...]
    launcher: tuple[str, ...]
    shape_of: str
    tile_inputs: tuple[str, ...]
    tile_params: tuple[str, ...]
    bases: tuple[tuple[str, str], ...]
    lengths: bool = False  # a per-doc length (doc_lengths) bounds each padded doc
    ahead: tuple[str, ...] = ()
    token_rows: bool = False
    nbits: int = 0
    sizes: tuple[KernelArg, ...] = ()  # sizes the hook reads beyond the layout's
    dot_dtype_of: str = "Q"  # the launcher tensor whose dtype is the dot dtype


def uncompressed_docs(variant: Variant, doc_axes: tuple[str, ...]) -> DocSource:
    """Docs stored as D; streaming forwards' loads may carry an evict-first hint."""
    return DocSource(
        hook="triton/load_doc_tile/none.py.j2",
        tensors=(KernelArg("D", "D"),),
        strides=tuple(strides("d", "D", doc_axes)),
        launcher=("D",),
        shape_of="D",
        tile_inputs=("D", "d_base"),
        tile_params=("stride_dt", "stride_dk", "EVICT_DOCS" if streams_docs(variant) else "False"),
        bases=(("d_base", "d"),),
    )
