"""Fused projection head: MaxSim over raw document hidden states.

    maxsim_from_hidden(Q, H_d, W, b=None, d_mask=None, normalize=True) -> [Nq, Nd] fp32

computes, for queries Q that are already projected, the MaxSim scores against
D = normalize(H_d W^T + b) without ever writing D to memory: each generated forward
program projects one block of doc tokens (a matmul tile, fp32 accumulation), scores
every query against it while it is still in registers and writes each query token's
max over the block; a small reduce kernel folds the blocks into scores.

`normalize` applies to the projected document tokens only, as in
late-interaction-kernels' `maxsim_from_hidden` (callers migrating from it get the same
numbers). Queries are used as given: they come out of the model's own query head, which
normalizes them already in ColBERT-style models. For unnormalized queries, pass
`F.normalize(Q, dim=-1)`; maxsim_from_hidden(Q, H, W, b) then equals
`maxsim(Q, F.linear(H, W, b), normalize=True)`.

Autograd reaches Q, H_d, W and b. Training calls whose projected docs hold at most
COMPOSED_TRAINING_MAX_DOC_VALUES values (in-batch training) project the docs with
PyTorch and score them with lik's maxsim and its generated backward (_composed_scores).
Larger ones run the fused forward, which saves each query token's winning doc token (an
int16/int32 argmax [Nq, Nd, Lq]), and a plain PyTorch backward on those winners that
works in bounded chunks; see _backward.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F

from lik.runtime import backends, ops, registry, validate
from lik.runtime.api import maxsim
from lik.runtime.keys import (
    MIN_BLOCK,
    gpu_family,
    next_power_of_two,
    padded_head_dim,
    query_bucket,
    variant_name,
)
from lik.runtime.reference import maxsim_from_hidden_reference
from lik.runtime.tuning import DEFAULT_SMEM_LIMIT, SMEM_LIMIT
from lik_gen.ir import MAX_HEAD_DIM

__all__ = ["HeadConfig", "head_config", "maxsim_from_hidden"]

_Q_DOC = "[Nq, Lq, d] or [Lq, d]"
# Query tokens one tile row block holds; longer queries are scored in chunks of this many
# tokens inside the same program (each doc tile is still projected once).
MAX_BLOCK_Q = 128
# Rows of the stacked query tile (queries x tokens) a program scores a doc tile against.
STACKED_ROWS = 128
# Bytes of per-block partial maxima (and winners) one launch may hold; larger batches
# are launched in chunks of docs. Nq * Lq = 1024 query tokens, Nd 1024, Ld 2048 need at
# most 64 MiB (one launch); only query batches of many thousand tokens get chunked.
PARTIAL_LIMIT_BYTES = 256 << 20


@dataclasses.dataclass(frozen=True)
class HeadConfig:
    """Launch config of a fused-head kernel."""

    block_q: int  # query tokens per tile (a power of two, >= 16)
    block_l: int  # doc tokens projected per step
    block_m: int  # d_model chunk of the projection
    block_k: int  # padded head dim d
    query_group: int  # queries stacked into one tile
    num_warps: int
    num_stages: int
    interpret: bool = False
    tma: bool = True  # read H through TMA descriptors where it is 16-byte aligned
    # Tile the flat token axis (docs back to back) when Ld is not a multiple of block_l,
    # so no program projects padding rows (Ld 300 in blocks of 128: 22% fewer programs).
    flat_tokens: bool = True


# Doc lengths from which a program projects 256 tokens instead of 128 (shorter docs
# would spend a large share of each program's tensor-core work on padding rows).
LONG_DOC_TOKENS = 512
# Hidden-state bytes from which H is read through a TMA descriptor. The descriptor costs
# host time on every call, which paces smaller calls back to back; larger ones are paced
# by the GPU, where TMA reads faster. H200, Nq 1, Ld 300, 768 -> 128, back to back (us per
# call, TMA / pointer; commit c25187a): 118 MB 95 / 59, 236 MB
# 90 / 97, 461 MB 152 / 170.
TMA_MIN_HIDDEN_BYTES = 160 << 20


@functools.cache
def _default_config(
    family: str, block_q: int, block_k: int, queries: int, long_docs: bool, tma: bool, smem_bytes
) -> HeadConfig:
    query_group = max(1, min(queries, STACKED_ROWS // block_q))
    if family == "interpreter":
        # numpy runs whole tiles: few, large steps are fastest.
        return HeadConfig(block_q, 32, 32, block_k, query_group, 4, 1, interpret=True, tma=tma)
    # Hopper: a matmul tile of 128 (or 256) doc tokens x 128 features, 64-wide d_model
    # steps, H tiles copied by TMA, the d_model loop pipelined num_stages deep. Swept on
    # an H200 (ms, one run; Nd 1024, Ld 2048, 768 -> 128):
    #   Nq 1:  block_l 128, 8 warps: pointer loads 1.08, TMA 0.95; 3 stages 0.95 against
    #          4 stages 1.07 (96 KiB of shared memory lets two programs share an SM);
    #          block_l 256 (W re-read from L2 half as often): 3 stages 0.95, 4 stages
    #          0.91. block_m 32 or 128 and block_l 64 were slower (1.14-1.7).
    #   Nq 32 (8 query tiles of 128 stacked rows per program): block_l 128, 4 warps
    #          2.34, 8 warps 2.32; block_l 256, 8 warps, 3 stages 2.03 (4 warps 4.16).
    #   Nq 1, Ld 300 (colbert-rerank): block_l 128, 4 warps 0.165, 8 warps 0.172;
    #          block_l 64 0.170.
    # Rechecked on an H200 against seven other configs per shape, Ld 300-2048, Nq 1-32: none
    # faster (commit f6a76bd).
    rows = queries * block_q
    if long_docs and block_k <= 128:
        block_l, warps, stages = 256, 8, 4 if rows <= 64 else 3
    else:
        block_l, warps, stages = (128 if block_k <= 128 else 64), 4, 3
    block_m = 64
    limit = SMEM_LIMIT.get(family, DEFAULT_SMEM_LIMIT)
    while stages > 1 and smem_bytes(block_l, block_m, block_k, stages) > limit:
        stages -= 1
    return HeadConfig(block_q, block_l, block_m, block_k, query_group, warps, stages, tma=tma)


def head_config(
    module, Q: torch.Tensor, doc_tokens: int | None = None, hidden_bytes: int | None = None
) -> HeadConfig:
    """The default launch config for scoring Q against docs of doc_tokens (Ld) hidden
    states, hidden_bytes in all, with a head variant from registry.load (whose smem_bytes
    counts its dtype's operand bytes; no sweep)."""
    Nq, Lq, d = Q.shape
    block_q = min(MAX_BLOCK_Q, max(MIN_BLOCK, next_power_of_two(Lq)))
    family = gpu_family(Q.device)
    long_docs = doc_tokens is not None and doc_tokens >= LONG_DOC_TOKENS
    tma = hidden_bytes is None or hidden_bytes >= TMA_MIN_HIDDEN_BYTES
    return _default_config(
        family, block_q, padded_head_dim(d), query_bucket(Nq), long_docs, tma, module.smem_bytes
    )


def _argmax_dtype(Ld: int) -> torch.dtype:
    # Doc token indices fit int16 below 32768 tokens: half the memory of int32.
    return torch.int16 if Ld < 2**15 else torch.int32


def _forward(Q, H, W, b, d_mask, normalize: bool, save_argmax: bool, config=None):
    """(scores [Nq, Nd] fp32, argmax [Nq, Nd, Lq] or None) from the generated kernel."""
    Nq, Lq, _ = Q.shape
    Nd, Ld, _ = H.shape
    out = torch.empty((Nq, Nd), dtype=torch.float32, device=Q.device)
    argmax = None
    if save_argmax:
        argmax = torch.empty((Nq, Nd, Lq), dtype=_argmax_dtype(Ld), device=Q.device)
    if out.numel() == 0 or Lq == 0 or Ld == 0:
        if argmax is not None:
            argmax.fill_(-1)
        return out.zero_(), argmax
    name = variant_name("dense", False, d_mask is not None, normalize, Q.dtype, op="head")
    module = registry.load(name)
    mask = validate.byte_mask(d_mask) if d_mask is not None else None
    config = config or head_config(module, Q, Ld, H.numel() * H.element_size())
    while True:
        try:
            _launch_in_doc_chunks(module, out, Q, H, W, b, mask, argmax, config)
            return out, argmax
        except Exception as error:
            # Shared-memory and register estimates are not exact (fp32 tf32x3 dots need
            # more): a config that does not fit this GPU is shrunk step by step.
            smaller = _smaller(config)
            if type(error).__name__ != "OutOfResources" or smaller is None:
                raise
            config = smaller


def _launch_in_doc_chunks(module, out, Q, H, W, b, mask, argmax, config):
    """One launch per chunk of docs whose per-block partial maxima fit PARTIAL_LIMIT_BYTES
    (a single launch unless the query batch has thousands of tokens)."""
    Nq, Lq, _ = Q.shape
    Nd, Ld, _ = H.shape
    slots = module.partial_blocks(Ld, config) * module.scratch_columns(
        Nq, Lq, config.query_group, config.block_q
    )
    per_doc = slots * (8 if argmax is not None else 4)
    docs = max(1, PARTIAL_LIMIT_BYTES // per_doc)
    if docs >= Nd:  # one launch on the tensors as given (views cost host time per call)
        module.launch(out, Q, H, W, b=b, d_mask=mask, argmax=argmax, config=config)
        return
    for start in range(0, Nd, docs):
        stop = min(Nd, start + docs)
        module.launch(
            out[:, start:stop],
            Q,
            H[start:stop],
            W,
            b=b,
            d_mask=mask[start:stop] if mask is not None else None,
            argmax=argmax[:, start:stop] if argmax is not None else None,
            config=config,
        )


def _smaller(config: HeadConfig) -> HeadConfig | None:
    """The next config down when a launch runs out of shared memory or registers."""
    if config.num_stages > 1:
        return dataclasses.replace(config, num_stages=config.num_stages - 1)
    if config.block_m > 16:
        return dataclasses.replace(config, block_m=config.block_m // 2)
    if config.block_l > 16:
        return dataclasses.replace(config, block_l=config.block_l // 2)
    if config.query_group > 1:
        return dataclasses.replace(config, query_group=config.query_group // 2)
    if config.block_q > MIN_BLOCK:  # the kernel walks a query's tokens in block_q chunks
        # fp32 dots (tf32x3) keep two parts of each operand: 128 query tokens at head dim
        # 256 alone take 256 KB.
        return dataclasses.replace(config, block_q=config.block_q // 2)
    return None


# Elements of the fp32 temporaries one backward step holds (~256 MB): docs are processed
# in chunks so the gathered hidden states and their gradients stay bounded.
BACKWARD_CHUNK_ELEMENTS = 1 << 26


def _backward(grad_scores, argmax, Q, H, W, b, normalize: bool, needs: tuple[bool, ...]):
    """Gradients (Q, H, W, b) of sum(grad_scores * scores), in the inputs' dtypes.

    Only winning doc tokens carry gradient. Per chunk of docs, it re-projects either each
    winner entry (when the Nq * Lq winners of a doc are fewer than its Ld tokens: reranks)
    or every token of the chunk once (in-batch training, where winners repeat), in fp32,
    then chains through the normalization and the linear layer. Extra memory: grad_H in
    H's dtype (it is dense), plus per chunk at most BACKWARD_CHUNK_ELEMENTS fp32 values;
    never a full projected [Nd, Ld, d] copy beyond one chunk.
    """
    need_q, need_h, need_w, need_b = needs
    Nq, Lq, d = Q.shape
    Nd, Ld, d_model = H.shape
    f32 = torch.float32
    grad_q = torch.zeros((Nq, Lq, d), dtype=f32, device=Q.device) if need_q else None
    grad_h = torch.zeros_like(H) if need_h else None
    grad_w = torch.zeros((d, d_model), dtype=f32, device=W.device) if need_w else None
    grad_b = torch.zeros((d,), dtype=f32, device=W.device) if need_b else None
    if Nq and Nd and Lq and Ld:
        grad_scores = grad_scores.to(f32)
        Qf, Wf = Q.to(f32), W.to(f32)
        bf = b.to(f32) if b is not None else None
        project_winners = Nq * Lq < Ld
        rows_per_doc = Nq * Lq if project_winners else Ld
        per_doc = rows_per_doc * (d_model + d) + Ld * d_model + Nq * Lq * d
        docs = max(1, BACKWARD_CHUNK_ELEMENTS // per_doc)
        for start in range(0, Nd, docs):
            stop = min(Nd, start + docs)
            count = stop - start
            winner = argmax[:, start:stop].long()  # [Nq, count, Lq], -1: no winner
            # Zero weight where no token won (masked query slot, fully masked doc).
            weight = grad_scores[:, start:stop, None] * (winner >= 0)
            local = torch.arange(count, device=H.device)[None, :, None] * Ld + winner.clamp_min(0)
            hidden = H[start:stop].reshape(count * Ld, d_model)
            # dL/d(projected token) of each winner entry: weight * its query token.
            grad_entry = (weight[..., None] * Qf[:, None]).reshape(-1, d)
            if project_winners:
                rows = local.reshape(-1)
                hidden = hidden[rows].to(f32)
                grad_proj = grad_entry
            else:
                hidden = hidden.to(f32)
                grad_proj = torch.zeros((count * Ld, d), dtype=f32, device=H.device)
                grad_proj.index_add_(0, local.reshape(-1), grad_entry)
            raw = hidden @ Wf.T
            if bf is not None:
                raw = raw + bf
            if normalize:
                norm = raw.norm(dim=1, keepdim=True)
                inv = 1.0 / norm.clamp_min(1e-12)
                proj = raw * inv
                # F.normalize's Jacobian; below eps the clamp makes it linear (no radial term).
                radial = torch.where(norm > 1e-12, (proj * grad_proj).sum(1, keepdim=True), 0.0)
                grad_raw = (grad_proj - proj * radial) * inv
            else:
                proj, grad_raw = raw, grad_proj
            if need_q:
                winners = proj if project_winners else proj[local.reshape(-1)]
                grad_q += torch.einsum("ijs,ijsk->isk", weight, winners.view(Nq, count, Lq, d))
            if need_w:
                grad_w += grad_raw.T @ hidden
            if need_b:
                grad_b += grad_raw.sum(0)
            if need_h:
                grad_hidden = grad_raw @ Wf
                if project_winners:
                    dense = torch.zeros((count * Ld, d_model), dtype=f32, device=H.device)
                    grad_hidden = dense.index_add_(0, rows, grad_hidden)
                grad_h[start:stop] = grad_hidden.view(count, Ld, d_model).to(H.dtype)
    return (
        grad_q.to(Q.dtype) if need_q else None,
        grad_h,
        grad_w.to(W.dtype) if need_w else None,
        grad_b.to(b.dtype) if need_b else None,
    )


# Training calls whose projected docs hold at most this many values (Nd * Ld * d) take
# _composed_scores, which keeps 8 bytes per value until the backward (the fp32
# projection the normalization saves, the normalized fp32 docs maxsim saves): at most
# 128 MiB, under the fused backward's chunk budget (BACKWARD_CHUNK_ELEMENTS fp32 values). An
# in-batch step of 32 docs of 300 tokens projected to 128 has 1.2M.
COMPOSED_TRAINING_MAX_DOC_VALUES = 1 << 24


def _composed_scores(Q, H, W, b, d_mask, normalize: bool) -> torch.Tensor:
    """maxsim_from_hidden for training as three autograd steps in fp32: the projection
    (PyTorch's matmul), the normalization, then lik's maxsim, whose generated backward
    routes each gradient to the winning doc tokens: a few library ops instead of the
    fused backward's re-projection and winner gathers.

    The normalization is one rms_norm, which leaves each token at norm sqrt(d), so the
    scores are divided by sqrt(d) after the maxsim. The step is paced by the host, and
    rms_norm is one op where F.normalize in fp32 was five: H200, an in-batch step of 32 x
    32 docs of 300 tokens, 768 -> 128 (bf16 docs then), 1.53-1.65 -> 0.93-1.36 ms back to
    back, LIK 0.4.5 1.35-1.56 (commit 30ed6fb). Its eps,
    1e-24 / d inside the mean, matches F.normalize's 1e-12 floor on the norm except for
    tokens of norm near 1e-12."""
    # fp32 docs (and queries) for bf16/fp16 inputs: docs rounded to the inputs' dtype move
    # near-tied winners, and with them whole gradient rows (bf16 on the CPU, 40 random
    # in-batch cases against float64: gradient error up to 0.31, 13 over 1e-2, against
    # 2.1e-3 at most in fp32 and through the fused kernel). Autograd casts the gradients
    # back to each input's dtype.
    Q, H, W = Q.float(), H.float(), W.float()
    docs = F.linear(H, W, None if b is None else b.float())
    if not normalize:
        return maxsim(Q, docs, d_mask=d_mask)
    dim = docs.shape[-1]
    docs = F.rms_norm(docs, (dim,), eps=1e-24 / dim)
    return maxsim(Q, docs, d_mask=d_mask) * dim**-0.5


@dataclasses.dataclass(frozen=True)
class _HeadCall:
    normalize: bool
    training: bool


def _head_forward(inputs, call: _HeadCall):
    Q, H, W, b, d_mask = inputs
    scores, argmax = _forward(Q, H, W, b, d_mask, call.normalize, save_argmax=call.training)
    return (scores,), (argmax,)


def _head_fake(inputs, call: _HeadCall):
    Q, H = inputs[:2]
    scores = Q.new_empty((Q.shape[0], H.shape[0]), dtype=torch.float32)
    argmax = None
    if call.training:
        argmax = Q.new_empty((Q.shape[0], H.shape[0], Q.shape[1]), dtype=_argmax_dtype(H.shape[1]))
    return (scores,), (argmax,)


def _head_backward(grads, inputs, saved, call: _HeadCall, needs):
    Q, H, W, b, _ = inputs
    needs = needs[:3] + (needs[3] and b is not None,)
    return _backward(grads[0], saved[0], Q, H, W, b, call.normalize, needs)


HEAD = ops.Family("head", _HeadCall, _head_forward, _head_fake, _head_backward, slots=4)


def _validate(Q, H_d, W, b, d_mask, normalize):
    validate.flag("normalize", normalize)
    Q = validate.tensor("Q", Q, (2, 3), _Q_DOC)
    H_d = validate.tensor("H_d", H_d, (3,), "[Nd, Ld, d_model]")
    W = validate.tensor("W", W, (2,), "[d, d_model] (nn.Linear.weight)")
    d, (Nd, Ld, d_model) = Q.shape[-1], H_d.shape
    if tuple(W.shape) != (d, d_model):
        raise ValueError(
            f"W must be [d, d_model] = [{d}, {d_model}] (d from Q, d_model from H_d; "
            f"nn.Linear.weight convention), got shape {tuple(W.shape)}"
        )
    if d > MAX_HEAD_DIM:
        raise ValueError(f"head dim {d} exceeds the largest supported, {MAX_HEAD_DIM}")
    if b is not None:
        b = validate.tensor("b", b, (1,), f"[d] = [{d}]")
        if b.shape[0] != d:
            raise ValueError(f"b must be [d] = [{d}] like Q's last axis, got {tuple(b.shape)}")
    named = [("Q", Q), ("H_d", H_d), ("W", W)] + ([("b", b)] if b is not None else [])
    for name, t in named[1:]:
        if t.device != Q.device:
            raise ValueError(f"{name} must be on {Q.device} like Q, got {t.device}")
        if t.dtype != Q.dtype:
            raise TypeError(
                f"Q, H_d, W and b must share a dtype: Q is {Q.dtype}, {name} is {t.dtype} "
                f"(cast it, e.g. {name}.to({Q.dtype}))"
            )
    d_mask = validate.mask("d_mask", d_mask, (Nd, Ld), Q.device, "[Nd, Ld]")
    return Q, H_d, W, b, d_mask


def maxsim_from_hidden(
    Q: torch.Tensor,
    H_d: torch.Tensor,
    W: torch.Tensor,
    b: torch.Tensor | None = None,
    d_mask: torch.Tensor | None = None,
    normalize: bool = True,
) -> torch.Tensor:
    """MaxSim of projected queries against documents given as raw hidden states.

    Q [Nq, Lq, d] (or [Lq, d], squeezing the query axis of the result) against
    D = normalize(H_d W^T + b), H_d [Nd, Ld, d_model], W [d, d_model] (nn.Linear.weight),
    b [d] or None -> [Nq, Nd] fp32. Scoring writes no D to memory; training calls whose
    D holds at most COMPOSED_TRAINING_MAX_DOC_VALUES values project it for the backward
    (see the module docstring). d_mask [Nd, Ld] bool, True = valid: a masked doc token
    never wins, a fully masked doc scores 0 and gets zero gradient. normalize
    L2-normalizes the projected doc tokens (Q is used as given). Q, H_d, W and b share one
    dtype (fp32, fp16 or bf16) and device. Autograd to Q, H_d, W and b.
    """
    Q, H_d, W, b, d_mask = _validate(Q, H_d, W, b, d_mask, normalize)
    squeeze = Q.dim() == 2
    Q3 = Q.unsqueeze(0) if squeeze else Q
    if backends.route("head", Q) == "reference":  # plain PyTorch, autograd
        out = maxsim_from_hidden_reference(Q3, H_d, W, b, d_mask, normalize=normalize).float()
    elif torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (Q3, H_d, W, b)
    ):
        if H_d.shape[0] * H_d.shape[1] * W.shape[0] <= COMPOSED_TRAINING_MAX_DOC_VALUES:
            out = _composed_scores(Q3, H_d, W, b, d_mask, normalize)
        else:
            out = HEAD((Q3, H_d, W, b, d_mask), _HeadCall(normalize, True), training=True)
    else:
        out = HEAD((Q3, H_d, W, b, d_mask), _HeadCall(normalize, False))
    return out[0] if squeeze else out
