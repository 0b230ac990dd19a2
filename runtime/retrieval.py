"""Top-k retrieval over a corpus: chunked scoring, exact tie rule, sharded merge.

Every score comes from lik.runtime.maxsim, so retrieval runs the generated kernels
wherever maxsim does. Selection is exact and deterministic: the k best scores per query,
and among equal scores the lower document index wins (torch.topk alone does not promise
which of two equal scores it keeps). To get that rule from a single topk call, each
candidate is packed into one int64 key, the score's order-preserving bit pattern in the
high 32 bits and the document id in the low 32, so no two candidates compare equal.

    retrieve           one process: [Nq, Nd] scores, or chunks of `chunk` docs at a time
    retrieve_sharded   torch.distributed: each rank scores its shard, ranks merge top-k
    merge_top_k        the selection rule itself, over any list of (scores, ids) pairs
    merge_shard_results  the cross-rank step alone (an all-gather of candidates)
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from lik.runtime import backends, dispatch, heuristics, ops, validate
from lik.runtime.api import maxsim

_Q_DOC = "[Nq, Lq, d] or [Lq, d]"
_D_DOC = "[Nd, Ld, d]"

# Document ids share an int64 key with the score's 32 bits.
MAX_DOCUMENTS = 1 << 32
_LOW_32 = 0xFFFFFFFF
_SIGN_CLEAR = 0x7FFFFFFF
# Candidates are encoded this many at a time, so the int64 keys and their temporaries
# stay near 8 MiB however wide the list. Unchunked retrieve over 1M docs (Nq=16) on an
# H200: 435 MiB peak above the inputs when encoded whole, 81 MiB in blocks, 64 MiB of
# which are the fp32 scores themselves.
KEY_BLOCK_ELEMENTS = 1 << 19
# Largest k the in-kernel top-k keeps per doc block (its slots live in registers).
TOPK_MAX_K = 128
# Score matrices from this many entries on (8M: 16 x 1M docs is 16M) go through the
# in-kernel top-k instead: below
# it, scoring every pair and one topk is faster (H200, 16 x 100k docs: 5.2 ms against
# 5.7), above it the [Nq, Nd] buffer is what the epilogue saves (16 x 1M: peak 41 MiB
# instead of 81, at the same 52-53 ms).
TOPK_EPILOGUE_MIN_SCORES = 1 << 23


# ---------------------------------------------------------------------------------------
# Argument checks


def _check_top_k(top_k: object) -> int:
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise TypeError(f"top_k must be an int >= 1, got {type(top_k).__name__} {top_k!r}")
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    return top_k


def _check_chunk(chunk: object) -> int | None:
    if chunk is None:
        return None
    if isinstance(chunk, bool) or not isinstance(chunk, int):
        raise TypeError(
            f"chunk must be None or an int >= 1 (docs per step), got {type(chunk).__name__}"
        )
    if chunk < 1:
        raise ValueError(f"chunk must be None or >= 1 (docs per step), got {chunk}")
    return chunk


def _check_document_count(count: int) -> None:
    if count > MAX_DOCUMENTS:
        raise ValueError(
            f"retrieval supports at most 2**32 documents (ids share an int64 key with the "
            f"score), got {count}"
        )


# ---------------------------------------------------------------------------------------
# The selection rule: int64 keys ordered by (score, then lower id)


def _encode(scores: torch.Tensor, ids: torch.Tensor, largest: bool) -> torch.Tensor:
    """One int64 per candidate; a larger key (largest=True) or smaller key (largest=False)
    is always the better candidate, and equal scores prefer the lower id.

    ids broadcast against scores ([1, n] for a range of docs). Eight elementwise ops,
    since a chunked retrieve pays their launches once per chunk.
    """
    # + 0.0 folds -0.0 into 0.0, which compare equal as floats (and makes a copy).
    values = scores.float() + 0.0
    # Every NaN becomes the positive quiet NaN, whose key orders above +inf as torch.topk
    # orders NaN; NaN from arithmetic (inf - inf on x86) has its sign bit set and would
    # otherwise sort below -inf, hiding a corrupt document from the top of the results.
    values.masked_fill_(values.isnan(), float("nan"))
    ordered = values.view(torch.int32)
    # Negative floats order backwards as integers: flip their magnitude bits.
    ordered ^= (ordered >> 31) & _SIGN_CLEAR
    # The score's bits above the id's, in one op: id_bits + ordered * 2**32 in int64.
    id_bits = (_LOW_32 - ids) if largest else ids
    return torch.add(id_bits, ordered, alpha=1 << 32)


def _decode(keys: torch.Tensor, largest: bool) -> tuple[torch.Tensor, torch.Tensor]:
    id_bits = keys & _LOW_32
    ids = (_LOW_32 - id_bits) if largest else id_bits
    ordered = keys >> 32
    bits = ordered ^ ((ordered >> 31) & _SIGN_CLEAR)  # the flip is its own inverse
    return bits.to(torch.int32).view(torch.float32), ids


def _best_keys(keys: torch.Tensor, k: int, largest: bool, sorted: bool) -> torch.Tensor:
    if keys.shape[1] <= k and not sorted:
        return keys
    return keys.topk(min(k, keys.shape[1]), dim=1, largest=largest, sorted=sorted).values


def _fold_keys(best, scores: torch.Tensor, ids: torch.Tensor, k: int, largest: bool):
    """The k best keys of `best` (keys kept so far, or None) and one candidate list,
    encoded a block of columns at a time; no order among them."""
    width = max(1, KEY_BLOCK_ELEMENTS // max(1, scores.shape[0]))
    for start in range(0, max(1, scores.shape[1]), width):
        keys = _encode(scores[:, start : start + width], ids[:, start : start + width], largest)
        if best is not None:
            keys = torch.cat([best, keys], dim=1)
        best = _best_keys(keys, k, largest, sorted=False)
    return best


def merge_top_k(
    candidates: list[tuple[torch.Tensor, torch.Tensor]],
    k: int,
    *,
    largest: bool = True,
    sorted: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best of the (scores [Nq, n_i] fp32, ids [Nq, n_i] int64) pairs, per row.

    Ids must be distinct within a row, >= 0 and < 2**32. Equal scores keep the lower id,
    so the result does not depend on the order or grouping of the candidates. With
    sorted=True each row runs best first (equal scores by ascending id).
    """
    best = None
    for scores, ids in candidates:
        best = _fold_keys(best, scores, ids, k, largest)
    return _decode(_best_keys(best, k, largest, sorted), largest)


