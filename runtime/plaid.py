"""PLAID (ColBERTv2 / fast-plaid) residual-compressed documents, scored in place.

    plaid_approx_score(query_centroid_scores [n_c, Lq], codes [B, Ld], doc_lengths [B]) -> [B]
    maxsim_residual(Q, codes, residuals, doc_lengths, centroids, bucket_weights, nbits,
                    *, normalize=True) -> [Nq, B]            (autograd to Q)
    maxsim_residual_varlen(Q, codes_flat, residuals_flat, cu_seqlens_d, centroids,
                           bucket_weights, nbits, *, max_seqlen_d=None, normalize=True)

Q is one query [Lq, d] (the result drops the query axis) or several [Nq, Lq, d], scored
against every candidate doc. A compressed doc token is a centroid id (codes, int32 or
int64) plus one nbits-bit bucket id per dim (residuals, uint8, ceil(d * nbits / 8) bytes
per token). One generated kernel per call decodes each doc tile in registers
(centroids[code] + bucket_weights[bucket] per dim), L2-normalizes it and scores it; the
decoded tokens never reach memory. Queries are L2-normalized too (normalize=True is the
only mode: PLAID's decoded residuals are defined up to that normalization).

Bit order (ColBERTv2 and fast-plaid write it with numpy.packbits over the bucket bits,
least significant bucket bit first): bucket bit i of dim k is flat bit p = k * nbits + i
of the token's bytes, stored in byte p // 8 at bit 7 - p % 8 (bit 0 = least significant).
For nbits = 2, byte 0 = b0(dim0) b1(dim0) b0(dim1) b1(dim1) ... from its most significant
bit down; for nbits = 8 each byte is its dim's bucket id with the bits reversed.

Bad inputs are caught where they are read, without a host sync: a doc length outside
[0, Ld], a valid token whose code is outside [0, n_centroids), or (varlen, with
max_seqlen_d given) offsets outside the packed tokens make that doc's score NaN, never a
truncated or wrong finite score; varlen offsets that do not start at 0 and end at the
packed length make every score NaN. Shapes, dtypes and devices are checked up front.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from lik.runtime import backends, dispatch, heuristics, launch_plan, ops, ragged, registry, validate
from lik.runtime.keys import MAX_HEAD_DIM, SUPPORTED_DTYPES, variant_name
from lik.runtime.reference import (
    decompress_residual_reference,
    maxsim_residual_reference,
    maxsim_residual_varlen_reference,
    plaid_approx_score_reference,
)

NBITS = (2, 4, 8)
_Q_DOC = "[Nq, Lq, d] or [Lq, d]"
_INDEX_DTYPES = (torch.int32, torch.int64)
# Docs per chunk of the PyTorch grad_Q recompute: bounds its decoded tokens and
# similarities (~Nq * Lq * chunk * Ld floats).
GRAD_CHUNK_ELEMENTS = 1 << 26


def _tensor(name: str, value: object, doc: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {doc}, got {type(value).__name__}")
    return value


def _shape_matches(got: torch.Size, want: tuple) -> bool:
    """got has want's rank and its size on every axis where want is not None."""
    if len(got) != len(want):
        return False
    for size, wanted in zip(got, want, strict=True):  # a loop: half the cost of any()
        if wanted is not None and size != wanted:
            return False
    return True


def _check(name, value, doc, *, shape, dtypes, device, dtype_doc) -> torch.Tensor:
    """A tensor of exactly `shape` (None = any size on that axis) and an allowed dtype.
    doc, the expected form, is a str or a function returning one: a call checks six
    tensors, so messages are formatted only for the one that fails."""
    if not isinstance(value, torch.Tensor) or not _shape_matches(value.shape, shape):
        doc = doc() if callable(doc) else doc
        value = _tensor(name, value, doc)
        raise ValueError(f"{name} must be {doc}, got {validate.describe(value)}")
    if value.dtype not in dtypes:
        raise TypeError(f"{name} must be {dtype_doc}, got {value.dtype}")
    if value.device != device:
        raise ValueError(f"{name} must be on {device} like the other inputs, got {value.device}")
    return value


