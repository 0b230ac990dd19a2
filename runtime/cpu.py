"""The CPU backend: MaxSim as chunked matrix products, with dispatch.forward and
dispatch.backward's contract for the padded layouts (dense, kd, pairs).

One chunk of docs at a time: its tokens (converted, or normalized in fp32, in a reused
buffer where the matmul cannot read them as they are) are multiplied against every query
token in one matmul, doc tokens as rows (S [chunk tokens, query tokens]); masked doc
tokens' rows are set to -inf, and each query token's max over each doc's rows is one
reduction. Where a dense call's doc mask leaves out enough tokens to pay for it, the
valid tokens are packed first, docs longest first (PACK_GAIN). Memory is bounded by
SIM_BUDGET (similarities per step), DOC_BUDGET, PACK_BUDGET, SIM_CAP and WINNER_BUDGET
whatever the batch; Python loops run per chunk, never per doc. The backward gathers each
query token's winning doc token and scatters the query token back (no similarity is
recomputed), chunked by GRAD_BUDGET.

Numerics follow lik.runtime.reference: the max keeps NaN; a masked doc token never wins;
a query token with no valid doc token adds 0 (the mask decides, not the value: a valid
row of -inf similarities is a real -inf); masked query tokens add 0; masked_as_zero lets
a masked doc token compete with similarity 0. Scores accumulate in fp32. fp32 and fp16
inputs, and every call that saves an argmax (training), multiply in fp32 (IEEE), so
scores land within fp32 rounding of the float64 reference. bf16 scoring multiplies in
bf16 (_matmul_dtype): the rounded similarities pick each query token's winner, the first
token at their max, and its similarity is recomputed as an fp32 dot (_exact_max). A
score is then exact for the tokens it chose; where another token's similarity rounds to
the winner's (a near tie), the exact max may top the winner's by less than that rounding
(2**-8 relative; with normalize, of the similarity before the doc token's norm).
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

LAYOUTS = ("dense", "kd", "pairs")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Similarities per step (fp32 elements; 4 MB; bf16 steps take as many bytes, _budget). On
# a 2-core EPYC (AVX512-BF16), rerank 1 x 1000 x 32 x 300 and in-batch 32 x 32 x 32 x 300
# (d 128) in fp32 were within noise of their best from 2**19 to 2**20 (31-32 and 21-22
# ms); 2**17 ran up to 50% slower (per-step overhead), 2**22 up to 20% slower (out of
# cache). Tests lower it.
SIM_BUDGET = 1 << 20
# Doc token elements per step (16 MB fp32): bounds the step when queries are few (Lq = 1
# would otherwise take 2**20 doc tokens at once).
DOC_BUDGET = 1 << 22
# A doc mask's tokens are packed (_dense_steps) where query rows x masked / valid tokens
# reach PACK_GAIN[matmul dtype]: packing gathers the valid tokens (at ~memcpy speed) to
# spare the matmul the masked ones, so it pays less where the matmul is cheap (bf16).
# d 128, packed / in place, ms: rerank 1 x 1000 x 32 x 300 with prefix lengths uniform in
# [32, 300] (gain 26) fp32 20.5 / 28.8 (2-core EPYC), bf16 21.4 / 16.2 (2-core Xeon,
# AMX); with 30% holes (14) fp32 33.7 / 34.0, bf16 27.3 / 18.3; in-batch 32 x 32 with
# prefix lengths (840) fp32 10.7 / 17.3.
PACK_GAIN = {torch.float32: 16, torch.bfloat16: 48}
# Packed doc token elements per step: the gathered tokens stay in cache for the matmul
# (rerank with prefix lengths, fp32, 2-core Xeon, 2-4 runs: 21.6-24.5 ms at 2**21,
# 24.2-25.5 at 2**20, 23.1-25.8 at 2**22).
PACK_BUDGET = 1 << 21
# One doc's similarities to every query token are split by query rows past this.
SIM_CAP = 1 << 22
# fp32 elements of bf16 winners' tokens recomputed at once (_DenseScores; 1 MB): small
# enough that a step's docs are recomputed while still in cache (rerank, d 128: 12.0 ms at
# 2**18 and 2**19, 13.2 at 2**22; d 48 and in-batch within noise), and short steps share
# one recompute.
WINNER_BUDGET = 1 << 18
# fp32 elements per backward step: the winners' rows gathered (and the query rows
# scattered) [queries, docs, Lq, d], and the step's docs [docs, Ld, d].
GRAD_BUDGET = 1 << 22
EPS = 1e-12  # F.normalize's: x / max(||x||, EPS)


def _budget(budget: int, dtype: torch.dtype) -> int:
    """A budget in fp32 elements as elements of the matmul dtype: the same bytes (bf16 steps
    of 2**21 similarities ran 12-23% faster than of 2**20, and 8-20% faster than of 2**22
    between the benchmark's other calls: rerank d 48 and 128, in-batch, 2-core Xeon)."""
    return budget * 4 // dtype.itemsize


def _matmul_dtype(dtype: torch.dtype, training: bool) -> torch.dtype:
    """bf16 scoring multiplies in bf16 (AMX: rerank 1 x 1000 x 32 x 300, d 128, 3.8 ms of
    matmuls against 15.8 in fp32, 2-core Xeon), whose rounded similarities only pick the
    winners (_exact_max recomputes them). Training multiplies in fp32, so that the saved
    argmax, hence each gradient, follows the exact winner. fp16 has no fast CPU matmul (7x
    slower than fp32 at 6000 x 128 x 32)."""
    if dtype == torch.bfloat16 and not training:
        return torch.bfloat16
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
    """With normalize, bf16 matmuls take the raw tokens, each similarity scaled by its doc
    token's inverse norm in fp32 before the max and by the query's after it: the docs need
    no normalized copy, and the winners' recompute reads the tokens the matmul read."""
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
    """docs [G, T, d] @ queries_t [G, d, R] -> [G, T, R] in a scratch buffer, in the matmul
    dtype, or fp32 times scale [G, T, 1] when given (in the same pass as the conversion)."""
    g, t, r = docs.shape[0], docs.shape[1], queries_t.shape[2]
    sim = _scratch("sims", g * t * r, docs.dtype)[: g * t * r].view(g, t, r)
    if g == 1:
        torch.mm(docs[0], queries_t[0], out=sim[0])
    else:
        torch.bmm(docs, queries_t, out=sim)
    if scale is None:
        return sim
    sim32 = _scratch("sims_fp32", g * t * r, torch.float32)[: g * t * r].view(g, t, r)
    return torch.mul(sim, scale, out=sim32)


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


def _step_max(chunk, queries_t, scale, invalid, ld, want_index):
    """One step's max of each query token over each doc's rows: chunk [G, n * ld, d] against
    queries_t [G, d, R] -> (the max [G, n, R] fp32, the winning row in its doc [G, n, R] or
    None where not asked). bf16 matmuls round each similarity, so there the max is None and
    the caller recomputes the winner's similarity (_exact_max)."""
    sim = _similarities(chunk, queries_t, scale)
    if invalid is not None:
        _fill_masked_rows(sim, invalid)
    if chunk.dtype == torch.bfloat16:
        return None, _rounded_winners(sim, ld)
    return _token_max(sim, ld, want_index)


def _rounded_winners(sims, ld):
    """The first row at each query token's max over each doc's rows of sims [G, n * ld, R]
    (rounded similarities) -> [G, n, R], the row in its doc: a max pool over a
    channels-last image [G, R, n, ld], one vectorized pass in bf16 with the indices, where
    torch.max over the strided axis took 3.8x as long (218 docs x 300 tokens x 32 query
    tokens, 2-core Xeon). A NaN wins, as in torch.max, and its recompute is NaN."""
    g, t, r = sims.shape
    image = sims.view(g, t // ld, ld, r).permute(0, 3, 1, 2)
    rows = F.max_pool2d(image, (1, ld), return_indices=True)[1]
    return rows.permute(0, 2, 3, 1).reshape(g, t // ld, r).remainder_(ld)


def _exact_max(D, rows, queries, normalize):
    """The winners' similarities, exactly: fp32 dots of D's tokens at rows [G, n, R] (flat
    indices over D's tokens) with queries [G, R, d] (fp32), over the tokens' norms with
    normalize -> [G, n, R]. The tokens are gathered doc by doc (nearby rows: 40% faster
    than query token by query token), widened to fp32, multiplied by their query tokens
    in place and summed: a batched matrix-vector product (bmm, query token by query
    token) took 3.7x as long (1.47 against 0.40 ms for 32 docs x 1024 query tokens, d
    128, 2-core EPYC)."""
    d = D.shape[-1]
    g, n, r = rows.shape
    size = rows.numel() * d
    picked = _scratch("picked", size, D.dtype)[:size].view(-1, d)
    if D.is_contiguous():
        torch.index_select(D.view(-1, d), 0, rows.view(-1), out=picked)
    else:
        picked.copy_(D[torch.unravel_index(rows.view(-1), D.shape[:-1])])
    wide = _scratch("picked_fp32", size, torch.float32)[:size].view(g, n, r, d)
    wide.copy_(picked.view(g, n, r, d))
    inv_norms = _inv_norms(wide) if normalize else None
    dots = wide.mul_(queries.unsqueeze(1)).sum(dim=-1)
    return dots if inv_norms is None else dots.mul_(inv_norms)


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
    store = _DenseScores(out, Q, D, q_mask, d_mask, normalize, q_scale, masked_as_zero)
    for docs, tokens, invalid, positions in _dense_steps(D, d_mask, row_step, rows, dtype):
        n, ld = tokens.shape[0], tokens.shape[1]
        chunk, scale = _load_docs(tokens, dtype, normalize)
        chunk, scale = chunk.unsqueeze(0), None if scale is None else scale.unsqueeze(0)
        invalid = None if invalid is None else invalid.view(1, n * ld)
        parts = [_step_max(chunk, queries_t[:, :, r0 : r0 + row_step], scale, invalid, ld,
                           argmax is not None) for r0 in range(0, rows, row_step)]  # fmt: skip
        index = None if parts[0][1] is None else _joined([p[1][0] for p in parts], 1)
        if index is not None and positions is not None:  # packed rows -> the doc's tokens
            index = positions.gather(1, index)
        if parts[0][0] is None:  # bf16: the winners' similarities come later, in bulk
            store.winners(docs, index)
            continue
        best, keep = store(docs, _joined([p[0][0] for p in parts], 1))
        if argmax is not None:
            index = _winners(index, best, keep, d_mask is not None)
            index = index.view(n, nq, lq).transpose(0, 1).to(argmax.dtype)
            if isinstance(docs, slice):
                argmax[:, docs].copy_(index)
            else:
                argmax.index_copy_(1, docs, index)
    store.flush()


class _DenseScores:
    """A dense call's scores into out [Nq, Nd], docs at a time: __call__ takes each query
    token's max over each doc's tokens; winners() takes the winning tokens of bf16 steps
    and recomputes their similarities (_exact_max) WINNER_BUDGET at a time."""

    def __init__(self, out, Q, D, q_mask, d_mask, normalize, q_scale, masked_as_zero):
        self.out, self.D, self.normalize, self.q_scale = out, D, normalize, q_scale
        self.nq, self.lq = Q.shape[0], Q.shape[1]
        self.queries = Q.reshape(1, -1, Q.shape[2]).float() if Q.dtype == torch.bfloat16 else None
        self.doc_valid, self.doc_masked = _doc_flags(d_mask)
        self.q_keep = None if q_mask is None else q_mask.reshape(1, -1)
        self.masked_as_zero = masked_as_zero
        self.pending, self.size = [], 0

    def __call__(self, docs, best):
        """best [n, rows] of docs (a slice or indices) -> (best as kept, where it counts)."""
        if self.q_scale is not None:
            best = best * self.q_scale
        keep = _keep(best, None if self.doc_valid is None else self.doc_valid[docs, None],
                     None if self.doc_masked is None else self.doc_masked[docs, None],
                     self.q_keep, self.masked_as_zero)  # fmt: skip
        if keep is not None:
            best = torch.where(keep, best, 0.0)
        scores = best.reshape(best.shape[0], self.nq, self.lq).sum(dim=2).t()
        if isinstance(docs, slice):
            self.out[:, docs].copy_(scores)
        else:
            self.out.index_copy_(1, docs, scores)
        return best, keep

    def winners(self, docs, tokens):
        """tokens [n, rows]: each query token's winning token in each of the docs."""
        if isinstance(docs, slice):
            docs = torch.arange(docs.start, docs.stop)
        self.pending.append((docs, tokens))
        self.size += tokens.numel() * self.D.shape[-1]
        if self.size >= WINNER_BUDGET:
            self.flush()

    def flush(self):
        if not self.pending:
            return
        docs = _joined([p[0] for p in self.pending], 0)
        tokens = _joined([p[1] for p in self.pending], 0)
        self.pending, self.size = [], 0
        rows = (docs.unsqueeze(1) * self.D.shape[1] + tokens).unsqueeze(0)
        self(docs, _exact_max(self.D, rows, self.queries, self.normalize)[0])


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
    sims = _budget(SIM_BUDGET, dtype)
    if d_mask is not None and D.is_contiguous() and _packing_pays(d_mask, query_rows, dtype):
        counts = d_mask.sum(dim=1)
        order = torch.argsort(counts, descending=True, stable=True)
        sorted_counts = counts[order].tolist()
        flat = D.view(nd * ld, d)
        j0 = 0
        while j0 < nd and sorted_counts[j0] > 0:
            length = sorted_counts[j0]
            n = min(nd - j0, max(1, min(sims // (length * row_step),
                                        _budget(PACK_BUDGET, dtype) // (length * d))))  # fmt: skip
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
    docs = min(nd, max(1, min(sims // (ld * row_step), _budget(DOC_BUDGET, dtype) // (ld * d))))
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


def _even_batches(step: int) -> int:
    """A batched matmul's batch count, rounded down to a multiple of the threads: bmm
    shares its batches out between them, and an odd count on 2 threads ran 1.3x as long
    per batch (docs of 9600 tokens x 32 query tokens, d 128, fp32: 0.53 ms a batch in 3s
    against 0.40 in 1s, 2s, 4s or 6s; kd 64 x 32 x 32 x 300 47 -> 34 ms, 2-core EPYC)."""
    threads = torch.get_num_threads()
    return step - step % threads if step > threads else step


def _forward_kd(Q, D, q_mask, d_mask, normalize, out, argmax, masked_as_zero):
    """D [Nq, K, Ld, d]: query i against its own K docs, a batched matmul per query chunk."""
    nq, lq, d = Q.shape
    k, ld = D.shape[1], D.shape[2]
    q_step = min(lq, max(1, SIM_CAP // ld))  # query tokens per step
    dtype = _matmul_dtype(Q.dtype, argmax is not None)
    # Docs per query, then queries, per step: as many as both budgets allow.
    sims, docs = _budget(SIM_BUDGET, dtype), _budget(DOC_BUDGET, dtype)
    k_step = min(k, max(1, min(sims // (ld * q_step), docs // (ld * d))))
    i_step = _even_batches(min(nq, max(1, min(sims // (k_step * ld * q_step),
                                              docs // (k_step * ld * d)))))  # fmt: skip
    queries, q_scale = _prepare_queries(Q, normalize, dtype)
    queries_t = queries.transpose(1, 2)  # [Nq, d, Lq]
    exact = Q.float() if dtype == torch.bfloat16 else None
    doc_valid, doc_masked = _doc_flags(d_mask)
    tokens = torch.arange(nq * k).view(nq, k, 1) * ld  # each doc's first token in D
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
            parts = [_step_max(chunk, queries_t[i0:i1, :, s0 : s0 + q_step], scale, invalid,
                               ld, argmax is not None) for s0 in range(0, lq, q_step)]  # fmt: skip
            if exact is not None:  # bf16: the winners' similarities, recomputed
                rows = tokens[i0:i1, k0:k1] + _joined([p[1] for p in parts], 2)
                best = _exact_max(D, rows, exact[i0:i1], normalize)
            else:
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
