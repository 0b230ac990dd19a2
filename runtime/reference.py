"""The ground truth: plain PyTorch MaxSim, autograd-aware, float64-capable, memory-bounded.

Every test compares a kernel against these functions. They follow lik's semantics (the
README's "API in brief"): masks are bool with True = valid; a masked doc token never wins
the max; a query token with no valid doc token (fully masked doc, Ld == 0) contributes 0;
masked query tokens contribute 0. Computation happens in the inputs' dtype promoted to at least
fp32 (pass float64 tensors for a float64 reference); scores come back in that dtype.

Masked positions and non-finite values (the rule every path follows):

- Padding may hold anything. A masked token (of Q, D, the hidden states of the fused
  head, the doc tokens past a PLAID length) and a masked query token's weight are set to
  0 before any arithmetic (a `where`, not a product), so NaN, inf or garbage there
  reaches no score and no gradient, and the gradient at a masked position is exactly 0.
- Valid values are scored in IEEE arithmetic: sim = <q, d>; the max over the valid doc
  tokens keeps NaN (a NaN similarity makes that query token's max NaN); -inf is a real
  similarity: it loses to any larger one, and a query token whose valid similarities
  are all -inf contributes -inf. That is not "no valid doc token" (a mask, or Ld == 0),
  which contributes 0; what decides it is the mask, never the value. Contributions add
  as IEEE numbers (+inf plus -inf is NaN).
- So a NaN or an infinity in a valid query token makes every score it takes part in
  non-finite (each of its similarities is an infinity or NaN); with normalize=True a
  token holding an infinity normalizes to NaN. One in a valid doc token makes the score
  non-finite unless its similarity is -inf and another valid doc token wins the max. A
  NaN or infinite weight on a valid query token is a value like any other (inf * 0 is
  NaN). The smooth and top-k-mean scores follow the same rule: logsumexp and the mean of
  the k best over the valid tokens, -inf ones included.
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


def _valid_only(X: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """X [..., L, d] with the tokens its mask [..., L] marks invalid set to 0: whatever
    padding holds reaches no score, and the gradient there is exactly 0 (a where passes
    none to the side it did not select)."""
    if mask is None:
        return X
    return torch.where(mask[..., None], X, torch.zeros((), dtype=X.dtype, device=X.device))


def _token_max(
    sim: torch.Tensor, d_mask: torch.Tensor | None, masked_as_zero: bool = False
) -> torch.Tensor:
    """max over the last axis (doc tokens) of sim, 0 where no doc token is valid; a valid
    row of -inf similarities is a real -inf (the mask decides, not the value).
    masked_as_zero: a masked doc token competes with similarity 0 (PyLate's convention):
    a max below 0 in a doc with a masked token is 0, with zero gradient; a tie at 0 keeps
    the valid token's."""
    if sim.shape[-1] == 0:  # a sum over no tokens: zeros that keep sim's graph
        return sim.sum(dim=-1)
    if d_mask is None:
        return sim.amax(dim=-1)
    best = sim.masked_fill(~d_mask, float("-inf")).amax(dim=-1)
    # Fully masked doc: 0, with zero gradient (where, not arithmetic).
    best = torch.where(d_mask.any(dim=-1), best, torch.zeros_like(best))
    if masked_as_zero:
        zero_wins = ~d_mask.all(dim=-1) & (best < 0)
        best = torch.where(zero_wins, torch.zeros_like(best), best)
    return best


def _empty_scores(shape, *inputs: torch.Tensor) -> torch.Tensor:
    """Scores of an empty batch (shape holds a 0) that still depend on inputs: a backward
    through them yields zero gradients instead of failing for want of a graph."""
    out = inputs[0].new_zeros(shape)
    for tensor in inputs:
        out = out + tensor.sum() * 0
    return out


def _sum_query_tokens(best: torch.Tensor, q_mask: torch.Tensor | None) -> torch.Tensor:
    """Sums best [..., Lq] over query tokens; q_mask broadcasts against best."""
    if q_mask is not None:
        best = torch.where(q_mask, best, torch.zeros_like(best))
    return best.sum(dim=-1)


def _prepare(Q, D, normalize, q_mask=None, d_mask=None):
    """Q and D in the compute dtype, masked tokens set to 0 (before normalizing: a NaN
    token would normalize to NaN), then normalized when asked."""
    dtype = _compute_dtype(Q, D)
    Q, D = _valid_only(Q.to(dtype), q_mask), _valid_only(D.to(dtype), d_mask)
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
    masked_as_zero: bool = False,
) -> torch.Tensor:
    """MaxSim with lik.runtime.maxsim's layouts, as plain PyTorch.

    Q [Nq, Lq, d] or [Lq, d]; D [Nd, Ld, d] -> [Nq, Nd], D [Nq, K, Ld, d] -> [Nq, K],
    D [Ld, d] -> [Nq]. A [Lq, d] query squeezes the query axis of the result.
    masked_as_zero: d_mask reads as zeros, PyLate's convention (_token_max;
    lik.runtime.api.maxsim_masked_as_zero).
    """
    squeeze = Q.dim() == 2
    if squeeze:
        Q = Q.unsqueeze(0)
        q_mask = None if q_mask is None else q_mask.unsqueeze(0)
    if D.dim() == 2:
        d_mask = None if d_mask is None else d_mask.unsqueeze(0)
        out = _dense(Q, D.unsqueeze(0), q_mask, d_mask, normalize, masked_as_zero)[:, 0]
    elif D.dim() == 4:
        out = _kd(Q, D, q_mask, d_mask, normalize, masked_as_zero)
    else:
        out = _dense(Q, D, q_mask, d_mask, normalize, masked_as_zero)
    return out[0] if squeeze else out