def _query(Q: object) -> torch.Tensor:
    Q = _tensor("Q", Q, _Q_DOC)
    if Q.dim() not in (2, 3):
        raise ValueError(f"Q must be {_Q_DOC}, got {validate.describe(Q)}")
    if Q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"Q must be fp32, fp16 or bf16, got {Q.dtype}")
    if Q.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"head dim {Q.shape[-1]} exceeds the largest supported, {MAX_HEAD_DIM}")
    return Q


def _nbits(nbits: object) -> int:
    if isinstance(nbits, bool) or not isinstance(nbits, int) or nbits not in NBITS:
        raise ValueError(f"nbits must be one of {NBITS}, got {nbits!r}")
    return nbits


def _normalize(normalize: object) -> None:
    if normalize is not True:
        raise ValueError(
            f"normalize must be True, got {normalize!r}: PLAID decodes residuals relative to "
            "normalized embeddings, so decoded tokens (and queries) are always L2-normalized"
        )


def _codebook(Q, centroids, bucket_weights, nbits):
    dim = Q.shape[-1]
    centroids = _check(
        "centroids",
        centroids,
        lambda: f"[n_centroids, {dim}]",
        shape=(None, dim),
        dtypes=SUPPORTED_DTYPES,
        device=Q.device,
        dtype_doc="fp32, fp16 or bf16",
    )
    if centroids.shape[0] == 0:
        raise ValueError("centroids must hold at least one centroid, got shape (0, d)")
    n_buckets = 1 << nbits
    bucket_weights = _check(
        "bucket_weights",
        bucket_weights,
        lambda: f"[{n_buckets}] (2 ** nbits)",
        shape=(n_buckets,),
        dtypes=SUPPORTED_DTYPES,
        device=Q.device,
        dtype_doc="fp32, fp16 or bf16",
    )
    return centroids, bucket_weights


