"""Triton functions every generated kernel shares, written once and imported by them.

Hand-written, not generated: a change here changes no generated file. Triton inlines
these into each kernel, so a helper costs nothing over the same code written in place.
Constexpr arguments are specialized per call like a kernel's.
"""

import torch
import triton
import triton.language as tl
from triton import knobs

from lik.runtime.launch_plan import recorded


@triton.jit
def max_keep_nan(a, b):
    """max that returns NaN when either side is NaN (the hardware max drops it)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def inv_l2_norm(x):
    """1 / max(||row||, 1e-12) per row of an fp32 tile: F.normalize's semantics."""
    return 1.0 / tl.maximum(tl.sqrt(tl.sum(x * x, axis=1)), 1e-12)


@triton.jit
def normalize_backward(x, grad):
    """Gradient through y = x / max(||x||, 1e-12), per row, from grad = dL/dy (fp32 tiles).
    A row that takes no gradient (grad all 0: a masked token, one that won nothing) gets
    exactly 0 whatever x holds, so NaN or inf in padding stays out of the gradients."""
    norm = tl.sqrt(tl.sum(x * x, axis=1))
    inv = 1.0 / tl.maximum(norm, 1e-12)
    y = x * inv[:, None]
    radial = tl.sum(y * grad, axis=1)
    # Below eps the clamp makes y linear in x: the radial term vanishes.
    radial = tl.where(norm > 1e-12, radial, 0.0)
    takes_gradient = tl.sum(tl.abs(grad), axis=1) != 0  # NaN counts: it stays NaN
    return tl.where(takes_gradient[:, None], (grad - y * radial[:, None]) * inv[:, None], 0.0)


@triton.jit
def token_valid(mask, base, offs, stride, length):
    """Which of tokens offs are valid: below length, and True in a bool/uint8 mask row.
    Tokens past the length load as masked (other=0): no second length test, which cost
    4-7% (H100, in-batch 256 with a doc mask 0.408 -> 0.390 ms, 8 queries x 2000 docs
    0.131 -> 0.122; commit 49fcebb)."""
    return tl.load(mask + base + offs * stride, mask=offs < length, other=0) != 0


@recorded
def valid_tokens(d_mask: torch.Tensor | None) -> torch.Tensor | None:
    """Each doc's count of valid tokens, int32, contiguous, d_mask's shape without its token
    axis; counted once per launch (one small reduction) for doc_has_token, in the kernels
    that do not count them per doc (doc_extent)."""
    return None if d_mask is None else d_mask.sum(-1, dtype=torch.int32)


# Mask bytes doc_extent reads per step: one 16-byte load per thread of a 1-warp program.
EXTENT_CHUNK = tl.constexpr(512)


@triton.jit
def doc_extent(mask, base, stride, length):
    """A masked doc's extent, one past its last valid token (0 when it has none, at most
    length), and its count of valid tokens. Its tile loops stop at the extent, so a doc
    padded at its end (prefix and ragged masks, as collators pad) reads none of its
    padding (H200, GPU time: rerank 1 x 1000 x 32 x 300 with prefix masks 0.069 -> 0.032
    ms, ColPali pages 0.134 -> 0.108; commit 0a774e2). Read per doc, before its tiles,
    the count replaces valid_tokens' launch: two PyTorch kernels of about 2 us each."""
    extent = length * 0  # length's type: the loops that read it carry it
    count = length * 0
    for start in range(0, length, EXTENT_CHUNK):
        offs = start + tl.arange(0, EXTENT_CHUNK)
        valid = token_valid(mask, base, offs, stride, length)
        extent = tl.maximum(extent, tl.max(tl.where(valid, offs + 1, 0)).to(extent.dtype))
        count += tl.sum(valid.to(tl.int32)).to(count.dtype)
    return extent, count


@triton.jit
def doc_has_token(d_tokens, index):
    """Whether a doc with a mask has a valid token, from its count (valid_tokens), so that
    a valid row's max of -inf reads as real when it has one and adds 0 when it has none:
    the mask decides, never the value. The flat loop's way: a scalar load per doc, where
    deciding it in the kernel (a max over each step's mask) cost 3-15% (H200, doc masks,
    GPU time: in-batch 256 x 256 x 32 x 300 0.389 -> 0.449 ms, 16 queries x 100k docs of
    128 tokens 4.09 -> 4.51, 16 x 32 docs of 8192 0.094 -> 0.096; a training forward
    0.769 -> 0.850). The other loops read the doc's extent (doc_extent) first."""
    return tl.load(d_tokens + index) != 0


