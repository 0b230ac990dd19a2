"""Ragged batches: packed tokens with cumulative offsets, scored without padding.

    maxsim_varlen       every query against every doc            -> [Nq, Nd]
    score_pairs_packed  an arbitrary list of (query, doc) pairs    -> [P]
    pack_padded         a padded rerank batch [B, C], packed for score_pairs_packed
    maxsim_padded       a padded rerank batch [B, C], scored as maxsim with length masks

Offsets (`cu_seqlens_*`) are int32 [N + 1], starting at 0, non-decreasing, ending at the
packed length. `max_seqlen_q` sizes the query tile of the kernel and `max_seqlen_d` is
only a hint: the kernels loop over each document's true length, so a wrong document
bound costs speed, never tokens. When `max_seqlen_q` is given, nothing is read back to
the host: every kernel program checks the offsets it reads, and a pair with a bad one
(negative length, outside the packed tokens, query longer than `max_seqlen_q`) scores
NaN instead of being truncated or read out of bounds; offsets that do not start at 0 and
end at the packed length (a missing leading 0, a short last offset) would leave tokens
out of every sequence, so every score is NaN. When it is omitted, one combined
host sync computes the maximum and validates the offsets (start at 0, never decrease,
end at the packed length), raising ValueError on bad ones.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from lik.runtime import backends, dispatch, norm_warning, ops, validate, workspace
from lik.runtime.api import choose_backward, maxsim
from lik.runtime.keys import LQ_CHUNK, SUPPORTED_DTYPES
from lik.runtime.reference import score_pairs_packed_reference


@dataclasses.dataclass(frozen=True)
class PackedBatch:
    """A padded rerank batch repacked for score_pairs_packed (unpacks as a tuple)."""

    Q_packed: torch.Tensor
    cu_seqlens_q: torch.Tensor
    D_packed: torch.Tensor
    cu_seqlens_d: torch.Tensor
    pair_q_idx: torch.Tensor
    pair_d_idx: torch.Tensor
    max_seqlen_q: int
    max_seqlen_d: int

    def __iter__(self):
        return iter(dataclasses.astuple(self))


def _packed(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor [total tokens, d], got {type(value)}")
    if value.dim() != 2:
        raise ValueError(f"{name} must be [total tokens, d], got shape {tuple(value.shape)}")
    if value.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} must be fp32, fp16 or bf16, got {value.dtype}")
    return value


def uniform_offsets(count: int, length: int, device: torch.device) -> torch.Tensor:
    """int32 offsets [count + 1] of count packed sequences of `length` tokens each,
    cached per stream (kernels only read them; building them took two launches per call),
    built afresh inside a CUDA graph capture (workspace.stream_key)."""
    key = workspace.stream_key(device)
    if key is None:
        return _arange_offsets(count, length, device)
    return _uniform_offsets(count, length, key)


@functools.lru_cache(maxsize=64)
def _uniform_offsets(count: int, length: int, key: tuple):
    return _arange_offsets(count, length, key[0])


def _arange_offsets(count: int, length: int, device: torch.device) -> torch.Tensor:
    return torch.arange(count + 1, dtype=torch.int32, device=device) * length


def _offsets(name: str, value: object, total: int, device: torch.device) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a 1-D int32 tensor [N + 1], got {type(value).__name__}")
    if value.dim() != 1 or value.numel() < 1:
        raise ValueError(f"{name} must be a 1-D int32 tensor [N + 1], got {tuple(value.shape)}")
    if value.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {value.dtype}")
    if value.device != device:
        raise ValueError(f"{name} must be on {device} like the packed tokens, got {value.device}")
    return value


def _indices(name: str, value: object, device: torch.device) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a 1-D integer tensor [P], got {type(value).__name__}")
    if value.dim() != 1:
        raise ValueError(f"{name} must be a 1-D integer tensor [P], got {tuple(value.shape)}")
    if value.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64, got {value.dtype}")
    if value.device != device:
        raise ValueError(f"{name} must be on {device} like the packed tokens, got {value.device}")
    return value


def _check_bound(name: str, bound: object) -> int:
    if not isinstance(bound, int) or isinstance(bound, bool) or bound < 0:
        raise ValueError(f"{name} must be a non-negative int, got {bound!r}")
    return bound


def _offset_facts(cu: torch.Tensor) -> torch.Tensor:
    """[longest, first, last, never decreases] as one int64 device tensor: no sync."""
    lengths = cu[1:] - cu[:-1]
    if lengths.numel():
        longest, monotone = lengths.max(), lengths.min() >= 0
    else:
        longest, monotone = cu.new_zeros(()), torch.ones((), dtype=torch.bool, device=cu.device)
    return torch.stack([longest.long(), cu[0].long(), cu[-1].long(), monotone.long()])


def _offset_problem(name: str, first: int, last: int, monotone: int, total: int) -> str | None:
    if first != 0:
        return f"{name} must start at 0, got {first}"
    if not monotone:
        return f"{name} must never decrease (a negative sequence length)"
    if last != total:
        return f"{name} must end at the packed length {total}, got {last}"
    return None


def _given_bounds(max_seqlen_q, max_seqlen_d) -> None:
    """Checks the bounds a call gives (types and the query limit), without a host sync."""
    if max_seqlen_d is not None:  # checked, though kernels walk each doc's own length
        _check_bound("max_seqlen_d", max_seqlen_d)
    if max_seqlen_q is not None:
        _check_query_bound(_check_bound("max_seqlen_q", max_seqlen_q))


def _resolve_bounds(cu_q, cu_d, total_q, total_d, max_seqlen_q):
    """The query bound: the given one (each kernel program then checks the offsets it
    reads and poisons its score with NaN when they are bad), or the longest query after
    validating every offset in one host sync."""
    if max_seqlen_q is not None:
        return max_seqlen_q
    facts_q, facts_d = _offset_facts(cu_q), _offset_facts(cu_d)
    (lq, *q_rest), (_, *d_rest) = torch.stack([facts_q, facts_d]).tolist()
    for name, rest, total in (("cu_seqlens_q", q_rest, total_q),
                              ("cu_seqlens_d", d_rest, total_d)):  # fmt: skip
        problem = _offset_problem(name, *rest, total)
        if problem:
            raise ValueError(problem)
    _check_query_bound(lq)
    return lq


def _common(Q_packed, D_packed, cu_seqlens_q, cu_seqlens_d):
    Q = _packed("Q_packed", Q_packed)
    D = _packed("D_packed", D_packed)
    validate.same_dtype_and_device(Q, D)
    validate.head_dims(Q, D, "Q_packed", "D_packed")
    cu_q = _offsets("cu_seqlens_q", cu_seqlens_q, Q.shape[0], Q.device)
    cu_d = _offsets("cu_seqlens_d", cu_seqlens_d, D.shape[0], D.device)
    return Q, D, cu_q, cu_d


def _check_query_bound(bound: int) -> None:
    if bound > LQ_CHUNK:
        raise ValueError(
            f"max_seqlen_q={bound}: ragged queries longer than {LQ_CHUNK} tokens are not "
            "supported yet (split them, or use maxsim with a padded batch)"
        )


@dataclasses.dataclass(frozen=True)
class _RaggedCall:
    layout: str  # "varlen" or "packed_pairs"
    max_seqlen_q: int | None  # None: found (and the offsets validated) by the forward
    normalize: bool
    backward: str  # a strategy when training, else "none"


_TENSORS = ("cu_seqlens_q", "cu_seqlens_d", "pair_q_idx", "pair_d_idx")


def _ragged_out_shape(layout: str, cu_q, cu_d, pairs) -> tuple[int, ...]:
    if layout == "varlen":
        return (cu_q.shape[0] - 1, cu_d.shape[0] - 1)
    return (pairs[0].shape[0],)


def _ragged_forward(inputs, call: _RaggedCall):
    Q, D, cu_q, cu_d, *pairs = inputs
    bound = _resolve_bounds(cu_q, cu_d, Q.shape[0], D.shape[0], call.max_seqlen_q)
    out = torch.empty(_ragged_out_shape(call.layout, cu_q, cu_d, pairs), dtype=torch.float32,
                      device=Q.device)  # fmt: skip
    argmax = None
    if call.backward != "none":
        argmax = torch.empty(out.shape + (bound,), dtype=torch.int32, device=Q.device)
    tensors = dict(zip(_TENSORS, inputs[2:], strict=False))
    dispatch.forward_ragged(call.layout, Q, D, tensors, bound, call.normalize, out,
                            backward=call.backward, argmax=argmax)  # fmt: skip
    return (out,), (argmax,)


def _ragged_fake(inputs, call: _RaggedCall):
    Q, D, cu_q, cu_d, *pairs = inputs
    out = Q.new_empty(_ragged_out_shape(call.layout, cu_q, cu_d, pairs), dtype=torch.float32)
    if call.backward == "none":
        return (out,), (None,)
    bound = call.max_seqlen_q
    if bound is None:  # the forward finds it on the device
        bound = torch.library.get_ctx().new_dynamic_size()
    return (out,), (Q.new_empty(out.shape + (bound,), dtype=torch.int32),)


def _ragged_backward(grads, inputs, saved, call: _RaggedCall, needs):
    Q, D, *rest = inputs
    (argmax,) = saved
    tensors = dict(zip(_TENSORS, rest, strict=False))
    return dispatch.backward_ragged(call.layout, grads[0], argmax, Q, D, tensors,
                                    argmax.shape[-1], call.normalize, call.backward)  # fmt: skip


RAGGED = ops.Family("ragged", _RaggedCall, _ragged_forward, _ragged_fake, _ragged_backward, slots=2)


def _score(layout, Q, D, tensors, bounds, normalize, backward):
    max_seqlen_q, max_seqlen_d = bounds
    _given_bounds(max_seqlen_q, max_seqlen_d)
    if not normalize:  # packed tokens: the first ones are the first query's and doc's
        norm_warning.check(Q, D)
    if backends.route("ragged", Q) == "reference":
        bound = _resolve_bounds(tensors["cu_seqlens_q"], tensors["cu_seqlens_d"], Q.shape[0],
                                D.shape[0], max_seqlen_q)  # fmt: skip
        return score_pairs_packed_reference(Q, D, layout=layout, normalize=normalize,
                                            max_seqlen_q=bound, **tensors)  # fmt: skip
    strategy = "none"
    training = torch.is_grad_enabled() and (Q.requires_grad or D.requires_grad)
    if training:
        queries = tensors["cu_seqlens_q"].shape[0] - 1
        docs = tensors["cu_seqlens_d"].shape[0] - 1
        strategy = choose_backward(backward, layout, queries, docs)
    call = _RaggedCall(layout, max_seqlen_q, normalize, strategy)
    return RAGGED((Q, D, *tensors.values()), call, training=training)


def maxsim_varlen(
    Q_packed: torch.Tensor,
    D_packed: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_d: torch.Tensor,
    max_seqlen_q: int | None = None,
    max_seqlen_d: int | None = None,
    *,
    normalize: bool = False,
    backward: str | None = None,
) -> torch.Tensor:
    """MaxSim of every packed query against every packed doc -> [Nq, Nd] fp32.

    Q_packed [sum Lq, d], D_packed [sum Ld, d]; cu_seqlens_* int32 [N + 1]. An empty
    query or document scores 0 and gets zero gradient. Autograd-aware; `backward` as for
    maxsim (None/"auto", "unified", "lowmem").
    """
    validate.backward_choice(backward)
    normalize = validate.flag("normalize", normalize)
    Q, D, cu_q, cu_d = _common(Q_packed, D_packed, cu_seqlens_q, cu_seqlens_d)
    tensors = {"cu_seqlens_q": cu_q, "cu_seqlens_d": cu_d}
    return _score("varlen", Q, D, tensors, (max_seqlen_q, max_seqlen_d), normalize, backward)


def score_pairs_packed(
    Q_packed: torch.Tensor,
    D_packed: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_d: torch.Tensor,
    pair_q_idx: torch.Tensor,
    pair_d_idx: torch.Tensor,
    *,
    max_seqlen_q: int | None = None,
    max_seqlen_d: int | None = None,
    normalize: bool = False,
) -> torch.Tensor:
    """MaxSim of query pair_q_idx[p] against doc pair_d_idx[p] for every p -> [P] fp32.

    One launch for any list of pairs; no [Nq, Nd] buffer. A pair index outside [0, Nq) or
    [0, Nd) is caught by the kernel (no host sync) and scores NaN. Autograd-aware.
    """
    normalize = validate.flag("normalize", normalize)
    Q, D, cu_q, cu_d = _common(Q_packed, D_packed, cu_seqlens_q, cu_seqlens_d)
    q_idx = _indices("pair_q_idx", pair_q_idx, Q.device)
    d_idx = _indices("pair_d_idx", pair_d_idx, Q.device)
    if q_idx.shape != d_idx.shape:
        raise ValueError(
            f"pair_q_idx and pair_d_idx must have one entry per pair: got {tuple(q_idx.shape)} "
            f"and {tuple(d_idx.shape)}"
        )
    tensors = {"cu_seqlens_q": cu_q, "cu_seqlens_d": cu_d, "pair_q_idx": q_idx,
               "pair_d_idx": d_idx}  # fmt: skip
    bounds = (max_seqlen_q, max_seqlen_d)
    return _score("packed_pairs", Q, D, tensors, bounds, normalize, None)  # auto: unified


def _lengths(name: str, value: object, rows: tuple[int, ...], limit: int, device) -> torch.Tensor:
    """Lengths as int64 on `device`, clamped to [0, limit] (pack_padded's validate=True
    refuses those out of range first)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be an integer tensor of shape {rows}, got "
                        f"{type(value).__name__}")  # fmt: skip
    if tuple(value.shape) != rows:
        raise ValueError(f"{name} must have shape {rows}, got {tuple(value.shape)}")
    if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {value.dtype}")
    return value.to(device=device, dtype=torch.int64).clamp(0, limit)


