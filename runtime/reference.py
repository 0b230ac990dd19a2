"""The ground truth: plain PyTorch MaxSim, autograd-aware, float64-capable, memory-bounded.

Every test compares a kernel against these functions. They follow lik's semantics
(DESIGN.md): masks are bool with True = valid; a masked doc token never wins the max; a
query token with no valid doc token (fully masked doc, Ld == 0) contributes 0; masked
query tokens contribute 0. Computation happens in the inputs' dtype promoted to at least
fp32 (pass float64 tensors for a float64 reference); scores come back in that dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Elements of the similarity block [queries, docs, Lq, Ld] materialized at once. Bounds
# CPU memory on large corpora (~256 MB in float64).
CHUNK_ELEMENTS = 1 << 25


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    dtype = torch.promote_types(tensors[0].dtype, tensors[1].dtype)
    return torch.promote_types(dtype, torch.float32)


def _token_max(sim: torch.Tensor, d_mask: torch.Tensor | None) -> torch.Tensor:
    """max over the last axis (doc tokens) of sim, 0 where no doc token is valid."""
    if sim.shape[-1] == 0:
        return sim.new_zeros(sim.shape[:-1])
    if d_mask is not None:
        sim = sim.masked_fill(~d_mask, float("-inf"))
    best = sim.amax(dim=-1)
    if d_mask is None:
        return best
    # Fully masked doc: -inf -> 0, with zero gradient (where, not arithmetic).
    return torch.where(torch.isneginf(best), torch.zeros_like(best), best)


def _sum_query_tokens(best: torch.Tensor, q_mask: torch.Tensor | None) -> torch.Tensor:
    """Sums best [..., Lq] over query tokens; q_mask broadcasts against best."""
    if q_mask is not None:
        best = torch.where(q_mask, best, torch.zeros_like(best))
    return best.sum(dim=-1)


def _prepare(Q, D, normalize):
    dtype = _compute_dtype(Q, D)
    Q, D = Q.to(dtype), D.to(dtype)
    if normalize:
        Q, D = F.normalize(Q, dim=-1), F.normalize(D, dim=-1)
    return Q, D


def maxsim_reference(
    Q: torch.Tensor,
    D: torch.Tensor,
    q_mask: torch.Tensor | None = None,
    d_mask: torch.Tensor | None = None,
    *,
    normalize: bool = False,
) -> torch.Tensor:
    """MaxSim with lik.runtime.maxsim's layouts, as plain PyTorch.

    Q [Nq, Lq, d] or [Lq, d]; D [Nd, Ld, d] -> [Nq, Nd], D [Nq, K, Ld, d] -> [Nq, K],
    D [Ld, d] -> [Nq]. A [Lq, d] query squeezes the query axis of the result.
    """
    squeeze = Q.dim() == 2
    if squeeze:
        Q = Q.unsqueeze(0)
        q_mask = None if q_mask is None else q_mask.unsqueeze(0)
    if D.dim() == 2:
        out = _dense(
            Q, D.unsqueeze(0), q_mask, None if d_mask is None else d_mask.unsqueeze(0), normalize
        )[:, 0]
    elif D.dim() == 4:
        out = _kd(Q, D, q_mask, d_mask, normalize)
    else:
        out = _dense(Q, D, q_mask, d_mask, normalize)
    return out[0] if squeeze else out


def maxsim_pairs_reference(
    Q: torch.Tensor,
    D: torch.Tensor,
    q_mask: torch.Tensor | None = None,
    d_mask: torch.Tensor | None = None,
    *,
    normalize: bool = False,
) -> torch.Tensor:
    """Diagonal MaxSim: Q [B, Lq, d] with D [B, Ld, d] -> [B] (query b against doc b)."""
    Q, D = _prepare(Q, D, normalize)
    B, Lq, Ld = Q.shape[0], Q.shape[1], D.shape[1]
    rows = max(1, CHUNK_ELEMENTS // max(1, Lq * Ld))
    parts = []
    for start in range(0, B, rows):
        stop = min(B, start + rows)
        sim = torch.einsum("bsk,btk->bst", Q[start:stop], D[start:stop])
        dm = None if d_mask is None else d_mask[start:stop, None, :]
        qm = None if q_mask is None else q_mask[start:stop]
        parts.append(_sum_query_tokens(_token_max(sim, dm), qm))
    return torch.cat(parts) if parts else Q.new_zeros(0)


def _dense(Q, D, q_mask, d_mask, normalize):
    Q, D = _prepare(Q, D, normalize)
    Nq, Lq, Nd, Ld = Q.shape[0], Q.shape[1], D.shape[0], D.shape[1]
    docs = max(1, CHUNK_ELEMENTS // max(1, Nq * Lq * Ld))
    parts = []
    for start in range(0, Nd, docs):
        stop = min(Nd, start + docs)
        sim = torch.einsum("isk,jtk->ijst", Q, D[start:stop])
        dm = None if d_mask is None else d_mask[None, start:stop, None, :]
        qm = None if q_mask is None else q_mask[:, None, :]
        parts.append(_sum_query_tokens(_token_max(sim, dm), qm))
    if not parts:
        return Q.new_zeros(Nq, 0)
    return torch.cat(parts, dim=1)


def _kd(Q, D, q_mask, d_mask, normalize):
    Q, D = _prepare(Q, D, normalize)
    Nq, Lq, K, Ld = Q.shape[0], Q.shape[1], D.shape[1], D.shape[2]
    rows = max(1, CHUNK_ELEMENTS // max(1, K * Lq * Ld))
    parts = []
    for start in range(0, Nq, rows):
        stop = min(Nq, start + rows)
        sim = torch.einsum("isk,ictk->icst", Q[start:stop], D[start:stop])
        dm = None if d_mask is None else d_mask[start:stop, :, None, :]
        qm = None if q_mask is None else q_mask[start:stop, None, :]
        parts.append(_sum_query_tokens(_token_max(sim, dm), qm))
    if not parts:
        return Q.new_zeros(0, K)
    return torch.cat(parts, dim=0)


def score_pairs_packed_reference(
    Q: torch.Tensor,
    D: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_d: torch.Tensor,
    pair_q_idx: torch.Tensor | None = None,
    pair_d_idx: torch.Tensor | None = None,
    layout: str = "packed_pairs",
    normalize: bool = False,
) -> torch.Tensor:
    """Ragged MaxSim over packed tokens: every (query, doc) pair for layout="varlen"
    ([Nq, Nd]), the listed pairs for "packed_pairs" ([P]). An empty sequence scores 0."""
    Q, D = _prepare(Q, D, normalize)
    cu_q, cu_d = cu_seqlens_q.tolist(), cu_seqlens_d.tolist()
    if layout == "varlen":
        nq, nd = len(cu_q) - 1, len(cu_d) - 1
        pairs = [(i, j) for i in range(nq) for j in range(nd)]
    else:
        pairs = list(zip(pair_q_idx.tolist(), pair_d_idx.tolist(), strict=True))
    scores = []
    for i, j in pairs:
        q, d = Q[cu_q[i] : cu_q[i + 1]], D[cu_d[j] : cu_d[j + 1]]
        scores.append(_token_max(q @ d.T, None).sum())
    out = torch.stack(scores) if scores else Q.new_zeros(0)
    if layout == "varlen":
        return out.view(len(cu_q) - 1, len(cu_d) - 1)
    return out