def packed_bytes(dim: int, nbits: int) -> int:
    """Bytes of one token's packed residual: ceil(dim * nbits / 8)."""
    return -(-dim * nbits // 8)


def _compressed(Q, codes, residuals, nbits, lead: tuple, lead_doc: str, suffix: str):
    """codes [*lead] and residuals [*lead, bytes], checked against each other and Q."""
    width = packed_bytes(Q.shape[-1], nbits)
    codes = _check(
        f"codes{suffix}",
        codes,
        lambda: f"{lead_doc} int32 or int64",
        shape=lead,
        dtypes=_INDEX_DTYPES,
        device=Q.device,
        dtype_doc="int32 or int64",
    )
    residuals = _check(
        f"residuals{suffix}",
        residuals,
        lambda: f"{lead_doc[:-1]}, {width}] uint8 (ceil(d * nbits / 8) = "
        f"ceil({Q.shape[-1]} * {nbits} / 8) bytes per token)",
        shape=tuple(codes.shape) + (width,),
        dtypes=(torch.uint8,),
        device=Q.device,
        dtype_doc="uint8 (packed bucket ids)",
    )
    return codes, residuals


def _residual_words(residuals: torch.Tensor) -> torch.Tensor:
    """The int32 word view of packed residuals where torch can make it (a multiple of 4
    bytes per token, rows 4-byte aligned), which the kernel reads a few words per token;
    otherwise the bytes, read one per dim (about half as fast)."""
    if residuals.shape[-1] % 4 or residuals.data_ptr() % 4:
        return residuals
    try:
        return residuals.view(torch.int32)
    except RuntimeError:  # a byte stride or offset that is not a whole word
        return residuals


def _variant(layout: str, centroids: torch.Tensor, nbits: int) -> str:
    return variant_name(layout, False, False, True, centroids.dtype,
                        decompression=f"residual{nbits}")  # fmt: skip


def _query_chunks(module, Q: torch.Tensor):
    # Lq == 0 still launches once: bad doc lengths or offsets must still poison.
    return dispatch.query_ranges(Q.shape[1], heuristics.query_chunk(module, Q)) or [(0, 0)]


def _launch(name, module, Q, lq, out, *args, **kwargs):
    dispatch.launch_keyed(name, module, Q, lq, out, *args, **kwargs)


def _forward_dense(Q, codes, residuals, doc_lengths, centroids, bucket_weights, nbits):
    out = torch.empty((Q.shape[0], codes.shape[0]), dtype=torch.float32, device=Q.device)
    if out.numel() == 0:
        return out
    # Lq == 0 still launches once (launch_in_query_chunks): bad lengths must still poison.
    shared = {"codes": codes, "residuals": _residual_words(residuals), "centroids": centroids,
              "bucket_weights": bucket_weights, "doc_lengths": doc_lengths}  # fmt: skip
    return dispatch.launch_in_query_chunks(
        _variant("dense", centroids, nbits), out, Q, {}, shared,
        docs=codes.shape[0], doc_tokens=codes.shape[1],
    )  # fmt: skip


def _grad_q(grad_out, Q, codes, residuals, doc_lengths, centroids, bucket_weights, nbits):
    """grad_Q of sum(grad_out * scores) in fp32, chunk by chunk over docs (only a chunk's
    decoded tokens and similarities are alive at a time), in closed form rather than by
    autograd, which a custom op's backward cannot run: each query token takes its doc's
    grad times the winning normalized doc token, then the normalization's Jacobian."""
    Nq, Lq, dim = Q.shape
    Ld = codes.shape[1]
    query = Q.detach().float()
    norm = query.norm(dim=-1, keepdim=True)
    unit = query / norm.clamp_min(1e-12)  # F.normalize's eps
    grad_unit = torch.zeros_like(unit)
    lengths = doc_lengths.long()
    per_doc = max(1, Nq * Lq * (Ld + dim) + Ld * dim)
    step = max(1, GRAD_CHUNK_ELEMENTS // per_doc)
    for start in range(0, codes.shape[0], step):
        stop = min(codes.shape[0], start + step)
        docs = decompress_residual_reference(codes[start:stop], residuals[start:stop],
                                             centroids, bucket_weights, nbits)  # fmt: skip
        valid = torch.arange(Ld, device=Q.device) < lengths[start:stop, None]
        docs = F.normalize(torch.where(valid[..., None], docs, 0.0), dim=-1)
        sim = torch.einsum("isk,jtk->ijst", unit, docs)
        winner = sim.masked_fill(~valid[None, :, None, :], float("-inf")).argmax(-1)
        chosen = docs[torch.arange(stop - start, device=Q.device)[None, :, None], winner]
        weight = grad_out[:, start:stop].float() * valid.any(-1)  # an empty doc: no gradient
        grad_unit += torch.einsum("ij,ijsk->isk", weight, chosen)
    radial = (unit * grad_unit).sum(-1, keepdim=True)
    grad_q = torch.where(norm > 1e-12, (grad_unit - unit * radial) / norm, grad_unit / 1e-12)
    return grad_q.to(Q.dtype)


@dataclasses.dataclass(frozen=True)
class _ResidualCall:
    layout: str  # "dense" (padded codes) or "varlen" (packed codes, forward only)
    nbits: int
    training: bool  # dense: Q takes a gradient
    check_offsets: bool  # varlen without max_seqlen_d: one host sync validates them


def _check_offsets(cu_d: torch.Tensor, tokens: int) -> None:
    _, *facts = ragged._offset_facts(cu_d).tolist()  # the one host sync
    problem = ragged._offset_problem("cu_seqlens_d", *facts, tokens)
    if problem:
        raise ValueError(problem)


def _check_no_empty_doc(doc_lengths: torch.Tensor) -> None:
    if bool((doc_lengths == 0).any()):  # one host sync
        empty = int((doc_lengths == 0).nonzero()[0, 0])
        raise ValueError(
            f"doc_lengths[{empty}] is 0: a zero-length doc has no token to route Q's "
            "gradient to; drop empty docs before scoring with Q.requires_grad"
        )


def _residual_forward(inputs, call: _ResidualCall):
    Q, codes, residuals, lengths, centroids, bucket_weights = inputs
    if call.layout == "varlen":
        if call.check_offsets:
            _check_offsets(lengths, codes.shape[0])
        out = _forward_varlen(Q, codes, residuals, lengths, centroids, bucket_weights, call.nbits)
        return (out,), ()
    if call.training:
        _check_no_empty_doc(lengths)
    out = _forward_dense(Q, codes, residuals, lengths, centroids, bucket_weights, call.nbits)
    return (out,), ()


def _residual_fake(inputs, call: _ResidualCall):
    Q, codes, _, lengths = inputs[:4]
    docs = lengths.shape[0] - 1 if call.layout == "varlen" else codes.shape[0]
    return (Q.new_empty((Q.shape[0], docs), dtype=torch.float32),), ()


def _residual_backward(grads, inputs, saved, call: _ResidualCall, needs):
    """grad_Q from a chunked PyTorch recompute (compressed docs and the codebook take no
    gradient)."""
    return (_grad_q(grads[0], *inputs, call.nbits),)


RESIDUAL = ops.Family("residual", _ResidualCall, _residual_forward, _residual_fake,
                      _residual_backward, slots=1)  # fmt: skip


def maxsim_residual(
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
    """MaxSim of Q [Nq, Lq, d] (or [Lq, d]) against B residual-compressed docs -> [Nq, B]
    fp32 (or [B]).

    codes [B, Ld] int32/int64 centroid ids; residuals [B, Ld, ceil(d * nbits / 8)] uint8;
    doc_lengths [B] int32/int64, doc b's valid tokens are t < doc_lengths[b] (an empty doc
    scores 0; a length outside [0, Ld], or a code outside [0, n_centroids), scores NaN,
    checked without a host sync); centroids [n_centroids, d] fp32/fp16/bf16 (picks the
    kernel's dot dtype); bucket_weights [2 ** nbits]; nbits in (2, 4, 8). Autograd flows
    to Q only; with Q requiring grad, a zero-length doc raises ValueError (one host sync
    checks it).
    """
    Q = _query(Q)
    nbits = _nbits(nbits)
    _normalize(normalize)
    codes, residuals = _compressed(Q, codes, residuals, nbits, (None, None), "[B, Ld]", "")
    doc_lengths = _check(
        "doc_lengths",
        doc_lengths,
        lambda: f"[{codes.shape[0]}] (one per doc)",
        shape=(codes.shape[0],),
        dtypes=_INDEX_DTYPES,
        device=Q.device,
        dtype_doc="int32 or int64",
    )
    centroids, bucket_weights = _codebook(Q, centroids, bucket_weights, nbits)
    squeeze = Q.dim() == 2
    batch = Q.unsqueeze(0) if squeeze else Q
    training = torch.is_grad_enabled() and Q.requires_grad
    call = _ResidualCall("dense", nbits, training, check_offsets=False)
    if backends.route("residual", Q) == "reference":
        if training:
            _check_no_empty_doc(doc_lengths)
        out = maxsim_residual_reference(
            batch, codes, residuals, doc_lengths, centroids, bucket_weights, nbits
        ).float()
    else:  # a rerank runs the kernel alone, without autograd's bookkeeping (~15 us per call)
        inputs = (batch, codes, residuals, doc_lengths, centroids, bucket_weights)
        out = RESIDUAL(inputs, call, training=training)
    return out[0] if squeeze else out


def maxsim_residual_varlen(
    Q: torch.Tensor,
    codes_flat: torch.Tensor,
    residuals_flat: torch.Tensor,
    cu_seqlens_d: torch.Tensor,
    centroids: torch.Tensor,
    bucket_weights: torch.Tensor,
    nbits: int,
    *,
    max_seqlen_d: int | None = None,
    normalize: bool = True,
) -> torch.Tensor:
    """maxsim_residual over an index's packed tokens (forward only): doc j is tokens
    cu_seqlens_d[j] : cu_seqlens_d[j + 1] of codes_flat [T] and residuals_flat [T, bytes]
    -> [Nq, Nd] fp32 (or [Nd] for Q [Lq, d]).

    cu_seqlens_d is int32 [Nd + 1]. Every doc is read to its true length: max_seqlen_d is a
    hint that never truncates. Without it, one host sync validates the offsets (start at
    0, never decrease, end at T) and raises ValueError; with it, nothing is read back, a
    doc with bad offsets scores NaN, and offsets that do not start at 0 and end at T make
    every score NaN.
    """
    Q = _query(Q)
    nbits = _nbits(nbits)
    _normalize(normalize)
    codes, residuals = _compressed(Q, codes_flat, residuals_flat, nbits, (None,), "[T]", "_flat")
    cu_d = ragged._offsets("cu_seqlens_d", cu_seqlens_d, codes.shape[0], Q.device)
    centroids, bucket_weights = _codebook(Q, centroids, bucket_weights, nbits)
    if max_seqlen_d is not None:
        ragged._check_bound("max_seqlen_d", max_seqlen_d)
    squeeze = Q.dim() == 2
    batch = Q.unsqueeze(0) if squeeze else Q
    inputs = (batch.detach(), codes, residuals, cu_d, centroids, bucket_weights)
    call = _ResidualCall("varlen", nbits, False, check_offsets=max_seqlen_d is None)
    if backends.route("residual", Q) == "reference":
        if call.check_offsets:
            _check_offsets(cu_d, codes.shape[0])
        out = maxsim_residual_varlen_reference(*inputs, nbits).float()
    else:
        out = RESIDUAL(inputs, call)
    return out[0] if squeeze else out


def _forward_varlen(Q, codes, residuals, cu_d, centroids, bucket_weights, nbits):
    Nq = Q.shape[0]
    out = torch.empty((Nq, cu_d.shape[0] - 1), dtype=torch.float32, device=Q.device)
    if out.numel() == 0:
        return out
    residuals = _residual_words(residuals)  # once for every query chunk
    # A whole query batch as packed queries: Nq sequences of Lq tokens (a view when Q is
    # contiguous). A call signature seen before replays its one launch.
    whole = Q.reshape(Nq * Q.shape[1], Q.shape[2])
    cu_q = ragged.uniform_offsets(Nq, Q.shape[1], Q.device)
    call = (out, whole, codes, residuals, centroids, bucket_weights, cu_q, cu_d)
    key, replayed = dispatch.replayed_call(backends.of(Q), call, "residual_varlen", nbits)
    if replayed is not launch_plan.NOT_PLANNED:
        return out
    name = _variant("varlen", centroids, nbits)
    module = registry.load(name)
    # remember_call keeps a call of one launch (the whole batch) for replay, not chunks.
    with dispatch.capturing(key, call):
        for start, stop in _query_chunks(module, Q):
            lq = stop - start
            if lq == Q.shape[1]:  # the whole batch: the call's own tensors, as a replay takes
                packed, offsets = whole, cu_q
            else:
                packed = Q[:, start:stop].reshape(Nq * lq, Q.shape[2])
                offsets = ragged.uniform_offsets(Nq, lq, Q.device)
            target = out if start == 0 else torch.empty_like(out)
            _launch(name, module, packed, lq, target, packed, codes, residuals, centroids,
                    bucket_weights, offsets, cu_d, max_seqlen_q=lq)  # fmt: skip
            if start > 0:
                out += target
    return out


def plaid_approx_score(
    query_centroid_scores: torch.Tensor, codes: torch.Tensor, doc_lengths: torch.Tensor
) -> torch.Tensor:
    """PLAID's centroid-only approximate score -> [B] fp32: per doc b, the sum over query
    tokens s of the max over its valid tokens t < doc_lengths[b] of
    query_centroid_scores[codes[b, t], s].

    query_centroid_scores [n_centroids, Lq] (usually centroids @ Q.T); codes [B, Ld] and
    doc_lengths [B] int32/int64. An empty doc scores 0; a length outside [0, Ld] or a valid
    token's code outside [0, n_centroids) scores NaN (no host sync). Plain PyTorch
    (gather, masked max, sum), chunked over docs to bound memory.
    """
    scores = _tensor("query_centroid_scores", query_centroid_scores, "[n_centroids, Lq]")
    if scores.dim() != 2:
        raise ValueError(
            f"query_centroid_scores must be [n_centroids, Lq], got {validate.describe(scores)}"
        )
    if scores.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"query_centroid_scores must be fp32, fp16 or bf16, got {scores.dtype}")
    codes = _check(
        "codes",
        codes,
        "[B, Ld] int32 or int64",
        shape=(None, None),
        dtypes=_INDEX_DTYPES,
        device=scores.device,
        dtype_doc="int32 or int64",
    )
    doc_lengths = _check(
        "doc_lengths",
        doc_lengths,
        lambda: f"[{codes.shape[0]}] (one per doc)",
        shape=(codes.shape[0],),
        dtypes=_INDEX_DTYPES,
        device=scores.device,
        dtype_doc="int32 or int64",
    )
    return plaid_approx_score_reference(scores, codes, doc_lengths).float()