def _padded_inputs(queries: object, documents: object, query_lengths: object,
                   doc_lengths: object) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """queries [B, Lq, d], documents [B, C, Ld, d] and their lengths (int64, clamped into
    the padded axes), checked by name."""
    queries = validate.tensor("queries", queries, (3,), "[B, Lq, d]")
    documents = validate.tensor("documents", documents, (4,), "[B, C, Ld, d]")
    if documents.device != queries.device:
        raise ValueError(f"queries and documents must be on one device: queries on "
                         f"{queries.device}, documents on {documents.device}")  # fmt: skip
    if documents.dtype != queries.dtype:
        raise TypeError(f"queries and documents must share a dtype: queries are "
                        f"{queries.dtype}, documents {documents.dtype}")  # fmt: skip
    (B, Lq, d), (C, Ld) = queries.shape, documents.shape[1:3]
    if documents.shape[0] != B or documents.shape[-1] != d:
        raise ValueError(f"documents must be [B={B}, C, Ld, d={d}], got {tuple(documents.shape)}")
    q_len = _lengths("query_lengths", query_lengths, (B,), Lq, queries.device)
    d_len = _lengths("doc_lengths", doc_lengths, (B, C), Ld, queries.device)
    return queries, documents, q_len, d_len


def _pack(queries, documents, q_len, d_len) -> PackedBatch:
    """The PackedBatch of checked padded inputs and clamped lengths."""
    (B, Lq, d), (C, Ld) = queries.shape, documents.shape[1:3]
    d_len = d_len.reshape(-1)
    q_keep = torch.arange(Lq, device=queries.device)[None, :] < q_len[:, None]
    d_keep = torch.arange(Ld, device=queries.device)[None, :] < d_len[:, None]
    zero = torch.zeros(1, dtype=torch.int64, device=queries.device)
    cu_q = torch.cat([zero, q_len.cumsum(0)]).to(torch.int32)
    cu_d = torch.cat([zero, d_len.cumsum(0)]).to(torch.int32)
    pair_q = torch.arange(B, device=queries.device).repeat_interleave(C)
    pair_d = torch.arange(B * C, device=queries.device)
    return PackedBatch(
        Q_packed=queries[q_keep],
        cu_seqlens_q=cu_q,
        D_packed=documents.reshape(B * C, Ld, d)[d_keep],
        cu_seqlens_d=cu_d,
        pair_q_idx=pair_q,
        pair_d_idx=pair_d,
        max_seqlen_q=Lq,
        max_seqlen_d=Ld,
    )