# ---------------------------------------------------------------------------------------
# One process


def _validated(Q, D, top_k, q_mask, d_mask, chunk):
    """Checks the whole call up front, so a chunked loop cannot fail halfway or accept a
    mask that only matches each slice."""
    top_k = _check_top_k(top_k)
    chunk = _check_chunk(chunk)
    Q = validate.tensor("Q", Q, (2, 3), _Q_DOC)
    D = validate.tensor("D", D, (3,), _D_DOC)
    validate.same_dtype_and_device(Q, D)
    validate.head_dims(Q, D)
    _check_document_count(D.shape[0])
    d_expected = tuple(D.shape[:2])
    d_mask = validate.mask("d_mask", d_mask, d_expected, D.device)
    return top_k, chunk, d_mask


def _top_k_by_chunks(Q, D, k, q_mask, d_mask, normalize, chunk, largest, sorted):
    """[Nq, k] best per query, scoring at most `chunk` docs at once (all when None).

    The running best stays encoded between chunks, so each chunk costs its maxsim call,
    its keys and one topk."""
    Nd, rows = D.shape[0], (Q.shape[0] if Q.dim() == 3 else 1)
    step = Nd if chunk is None else chunk
    best = None
    for start in range(0, max(Nd, 1), max(step, 1)):
        stop = min(Nd, start + step)
        part_mask = None if d_mask is None else d_mask[start:stop]
        scores = maxsim(Q, D[start:stop], q_mask, part_mask, normalize=normalize)
        ids = torch.arange(start, stop, device=scores.device)[None]
        best = _fold_keys(best, scores.view(rows, stop - start), ids, k, largest)
    return _decode(_best_keys(best, k, largest, sorted), largest)


def _top_k_in_kernel(Q, D, k, q_mask, d_mask, normalize, sorted):
    """[Nq, k] best per query through the top-k epilogue: every doc is scored, but only
    each doc block's k best per query ever reach memory (no [Nq, Nd] buffer)."""
    Q3 = Q if Q.dim() == 3 else Q[None]
    q_expected = tuple(Q.shape[:-1])
    q_mask = validate.mask("q_mask", q_mask, q_expected, Q.device)
    qm = q_mask if q_mask is None or Q.dim() == 3 else q_mask[None]
    scores, docs = dispatch.topk_candidates(Q3, D, qm, d_mask, normalize, k)
    rows = Q3.shape[0]
    scores, docs = scores.view(rows, -1), docs.view(rows, -1)
    # Empty slots (score -inf) get distinct ids past the corpus; with k <= Nd real
    # candidates they are never chosen.
    spare = D.shape[0] + torch.arange(docs.shape[1], device=docs.device)
    docs = torch.where(docs < 0, spare, docs)
    return merge_top_k([(scores, docs)], k, largest=True, sorted=sorted)