def maxsim_pairs_reference(
    Q: torch.Tensor,
    D: torch.Tensor,
    q_mask: torch.Tensor | None = None,
    d_mask: torch.Tensor | None = None,
    *,
    normalize: bool = False,
    masked_as_zero: bool = False,
) -> torch.Tensor:
    """Diagonal MaxSim: Q [B, Lq, d] with D [B, Ld, d] -> [B] (query b against doc b).
    masked_as_zero as in maxsim_reference."""
    Q, D = _prepare(Q, D, normalize, q_mask, d_mask)
    B, Lq, Ld = Q.shape[0], Q.shape[1], D.shape[1]
    rows = max(1, CHUNK_ELEMENTS // max(1, Lq * Ld))
    parts = []
    for start in range(0, B, rows):
        stop = min(B, start + rows)
        sim = torch.einsum("bsk,btk->bst", Q[start:stop], D[start:stop])
        dm = None if d_mask is None else d_mask[start:stop, None, :]
        qm = None if q_mask is None else q_mask[start:stop]
        parts.append(_sum_query_tokens(_token_max(sim, dm, masked_as_zero), qm))
    return torch.cat(parts) if parts else _empty_scores((0,), Q, D)


def maxsim_from_hidden_reference(
    Q: torch.Tensor,
    H_d: torch.Tensor,
    W: torch.Tensor,
    b: torch.Tensor | None = None,
    d_mask: torch.Tensor | None = None,
    *,
    normalize: bool = True,
) -> torch.Tensor:
    """The fused head as plain PyTorch: D = H_d W^T + b, L2-normalized per token when
    normalize (the queries are used as given), then MaxSim against Q -> [Nq, Nd].

    Q [Nq, Lq, d] or [Lq, d]; H_d [Nd, Ld, d_model]; W [d, d_model]; b [d] or None;
    d_mask [Nd, Ld]. Materializes the projected documents (the fused kernel does not).
    """
    dtype = torch.promote_types(_compute_dtype(Q, H_d), W.dtype)
    H_d = _valid_only(H_d.to(dtype), d_mask)  # padding's hidden states reach no gradient of W
    D = F.linear(H_d, W.to(dtype), None if b is None else b.to(dtype))
    if normalize:
        D = F.normalize(D, dim=-1)
    return maxsim_reference(Q.to(dtype), D, None, d_mask)


def _dense(Q, D, q_mask, d_mask, normalize, masked_as_zero=False):
    Q, D = _prepare(Q, D, normalize, q_mask, d_mask)
    Nq, Lq, Nd, Ld = Q.shape[0], Q.shape[1], D.shape[0], D.shape[1]
    docs = max(1, CHUNK_ELEMENTS // max(1, Nq * Lq * Ld))
    parts = []
    for start in range(0, Nd, docs):
        stop = min(Nd, start + docs)
        sim = torch.einsum("isk,jtk->ijst", Q, D[start:stop])
        dm = None if d_mask is None else d_mask[None, start:stop, None, :]
        qm = None if q_mask is None else q_mask[:, None, :]
        parts.append(_sum_query_tokens(_token_max(sim, dm, masked_as_zero), qm))
    return torch.cat(parts, dim=1) if parts else _empty_scores((Nq, 0), Q, D)


def _kd(Q, D, q_mask, d_mask, normalize, masked_as_zero=False):
    Q, D = _prepare(Q, D, normalize, q_mask, d_mask)
    Nq, Lq, K, Ld = Q.shape[0], Q.shape[1], D.shape[1], D.shape[2]
    rows = max(1, CHUNK_ELEMENTS // max(1, K * Lq * Ld))
    parts = []
    for start in range(0, Nq, rows):
        stop = min(Nq, start + rows)
        sim = torch.einsum("isk,ictk->icst", Q[start:stop], D[start:stop])
        dm = None if d_mask is None else d_mask[start:stop, :, None, :]
        qm = None if q_mask is None else q_mask[start:stop, None, :]
        parts.append(_sum_query_tokens(_token_max(sim, dm, masked_as_zero), qm))
    return torch.cat(parts, dim=0) if parts else _empty_scores((0, K), Q, D)


def _bad_sequences(cu: torch.Tensor, total: int) -> torch.Tensor:
    """Per sequence of the offsets cu [N + 1] over `total` packed tokens, whether the
    kernels poison its scores: offsets that run backwards, before 0 or past the tokens;
    and every sequence when the offsets do not start at 0 and end at `total` (they would
    leave tokens out)."""
    cu = cu.long()
    bad = (cu[1:] < cu[:-1]) | (cu[:-1] < 0) | (cu[1:] > total)
    if cu[0] != 0 or cu[-1] != total:
        return torch.ones_like(bad)
    return bad


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
    max_seqlen_q: int | None = None,
) -> torch.Tensor:
    """Ragged MaxSim over packed tokens: every (query, doc) pair for layout="varlen"
    ([Nq, Nd]), the listed pairs for "packed_pairs" ([P]). An empty sequence scores 0.

    A pair the kernels cannot score scores NaN, as they do (their offsets are checked
    on the device, not read back): a pair index outside [0, N), or a sequence whose
    offsets run backwards, before 0 or past its packed tokens, or a query longer than
    max_seqlen_q when given. Offsets that do not start at 0 and end at the packed length
    poison every score (they would leave tokens out)."""
    Q, D = _prepare(Q, D, normalize)
    cu_q, cu_d = cu_seqlens_q.tolist(), cu_seqlens_d.tolist()
    nq, nd = len(cu_q) - 1, len(cu_d) - 1
    if layout == "varlen":
        pairs = [(i, j) for i in range(nq) for j in range(nd)]
    else:
        pairs = list(zip(pair_q_idx.tolist(), pair_d_idx.tolist(), strict=True))
    bad_q = _bad_sequences(cu_seqlens_q, Q.shape[0])
    if max_seqlen_q is not None:
        bad_q |= cu_seqlens_q[1:] - cu_seqlens_q[:-1] > max_seqlen_q
    bad_q, bad_d = bad_q.tolist(), _bad_sequences(cu_seqlens_d, D.shape[0]).tolist()

    nan = Q.new_full((), float("nan"))
    scores = []
    for i, j in pairs:
        if not (0 <= i < nq and 0 <= j < nd) or bad_q[i] or bad_d[j]:
            scores.append(nan)
            continue
        q, d = Q[cu_q[i] : cu_q[i + 1]], D[cu_d[j] : cu_d[j + 1]]
        scores.append(_token_max(q @ d.T, None).sum())
    out = torch.stack(scores) if scores else _empty_scores((0,), Q, D)
    if layout == "varlen":
        return out.view(len(cu_q) - 1, len(cu_d) - 1)
    return out


def _dequantize(X: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """X (fp8) times its scale: one per tensor (shape () or (1,)) or one per token
    (X.shape[:-1]), in `dtype`."""
    scale = scale.to(dtype)
    if scale.dim() > 0:
        scale = scale.unsqueeze(-1)
    return X.to(dtype) * scale


def maxsim_fp8_reference(
    Q: torch.Tensor,
    D: torch.Tensor,
    *,
    scale_Q: torch.Tensor,
    scale_D: torch.Tensor,
    q_mask: torch.Tensor | None = None,
    d_mask: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """lik.runtime.fp8.maxsim_inference_fp8 as plain PyTorch: dequantizes Q and D
    (float8_e4m3fn) with their scales into `dtype`, then scores with maxsim_reference.

    Q [Nq, Lq, d] or [Lq, d]; D [Nd, Ld, d] or [Ld, d]; scale_Q shape () / (1,) or
    Q.shape[:-1]; scale_D likewise. Scores come back in `dtype`.
    """
    return maxsim_reference(
        _dequantize(Q, scale_Q, dtype), _dequantize(D, scale_D, dtype), q_mask, d_mask
    )


def _token_score(sim, d_mask, score: str, tau: float, k: int) -> torch.Tensor:
    """One score per query token from sim [..., Ld]: max (also for "weighted", whose
    weights apply outside), tau * logsumexp(sim / tau) ("smooth"), or the mean of the k
    largest ("topk_mean", over fewer when fewer doc tokens are valid; among equal
    similarities the earliest tokens, as the kernels pick them). 0 where no doc token is
    valid, with zero gradient."""
    if sim.shape[-1] == 0:  # a sum over no tokens: zeros that keep sim's graph
        return sim.sum(dim=-1)
    if score not in ("max", "weighted", "smooth", "topk_mean"):
        raise ValueError(f"score must be 'weighted', 'smooth' or 'topk_mean', got {score!r}")
    # Valid doc tokens per row: the mask decides, so a valid row of -inf similarities is
    # a real -inf (the module docstring's rule), unlike a row with no valid token.
    if d_mask is None:
        valid = torch.full(sim.shape[:-1], sim.shape[-1], device=sim.device)
    else:
        sim = sim.masked_fill(~d_mask, float("-inf"))
        valid = d_mask.sum(dim=-1).expand(sim.shape[:-1])
    empty = valid == 0
    # Rows with no valid token score 0 below; computing on zeros keeps their gradient
    # finite (logsumexp of all -inf would backpropagate NaN through the where).
    sim = torch.where(empty[..., None], torch.zeros_like(sim), sim)
    if score in ("max", "weighted"):
        token = sim.amax(dim=-1)
    elif score == "smooth":
        # Shifted by the row max, as the kernels compute it: sim / tau alone overflows
        # for a tau near fp32's smallest normal. The shift is a constant of the gradient
        # (softmax either way); a row whose max is not finite keeps IEEE's answer.
        best = sim.detach().amax(dim=-1, keepdim=True)
        shift = torch.where(best.isfinite(), best, torch.zeros_like(best))
        token = shift[..., 0] + tau * torch.logsumexp((sim - shift) / tau, dim=-1)
    else:  # topk_mean: the mean of the min(k, valid) best, valid -inf ones included
        # A stable sort keeps equal similarities in token order (topk picks any of them).
        kk = min(k, sim.shape[-1])
        top = sim.sort(dim=-1, descending=True, stable=True).values[..., :kk]
        count = valid.clamp(max=kk)
        kept = torch.arange(kk, device=sim.device) < count[..., None]
        total = torch.where(kept, top, torch.zeros_like(top)).sum(dim=-1)
        token = total / count.clamp(min=1)
    return torch.where(empty, torch.zeros_like(token), token)


def maxsim_scored_reference(
    Q: torch.Tensor,
    D: torch.Tensor,
    q_mask: torch.Tensor | None = None,
    d_mask: torch.Tensor | None = None,
    *,
    score: str,
    weights: torch.Tensor | None = None,
    tau: float = 0.1,
    k: int = 1,
    normalize: bool = False,
    pairs: bool = False,
) -> torch.Tensor:
    """MaxSim with another token score (lik.runtime.variants), as plain PyTorch:
    sum over query tokens s of weights[s] * token_score(sim[s, :]).

    Q [Nq, Lq, d], D [Nd, Ld, d] -> [Nq, Nd]; pairs=True: Q [B, Lq, d], D [B, Ld, d] -> [B].
    weights [Nq, Lq] (or [B, Lq]) for score="weighted". Masks as in maxsim_reference.
    """
    Q, D = _prepare(Q, D, normalize, q_mask, d_mask)
    if weights is not None:  # a masked query token's weight is padding too
        weights = _valid_only(weights.to(Q.dtype)[..., None], q_mask)[..., 0]
    Nq, Lq, Nd, Ld = Q.shape[0], Q.shape[1], D.shape[0], D.shape[1]
    if pairs:
        sim = torch.einsum("bsk,btk->bst", Q, D)
        dm = None if d_mask is None else d_mask[:, None, :]
        token = _token_score(sim, dm, score, tau, k)
        if weights is not None:
            token = token * weights
        return _sum_query_tokens(token, q_mask)
    docs = max(1, CHUNK_ELEMENTS // max(1, Nq * Lq * Ld))
    parts = []
    for start in range(0, Nd, docs):
        stop = min(Nd, start + docs)
        sim = torch.einsum("isk,jtk->ijst", Q, D[start:stop])
        dm = None if d_mask is None else d_mask[None, start:stop, None, :]
        token = _token_score(sim, dm, score, tau, k)
        if weights is not None:
            token = token * weights[:, None, :]
        parts.append(_sum_query_tokens(token, None if q_mask is None else q_mask[:, None, :]))
    return torch.cat(parts, dim=1) if parts else _empty_scores((Nq, 0), Q, D)


# PLAID residual compression (lik.runtime.plaid). A compressed doc token is a centroid id
# (code) plus one nbits-bit bucket id per dim, packed into ceil(d * nbits / 8) bytes in the
# bit order of ColBERTv2 and fast-plaid (numpy.packbits over the bucket bits, least
# significant bucket bit first): bucket bit i of dim k is flat bit p = k * nbits + i,
# stored in byte p // 8 at bit 7 - p % 8 (bit 0 = least significant). It decodes to
# centroids[code] + bucket_weights[bucket] per dim, then L2-normalizes.


def unpack_residual_buckets(residuals: torch.Tensor, nbits: int, dim: int) -> torch.Tensor:
    """Bucket ids [..., dim] (int64) from packed residual bytes [..., ceil(dim*nbits/8)]."""
    msb_first = torch.arange(7, -1, -1, device=residuals.device)
    bits = (residuals.long().unsqueeze(-1) >> msb_first) & 1  # [..., bytes, 8]
    bits = bits.flatten(-2)[..., : dim * nbits].unflatten(-1, (dim, nbits))
    return (bits << torch.arange(nbits, device=residuals.device)).sum(-1)


def decompress_residual_reference(
    codes: torch.Tensor,
    residuals: torch.Tensor,
    centroids: torch.Tensor,
    bucket_weights: torch.Tensor,
    nbits: int,
) -> torch.Tensor:
    """Decoded doc tokens [..., d] (not normalized): centroids[code] + bucket_weights[bucket],
    in the centroids' and weights' dtype promoted to at least fp32. A code outside
    [0, n_centroids) decodes to a NaN token."""
    dtype = torch.promote_types(torch.promote_types(centroids.dtype, bucket_weights.dtype),
                                torch.float32)  # fmt: skip
    codes = codes.long()
    code_ok = (codes >= 0) & (codes < centroids.shape[0])
    buckets = unpack_residual_buckets(residuals, nbits, centroids.shape[1])
    decoded = centroids.to(dtype)[torch.where(code_ok, codes, 0)]
    decoded = decoded + bucket_weights.to(dtype)[buckets]
    return torch.where(code_ok.unsqueeze(-1), decoded, float("nan"))


def _residual_doc_chunks(n_docs: int, per_doc: int):
    step = max(1, CHUNK_ELEMENTS // max(1, per_doc))
    return [(start, min(n_docs, start + step)) for start in range(0, n_docs, step)]


def maxsim_residual_reference(
    Q: torch.Tensor,
    codes: torch.Tensor,
    residuals: torch.Tensor,
    doc_lengths: torch.Tensor,
    centroids: torch.Tensor,
    bucket_weights: torch.Tensor,
    nbits: int,
    *,
    normalize: bool = True,
) -> torch.Tensor:
    """MaxSim of Q [Nq, Lq, d] (or [Lq, d]) against B residual-compressed docs
    (codes [B, Ld], residuals [B, Ld, bytes], doc_lengths [B]) -> [Nq, B] (or [B]).

    Doc b's tokens t < doc_lengths[b] are valid; an empty doc scores 0, a length outside
    [0, Ld] scores NaN. Autograd-aware in Q (and centroids, bucket_weights)."""
    squeeze = Q.dim() == 2
    if squeeze:
        Q = Q.unsqueeze(0)
    dtype = torch.promote_types(Q.dtype, centroids.dtype)
    dtype = torch.promote_types(torch.promote_types(dtype, bucket_weights.dtype), torch.float32)
    Q = Q.to(dtype)
    if normalize:
        Q = F.normalize(Q, dim=-1)
    Nq, Lq, B, Ld = Q.shape[0], Q.shape[1], codes.shape[0], codes.shape[1]
    lengths = doc_lengths.long()
    bad_length = (lengths < 0) | (lengths > Ld)
    parts = []
    for start, stop in _residual_doc_chunks(B, Nq * Lq * Ld + Ld * Q.shape[-1]):
        D = decompress_residual_reference(
            codes[start:stop], residuals[start:stop], centroids.to(dtype),
            bucket_weights.to(dtype), nbits,
        )  # fmt: skip
        valid = torch.arange(Ld, device=codes.device) < lengths[start:stop, None]
        D = _valid_only(D, valid)  # tokens past a length (any code) reach no gradient
        if normalize:
            D = F.normalize(D, dim=-1)
        sim = torch.einsum("isk,jtk->ijst", Q, D)
        parts.append(_token_max(sim, valid[None, :, None, :]).sum(dim=-1))
    out = torch.cat(parts, dim=1) if parts else _empty_scores((Nq, 0), Q, centroids, bucket_weights)
    out = torch.where(bad_length[None, :], float("nan"), out)
    return out[0] if squeeze else out


def maxsim_residual_varlen_reference(
    Q: torch.Tensor,
    codes_flat: torch.Tensor,
    residuals_flat: torch.Tensor,
    cu_seqlens_d: torch.Tensor,
    centroids: torch.Tensor,
    bucket_weights: torch.Tensor,
    nbits: int,
    *,
    normalize: bool = True,
) -> torch.Tensor:
    """maxsim_residual_reference over packed index tokens: doc j is tokens
    cu_seqlens_d[j] : cu_seqlens_d[j + 1] of codes_flat [T] and residuals_flat [T, bytes].
    As in the kernels, a doc whose offsets run backwards, before 0 or past T scores NaN,
    and offsets that do not start at 0 and end at T poison every score."""
    cu = cu_seqlens_d.long()
    total = codes_flat.shape[0]
    bad = _bad_sequences(cu, total)
    lengths = torch.where(bad, 0, cu[1:] - cu[:-1])
    longest = int(lengths.max()) if lengths.numel() else 0
    # Repack as a padded batch; padding reads some token in range, masked by the lengths.
    index = cu[:-1, None].clamp(0, total) + torch.arange(longest, device=cu.device)
    index = index.clamp(0, max(total - 1, 0))
    out = maxsim_residual_reference(
        Q, codes_flat[index], residuals_flat[index], lengths, centroids, bucket_weights, nbits,
        normalize=normalize,
    )  # fmt: skip
    return torch.where(bad, float("nan"), out)


def plaid_approx_score_reference(
    query_centroid_scores: torch.Tensor, codes: torch.Tensor, doc_lengths: torch.Tensor
) -> torch.Tensor:
    """PLAID's centroid-only score: per doc b, sum over query tokens s of the max over its
    valid tokens t < doc_lengths[b] of query_centroid_scores[codes[b, t], s] -> [B].
    An empty doc scores 0; a length outside [0, Ld] or a valid token's code outside
    [0, n_centroids) scores NaN."""
    scores = query_centroid_scores
    if not scores.dtype.is_floating_point:
        raise TypeError(f"query_centroid_scores must be floating point, got {scores.dtype}")
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
    n_c, Lq = scores.shape
    B, Ld = codes.shape
    lengths = doc_lengths.long()
    codes = codes.long()
    valid = torch.arange(Ld, device=codes.device) < lengths[:, None]
    code_ok = (codes >= 0) & (codes < n_c)
    bad = (lengths < 0) | (lengths > Ld) | (valid & ~code_ok).any(dim=1)
    # Bad codes gather row 0 (their docs score NaN); with no centroids, a zero stand-in row.
    table = scores if n_c else scores.new_zeros(1, Lq)
    parts = []
    for start, stop in _residual_doc_chunks(B, Ld * Lq):
        sim = table[torch.where(code_ok[start:stop], codes[start:stop], 0)]  # [c, Ld, Lq]
        best = _token_max(sim.transpose(1, 2), valid[start:stop, None, :])  # [c, Lq]
        parts.append(best.sum(dim=-1))
    out = torch.cat(parts) if parts else scores.new_zeros(0)
    return torch.where(bad, float("nan"), out)
