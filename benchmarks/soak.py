"""Randomized soak: lik's public entries on random inputs against the float64 reference.

Each case draws what users pass: layouts (in-batch, KD, pairs, one query, one doc),
dtypes, sizes from one token to thousands (across the runtime's strategy thresholds and
query chunks), masks, normalization, memory layouts (contiguous, sliced, permuted
storage) and backward strategies; ragged batches and pair lists, retrieval, other token
scores (weighted, smooth, top-k mean), fp8 docs, the fused head and PLAID docs. Scores
and gradients are checked against the reference with the test suite's tolerances. A case
is replayed from its seed alone.

    python3 benchmarks/soak.py --seconds 600 --workers 8   # GPU; report in --out
    python3 benchmarks/soak.py --case SEED                 # replay one case
    python3 benchmarks/soak.py --dry-run                   # CPU, tiny sizes, seconds

Compiling dominates a GPU soak (most cases key a new kernel specialization), so --workers
runs that many processes with their own seeds side by side; a worker whose CUDA context
breaks (an illegal address) records the case and stops, and one still in a case
GRACE_SECONDS past the soak time is stopped, its case named in the report as cut off. A
first soak of an H200 found queries whose tile outgrew shared memory (fp32, or head dim
256 past 256 tokens), docs stored token-major faulting under nested docs and bf16
fused-head gradients off by up to 10% (docs rounded before scoring); all three are tests
now.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from common import (
    RESULTS,
    environment_info,
    markdown_table,
    provenance,
    result_stem,
    write_json,
    write_results,
)

TOLERANCE = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 1e-2}
FP8_TOLERANCE = 5e-2
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.bfloat16)


@dataclass(frozen=True)
class Scale:
    """Bounds of the drawn sizes."""

    queries: int
    docs: int
    query_tokens: int
    doc_tokens: int
    long_query_tokens: int  # one case in ten
    long_doc_tokens: int  # one case in seven
    head_dims: tuple[int, ...]
    scored_tokens: float  # Nq * Nd * Lq * Ld of a forward case at most
    trained_tokens: float  # the same for a case with gradients


SCALES = {
    "gpu": Scale(300, 3000, 300, 1100, 1100, 9000,
                 (1, 3, 8, 16, 32, 48, 64, 96, 100, 128, 128, 128, 200, 256), 3e8, 4e7),
    "tiny": Scale(3, 5, 9, 24, 20, 70, (1, 8, 16, 24, 33), 2e4, 1e4),
}  # fmt: skip


class Draw:
    """A case's random choices (from its seed) and tensors (from its generator)."""

    def __init__(self, seed: int, scale: Scale, device: str):
        self.rng = random.Random(seed)
        self.scale = scale
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def choice(self, options):
        return self.rng.choice(list(options))

    def chance(self, p: float) -> bool:
        return self.rng.random() < p

    def size(self, low: int, high: int) -> int:
        """Log-uniform in [low, high]: small sizes as often as large ones."""
        value = math.exp(self.rng.uniform(math.log(low), math.log(high + 0.999)))
        return min(high, max(low, int(value)))

    def randn(self, *shape, dtype=torch.float32) -> torch.Tensor:
        return torch.randn(*shape, generator=self.generator, device=self.device).to(dtype)

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype):
        """(tensor, memory layout): contiguous, a slice of a wider tensor, or a permuted
        storage seen through the inverse permutation."""
        layout = self.choice(["contiguous", "contiguous", "sliced", "permuted"])
        if layout == "sliced":
            return self.randn(*shape[:-1], 2 * shape[-1] + 1, dtype=dtype)[..., 1::2], layout
        if layout == "permuted" and len(shape) > 1:
            order = list(range(len(shape)))
            self.rng.shuffle(order)
            stored = self.randn(*[shape[i] for i in order], dtype=dtype)
            return stored.permute(*sorted(range(len(order)), key=order.__getitem__)), layout
        return self.randn(*shape, dtype=dtype), "contiguous"

    def mask(self, shape: tuple[int, ...], p: float = 0.4) -> torch.Tensor | None:
        if not self.chance(p):
            return None
        valid = self.choice([0.0, 0.3, 0.9, 1.0])
        return torch.rand(shape, generator=self.generator, device=self.device) < valid

    def sizes(self, grad: bool) -> tuple[int, int, int, int, int]:
        """(Nq, Nd, Lq, Ld, d) within the scale, halved at random until scored tokens fit."""
        s = self.scale
        nq, nd = self.size(1, s.queries), self.size(1, s.docs)
        lq = self.size(1, s.query_tokens if self.chance(0.9) else s.long_query_tokens)
        ld = self.size(1, s.doc_tokens if self.chance(0.85) else s.long_doc_tokens)
        d = self.choice(s.head_dims)
        if grad:  # d 1 ties exactly in low precision, where gradients pick one token
            d = max(d, 8)
        sizes = [nq, nd, lq, ld]
        while math.prod(sizes) > (s.trained_tokens if grad else s.scored_tokens):
            axis = self.rng.randrange(4)
            sizes[axis] = max(1, sizes[axis] // 2)
        return (*sizes, d)


def _trainable(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(leaf, scored): a leaf holding t's values and the view of it that is scored, with
    t's strides. A copy keeps dense strides (permuted storage) but not a slice's, so a
    sliced t is rebuilt as the same slice of a wider leaf."""
    copy = t.detach().clone()
    if copy.stride() == t.stride():
        copy.requires_grad_()
        return copy, copy
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1] + 1, dtype=t.dtype, device=t.device)
    wide[..., 1::2] = t.detach()
    wide.requires_grad_()
    return wide, wide[..., 1::2]


def _bounded_kd_docs(rows: int, per_row: int, ld: int, d: int, limit: float) -> tuple[int, int]:
    """(rows, ld) halved, the larger first, until [rows, per_row, ld, d] docs hold at most
    `limit` elements (a KD or padded batch of docs, one block of them per query)."""
    while rows * per_row * ld * d > limit:
        rows, ld = (max(1, rows // 2), ld) if rows >= ld else (rows, max(1, ld // 2))
    return rows, ld


def _with_gradients(draw: Draw, score, reference, inputs, tolerance, names):
    """Checks of score(*inputs), in the inputs' memory layouts, and of the gradients of a
    random weighting of it."""
    leaves, scored = zip(*(_trainable(t) for t in inputs), strict=True)
    out = score(*scored)
    weights = draw.randn(*out.shape)
    (out * weights).sum().backward()
    exact = [t.detach().double().requires_grad_() for t in inputs]
    ref = reference(*exact)
    (ref * weights.double()).sum().backward()
    checks = [("scores", out.detach(), ref.detach(), tolerance)]
    for name, leaf, view, want in zip(names, leaves, scored, exact, strict=True):
        grad = leaf.grad if view is leaf else leaf.grad[..., 1::2]
        checks.append((f"grad_{name}", grad, want.grad, tolerance))
    return checks


def maxsim_case(draw: Draw, grad: bool):
    from lik.runtime import maxsim, maxsim_pairs
    from lik.runtime.reference import maxsim_pairs_reference, maxsim_reference

    layout = draw.choice(["in-batch", "in-batch", "kd", "pairs", "one query", "one doc"])
    dtype = draw.choice(DTYPES)
    nq, nd, lq, ld, d = draw.sizes(grad)
    if layout == "kd":  # Nq x K docs: K of a few dozen, and their elements bounded
        nd = min(nd, 64)
        nq, ld = _bounded_kd_docs(nq, nd, ld, d, draw.scale.scored_tokens)
    q_shape = (lq, d) if layout == "one query" else (nq, lq, d)
    d_shape = {"kd": (nq, nd, ld, d), "pairs": (nq, ld, d), "one doc": (ld, d)}.get(
        layout, (nd, ld, d)
    )
    Q, q_layout = draw.tensor(q_shape, dtype)
    D, d_layout = draw.tensor(d_shape, dtype)
    q_mask, d_mask = draw.mask(q_shape[:-1]), draw.mask(d_shape[:-1])
    normalize = draw.chance(0.5)
    backward = draw.choice([None, "unified", "lowmem"]) if grad else None
    info = {"entry": "maxsim_pairs" if layout == "pairs" else "maxsim", "layout": layout,
            "dtype": str(dtype), "Q": q_shape, "D": d_shape, "memory": (q_layout, d_layout),
            "q_mask": q_mask is not None, "d_mask": d_mask is not None, "normalize": normalize,
            "backward": backward if grad else "no gradients"}  # fmt: skip
    score = maxsim_pairs if layout == "pairs" else maxsim
    reference = maxsim_pairs_reference if layout == "pairs" else maxsim_reference
    if not grad:
        with torch.no_grad():
            out = score(Q, D, q_mask, d_mask, normalize=normalize)
        ref = reference(Q.double(), D.double(), q_mask, d_mask, normalize=normalize)
        return info, [("scores", out, ref, TOLERANCE[dtype])]
    checks = _with_gradients(
        draw,
        lambda q, k: score(q, k, q_mask, d_mask, normalize=normalize, backward=backward),
        lambda q, k: reference(q, k, q_mask, d_mask, normalize=normalize),
        (Q, D), TOLERANCE[dtype], ("Q", "D"),
    )  # fmt: skip
    for name, mask, (_, grad_, _, _) in (("Q", q_mask, checks[1]), ("D", d_mask, checks[2])):
        if mask is not None:  # masked tokens take no gradient
            leak = grad_[~mask]
            checks.append((f"grad_{name} of masked tokens", leak, torch.zeros_like(leak), 0.0))
    return info, checks


def token_score_case(draw: Draw, grad: bool):
    from lik.runtime import maxsim_smooth, maxsim_topk_mean, maxsim_weighted
    from lik.runtime.reference import maxsim_scored_reference

    score = draw.choice(["weighted", "smooth", "topk_mean"])
    pairs = draw.chance(0.3)
    dtype = draw.choice(DTYPES)
    nq, nd, lq, ld, d = draw.sizes(grad)
    lq = min(lq, draw.scale.query_tokens)
    q_shape, d_shape = (nq, lq, d), ((nq, ld, d) if pairs else (nd, ld, d))
    Q, q_layout = draw.tensor(q_shape, dtype)
    D, d_layout = draw.tensor(d_shape, dtype)
    q_mask, d_mask = draw.mask(q_shape[:-1]), draw.mask(d_shape[:-1])
    normalize = draw.chance(0.5)
    options = {"weighted": {"weights": draw.randn(nq, lq).abs()},
               "smooth": {"tau": draw.choice([0.02, 0.1, 1.0])},
               "topk_mean": {"k": draw.size(1, 16)}}[score]  # fmt: skip
    entry = {"weighted": maxsim_weighted, "smooth": maxsim_smooth,
             "topk_mean": maxsim_topk_mean}[score]  # fmt: skip
    info = {"entry": entry.__name__, "pairs": pairs, "dtype": str(dtype), "Q": q_shape,
            "D": d_shape, "memory": (q_layout, d_layout), "q_mask": q_mask is not None,
            "d_mask": d_mask is not None, "normalize": normalize,
            "options": {k: (v if k != "weights" else "random") for k, v in options.items()},
            "gradients": grad}  # fmt: skip

    def scored(q, k):
        if score == "weighted":
            return entry(q, k, options["weights"], q_mask, d_mask, normalize=normalize,
                         pairs=pairs)  # fmt: skip
        return entry(q, k, q_mask, d_mask, normalize=normalize, pairs=pairs, **options)

    def reference(q, k):
        exact = {n: (v.double() if n == "weights" else v) for n, v in options.items()}
        return maxsim_scored_reference(q, k, q_mask, d_mask, score=score, normalize=normalize,
                                       pairs=pairs, **exact)  # fmt: skip

    if grad:
        return info, _with_gradients(draw, scored, reference, (Q, D), TOLERANCE[dtype], "QD")
    with torch.no_grad():
        out = scored(Q, D)
    return info, [("scores", out, reference(Q.double(), D.double()), TOLERANCE[dtype])]


def _offsets(lengths: list[int], device) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)


def _lengths(draw: Draw, count: int, longest: int) -> list[int]:
    kind = draw.choice(["equal", "varied", "with empty ones"])
    if kind == "equal":
        return [longest] * count
    return [draw.rng.randint(0 if kind == "with empty ones" else 1, longest) for _ in range(count)]


def ragged_case(draw: Draw, grad: bool):
    from lik.runtime import maxsim_varlen, score_pairs_packed
    from lik.runtime.reference import score_pairs_packed_reference

    s = draw.scale
    dtype = draw.choice(DTYPES)
    d = draw.choice([h for h in s.head_dims if h >= 8])
    lq = _lengths(draw, draw.size(1, 24), draw.size(1, min(256, s.query_tokens)))
    ld = _lengths(draw, draw.size(1, 24), draw.size(1, s.doc_tokens * 2))
    cu_q, cu_d = _offsets(lq, draw.device), _offsets(ld, draw.device)
    Q, q_layout = draw.tensor((sum(lq), d), dtype)
    D, d_layout = draw.tensor((sum(ld), d), dtype)
    normalize = draw.chance(0.5)
    bounds = (max(lq), max(ld)) if draw.chance(0.5) else (None, None)
    kw = {"cu_seqlens_q": cu_q, "cu_seqlens_d": cu_d, "normalize": normalize}
    info = {"entry": "maxsim_varlen", "dtype": str(dtype), "query lengths": lq,
            "doc lengths": ld, "d": d, "memory": (q_layout, d_layout), "normalize": normalize,
            "bounds given": bounds[0] is not None}  # fmt: skip
    if draw.chance(0.5):
        backward = draw.choice([None, "unified", "lowmem"])
        info["backward"] = backward if grad else "no gradients"

        def score(q, k):
            return maxsim_varlen(q, k, cu_q, cu_d, *bounds, normalize=normalize, backward=backward)

        def reference(q, k):
            return score_pairs_packed_reference(q, k, layout="varlen", **kw)
    else:
        pairs = draw.size(1, 200)
        pair_q = torch.randint(0, len(lq), (pairs,), generator=draw.generator, device=draw.device)
        pair_d = torch.randint(0, len(ld), (pairs,), generator=draw.generator, device=draw.device)
        info.update(entry="score_pairs_packed", pairs=pairs)

        def score(q, k):
            return score_pairs_packed(q, k, cu_q, cu_d, pair_q, pair_d, max_seqlen_q=bounds[0],
                                      max_seqlen_d=bounds[1], normalize=normalize)  # fmt: skip

        def reference(q, k):
            return score_pairs_packed_reference(q, k, pair_q_idx=pair_q, pair_d_idx=pair_d, **kw)

    if grad:
        return info, _with_gradients(draw, score, reference, (Q, D), TOLERANCE[dtype], "QD")
    with torch.no_grad():
        out = score(Q, D)
    return info, [("scores", out, reference(Q.double(), D.double()), TOLERANCE[dtype])]


def padded_case(draw: Draw, grad: bool):
    """maxsim_padded: each query against its C candidates, padding past per-row lengths
    (0 included) ignored, as the KD layout with length masks."""
    from lik.runtime import maxsim_padded
    from lik.runtime.reference import maxsim_reference

    s = draw.scale
    dtype = draw.choice(DTYPES)
    nq, nd, lq, ld, d = draw.sizes(grad=False)
    batch, candidates = nq, max(1, min(nd, 64))
    batch, ld = _bounded_kd_docs(batch, candidates, ld, d, s.scored_tokens)
    queries, q_layout = draw.tensor((batch, lq, d), dtype)
    documents, d_layout = draw.tensor((batch, candidates, ld, d), dtype)
    index = {"generator": draw.generator, "device": draw.device}
    q_len = torch.randint(0, lq + 1, (batch,), **index)
    d_len = torch.randint(0, ld + 1, (batch, candidates), **index)
    info = {"entry": "maxsim_padded", "dtype": str(dtype), "queries": (batch, lq, d),
            "documents": (batch, candidates, ld, d), "memory": (q_layout, d_layout),
            "long queries": lq > s.query_tokens}  # fmt: skip
    with torch.no_grad():
        out = maxsim_padded(queries, documents, q_len, d_len)
    q_mask = torch.arange(lq, device=draw.device) < q_len[:, None]
    d_mask = torch.arange(ld, device=draw.device) < d_len[..., None]
    ref = maxsim_reference(queries.double(), documents.double(), q_mask, d_mask)
    return info, [("scores", out, ref, TOLERANCE[dtype])]


def scorer_case(draw: Draw, grad: bool):
    """MaxSimScorer.forward_with_ids: masks from token ids equal to the padding id."""
    from lik.runtime import MaxSimScorer
    from lik.runtime.reference import maxsim_reference

    dtype = draw.choice(DTYPES)
    nq, nd, lq, ld, d = draw.sizes(grad)
    pad, normalize = draw.choice([0, 1, 50283]), draw.chance(0.7)
    backward = draw.choice(["auto", "unified", "lowmem"])
    scorer = MaxSimScorer(normalize=normalize, backward=backward, mask_pad_token=pad)
    Q, q_layout = draw.tensor((nq, lq, d), dtype)
    D, d_layout = draw.tensor((nd, ld, d), dtype)
    index = {"generator": draw.generator, "device": draw.device}
    q_ids = torch.where(torch.rand(nq, lq, **index) < 0.2, pad, pad + 1)
    d_ids = torch.where(torch.rand(nd, ld, **index) < draw.choice([0.0, 0.3, 1.0]), pad, pad + 7)
    q_mask, d_mask = q_ids != pad, d_ids != pad
    info = {"entry": "MaxSimScorer.forward_with_ids", "dtype": str(dtype), "Q": (nq, lq, d),
            "D": (nd, ld, d), "memory": (q_layout, d_layout), "normalize": normalize,
            "backward": backward if grad else "no gradients"}  # fmt: skip

    def score(q, k):
        return scorer.forward_with_ids(q, k, q_ids, d_ids)

    def reference(q, k):
        return maxsim_reference(q, k, q_mask, d_mask, normalize=normalize)

    if grad:
        return info, _with_gradients(draw, score, reference, (Q, D), TOLERANCE[dtype], "QD")
    with torch.no_grad():
        out = score(Q, D)
    return info, [("scores", out, reference(Q.double(), D.double()), TOLERANCE[dtype])]


def retrieve_case(draw: Draw, grad: bool):
    from lik.runtime import maxsim, retrieve

    dtype = draw.choice(DTYPES)
    nq, nd, lq, ld, d = draw.sizes(grad=False)
    Q, q_layout = draw.tensor((nq, lq, d), dtype)
    D, d_layout = draw.tensor((nd, ld, d), dtype)
    top_k, chunk = draw.size(1, 200), draw.choice([None, draw.size(1, nd)])
    info = {"entry": "retrieve", "dtype": str(dtype), "Q": (nq, lq, d), "D": (nd, ld, d),
            "memory": (q_layout, d_layout), "top_k": top_k, "chunk": chunk}  # fmt: skip
    with torch.no_grad():
        scores, ids = retrieve(Q, D, top_k, chunk=chunk)
        full = maxsim(Q, D, normalize=True)
    # The top k of the full scores, up to the rounding of another launch's tiles: the
    # ids' own scores must be those, and their order the scores' order.
    k = min(top_k, nd)
    best = torch.sort(full, dim=1, descending=True, stable=True).values[:, :k]
    picked = torch.gather(full, 1, ids)
    return info, [("top-k scores", scores, best, 1e-5), ("scores of the ids", picked, best, 1e-5)]


def fp8_case(draw: Draw, grad: bool):
    from lik.runtime import fp8
    from lik.runtime.reference import maxsim_fp8_reference

    nq, nd, lq, ld, d = draw.sizes(grad=False)
    d = max(16, d // 16 * 16)
    per = draw.choice(["tensor", "token"])
    quantize = fp8.quantize_fp8_per_tensor if per == "tensor" else fp8.quantize_fp8_per_token
    (Q, scale_Q), (D, scale_D) = (quantize(F.normalize(draw.randn(*shape), dim=-1))
                                  for shape in ((nq, lq, d), (nd, ld, d)))  # fmt: skip
    d_mask = draw.mask((nd, ld))
    info = {"entry": "maxsim_inference_fp8", "scales": f"per {per}", "Q": (nq, lq, d),
            "D": (nd, ld, d), "d_mask": d_mask is not None}  # fmt: skip
    with torch.no_grad():
        out = fp8.maxsim_inference_fp8(Q, D, scale_Q=scale_Q, scale_D=scale_D, d_mask=d_mask)
    ref = maxsim_fp8_reference(Q, D, scale_Q=scale_Q, scale_D=scale_D, d_mask=d_mask,
                               dtype=torch.float64)  # fmt: skip
    return info, [("scores", out, ref, FP8_TOLERANCE)]


def head_case(draw: Draw, grad: bool):
    from lik.runtime.head import maxsim_from_hidden
    from lik.runtime.reference import maxsim_from_hidden_reference

    dtype = draw.choice(DTYPES)
    s = draw.scale
    nq, lq = draw.size(1, min(16, s.queries)), draw.size(1, min(64, s.query_tokens))
    nd, ld = draw.size(1, min(200, s.docs)), draw.size(1, min(600, s.doc_tokens))
    d_model, d = draw.choice([64, 100, 256, 768]), draw.choice([16, 32, 64, 96, 128])
    Q, q_layout = draw.tensor((nq, lq, d), dtype)
    H, h_layout = draw.tensor((nd, ld, d_model), dtype)
    W, w_layout = draw.tensor((d, d_model), dtype)
    W = W * d_model**-0.5  # a product keeps a permuted operand's strides
    b = (draw.randn(d) * 0.03).to(dtype) if draw.chance(0.5) else None
    d_mask, normalize = draw.mask((nd, ld), 0.3), draw.chance(0.7)
    info = {"entry": "maxsim_from_hidden", "dtype": str(dtype), "Q": (nq, lq, d),
            "H": (nd, ld, d_model), "memory": (q_layout, h_layout, w_layout),
            "bias": b is not None, "d_mask": d_mask is not None, "normalize": normalize,
            "gradients": grad}  # fmt: skip
    inputs, names = (Q, H, W) + ((b,) if b is not None else ()), "QHWb"[: 3 + (b is not None)]

    def score(*t):
        return maxsim_from_hidden(*t[:3], t[3] if len(t) > 3 else None, d_mask,
                                  normalize=normalize)  # fmt: skip

    def reference(*t):
        return maxsim_from_hidden_reference(*t[:3], t[3] if len(t) > 3 else None, d_mask,
                                            normalize=normalize)  # fmt: skip

    if grad:
        return info, _with_gradients(draw, score, reference, inputs, TOLERANCE[dtype], names)
    with torch.no_grad():
        out = score(*inputs)
    return info, [("scores", out, reference(*(t.double() for t in inputs)), TOLERANCE[dtype])]


def plaid_case(draw: Draw, grad: bool):
    from lik.runtime import plaid
    from lik.runtime.reference import maxsim_residual_reference

    s = draw.scale
    nbits, dtype = draw.choice(plaid.NBITS), draw.choice(DTYPES)
    nq, lq = draw.size(1, min(8, s.queries)), draw.size(1, min(64, s.query_tokens))
    docs, ld = draw.size(1, min(2000, s.docs)), draw.size(1, min(400, s.doc_tokens))
    d, centroids_n = draw.choice([64, 96, 128]), draw.size(1, 65536)
    index = dict(dtype=draw.choice([torch.int32, torch.int64]), device=draw.device)
    codes = torch.randint(0, centroids_n, (docs, ld), generator=draw.generator, **index)
    residuals = torch.randint(0, 256, (docs, ld, d * nbits // 8), generator=draw.generator,
                              dtype=torch.uint8, device=draw.device)  # fmt: skip
    lengths = torch.randint(1, ld + 1, (docs,), generator=draw.generator, device=draw.device,
                            dtype=torch.int32)  # fmt: skip
    centroids = F.normalize(draw.randn(centroids_n, d), dim=-1).to(dtype)
    weights = torch.sort(draw.randn(2**nbits) * 0.03).values.to(dtype)
    Q, q_layout = draw.tensor((nq, lq, d), dtype)
    varlen = draw.chance(0.5)
    info = {"entry": "maxsim_residual_varlen" if varlen else "maxsim_residual", "nbits": nbits,
            "dtype": str(dtype), "Q": (nq, lq, d), "memory": q_layout, "docs": docs, "Ld": ld,
            "centroids": centroids_n}  # fmt: skip
    with torch.no_grad():
        if varlen:
            kept = torch.arange(ld, device=draw.device)[None, :] < lengths[:, None]
            cu = _offsets(lengths.tolist(), draw.device)
            out = plaid.maxsim_residual_varlen(Q, codes[kept], residuals[kept], cu, centroids,
                                               weights, nbits, max_seqlen_d=ld)  # fmt: skip
        else:
            out = plaid.maxsim_residual(Q, codes, residuals, lengths, centroids, weights, nbits)
    ref = maxsim_residual_reference(Q.double(), codes, residuals, lengths, centroids.double(),
                                    weights.double(), nbits)  # fmt: skip
    return info, [("scores", out, ref, TOLERANCE[dtype])]


# kind -> (case, with gradients, weight among the draws)
KINDS = {
    "maxsim": (maxsim_case, False, 5),
    "maxsim, gradients": (maxsim_case, True, 4),
    "ragged": (ragged_case, False, 1),
    "ragged, gradients": (ragged_case, True, 1),
    "padded rerank": (padded_case, False, 1),
    "scorer module": (scorer_case, False, 1),
    "scorer module, gradients": (scorer_case, True, 1),
    "retrieve": (retrieve_case, False, 1),
    "fp8": (fp8_case, False, 1),
    "head": (head_case, False, 1),
    "head, gradients": (head_case, True, 1),
    "plaid": (plaid_case, False, 1),
    "token scores": (token_score_case, False, 1),
    "token scores, gradients": (token_score_case, True, 1),
}


def kind_of(seed: int) -> str:
    names = list(KINDS)
    return random.Random(seed).choices(names, [KINDS[n][2] for n in names])[0]


def error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want||, the norm floored at 1e-3 per element: scores can cancel
    to 0 in float64 (two query tokens' exact +1 and -1 at head dim 1) and to 1e-7 in fp32."""
    floor = 1e-3 * math.sqrt(want.numel())
    diff = (got.double().to(want.device) - want.double()).norm()
    return float(diff / max(float(want.double().norm()), floor))


def problems(checks) -> list[str]:
    """What is wrong with a case's (name, got, want, tolerance) checks."""
    found = []
    for name, got, want, tolerance in checks:
        if got.shape != want.shape:
            found.append(f"{name}: shape {tuple(got.shape)}, expected {tuple(want.shape)}")
        elif got.isnan().any() and not want.isnan().any():
            found.append(f"{name}: NaN")
        elif got.numel() and (found_error := error(got, want)) > tolerance:
            found.append(f"{name}: relative error {found_error:.3g} > {tolerance:g}")
    return found


def run_case(seed: int, scale: Scale, device: str) -> dict:
    """{"seed", "kind", "info", "problems"} of one case; an exception is its problem."""
    kind = kind_of(seed)
    case, grad, _ = KINDS[kind]
    draw = Draw(seed + 1, scale, device)
    record = {"seed": seed, "kind": kind, "info": None, "problems": []}
    try:
        record["info"], checks = case(draw, grad)
        record["problems"] = problems(checks)
    except Exception as error:  # noqa: BLE001 - a valid input must never raise
        record["problems"] = [f"{type(error).__name__}: {str(error)[:400]}"]
        record["traceback"] = traceback.format_exc()[-3000:]
    return record


def context_broken(device: str) -> bool:
    """Whether the CUDA context is gone (after an illegal address every call fails)."""
    if device != "cuda":
        return False
    try:
        torch.cuda.synchronize()
        return False
    except Exception:  # noqa: BLE001
        return True


def soak(seconds: float, seed: int, scale: Scale, device: str, progress: Path | None = None):
    """Cases drawn from `seed` until `seconds` pass: counts per kind and the failures.
    progress: rewritten before every case with the counts so far and the seed of the case
    it starts, so a worker stopped mid-case still reports (and names the case it ran)."""
    seeds = random.Random(seed)
    counts, failures, began = {}, [], time.perf_counter()

    def state(running: int | None) -> dict:
        return {"cases": counts, "failures": failures, "running": running,
                "seconds": time.perf_counter() - began}  # fmt: skip

    while time.perf_counter() - began < seconds:
        case_seed = seeds.randrange(2**31)
        if progress is not None:
            _write_whole(progress, state(case_seed))
        record = run_case(case_seed, scale, device)
        counts[record["kind"]] = counts.get(record["kind"], 0) + 1
        if record["problems"]:
            failures.append(record)
            print(json.dumps(record, default=str)[:600], flush=True)
            if context_broken(device):
                break
    if progress is not None:
        _write_whole(progress, state(None))
    return state(None)


def _write_whole(path: Path, payload: dict) -> None:
    """Writes beside the file, then renames: a worker stopped mid-write leaves the last
    whole report."""
    partial = path.with_suffix(".partial")
    write_json(partial, payload)
    os.replace(partial, path)


# How long past --seconds the workers may take to end the case they run (a long case
# compiles several kernels) before they are stopped and the case is reported as cut off.
GRACE_SECONDS = 90


def in_workers(args, scale_name: str) -> dict:
    """soak() in args.workers processes with seeds args.seed, args.seed + 1, ..., merged."""
    with tempfile.TemporaryDirectory() as folder:
        paths = [Path(folder) / f"worker{i}.json" for i in range(args.workers)]
        workers = [subprocess.Popen([sys.executable, __file__, "--worker", str(path),
                                     "--seconds", str(args.seconds), "--seed", str(args.seed + i),
                                     "--scale", scale_name, "--device", args.device])
                   for i, path in enumerate(paths)]  # fmt: skip
        deadline = time.monotonic() + args.seconds + GRACE_SECONDS
        for worker in workers:
            try:
                worker.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
        parts = [json.loads(path.read_text()) for path in paths if path.exists()]
    merged = {"cases": {}, "failures": [], "seconds": max((p["seconds"] for p in parts), default=0)}
    for part in parts:
        for kind, count in part["cases"].items():
            merged["cases"][kind] = merged["cases"].get(kind, 0) + count
        merged["failures"] += part["failures"]
    merged["cut_off"] = [p["running"] for p in parts if p["running"] is not None]
    merged["workers"] = {"asked": args.workers, "reported": len(parts)}
    return merged


def markdown(report: dict) -> str:
    env, result = report["environment"], report["result"]
    total = sum(result["cases"].values())
    lines = [
        f"# Randomized soak on {env['gpu']}",
        "",
        provenance(env, packages=False),
        "",
        f"{total} cases in {result['seconds']:.0f} s ({report['workers']} workers, seeds from "
        f"{report['seed']}, scale {report['scale']}); {len(result['failures'])} failed. A case "
        "replays with `python3 benchmarks/soak.py --case SEED`.",
        "",
        markdown_table(["kind", "cases"], sorted(result["cases"].items())),
    ]
    if result["failures"]:
        rows = [(f["seed"], f["kind"], "; ".join(f["problems"])[:200]) for f in result["failures"]]
        lines += ["", "## Failures", "", markdown_table(["seed", "kind", "problems"], rows)]
    if result.get("cut_off"):
        lines += ["", f"Workers stopped {GRACE_SECONDS} s past the soak time, in the case of seed "
                  + ", ".join(f"{seed} ({kind_of(seed)})" for seed in result["cut_off"])
                  + ": slow or hung, to replay."]  # fmt: skip
    return "\n".join(lines) + "\n"


def replay(seed: int, scale: Scale, device: str) -> int:
    record = run_case(seed, scale, device)
    print(f"case {seed}: {record['kind']}")
    print(json.dumps(record["info"], default=str))
    print("\n".join(record["problems"]) or "no problem found")
    print(record.get("traceback", ""), end="")
    return 1 if record["problems"] else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=300, help="soak time per worker")
    parser.add_argument("--workers", type=int, default=1, help="processes side by side")
    parser.add_argument("--seed", type=int, default=1, help="first worker's seed")
    parser.add_argument("--out", type=Path, help="output folder (default: benchmarks/results)")
    parser.add_argument("--case", type=int, help="replay the case of this seed")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, 10 s")
    parser.add_argument("--scale", choices=list(SCALES), help=argparse.SUPPRESS)
    parser.add_argument("--device", help=argparse.SUPPRESS)
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # a worker's output
    args = parser.parse_args(argv)
    scale_name = args.scale or ("tiny" if args.dry_run else "gpu")
    args.device = args.device or ("cpu" if args.dry_run else "cuda")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("the soak needs a CUDA GPU (or --dry-run)", file=sys.stderr)
        return 2
    if args.dry_run and args.seconds == parser.get_default("seconds"):
        args.seconds = 10
    if args.case is not None:
        return replay(args.case, SCALES[scale_name], args.device)
    if args.worker is not None:
        soak(args.seconds, args.seed, SCALES[scale_name], args.device, progress=args.worker)
        return 0
    if args.workers > 1:
        result = in_workers(args, scale_name)
    else:
        result = soak(args.seconds, args.seed, SCALES[scale_name], args.device)
    report = {"environment": environment_info(), "workers": args.workers, "seed": args.seed,
              "scale": scale_name, "result": result}  # fmt: skip
    out = args.out or RESULTS
    stem = result_stem("soak", report["environment"]["gpu"], args.dry_run)
    write_results(out, stem, report, markdown(report))
    total = sum(result["cases"].values())
    print(f"{total} cases, {len(result['failures'])} failed: {out / stem}.md")
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