@triton.jit
def masked_as_zero(scored, best, holes):
    """The rows that count (`scored`, as the doc's valid tokens decided them) when the doc
    mask reads as zeros (MASKED_AS_ZERO, PyLate's convention): a masked doc token is not
    left out of the max but competes with similarity 0. So a counted row whose max over
    the valid tokens `best` is below 0 (-inf included) scores the 0 instead when the doc
    has a masked token (`holes`: its count of valid tokens is below Ld): it counts for
    nothing, as a row with no valid doc token does (it adds 0, and its argmax is -1: no
    gradient, as PyLate's product with the mask passes none to a masked winner). A tie at
    0 keeps the valid token, NaN stays NaN. Applied once per doc, after its tiles, which
    mask their similarities as for a plain doc mask."""
    return scored & ~((best < 0) & holes)


@triton.jit
def one_hot_dot(won, g, rows, acc, SPLIT_G: tl.constexpr, DOT_DTYPE: tl.constexpr,
                INPUT_PRECISION: tl.constexpr):  # fmt: skip
    """acc + (won * g) @ rows on the tensor cores: won [T, R] says which of R rows each of
    T tokens takes, g [R] each row's weight. Each row has its own g, so g goes into the
    one-hot matrix; in a 16-bit dot (SPLIT_G) it is split into a head and the tail the
    head rounds off: two exact products that sum to g * rows within fp32 rounding (one
    rounded g doubles the error of grad_D)."""
    g_head = g.to(DOT_DTYPE)
    acc = tl.dot(tl.where(won, g_head[None, :], 0.0).to(DOT_DTYPE), rows, acc,
                 input_precision=INPUT_PRECISION)  # fmt: skip
    if SPLIT_G:
        g_tail = (g - g_head.to(tl.float32)).to(DOT_DTYPE)
        acc = tl.dot(tl.where(won, g_tail[None, :], 0.0).to(DOT_DTYPE), rows, acc,
                     input_precision=INPUT_PRECISION)  # fmt: skip
    return acc


# Operand dtype and precision of tl.dot on a GPU, by the dtype of the tensor that sets it
# (Q, or PLAID's centroids). fp32 inputs use three tf32 passes ("tf32x3", about fp32
# accuracy): a single tf32 pass (~3e-4 error) flips near-tied argmaxes, which moves
# gradients to another doc token (seen on an H200: grad_Q error 0.08-0.2 vs float64).
DOT_DTYPE = {
    torch.float32: (tl.float32, "tf32x3"),
    torch.float16: (tl.float16, "ieee"),
    torch.bfloat16: (tl.bfloat16, "ieee"),
    torch.float8_e4m3fn: (tl.float8e4nv, "ieee"),
}
# The Triton interpreter multiplies the raw bit patterns of bf16 dot operands, so under it
# every dot runs in fp32; tensors stay in their dtype in memory, so loads and stores are
# still exercised.
INTERPRETER_DOT = (tl.float32, "ieee")


def dot_config(config, dtype):
    """(DOT_DTYPE, INPUT_PRECISION) of a launch with `config` whose dot inputs are `dtype`."""
    return INTERPRETER_DOT if config.interpret else DOT_DTYPE[dtype]


# The strides launchers pass for an input a call lacks (None): the kernel never reads
# them, and 0 keeps one specialization for every absent input.
NO_STRIDES = (0, 0, 0, 0)


@triton.jit
def row_argmax(sim, best, best_index, start, WIDTH: tl.constexpr):
    """A tile's row maxima and their earliest tokens (sim [rows, WIDTH], doc tokens from
    `start`), folded into the running best and best_index. The max first (NaN kept),
    then the earliest token equal to it: cheaper than a fused (value, index) reduction,
    which also drops NaN (H200, in-batch 256 with argmax: 0.60 -> 0.54 ms). Strict >
    keeps the earliest doc token on ties across tiles too."""
    tile_best = tl.reduce(sim, 1, max_keep_nan)
    slot = tl.arange(0, WIDTH)
    tile_index = tl.min(tl.where(sim == tile_best[:, None], slot[None, :], WIDTH), axis=1)
    better = tile_best > best
    best_index = tl.where(better, (start + tile_index).to(tl.int32), best_index)
    return max_keep_nan(best, tile_best), best_index


