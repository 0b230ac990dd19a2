"""The CPU backend: MaxSim as chunked matrix products, with dispatch.forward and
dispatch.backward's contract for the padded layouts (dense, kd, pairs).

One chunk of docs at a time: its tokens (converted, or normalized in fp32, in a reused
buffer where the matmul cannot read them as they are) are multiplied against every query
token in one matmul, doc tokens as rows (S [chunk tokens, query tokens]); masked doc
tokens' rows are set to -inf, and each query token's max over each doc's rows is one
reduction. Where a dense call's doc mask leaves out enough tokens to pay for it, the
valid tokens are packed first, docs longest first (PACK_GAIN). Memory is bounded by
SIM_BUDGET (similarities per step), DOC_BUDGET, PACK_BUDGET and SIM_CAP whatever the
batch; Python loops run per chunk, never per doc. The backward gathers each query
token's winning doc token and scatters the query token back (no similarity is
recomputed), chunked by GRAD_BUDGET.

Numerics follow lik.runtime.reference: the max keeps NaN; a masked doc token never wins;
a query token with no valid doc token adds 0 (the mask decides, not the value: a valid
row of -inf similarities is a real -inf); masked query tokens add 0; masked_as_zero lets
a masked doc token compete with similarity 0. Scores accumulate in fp32. fp32 and fp16
and 16-bit inputs multiply in fp32 (IEEE), so scores land within fp32 rounding of the
float64 reference (_matmul_dtype).
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

LAYOUTS = ("dense", "kd", "pairs")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Similarities per step (fp32 elements; 4 MB). On a 2-core EPYC (AVX512-BF16), rerank 1 x
# 1000 x 32 x 300 and in-batch 32 x 32 x 32 x 300 (d 128) were within noise of their best
# from 2**19 to 2**20 (fp32 31-32 and 21-22 ms, bf16 17 and 11-13 ms); 2**17 ran up to
# 50% slower (per-step overhead), 2**22 up to 20% slower (out of cache). Tests lower it.
SIM_BUDGET = 1 << 20
# Doc token elements per step (16 MB fp32): bounds the step when queries are few (Lq = 1
# would otherwise take 2**20 doc tokens at once).
DOC_BUDGET = 1 << 22
# A doc mask's tokens are packed (_dense_steps) where query rows x masked / valid tokens
# reach PACK_GAIN[matmul dtype]: packing gathers the valid tokens (at ~memcpy speed) to
# spare the matmul the masked ones, so it pays less where the matmul is cheap (bf16).
# Measured on a 2-core EPYC (d 128; packed / in place, ms): rerank 1 x 1000 x 32 x 300
# with prefix lengths uniform in [32, 300] (gain 26) fp32 20.5 / 28.8, bf16 14.3 / 13.2;
# with 30% holes (14) fp32 33.7 / 34.0, bf16 20.8 / 14.2; in-batch 32 x 32 with prefix
# lengths (840) fp32 10.7 / 17.3, bf16 6.6 / 10.2.
PACK_GAIN = {torch.float32: 16, torch.bfloat16: 48}
# Packed doc token elements per step: the gathered tokens stay in cache for the matmul
# (rerank with prefix lengths, fp32: 19.9 ms at 2**20, 25.9 at 2**22, 27.6 at 2**18).
PACK_BUDGET = 1 << 20
# One doc's similarities to every query token are split by query rows past this.
SIM_CAP = 1 << 22
# fp32 elements per backward step: the winners' rows gathered (and the query rows
# scattered) [queries, docs, Lq, d], and the step's docs [docs, Ld, d].
GRAD_BUDGET = 1 << 22
EPS = 1e-12  # F.normalize's: x / max(||x||, EPS)


def _matmul_dtype(dtype: torch.dtype, training: bool) -> torch.dtype:
    """Every dtype multiplies in fp32 (IEEE): products of 16-bit inputs are exact there,
    so scores land within fp32 rounding of the float64 reference, as the GPU kernels'
    do. bf16 matmuls ran 2.5x faster with AVX512-BF16, but round every similarity to
    bf16 (relative 4e-3), enough to reorder a retrieval's near ties; fp16 has no fast CPU
    matmul (7x slower than fp32 at 6000 x 128 x 32)."""
    return torch.float32


def handles(layout: str, dtype: torch.dtype) -> bool:
    """Whether this backend serves a (layout, dtype): the padded layouts in fp32, fp16, bf16."""
    return layout in LAYOUTS and dtype in DTYPES


def _as_kd(layout, Q, D, d_mask, out, argmax):
    """pairs as kd with one doc per query: D [B, 1, Ld, d], out [B, 1]."""
    if layout != "pairs":
        return D, d_mask, out, argmax
    return (D.unsqueeze(1), None if d_mask is None else d_mask.unsqueeze(1), out.view(-1, 1),
            None if argmax is None else argmax.view(argmax.shape[0], 1, -1))  # fmt: skip


def _inv_norms(x: torch.Tensor) -> torch.Tensor:
    """1 / max(||row||, EPS) per row of x [..., d], computed in fp32."""
    return torch.linalg.vector_norm(x, dim=-1, dtype=torch.float32).clamp_min_(EPS).reciprocal_()


def _prepare_queries(Q: torch.Tensor, normalize: bool, dtype: torch.dtype):
    """(Q [..., d] in the matmul dtype, the query norms' inverses or None). Normalizing
    happens in fp32; in bf16 the similarities are scaled instead (scaled_norms)."""
    if not normalize:
        return Q.to(dtype), None
    if _scaled_norms(dtype):
        return Q, _inv_norms(Q)
    return F.normalize(Q.float(), dim=-1, eps=EPS).to(dtype), None


def _scaled_norms(dtype: torch.dtype) -> bool:
    """With normalize, bf16 matmuls take the raw tokens and the similarities are scaled by
    both inverse norms in fp32 (as the kernels do), instead of normalized tokens rounded
    to bf16: that rounding made the bf16 scores' error exceed eager PyTorch's by up to 3x
    (pairs, 4 x 9 x 13 tokens), where the scaled form stays under it."""
    return dtype == torch.bfloat16


_local = threading.local()


def _scratch(name: str, elements: int, dtype: torch.dtype) -> torch.Tensor:
    """A flat buffer of at least `elements`, kept per thread between calls (grown, never
    shrunk; a few SIM_BUDGET's worth): fresh buffers of a few MB page-fault on every call,
    which made rerank 1 x 1000 x 32 x 300 fp32 67 ms instead of 29."""
    buffers = getattr(_local, "buffers", None)
    if buffers is None:
        buffers = _local.buffers = {}
    key = (name, dtype)
    buffer = buffers.get(key)
    if buffer is None or buffer.numel() < elements:
        buffer = buffers[key] = torch.empty(elements, dtype=dtype)
    return buffer


def _load_docs(tokens: torch.Tensor, dtype: torch.dtype, normalize: bool):
    """(doc tokens [..., d] as [rows, d] in the matmul dtype, each row's inverse norm
    [rows, 1] where the similarities take it, else None). A view when the tokens already
    are what the matmul reads (copying them first measured no faster), else a scratch
    copy, normalized in fp32 when asked."""
    d = tokens.shape[-1]
    rows = tokens.numel() // d
    scale = _inv_norms(tokens).view(rows, 1) if normalize and _scaled_norms(dtype) else None
    if (not normalize or scale is not None) and tokens.dtype == dtype and tokens.is_contiguous():
        return tokens.view(rows, d), scale
    target = _scratch("docs", rows * d, dtype)[: rows * d].view(*tokens.shape).copy_(tokens)
    if normalize and scale is None:  # an fp32 matmul (_scaled_norms)
        target.div_(torch.linalg.vector_norm(target, dim=-1, keepdim=True).clamp_min_(EPS))
    return target.view(rows, d), scale


def _similarities(docs: torch.Tensor, queries_t: torch.Tensor, scale) -> torch.Tensor:
    """docs [G, T, d] @ queries_t [G, d, R] -> fp32 [G, T, R] in a scratch buffer, each
    row times scale [G, T, 1] when given. bf16 products are converted to fp32 (with the
    scale, in the same pass) for the max: over a strided axis it ran 12 ms in bf16
    against 2 ms for convert + fp32 max (rerank, d 128)."""
    g, t, r = docs.shape[0], docs.shape[1], queries_t.shape[2]
    sim = _scratch("sims", g * t * r, docs.dtype)[: g * t * r].view(g, t, r)
    if g == 1:
        torch.mm(docs[0], queries_t[0], out=sim[0])
    else:
        torch.bmm(docs, queries_t, out=sim)
    if sim.dtype == torch.float32 and scale is None:
        return sim
    sim32 = _scratch("sims_fp32", g * t * r, torch.float32)[: g * t * r].view(g, t, r)
    return sim32.copy_(sim) if scale is None else torch.mul(sim, scale, out=sim32)


def _fill_masked_rows(sim: torch.Tensor, invalid: torch.Tensor) -> None:
    """Sets the rows of sim [G, T, R] whose doc token invalid [G, T] marks to -inf, so a
    masked doc token never wins (whatever its values: the rows are overwritten)."""
    rows = invalid.reshape(-1).nonzero().squeeze(1)
    if rows.numel():
        sim.view(-1, sim.shape[-1]).index_fill_(0, rows, float("-inf"))


def _token_max(sim, ld, want_index):
    """Each query token's max over each doc's rows: sim [G, n * ld, R] -> [G, n, R] (and
    the winning row in its doc, int64)."""
    g, r = sim.shape[0], sim.shape[2]
    blocks = sim.view(g, -1, ld, r)
    if want_index:
        return torch.max(blocks, dim=2)
    return torch.amax(blocks, dim=2), None


def _keep(best, doc_valid, doc_masked, q_keep, masked_as_zero):
    """Where a query token's max counts: it has a valid doc token (doc_valid), is not
    masked (q_keep) and, under masked_as_zero, is not beaten by a masked token's 0."""
    keep = q_keep
    if doc_valid is not None:
        keep = doc_valid if keep is None else keep & doc_valid
        if masked_as_zero:
            beaten = doc_masked & (best < 0)
            keep = ~beaten if keep is None else keep & ~beaten
    return keep


def forward(
    layout: str,
    Q: torch.Tensor,
    D: torch.Tensor,
    q_mask,
    d_mask,
    normalize: bool,
    out: torch.Tensor,
    *,
    backward: str = "none",
    argmax: torch.Tensor | None = None,
    masked_as_zero: bool = False,
) -> torch.Tensor:
    """Scores into `out` (fp32, shaped for the layout); with a backward strategy, each
    query token's winning doc token into `argmax` (out.shape + (Lq,), -1 where none wins).
    Arguments as dispatch.forward's."""
    want_index = backward != "none"
    if out.numel() == 0 or Q.shape[1] == 0 or D.shape[-2] == 0:
        if argmax is not None:
            argmax.fill_(-1)
        return out.zero_()
    if layout == "dense":
        _forward_dense(Q, D, q_mask, d_mask, normalize, out, argmax if want_index else None,
                       masked_as_zero)  # fmt: skip
    else:
        D, d_mask, out_kd, argmax_kd = _as_kd(layout, Q, D, d_mask, out, argmax)
        _forward_kd(Q, D, q_mask, d_mask, normalize, out_kd, argmax_kd if want_index else None,
                    masked_as_zero)  # fmt: skip
    return out


def _doc_flags(d_mask):
    """(doc has a valid token, doc has a masked token), d_mask's shape without Ld."""
    if d_mask is None:
        return None, None
    return d_mask.any(dim=-1), ~d_mask.all(dim=-1)


def _forward_dense(Q, D, q_mask, d_mask, normalize, out, argmax, masked_as_zero):
    nq, lq, d = Q.shape
    rows = nq * lq
    dtype = _matmul_dtype(Q.dtype, argmax is not None)
    queries, q_scale = _prepare_queries(Q.reshape(rows, d), normalize, dtype)
    queries_t = queries.t().unsqueeze(0)
    # Query rows per step: all of them unless one doc's block would pass the cap.
    row_step = min(rows, max(1, SIM_CAP // D.shape[1]))
    doc_valid, doc_masked = _doc_flags(d_mask)
    q_keep = None if q_mask is None else q_mask.reshape(1, rows)
    for docs, tokens, invalid, positions in _dense_steps(D, d_mask, row_step, rows, dtype):
        n, ld = tokens.shape[0], tokens.shape[1]
        chunk, scale = _load_docs(tokens, dtype, normalize)
        chunk, scale = chunk.unsqueeze(0), None if scale is None else scale.unsqueeze(0)
        parts = []
        for r0 in range(0, rows, row_step):
            sim = _similarities(chunk, queries_t[:, :, r0 : r0 + row_step], scale)
            if invalid is not None:
                _fill_masked_rows(sim, invalid.view(1, n * ld))
            best, index = _token_max(sim, ld, argmax is not None)
            parts.append((best[0], None if index is None else index[0]))  # [n, rows of step]
        best = _joined([p[0] for p in parts], 1)
        if q_scale is not None:
            best = best * q_scale
        keep = _keep(best, None if doc_valid is None else doc_valid[docs, None],
                     None if doc_masked is None else doc_masked[docs, None], q_keep,
                     masked_as_zero)  # fmt: skip
        if keep is not None:
            best = torch.where(keep, best, 0.0)
        scores = best.view(n, nq, lq).sum(dim=2).t()
        if isinstance(docs, slice):
            out[:, docs].copy_(scores)
        else:
            out.index_copy_(1, docs, scores)
        if argmax is not None:
            index = _joined([p[1] for p in parts], 1)
            if positions is not None:  # packed rows -> the doc's own token indices
                index = positions.gather(1, index)
            index = _winners(index, best, keep, d_mask is not None)
            index = index.view(n, nq, lq).transpose(0, 1).to(argmax.dtype)
            if isinstance(docs, slice):
                argmax[:, docs].copy_(index)
            else:
                argmax.index_copy_(1, docs, index)


def _packing_pays(d_mask, query_rows: int, dtype: torch.dtype) -> bool:
    valid = int(d_mask.sum())
    return query_rows * (d_mask.numel() - valid) >= PACK_GAIN[dtype] * max(valid, 1)


def _dense_steps(D, d_mask, row_step, query_rows, dtype):
    """The dense forward's steps: (docs, their tokens [n, L, d], masked tokens [n, L] or
    None, each packed token's index in its doc [n, L] or None), docs a slice of D or an
    index tensor. Where packing pays (PACK_GAIN), docs go longest first and each step
    takes only as many tokens per doc as its longest has valid, valid ones first (a
    stable sort of the mask): masked tokens cost no matmul."""
    nd, ld, d = D.shape
    if d_mask is not None and D.is_contiguous() and _packing_pays(d_mask, query_rows, dtype):
        counts = d_mask.sum(dim=1)
        order = torch.argsort(counts, descending=True, stable=True)
        sorted_counts = counts[order].tolist()
        flat = D.view(nd * ld, d)
        j0 = 0
        while j0 < nd and sorted_counts[j0] > 0:
            length = sorted_counts[j0]
            n = min(nd - j0, max(1, min(SIM_BUDGET // (length * row_step),
                                        PACK_BUDGET // (length * d))))  # fmt: skip
            docs = order[j0 : j0 + n]
            mask = d_mask[docs]
            positions = torch.sort((~mask).view(torch.uint8), dim=1, stable=True).indices
            positions = positions[:, :length]
            rows = (docs[:, None] * ld + positions).view(-1)
            tokens = _scratch("packed", n * length * d, D.dtype)[: n * length * d]
            torch.index_select(flat, 0, rows, out=tokens.view(n * length, d))
            yield docs, tokens.view(n, length, d), ~mask.gather(1, positions), positions
            j0 += n
        if j0 < nd:  # docs with no valid token: one step of a single masked token each
            docs = order[j0:]
            yield docs, D[docs, :1], torch.ones(nd - j0, 1, dtype=torch.bool), None
        return
    docs = min(nd, max(1, min(SIM_BUDGET // (ld * row_step), DOC_BUDGET // (ld * d))))
    for j0 in range(0, nd, docs):
        j1 = min(nd, j0 + docs)
        invalid = None if d_mask is None else ~d_mask[j0:j1]
        yield slice(j0, j1), D[j0:j1], invalid, None


def _joined(parts, dim):
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def _winners(index, best, keep, has_d_mask):
    """The saved argmax: -1 where a query token's max does not count, and, with a doc
    mask, where it is -inf (no finite winner: the row found may be a masked one)."""
    if has_d_mask:
        index = torch.where(best == float("-inf"), -1, index)
    if keep is not None:
        index = torch.where(keep, index, -1)
    return index


def _forward_kd(Q, D, q_mask, d_mask, normalize, out, argmax, masked_as_zero):
    """D [Nq, K, Ld, d]: query i against its own K docs, a batched matmul per query chunk."""
    nq, lq, d = Q.shape
    k, ld = D.shape[1], D.shape[2]
    q_step = min(lq, max(1, SIM_CAP // ld))  # query tokens per step
    # Docs per query, then queries, per step: as many as both budgets allow.
    k_step = min(k, max(1, min(SIM_BUDGET // (ld * q_step), DOC_BUDGET // (ld * d))))
    i_step = min(nq, max(1, min(SIM_BUDGET // (k_step * ld * q_step),
                                DOC_BUDGET // (k_step * ld * d))))  # fmt: skip
    dtype = _matmul_dtype(Q.dtype, argmax is not None)
    queries, q_scale = _prepare_queries(Q, normalize, dtype)
    queries_t = queries.transpose(1, 2)  # [Nq, d, Lq]
    doc_valid, doc_masked = _doc_flags(d_mask)
    for i0 in range(0, nq, i_step):
        i1 = min(nq, i0 + i_step)
        b = i1 - i0
        for k0 in range(0, k, k_step):
            k1 = min(k, k0 + k_step)
            n = k1 - k0
            chunk, scale = _load_docs(D[i0:i1, k0:k1], dtype, normalize)
            chunk = chunk.view(b, n * ld, d)
            scale = None if scale is None else scale.view(b, n * ld, 1)
            invalid = None if d_mask is None else ~d_mask[i0:i1, k0:k1].reshape(b, n * ld)
            parts = []
            for s0 in range(0, lq, q_step):
                sim = _similarities(chunk, queries_t[i0:i1, :, s0 : s0 + q_step], scale)
                if invalid is not None:
                    _fill_masked_rows(sim, invalid)
                parts.append(_token_max(sim, ld, argmax is not None))  # [b, n, q_step]
            best = _joined([p[0] for p in parts], 2)
            if q_scale is not None:
                best = best * q_scale[i0:i1, None, :]
            keep = _keep(best, None if doc_valid is None else doc_valid[i0:i1, k0:k1, None],
                         None if doc_masked is None else doc_masked[i0:i1, k0:k1, None],
                         None if q_mask is None else q_mask[i0:i1, None, :],
                         masked_as_zero)  # fmt: skip
            if keep is not None:
                best = torch.where(keep, best, 0.0)
            torch.sum(best, dim=2, out=out[i0:i1, k0:k1])
            if argmax is not None:
                index = _winners(_joined([p[1] for p in parts], 2), best, keep, d_mask is not None)
                argmax[i0:i1, k0:k1].copy_(index)


def _normalize_backward(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Gradient through y = x / max(||x||, EPS) per row, from grad = dL/dy (fp32), as the
    kernels compute it (kernel_lib.normalize_backward): a row with no gradient gets exactly
    0 whatever x holds, so NaN or inf in padding stays out."""
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    inv = 1.0 / norm.clamp_min(EPS)
    y = x * inv
    radial = torch.where(norm > EPS, (y * grad).sum(-1, keepdim=True), 0.0)
    takes = grad.abs().sum(-1, keepdim=True) != 0  # NaN counts: it stays NaN
    return torch.where(takes, (grad - y * radial) * inv, 0.0)


def backward(
    layout: str,
    grad_out: torch.Tensor,
    argmax: torch.Tensor,
    Q: torch.Tensor,
    D: torch.Tensor,
    has_q_mask: bool,
    has_d_mask: bool,
    normalize: bool,
    strategy: str,
    masked_as_zero: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_Q, grad_D) of sum(grad_out * scores), in the inputs' dtype, from the argmax
    the forward saved (it already says which tokens are masked: -1 takes no gradient).
    Deterministic; every strategy gives the same result. Arguments as dispatch.backward's."""
    if grad_out.numel() == 0 or Q.shape[1] == 0 or D.shape[-2] == 0:
        return torch.zeros_like(Q), torch.zeros_like(D)
    nq, lq, d = Q.shape
    Qf = Q.float()
    Qn = F.normalize(Qf, dim=-1, eps=EPS) if normalize else Qf
    grad_qn = torch.zeros(nq, lq, d)
    grad_D = torch.empty_like(D)
    g = grad_out.float()
    if layout == "dense":
        nd = D.shape[0]
        # Both the gathered rows [Nq, docs, Lq, d] and the chunk's docs [docs, Ld, d].
        docs = min(nd, max(1, GRAD_BUDGET // (max(nq * lq, D.shape[1]) * d)))
        for j0 in range(0, nd, docs):
            j1 = min(nd, j0 + docs)
            local = torch.arange(j1 - j0).view(1, -1, 1)
            gq, gd = _grad_chunk(g[:, j0:j1], argmax[:, j0:j1], Qn, D[j0:j1], local, normalize)
            grad_qn += gq
            grad_D[j0:j1].copy_(gd)
    else:
        D_kd, grad_D_kd = D, grad_D
        if layout == "pairs":  # kd with one doc per query
            g, argmax = g.view(-1, 1), argmax.view(nq, 1, lq)
            D_kd, grad_D_kd = D.unsqueeze(1), grad_D.unsqueeze(1)
        k = D_kd.shape[1]
        rows = min(nq, max(1, GRAD_BUDGET // (k * max(lq, D_kd.shape[2]) * d)))
        for i0 in range(0, nq, rows):
            i1 = min(nq, i0 + rows)
            local = (torch.arange(i1 - i0).view(-1, 1) * k + torch.arange(k)).unsqueeze(-1)
            gq, gd = _grad_chunk(g[i0:i1], argmax[i0:i1], Qn[i0:i1], D_kd[i0:i1], local,
                                 normalize)  # fmt: skip
            grad_qn[i0:i1] = gq
            grad_D_kd[i0:i1].copy_(gd)
    grad_Q = _normalize_backward(Qf, grad_qn) if normalize else grad_qn
    return grad_Q.to(Q.dtype), grad_D


def _grad_chunk(g, argmax, Qn, D, local, normalize):
    """One chunk's gradients: g [A, B] (B docs per query row), argmax [A, B, Lq], Qn
    [A, Lq, d] (normalized when asked), D [..., Ld, d] holding the chunk's A*B or B docs,
    local [A or 1, B, 1] each (query, doc) pair's doc in D. Returns (grad of Qn [A, Lq, d],
    grad of D fp32, D's shape)."""
    ld, d = D.shape[-2], D.shape[-1]
    Df = D.float()
    Dn = F.normalize(Df, dim=-1, eps=EPS) if normalize else Df
    flat = Dn.reshape(-1, d)
    won = argmax >= 0
    rows = (local * ld + argmax.long().clamp(min=0)).reshape(-1)
    weight = torch.where(won, g[..., None], 0.0)  # [A, B, Lq]
    picked = flat.index_select(0, rows).view(*argmax.shape, d)
    picked = torch.where(won[..., None], picked, 0.0)  # a loser's row may hold anything
    grad_qn = torch.einsum("abs,absd->asd", weight, picked)
    source = torch.where(won[..., None], weight[..., None] * Qn[:, None], 0.0)
    grad_dn = torch.zeros_like(flat).index_add_(0, rows, source.reshape(-1, d))
    grad_dn = grad_dn.view(Df.shape)
    return grad_qn, _normalize_backward(Df, grad_dn) if normalize else grad_dn