def _epilogue_applies(Q, D, k, chunk, largest) -> bool:
    """The in-kernel top-k serves unchunked, largest-first calls on the kernel path."""
    queries = Q.shape[0] if Q.dim() == 3 else 1
    return (
        chunk is None
        and queries * D.shape[0] >= TOPK_EPILOGUE_MIN_SCORES
        and largest
        and 0 < k <= TOPK_MAX_K
        and D.shape[0] > 0
        and backends.route("topk", Q) != "reference"
        and Q.shape[-2] <= heuristics.layout_query_chunk("dense", Q, op="topk")
    )


def retrieve(
    Q: torch.Tensor,
    D: torch.Tensor,
    top_k: int,
    q_mask: torch.Tensor | None = None,
    d_mask: torch.Tensor | None = None,
    *,
    normalize: bool = True,
    chunk: int | None = None,
    largest: bool = True,
    sorted: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The top_k documents of D for each query of Q by MaxSim score.

    Q [Nq, Lq, d] (or [Lq, d], dropping the query axis of the results), D [Nd, Ld, d],
    masks as in maxsim. Returns (scores fp32 [Nq, k], indices int64 [Nq, k]) with
    k = min(top_k, Nd); Nd == 0 gives empty [Nq, 0] results. Equal scores keep the lower
    document index. With `chunk`, docs are scored `chunk` at a time and merged into a
    running top-k, so extra memory stays near Nq * (chunk + k) and the [Nq, Nd] score
    matrix is never built. largest=False returns the lowest scores; sorted=True orders
    each row best first. Inference only: runs under torch.no_grad.
    """
    top_k, chunk, d_mask = _validated(Q, D, top_k, q_mask, d_mask, chunk)
    normalize, largest = validate.flag("normalize", normalize), validate.flag("largest", largest)
    sorted = validate.flag("sorted", sorted)
    k = min(top_k, D.shape[0])
    with torch.no_grad():
        if _epilogue_applies(Q, D, k, chunk, largest):
            scores, ids = _top_k_in_kernel(Q, D, k, q_mask, d_mask, normalize, sorted)
        else:
            scores, ids = _top_k_by_chunks(
                Q, D, k, q_mask, d_mask, normalize, chunk, largest, sorted
            )
    if Q.dim() == 2:
        return scores[0], ids[0]
    return scores, ids


# ---------------------------------------------------------------------------------------
# Sharded over ranks of a torch.distributed process group


def _comm_device(group) -> torch.device:
    """NCCL moves only CUDA tensors; every other backend here takes CPU tensors."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_gather(tensor: torch.Tensor, group) -> list[torch.Tensor]:
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return parts


def _gather_ints(values: list[int], group) -> torch.Tensor:
    """[world_size, len(values)]: every rank's values, in rank order."""
    mine = torch.tensor(values, dtype=torch.int64, device=_comm_device(group))
    return torch.stack(_all_gather(mine, group)).cpu()


def _check_same_query_count(query_counts: list[int]) -> None:
    if len(set(query_counts)) > 1:
        raise ValueError(
            f"every rank must pass the same queries Q; got query counts by rank {query_counts}"
        )


def merge_shard_results(
    scores: torch.Tensor,
    local_indices: torch.Tensor,
    shard_size: int,
    top_k: int,
    *,
    largest: bool = True,
    sorted: bool = True,
    group=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global top-k from each rank's local top-k (every rank of `group` must call it).

    scores [Nq, n] fp32 and local_indices [Nq, n] int64 (indices into this rank's shard of
    shard_size docs) are this rank's candidates. Shards are concatenated in rank order:
    a document's global id is its local index plus the sizes of the lower ranks' shards.
    Returns the same (scores [Nq, k], global ids [Nq, k]) on every rank,
    k = min(top_k, total docs); equal scores keep the lower global id.
    """
    top_k = _check_top_k(top_k)
    if scores.dim() != 2 or local_indices.shape != scores.shape:
        raise ValueError(
            "scores and local_indices must both be [Nq, n], got shapes "
            f"{tuple(scores.shape)} and {tuple(local_indices.shape)}"
        )
    meta = _gather_ints([shard_size, scores.shape[1], scores.shape[0]], group)
    sizes, counts, query_counts = (meta[:, i].tolist() for i in range(3))
    _check_same_query_count(query_counts)
    _check_document_count(sum(sizes))
    rank = dist.get_rank(group)
    offset = sum(sizes[:rank])

    # all_gather needs one shape on every rank: pad to the longest candidate list.
    width, device = max(counts), _comm_device(group)
    padded_scores = scores.new_zeros(scores.shape[0], width, device=device)
    padded_ids = torch.zeros(scores.shape[0], width, dtype=torch.int64, device=device)
    padded_scores[:, : counts[rank]] = scores
    padded_ids[:, : counts[rank]] = local_indices + offset
    gathered = zip(_all_gather(padded_scores, group), _all_gather(padded_ids, group), strict=True)
    candidates = [(s[:, :n], i[:, :n]) for (s, i), n in zip(gathered, counts, strict=True)]
    best_scores, best_ids = merge_top_k(
        candidates, min(top_k, sum(sizes)), largest=largest, sorted=sorted
    )
    return best_scores.to(scores.device), best_ids.to(scores.device)


def _raise_if_any_rank_failed(error: Exception | None, group) -> None:
    """Collective: a rank whose local step raised must not leave the others waiting in
    an all-gather, so every rank learns of the failure and raises too."""
    failed = _gather_ints([int(error is not None)], group)[:, 0].tolist()
    if error is not None:
        raise error
    bad = [rank for rank, flag in enumerate(failed) if flag]
    if bad:
        raise RuntimeError(f"retrieve_sharded failed on rank(s) {bad}; see the error there")


def retrieve_sharded(
    Q: torch.Tensor,
    D_shard: torch.Tensor,
    top_k: int,
    q_mask: torch.Tensor | None = None,
    d_mask: torch.Tensor | None = None,
    *,
    normalize: bool = True,
    chunk: int | None = None,
    largest: bool = True,
    sorted: bool = True,
    group=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """retrieve over a corpus split across the ranks of a torch.distributed group.

    Every rank passes the same queries Q (and q_mask) and its own shard D_shard
    [n_rank, Ld, d] with its d_mask [n_rank, Ld] (any size, empty included; Ld may differ
    between ranks). Shards are concatenated in rank order. Each rank scores its shard with
    retrieve (chunked by `chunk`); all-gathers of the candidates (scores and global ids)
    then merge them, moving only Nq * k values per rank. Every rank returns the same
    (scores [Nq, k], global ids [Nq, k]), equal to retrieve on the concatenated corpus:
    k = min(top_k, total docs), equal scores keep the lower global id. Must be called by
    every rank of `group` (default: the world).
    """
    call = _ShardedCall(top_k, normalize, chunk, largest, sorted, _group_name(group))
    return SHARDED((Q, D_shard, q_mask, d_mask), call)


@dataclasses.dataclass(frozen=True)
class _ShardedCall:
    top_k: object  # checked by retrieve on every rank, so that a bad value fails them all
    normalize: object
    chunk: object
    largest: object
    sorted: object
    group: str | None  # the process group's name; None: the default group


def _group_name(group) -> str | None:
    return None if group is None else group.group_name


def _sharded_forward(inputs, call: _ShardedCall):
    Q, D_shard, q_mask, d_mask = inputs
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "retrieve_sharded needs an initialized torch.distributed process group "
            "(torch.distributed.init_process_group, e.g. under torchrun)"
        )
    # A name back to its group: the registry torch's functional collectives resolve by.
    group = None if call.group is None else dist.distributed_c10d._resolve_process_group(call.group)
    error, squeeze = None, isinstance(Q, torch.Tensor) and Q.dim() == 2
    try:
        scores, local_ids = retrieve(
            Q, D_shard, call.top_k, q_mask, d_mask,
            normalize=call.normalize, chunk=call.chunk, largest=call.largest, sorted=False,
        )  # fmt: skip
    except Exception as exc:  # re-raised below, once the other ranks know
        error = exc
    _raise_if_any_rank_failed(error, group)
    if squeeze:
        scores, local_ids = scores[None], local_ids[None]
    scores, ids = merge_shard_results(
        scores, local_ids, D_shard.shape[0], call.top_k, largest=call.largest,
        sorted=call.sorted, group=group,
    )  # fmt: skip
    return ((scores[0], ids[0]) if squeeze else (scores, ids)), ()


def _sharded_fake(inputs, call: _ShardedCall):
    """k = min(top_k, every rank's docs) is known only once the ranks have exchanged
    their shard sizes: a size of its own in a compiled graph."""
    Q, top_k = inputs[0], call.top_k
    # A bad top_k gets no bound here: the op itself refuses it, on every rank.
    valid = isinstance(top_k, int) and not isinstance(top_k, bool) and top_k >= 1
    k = torch.library.get_ctx().new_dynamic_size(max=top_k if valid else None)
    shape = (k,) if Q.dim() == 2 else (Q.shape[0], k)
    return (Q.new_empty(shape, dtype=torch.float32), Q.new_empty(shape, dtype=torch.int64)), ()


# One opaque op under torch.compile: its exchange of shard sizes and candidates between
# the ranks reads them on the host, which a graph cannot hold.
SHARDED = ops.Family("retrieve_sharded", _ShardedCall, _sharded_forward, _sharded_fake,
                     outputs=2)  # fmt: skip