if knobs.runtime.interpret:  # read as triton.jit reads it: the mode the kernels run in

    @triton.jit
    def row_max_index(sim):
        """Each row's max of sim [rows, columns] and its earliest column. The interpreter
        takes this reduction's index with np.nanargmax, which raises on a row of NaN (a NaN
        query token); NaN reads as -inf here instead. Callers keep NaN in the score by a
        probe of their own, so only the index of such a row differs from a GPU's."""
        sim = tl.where(sim != sim, float("-inf"), sim)
        return tl.max(sim, axis=1, return_indices=True, return_indices_tie_break_left=True)

else:

    @triton.jit
    def row_max_index(sim):
        """Each row's max of sim [rows, columns] and its earliest column (tl.max with
        indices; the interpreter's twin above reads NaN as -inf)."""
        return tl.max(sim, axis=1, return_indices=True, return_indices_tie_break_left=True)


@triton.jit
def column_argmax_step(sim, col_best, col_start, start):
    """The argmax kept per tile column: each column's running max and the tile it came
    from (strict >: the earliest tile on ties), elementwise; rows reduce once, after the
    whole tiles (fold_column_argmax)."""
    col_start = tl.where(sim > col_best, start, col_start)
    return max_keep_nan(col_best, sim), col_start


@triton.jit
def fold_column_argmax(col_best, col_start, BLOCK_L: tl.constexpr):
    """The column argmax's rows reduced: their max over the tile columns, then the
    earliest token equal to it (-1 where the max is NaN: that row's score is NaN)."""
    best = tl.reduce(col_best, 1, max_keep_nan)
    token = col_start + tl.arange(0, BLOCK_L)[None, :]
    best_index = tl.min(tl.where(col_best == best[:, None], token, 2**30), axis=1)
    return best, tl.where(best_index < 2**30, best_index, -1).to(tl.int32)


# Token ranges whose row maxima the last range loads unrolled, at once; more ranges load
# this many per step of a loop. Every load unrolled compiled in 4.6 s at 128 ranges and
# 20 s at 256; steps of 16 cost 0.5-0.8 us at 32-128 ranges (one more L2 round trip a
# step), steps of 64 0.2-0.5 us at 128 (H100 and H200, commit 49fcebb).
SPLIT_LOADS_UNROLLED = tl.constexpr(64)


@triton.jit
def reduce_token_ranges(Partial, Arrivals, Out, doc, groups, group, Nq, stride_ob, stride_oc,
                        ROWS: tl.constexpr, QUERY_GROUP: tl.constexpr, BLOCK_Q: tl.constexpr,
                        DOC_SPLITS: tl.constexpr):  # fmt: skip
    """After a token range's row maxima are stored: the last range of its (doc, group) to
    finish reduces them all, each row's max over the ranges (NaN kept), then the sum over
    each query's tokens, and stores the scores. One launch instead of a second, reducing
    kernel (H100: 2 queries x 64 docs of 4096 tokens 0.039 -> 0.037 ms, 4 x 16 of 16384
    0.0395 -> 0.0384). Arrivals counts the ranges done; the last one sets it back to 0
    for the next launch (lik.runtime.workspace). Partial is [Nd, DOC_SPLITS, groups, ROWS]."""
    tl.debug_barrier()  # every thread's store is made before the release
    arrival = Arrivals + doc * groups + group
    if tl.atomic_add(arrival, 1, sem="acq_rel") == DOC_SPLITS - 1:
        rows = tl.arange(0, ROWS)
        best = tl.full([ROWS], float("-inf"), dtype=tl.float32)
        ranges = Partial + (doc * DOC_SPLITS * groups + group) * ROWS + rows
        # .cg: read from L2, where the other ranges' stores are.
        if DOC_SPLITS <= SPLIT_LOADS_UNROLLED:
            for split in tl.static_range(DOC_SPLITS):
                part = tl.load(ranges + split * groups * ROWS, cache_modifier=".cg")
                best = max_keep_nan(best, part)
        else:
            for first_split in range(0, DOC_SPLITS, SPLIT_LOADS_UNROLLED):
                for offset in tl.static_range(SPLIT_LOADS_UNROLLED):
                    # Past the last range (a count not a multiple of the step): the last
                    # one again, which leaves the max as it is.
                    split = tl.minimum(first_split + offset, DOC_SPLITS - 1)
                    part = tl.load(ranges + split * groups * ROWS, cache_modifier=".cg")
                    best = max_keep_nan(best, part)
        # Rows that add 0 (a masked query token, a doc with no valid token) were stored as
        # 0 by every range: a row's -inf here is real (every valid similarity was -inf).
        scores = tl.sum(tl.reshape(best, [QUERY_GROUP, BLOCK_Q]), axis=1)
        group_queries = group * QUERY_GROUP + tl.arange(0, QUERY_GROUP)
        tl.store(Out + group_queries * stride_ob + doc * stride_oc, scores,
                 mask=group_queries < Nq)  # fmt: skip
        tl.atomic_xchg(arrival, 0)