def _validate_flag(value: object) -> bool:
    """pack_padded's `validate`, checked as a bool (its name hides the validate module)."""
    return validate.flag("validate", value)


def pack_padded(
    queries: torch.Tensor,
    documents: torch.Tensor,
    query_lengths: torch.Tensor,
    doc_lengths: torch.Tensor,
    *,
    validate: bool = False,
) -> PackedBatch:
    """Packs a padded rerank batch (query b against its C candidates) for score_pairs_packed.

    queries [B, Lq, d], documents [B, C, Ld, d], query_lengths [B], doc_lengths [B, C].
    Lengths outside [0, padded axis] raise with validate=True (one host sync); without
    it they are clamped into it. Tokens past a length are dropped.
    """
    checked = _padded_inputs(queries, documents, query_lengths, doc_lengths)
    if _validate_flag(validate):
        Lq, Ld = checked[0].shape[1], checked[1].shape[2]
        q_raw, d_raw = (t.to(checked[0].device) for t in (query_lengths, doc_lengths))
        outside = torch.stack([((q_raw < 0) | (q_raw > Lq)).any(),
                               ((d_raw < 0) | (d_raw > Ld)).any()]).tolist()  # fmt: skip
        if outside[0] or outside[1]:
            raise ValueError(f"lengths outside the padded axes (0 <= query_lengths <= {Lq}, "
                             f"0 <= doc_lengths <= {Ld})")  # fmt: skip
    return _pack(*checked)


def maxsim_padded(
    queries: torch.Tensor,
    documents: torch.Tensor,
    query_lengths: torch.Tensor,
    doc_lengths: torch.Tensor,
) -> torch.Tensor:
    """Scores each query's C candidates -> [B, C] fp32, ignoring padding past the lengths.
    Lengths are clamped into [0, padded axis] without a host sync (pack_padded with
    validate=True refuses them instead). Scored as maxsim's KD layout with length masks,
    whose docs stop at their last valid token: packing them first selects a
    data-dependent number of tokens, which waits on the GPU, and copies them."""
    queries, documents, q_len, d_len = _padded_inputs(queries, documents, query_lengths,
                                                      doc_lengths)  # fmt: skip
    (B, Lq, _), (C, Ld) = queries.shape, documents.shape[1:3]
    if B * C == 0:
        return torch.zeros(B, C, dtype=torch.float32, device=queries.device)
    q_mask = torch.arange(Lq, device=queries.device) < q_len[:, None]
    d_mask = torch.arange(Ld, device=queries.device) < d_len[..., None]
    return maxsim(queries, documents, q_mask, d_mask)