@triton.jit
def topk_insert(top_scores, top_ranks, top_docs, scores, doc, doc_ok):
    """One doc's scores [QUERY_GROUP] into each query's TOP_K slots (score, rank, doc).
    NaN ranks above everything (as torch.topk does), the score itself is kept. The
    weakest slot is evicted: lowest rank, and among equal ranks an empty slot (negative
    doc), else the highest doc. A new doc enters an empty slot whatever its score (a -inf
    score is a real one), a filled one only with a strictly higher rank, so on equal
    scores the lower (earlier) doc stays: the same rule as retrieve's final merge."""
    rank = tl.where(scores != scores, float("inf"), scores)
    low = tl.min(top_ranks, axis=1)
    at_low = top_ranks == low[:, None]
    lowest_doc = tl.min(tl.where(at_low, top_docs, 2**62), axis=1)
    empty = lowest_doc < 0  # an empty slot is left (then low is -inf)
    weakest = tl.where(empty, lowest_doc, tl.max(tl.where(at_low, top_docs, -(2**62)), axis=1))
    enters = tl.where(doc_ok, (rank > low) | empty, False)
    evict = (top_docs == weakest[:, None]) & enters[:, None]
    top_ranks = tl.where(evict, rank[:, None], top_ranks)
    top_scores = tl.where(evict, scores[:, None], top_scores)
    top_docs = tl.where(evict, doc, top_docs)
    return top_scores, top_ranks, top_docs


@triton.jit
def tile_similarities(q, tile, NORMALIZE: tl.constexpr, TOKEN_ROWS: tl.constexpr,
                      DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr):  # fmt: skip
    """A query tile's fp32 similarities to a doc tile [tokens, dim]: q @ tile^T, [rows,
    tokens]; with TOKEN_ROWS, tile @ q for q given transposed, [tokens, rows], so a tile
    decoded in registers feeds the MMA as its left operand without a transpose. With
    NORMALIZE the doc tokens' inverse norms scale them (query norms commute with a max
    and scale its result; hooked scores apply them here too, see the forward)."""
    if TOKEN_ROWS:
        sim = tl.dot(tile.to(DOT_DTYPE), q, input_precision=INPUT_PRECISION)
        if NORMALIZE:
            sim = sim * inv_l2_norm(tile.to(tl.float32))[:, None]
    else:
        sim = tl.dot(q, tl.trans(tile.to(DOT_DTYPE)), input_precision=INPUT_PRECISION)
        if NORMALIZE:
            sim = sim * inv_l2_norm(tile.to(tl.float32))[None, :]
    return sim


@triton.jit
def per_token(values, TOKEN_ROWS: tl.constexpr):
    """A per-doc-token vector broadcast along the similarities' token axis."""
    if TOKEN_ROWS:
        return values[:, None]
    else:
        return values[None, :]


@triton.jit
def row_max(best, sim, TOKEN_ROWS: tl.constexpr):
    """The running max of each query row, NaN kept (same cost as the plain max: a
    non-finite input never scores finite)."""
    if TOKEN_ROWS:
        return max_keep_nan(best, tl.reduce(sim, 0, max_keep_nan))
    else:
        return max_keep_nan(best, tl.reduce(sim, 1, max_keep_nan))
