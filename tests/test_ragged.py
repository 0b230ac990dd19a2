"""Ragged batches (varlen, packed pairs, padded rerank) against the float64 reference."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import TOLERANCE, relative_error

from lik.runtime import (
    PackedBatch,
    backends,
    configs,
    heuristics,
    maxsim_padded,
    maxsim_varlen,
    pack_padded,
    ragged,
    registry,
    score_pairs_packed,
)
from lik.runtime.keys import LQ_CHUNK
from lik.runtime.reference import maxsim_pairs_reference, score_pairs_packed_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETER = DEVICE == "cpu"
pytestmark = pytest.mark.skipif(
    backends.device_backend(torch.device(DEVICE)) not in backends.GENERATED_TRITON,
    reason="no Triton path on this machine",
)


def _offsets(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                        device=DEVICE)  # fmt: skip


def _batch(seed, n_queries, n_docs, dim=24, dtype=torch.float32, max_len=70):
    g = torch.Generator().manual_seed(seed)
    lq = torch.randint(0, max_len + 1, (n_queries,), generator=g).tolist()
    ld = torch.randint(0, max_len + 1, (n_docs,), generator=g).tolist()
    lq[0], ld[0] = 0, 0  # an empty query and an empty doc in every batch
    Q = torch.randn(sum(lq), dim, generator=g).to(DEVICE, dtype)
    D = torch.randn(sum(ld), dim, generator=g).to(DEVICE, dtype)
    return Q, D, _offsets(lq), _offsets(ld)


def _grads(fn, Q, D):
    Qg, Dg = Q.clone().requires_grad_(), D.clone().requires_grad_()
    out = fn(Qg, Dg)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    (out * weights).sum().backward()
    return out, Qg.grad, Dg.grad, weights


def _reference_grads(Q, D, weights, **kwargs):
    Qr, Dr = Q.double().requires_grad_(), D.double().requires_grad_()
    out = score_pairs_packed_reference(Qr, Dr, **kwargs)
    (out * weights.double()).sum().backward()
    return out, Qr.grad, Dr.grad


def _check(got, want, dtype):
    bound = 1e-5 if INTERPRETER and dtype == torch.float32 else TOLERANCE[dtype]
    for g, w in zip(got, want, strict=True):
        assert relative_error(g, w) < bound


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("normalize", [False, True])
def test_varlen_forward_and_gradients(dtype, normalize):
    Q, D, cu_q, cu_d = _batch(3, 4, 5, dtype=dtype)
    out, gq, gd, w = _grads(lambda q, d: maxsim_varlen(q, d, cu_q, cu_d, normalize=normalize), Q, D)
    ref = _reference_grads(Q, D, w, cu_seqlens_q=cu_q, cu_seqlens_d=cu_d, layout="varlen",
                           normalize=normalize)  # fmt: skip
    assert out.shape == (4, 5) and torch.all(out[0] == 0) and torch.all(out[:, 0] == 0)
    _check((out, gq, gd), ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("normalize", [False, True])
def test_varlen_lowmem_gradients(dtype, normalize):
    """Docs of 0-70 tokens span up to three 32-token tiles (the interpreter's) or two 64-
    token ones, so grad_D's tile map and winner lists cross tile and doc boundaries."""
    Q, D, cu_q, cu_d = _batch(13, 5, 7, dim=40, dtype=dtype)

    def score(q, d):
        return maxsim_varlen(q, d, cu_q, cu_d, normalize=normalize, backward="lowmem")

    out, gq, gd, w = _grads(score, Q, D)
    ref = _reference_grads(Q, D, w, cu_seqlens_q=cu_q, cu_seqlens_d=cu_d, layout="varlen",
                           normalize=normalize)  # fmt: skip
    _check((out, gq, gd), ref, dtype)
    assert gq.dtype == dtype and gd.dtype == dtype  # written by their owners, no fp32 buffer
    assert torch.equal(_grads(score, Q, D)[2], gd)  # no atomics: bitwise repeatable


@pytest.mark.parametrize("backward", ["unified", "lowmem"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_stacks_short_queries(backward, dtype):
    """Queries of up to 30 tokens stack four to a program (the last group holds three of
    seven): scores, argmax and both gradients against float64."""
    Q, D, cu_q, cu_d = _batch(17, 7, 5, dtype=dtype, max_len=30)
    D = torch.randn(D.shape[0] * 2, D.shape[1]).to(DEVICE, dtype)  # docs of 0-60 tokens
    cu_d = cu_d * 2

    def score(q, d):
        return maxsim_varlen(q, d, cu_q, cu_d, normalize=True, backward=backward)

    out, gq, gd, w = _grads(score, Q, D)
    ref = _reference_grads(Q, D, w, cu_seqlens_q=cu_q, cu_seqlens_d=cu_d, layout="varlen",
                           normalize=True)  # fmt: skip
    _check((out, gq, gd), ref, dtype)


def test_stacked_ragged_queries_fill_the_query_tile():
    from lik.runtime.dispatch import stack_ragged_queries
    from lik.runtime.tuning import LaunchConfig

    config = LaunchConfig(block_q=32, block_l=64, block_k=128, num_warps=4, num_stages=3)
    stacked = stack_ragged_queries(config, queries=7)
    assert (stacked.query_group, stacked.num_warps) == (4, 8)
    assert stack_ragged_queries(config, queries=1) == config  # one query: nothing to stack
    short = dataclasses.replace(config, block_q=16)
    assert stack_ragged_queries(short, queries=100).query_group == 8
    assert stack_ragged_queries(short, queries=2).num_warps == 4  # 32 rows: the default's 4
    long = dataclasses.replace(config, block_q=256)
    assert stack_ragged_queries(long, queries=100).query_group == 1


def test_varlen_lowmem_with_one_query_against_many_docs():
    Q, D, cu_q, cu_d = _batch(14, 1, 40, max_len=9)
    cu_q = _offsets([9])
    Q = torch.randn(9, 24, device=DEVICE)
    out, gq, gd, w = _grads(lambda q, d: maxsim_varlen(q, d, cu_q, cu_d, backward="lowmem"), Q, D)
    ref = _reference_grads(Q, D, w, cu_seqlens_q=cu_q, cu_seqlens_d=cu_d, layout="varlen")
    _check((out, gq, gd), ref, torch.float32)


def test_varlen_lowmem_passes_no_gradient_through_a_bad_doc():
    """With the bounds given nothing is validated on the host: docs whose offsets run
    past the packed tokens or backwards score NaN, and the tokens no valid doc covers get
    no gradient; the others score as usual."""
    g = torch.Generator().manual_seed(15)
    Q = torch.randn(12, 16, generator=g).to(DEVICE)
    D = torch.randn(30, 16, generator=g).to(DEVICE)
    cu_q = torch.tensor([0, 5, 12], dtype=torch.int32, device=DEVICE)
    # Doc 2 runs past the 30 tokens, doc 3 backwards: tokens 20-29 are in no valid doc.
    cu_d = torch.tensor([0, 10, 20, 40, 30], dtype=torch.int32, device=DEVICE)
    keep = [0, 1]
    Qg, Dg = Q.clone().requires_grad_(), D.clone().requires_grad_()
    out = maxsim_varlen(Qg, Dg, cu_q, cu_d, 7, 20, backward="lowmem")
    assert torch.isnan(out[:, 2:]).all() and not torch.isnan(out[:, keep]).any()
    weights = torch.randn(2, 2, generator=g).to(DEVICE)
    (out[:, keep] * weights).sum().backward()
    assert torch.all(Dg.grad[20:] == 0)
    Qr, Dr = Q.double().requires_grad_(), D.double().requires_grad_()
    want = score_pairs_packed_reference(Qr, Dr, cu_seqlens_q=cu_q, cu_seqlens_d=cu_d,
                                        layout="varlen")[:, keep]  # fmt: skip
    (want * weights.double()).sum().backward()
    _check((out[:, keep], Qg.grad, Dg.grad), (want, Qr.grad, Dr.grad), torch.float32)


def test_varlen_backward_choice():
    from lik.runtime.api import LOPSIDED_DOCS, LOPSIDED_QUERIES, choose_backward

    assert choose_backward(None, "varlen", 32, 32) == "lowmem"
    assert choose_backward("auto", "varlen", 1, LOPSIDED_DOCS) == "unified"
    assert choose_backward("auto", "varlen", 8 * LOPSIDED_QUERIES, 8) == "unified"  # 256 x 8
    assert choose_backward("unified", "varlen", 32, 32) == "unified"
    assert choose_backward(None, "packed_pairs", 32, 32) == "unified"
    Q, D, cu_q, cu_d = _batch(16, 2, 2)
    with pytest.raises(ValueError, match="backward must be one of"):
        maxsim_varlen(Q, D, cu_q, cu_d, backward="fast")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("normalize", [False, True])
def test_packed_pairs_forward_and_gradients(dtype, normalize):
    Q, D, cu_q, cu_d = _batch(4, 3, 6, dtype=dtype)
    g = torch.Generator().manual_seed(5)
    pq = torch.randint(0, 3, (9,), generator=g).to(DEVICE)
    pd = torch.randint(0, 6, (9,), generator=g).to(DEVICE)

    def score(q, d):
        return score_pairs_packed(q, d, cu_q, cu_d, pq, pd, normalize=normalize)

    out, gq, gd, w = _grads(score, Q, D)
    ref = _reference_grads(Q, D, w, cu_seqlens_q=cu_q, cu_seqlens_d=cu_d, pair_q_idx=pq,
                           pair_d_idx=pd, normalize=normalize)  # fmt: skip
    _check((out, gq, gd), ref, dtype)


def test_given_bounds_match_computed_bounds():
    Q, D, cu_q, cu_d = _batch(6, 3, 4)
    lq = int((cu_q[1:] - cu_q[:-1]).max())
    ld = int((cu_d[1:] - cu_d[:-1]).max())
    computed = maxsim_varlen(Q, D, cu_q, cu_d)
    given = maxsim_varlen(Q, D, cu_q, cu_d, lq, ld)
    assert torch.equal(computed, given)


def test_a_too_small_query_bound_poisons_instead_of_truncating():
    Q, D, cu_q, cu_d = _batch(7, 3, 2, max_len=20)
    lengths = (cu_q[1:] - cu_q[:-1]).tolist()
    bound = max(lengths) - 1
    out = maxsim_varlen(Q, D, cu_q, cu_d, max_seqlen_q=bound)
    for i, n in enumerate(lengths):
        assert torch.isnan(out[i]).all() == (n > bound)


def test_a_small_doc_bound_never_drops_tokens():
    Q, D, cu_q, cu_d = _batch(8, 2, 3)
    exact = maxsim_varlen(Q, D, cu_q, cu_d)
    # Another query bound is another query tile, so the dot's rounding may differ; a
    # dropped doc token would move a score by a whole similarity.
    bounded = maxsim_varlen(Q, D, cu_q, cu_d, max_seqlen_q=70, max_seqlen_d=1)
    torch.testing.assert_close(bounded, exact, rtol=1e-6, atol=1e-5)
    # A guard for a future kernel that takes the doc bound as its loop bound: today the
    # kernels walk each doc's own length, so both match float64 as well.
    ref = score_pairs_packed_reference(Q.double(), D.double(), cu_seqlens_q=cu_q,
                                       cu_seqlens_d=cu_d, layout="varlen")  # fmt: skip
    assert relative_error(bounded, ref) < 1e-5


@pytest.mark.parametrize(
    "offsets, message",
    [
        ([0, 5, 3, 9], "cu_seqlens_q must never decrease"),
        ([1, 5, 9], "cu_seqlens_q must start at 0, got 1"),
        ([0, 5, 8], "cu_seqlens_q must end at the packed length 9, got 8"),
    ],
)
def test_bad_offsets_raise(offsets, message):
    Q = torch.randn(9, 16, device=DEVICE)
    D = torch.randn(4, 16, device=DEVICE)
    cu_q = torch.tensor(offsets, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=message):
        maxsim_varlen(Q, D, cu_q, _offsets([4]))


def test_bad_offsets_with_given_bounds_poison_only_their_pairs():
    Q, D = torch.randn(9, 16, device=DEVICE), torch.randn(4, 16, device=DEVICE)
    cu_q = torch.tensor([0, 5, 3, 9], dtype=torch.int32, device=DEVICE)  # query 1: length -2
    out = maxsim_varlen(Q, D, cu_q, _offsets([4]), 6, 4)
    assert torch.isnan(out[1]).all() and not torch.isnan(out[[0, 2]]).any()
    beyond = torch.tensor([0, 5, 12, 9], dtype=torch.int32, device=DEVICE)  # 1: past the end
    out = maxsim_varlen(Q, D, beyond, _offsets([4]), 7, 4)
    assert torch.isnan(out[1:]).all() and not torch.isnan(out[0]).any()


def test_out_of_range_pair_indices_poison_their_scores():
    Q, D, cu_q, cu_d = _batch(10, 3, 4)
    pq = torch.tensor([0, 3, 1, -1], device=DEVICE)
    pd = torch.tensor([1, 1, 9, 2], device=DEVICE)
    out = score_pairs_packed(Q, D, cu_q, cu_d, pq, pd, max_seqlen_q=70)
    assert not torch.isnan(out[0]) and torch.isnan(out[1:]).all()


@pytest.mark.parametrize(
    "call, error, fragment",
    [
        (lambda Q, D, cq, cd: maxsim_varlen(Q[None], D, cq, cd), ValueError, "Q_packed must be"),
        (lambda Q, D, cq, cd: maxsim_varlen(Q, D, cq.long(), cd), TypeError, "int32"),
        (lambda Q, D, cq, cd: maxsim_varlen(Q, D[:, :8], cq, cd), ValueError, "head dim"),
        (lambda Q, D, cq, cd: maxsim_varlen(Q, D, cq, cd, 600), ValueError, "longer than 512"),
        (lambda Q, D, cq, cd: maxsim_varlen(Q, D, cq, cd, -1), ValueError, "max_seqlen_q"),
        (lambda Q, D, cq, cd: score_pairs_packed(Q, D, cq, cd, cq[:2].long(), cq[:3].long()),
         ValueError, "one entry per pair"),
        (lambda Q, D, cq, cd: score_pairs_packed(Q, D, cq, cd, cq[:2].float(), cq[:2].long()),
         TypeError, "pair_q_idx must be int32 or int64"),
    ],
)  # fmt: skip
def test_bad_arguments_name_the_argument(call, error, fragment):
    Q, D, cu_q, cu_d = _batch(9, 2, 2, dim=16)
    with pytest.raises(error, match=fragment):
        call(Q, D, cu_q, cu_d)


def test_empty_batches():
    Q, D = torch.randn(0, 16, device=DEVICE), torch.randn(5, 16, device=DEVICE)
    assert maxsim_varlen(Q, D, _offsets([]), _offsets([5])).shape == (0, 1)
    assert maxsim_varlen(Q[:0], D[:0], _offsets([0]), _offsets([])).shape == (1, 0)
    none = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    assert score_pairs_packed(Q, D, _offsets([]), _offsets([5]), none, none).shape == (0,)


def test_distinct_maxima_share_one_kernel_entry():
    """Five different max lengths in one Lq bucket reuse one launch-config entry (one
    compiled kernel: the sizes are not specialized on)."""
    configs._configs.clear()
    configs._call_configs.clear()
    variant = "maxsim_varlen_nomask_fp32_triton"
    kernel = registry.load(variant).maxsim_varlen_triton_fwd_kernel
    compiled = _compiled_kernels(kernel)  # other tests of this process may have compiled some
    for longest in (17, 20, 23, 29, 31):
        Q, D, cu_q, cu_d = _batch(longest, 2, 2, max_len=longest)
        cu_q = _offsets([longest, 3])
        Q = torch.randn(longest + 3, 24, device=DEVICE)
        maxsim_varlen(Q, D, cu_q, cu_d)
    keys = [k for k in configs._configs if k.variant.startswith("maxsim_varlen")]
    assert [k.variant for k in keys] == [variant]
    if DEVICE == "cuda":  # and Triton compiled the kernel once at most, not once per length
        assert len(_compiled_kernels(kernel) - compiled) <= 1


def _compiled_kernels(kernel) -> set:
    """The specializations Triton holds compiled for kernel on the current GPU."""
    if DEVICE != "cuda":
        return set()
    return set(kernel.device_caches[torch.cuda.current_device()][0])


def _padded_batch(seed: int, q_len: list[int]):
    """(queries [2, max(q_len), 16], documents [2, 3, 9, 16], query and doc lengths, the
    scores of masked pairs in float64); the first query's second doc is empty."""
    g = torch.Generator().manual_seed(seed)
    B, C, Lq, Ld, dim = 2, 3, max(q_len), 9, 16
    queries = torch.randn(B, Lq, dim, generator=g).to(DEVICE)
    documents = torch.randn(B, C, Ld, dim, generator=g).to(DEVICE)
    query_lengths = torch.tensor(q_len, device=DEVICE)
    doc_lengths = torch.tensor([[9, 0, 4], [1, 9, 7]], device=DEVICE)
    q_mask = torch.arange(Lq, device=DEVICE)[None] < query_lengths[:, None]
    d_mask = torch.arange(Ld, device=DEVICE)[None, None] < doc_lengths[..., None]
    expected = torch.stack([
        maxsim_pairs_reference(queries.double(), documents[:, c].double(), q_mask, d_mask[:, c])
        for c in range(C)
    ], dim=1)  # fmt: skip
    return queries, documents, query_lengths, doc_lengths, expected


def test_pack_padded_and_maxsim_padded_match_masked_pairs():
    queries, documents, q_len, d_len, expected = _padded_batch(12, [6, 2])
    batch = pack_padded(queries, documents, q_len, d_len)
    assert isinstance(batch, PackedBatch) and len(tuple(batch)) == 8
    Q_packed, cu_q, *_ = batch
    assert Q_packed.shape == (8, 16) and cu_q.tolist() == [0, 6, 8]
    scores = maxsim_padded(queries, documents, q_len, d_len)
    assert relative_error(scores, expected) < 1e-5
    assert scores[0, 1] == 0


def test_maxsim_padded_trains_as_the_masked_reference():
    queries, documents, q_len, d_len, _ = _padded_batch(14, [7, 4])
    q, d = queries.clone().requires_grad_(), documents.clone().requires_grad_()
    weights = torch.rand(2, 3, generator=torch.Generator().manual_seed(15)).to(DEVICE)
    (maxsim_padded(q, d, q_len, d_len) * weights).sum().backward()
    q64, d64 = queries.double().requires_grad_(), documents.double().requires_grad_()
    q_mask = torch.arange(7, device=DEVICE) < q_len[:, None]
    d_mask = torch.arange(9, device=DEVICE) < d_len[..., None]
    ref = torch.stack([maxsim_pairs_reference(q64, d64[:, c], q_mask, d_mask[:, c])
                       for c in range(3)], dim=1)  # fmt: skip
    (ref * weights.double()).sum().backward()
    assert relative_error(q.grad, q64.grad) < 1e-5
    assert relative_error(d.grad, d64.grad) < 1e-5
    assert d.grad[0, 1].abs().max() == 0  # the empty doc takes no gradient


@pytest.mark.parametrize("fitting", [LQ_CHUNK, 16])
def test_maxsim_padded_scores_through_maxsim_with_length_masks(monkeypatch, fitting):
    # Always maxsim's KD layout with length masks, never a packing (which would wait on
    # the GPU), queries longer than one launch's query tile (forced to 16 tokens here)
    # included: maxsim scores those in chunks.
    monkeypatch.setattr(heuristics, "query_chunk", lambda module, Q: fitting)
    taken = []
    for path in ("maxsim", "score_pairs_packed"):
        real = getattr(ragged, path)
        monkeypatch.setattr(ragged, path, lambda *a, real=real, path=path, **k: (
            taken.append(path), real(*a, **k))[1])  # fmt: skip
    queries, documents, q_len, d_len, expected = _padded_batch(13, [20, 3])
    scores = maxsim_padded(queries, documents, q_len, d_len)
    assert scores.shape == (2, 3) and relative_error(scores, expected) < 1e-5
    assert scores[0, 1] == 0
    assert taken == ["maxsim"]


@pytest.mark.parametrize(
    "queries, documents, error, message",
    [
        ([[1.0]], torch.randn(1, 2, 5, 8), TypeError, "queries must be a torch.Tensor"),
        (torch.randn(4, 8), torch.randn(1, 2, 5, 8), ValueError, r"queries must be \[B, Lq, d\]"),
        (torch.randn(1, 4, 8).double(), torch.randn(1, 2, 5, 8).double(), TypeError,
         "queries must have dtype"),
        (torch.randn(1, 4, 8), torch.randn(1, 2, 5, 8).half(), TypeError, "share a dtype"),
        (torch.randn(1, 4, 8), torch.randn(2, 5, 8), ValueError, r"documents must be \[B, C"),
    ],
)  # fmt: skip
def test_padded_inputs_are_checked_by_name(queries, documents, error, message):
    with pytest.raises(error, match=message):
        maxsim_padded(queries, documents, torch.tensor([4]), torch.tensor([[5, 5]]))


@pytest.mark.parametrize(
    "query_lengths, doc_lengths",
    [([5], [[5, 5]]), ([-1], [[5, 5]]), ([4], [[6, 5]]), ([4], [[5, -2]])],
)
def test_pack_padded_validate_rejects_lengths_outside_the_padded_axes(query_lengths, doc_lengths):
    queries, documents = torch.randn(1, 4, 8), torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match="lengths outside the padded axes"):
        pack_padded(queries, documents, torch.tensor(query_lengths), torch.tensor(doc_lengths),
                    validate=True)  # fmt: skip


@pytest.mark.parametrize(
    "query_lengths, error, message",
    [([4], TypeError, "query_lengths must be an integer tensor"),
     (torch.tensor([True]), TypeError, "query_lengths must be an integer tensor, got torch.bool"),
     (torch.tensor([4.0]), TypeError, "query_lengths must be an integer tensor"),
     (torch.tensor([4, 4]), ValueError, r"query_lengths must have shape \(1,\)")],
)  # fmt: skip
def test_lengths_are_checked_by_name(query_lengths, error, message):
    queries, documents = torch.randn(1, 4, 8), torch.randn(1, 2, 5, 8)
    for validate in (False, True):
        with pytest.raises(error, match=message):
            pack_padded(queries, documents, query_lengths, torch.tensor([[5, 5]]),
                        validate=validate)  # fmt: skip
    with pytest.raises(error, match=message):  # an empty batch too
        no_docs = torch.zeros(1, 0, dtype=torch.int64)
        maxsim_padded(queries, documents[:, :0], query_lengths, no_docs)


def test_a_doc_bound_is_checked_without_a_query_bound():
    Q, D, cu_q, cu_d = _batch(8, 2, 3)
    with pytest.raises(ValueError, match="max_seqlen_d must be a non-negative int"):
        maxsim_varlen(Q, D, cu_q, cu_d, max_seqlen_d=-1)


def test_variants_exist_for_every_ragged_call():
    for layout, backwards in (("varlen", ("", "_unified", "_lowmem")),
                              ("packedpairs", ("", "_unified"))):  # fmt: skip
        for suffix in backwards:
            assert f"maxsim_{layout}_nomask_bf16_triton_norm{suffix}" in registry.names()


def test_uniform_offsets_are_built_once_per_shape():
    from lik.runtime.ragged import uniform_offsets

    offsets = uniform_offsets(3, 5, torch.device("cpu"))
    assert offsets.dtype == torch.int32 and offsets.tolist() == [0, 5, 10, 15]
    assert uniform_offsets(3, 5, torch.device("cpu")) is offsets
    assert uniform_offsets(3, 6, torch.device("cpu")).tolist() == [0, 6, 12, 18]


def test_ragged_queries_longer_than_fit_are_refused(monkeypatch):
    # Packed queries are scored whole: where a query tile of max_seqlen_q tokens would not
    # fit shared memory (fp32 at head dim 256 past 64 tokens on an H100 or H200), the call
    # says so instead of failing at launch.
    monkeypatch.setattr(heuristics, "query_chunk", lambda module, Q: 16)
    Q = torch.randn(20, 8, device=DEVICE)
    D = torch.randn(5, 8, device=DEVICE)
    cu_q = torch.tensor([0, 20], dtype=torch.int32, device=DEVICE)
    cu_d = torch.tensor([0, 5], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"max_seqlen_q=20: torch.float32 queries of head dim 8"):
        maxsim_varlen(Q, D, cu_q, cu_d, max_seqlen_q=20, max_seqlen_d=5)
    assert maxsim_varlen(Q[:16], D, torch.tensor([0, 16], dtype=torch.int32, device=DEVICE),
                         cu_d).shape == (1, 1)  # fmt: skip


@pytest.mark.parametrize(
    "pairs, expected_nan",
    [(([5], [0]), True), (([0], [2]), True), (([-1], [0]), True), (([0], [-1]), True),
     (([1], [1]), False)],
)  # fmt: skip
def test_out_of_range_pairs_score_nan_on_every_path(lik_path, pairs, expected_nan):
    # The kernels check pair indices on the device and poison the score; the reference
    # path does the same (it raised IndexError, or read index -1 as the last sequence).
    Q, D = torch.randn(7, 16), torch.randn(9, 16)
    cu_q, cu_d = _offsets([3, 4]), _offsets([4, 5])
    pair_q, pair_d = (torch.tensor(p, device=DEVICE) for p in pairs)
    score = score_pairs_packed(Q.to(DEVICE), D.to(DEVICE), cu_q, cu_d, pair_q, pair_d)
    assert bool(score.isnan().item()) is expected_nan


def test_offsets_past_the_packed_tokens_score_nan_on_every_path(lik_path):
    # With the bounds given nothing is read back: a doc whose offsets run past D_packed,
    # and a query longer than max_seqlen_q, score NaN on the reference path as in the
    # kernels; their other pairs score as usual.
    Q, D = torch.randn(7, 16).to(DEVICE), torch.randn(9, 16).to(DEVICE)
    cu_q = _offsets([3, 4])
    past_the_end = torch.tensor([0, 4, 12, 9], dtype=torch.int32, device=DEVICE)
    out = maxsim_varlen(Q, D, cu_q, past_the_end, max_seqlen_q=4)
    assert out[:, 1:].isnan().all() and not out[:, 0].isnan().any()
    too_long = maxsim_varlen(Q, D, cu_q, _offsets([4, 5]), max_seqlen_q=3, max_seqlen_d=9)
    assert too_long[1].isnan().all() and not too_long[0].isnan().any()


@pytest.mark.parametrize(
    "side, offsets",
    [("q", [3, 7]), ("q", [0, 3, 6]), ("d", [1, 4, 9]), ("d", [0, 4, 8]), ("d", [0, 4, 10])],
)  # fmt: skip
@pytest.mark.parametrize("entry", ["maxsim_varlen", "score_pairs_packed"])
def test_offsets_that_miss_packed_tokens_poison_every_score_on_every_path(lik_path, side,
                                                                          offsets, entry):
    # With the bounds given, offsets that do not start at 0 or do not end at the packed
    # length (a missing leading 0, a short or long last offset) would leave tokens out of
    # every sequence: every score is NaN, where the host check (no bounds) raises.
    Q, D = torch.randn(7, 16).to(DEVICE), torch.randn(9, 16).to(DEVICE)
    cu = {"q": _offsets([3, 4]), "d": _offsets([4, 5])}
    cu[side] = torch.tensor(offsets, dtype=torch.int32, device=DEVICE)
    if entry == "maxsim_varlen":
        out = maxsim_varlen(Q, D, cu["q"], cu["d"], max_seqlen_q=7)
    else:
        pairs = torch.tensor([0, 1, 1], device=DEVICE), torch.tensor([1, 0, 1], device=DEVICE)
        out = score_pairs_packed(Q, D, cu["q"], cu["d"], *pairs, max_seqlen_q=7)
    assert out.numel() and out.isnan().all()
    with pytest.raises(ValueError, match=f"cu_seqlens_{side} must"):
        maxsim_varlen(Q, D, cu["q"], cu["d"])


def _cu(*offsets):
    return torch.tensor(offsets, dtype=torch.int32, device=DEVICE)


EMPTY_SIDE_CASES = {
    # case: (query tokens, doc tokens, cu_seqlens_q, cu_seqlens_d, max_seqlen_q, pairs or
    # None for maxsim_varlen)
    "bound 0, queries of 3 and 7 tokens": (10, 7, (0, 3, 10), (0, 4, 7), 0, None),
    "bound 0, empty queries": (0, 7, (0, 0, 0), (0, 4, 7), 0, None),
    "bound 0, offsets past the queries": (0, 7, (0, 2, 0), (0, 4, 7), 0, None),
    "no doc tokens": (10, 0, (0, 3, 10), (0, 0, 0), 7, None),
    "no doc tokens, offsets past them": (10, 0, (0, 3, 10), (0, 2, 0), 7, None),
    "no doc tokens, a doc offset not 0": (10, 0, (0, 3, 10), (1, 0), 7, None),
    "pairs, bound 0, a 4-token query": (7, 9, (0, 0, 7), (0, 9), 0, ([0, 1], [0, 0])),
    "pairs, no doc tokens, one past the queries": (10, 0, (0, 3, 10), (0, 0), 7, ([5, 1], [0, 0])),
    "pairs, no doc tokens, a pair past the docs": (10, 0, (0, 3, 10), (0, 0), 7, ([1], [1])),
}


@pytest.mark.parametrize("case", list(EMPTY_SIDE_CASES))
def test_empty_sides_still_check_offsets_and_pairs_on_every_path(lik_path, case):
    """With no query tokens to score (max_seqlen_q == 0) or no doc tokens, the offsets,
    pair indices and query bound are still checked: what is bad scores NaN, what is good
    0, as the reference gives (the kernel path once returned zeros before any check)."""
    q_tokens, d_tokens, cu_q, cu_d, bound, pairs = EMPTY_SIDE_CASES[case]
    g = torch.Generator().manual_seed(2)
    Q = torch.randn(q_tokens, 16, generator=g).to(DEVICE).requires_grad_()
    D = torch.randn(d_tokens, 16, generator=g).to(DEVICE).requires_grad_()
    cu_q, cu_d = _cu(*cu_q), _cu(*cu_d)
    if pairs is None:
        out = maxsim_varlen(Q, D, cu_q, cu_d, max_seqlen_q=bound)
        kwargs = {"layout": "varlen"}
    else:
        pair_q, pair_d = (torch.tensor(p, device=DEVICE) for p in pairs)
        out = score_pairs_packed(Q, D, cu_q, cu_d, pair_q, pair_d, max_seqlen_q=bound)
        kwargs = {"pair_q_idx": pair_q, "pair_d_idx": pair_d}
    want = score_pairs_packed_reference(Q.detach().double(), D.detach().double(),
                                        cu_seqlens_q=cu_q, cu_seqlens_d=cu_d,
                                        max_seqlen_q=bound, **kwargs)  # fmt: skip
    assert out.shape == want.shape
    assert torch.equal(out.isnan(), want.isnan()), f"{out} vs {want}"
    assert torch.equal(out[~out.isnan()].double(), want[~want.isnan()])
    if out.requires_grad:  # (the reference's all-NaN scores are constants)
        grads = torch.autograd.grad(out.nan_to_num(0.0).sum(), (Q, D), allow_unused=True)
        assert all(grad is None or not grad.any() for grad in grads)  # bad pairs take none


@pytest.mark.parametrize(
    "argument, error, message",
    [("cu_seqlens_q", TypeError, "cu_seqlens_q must be a 1-D int32 tensor .*got list"),
     ("cu_seqlens_d", ValueError, r"cu_seqlens_d must be a 1-D int32 tensor .*got \(1, 3\)"),
     ("pair_q_idx", TypeError, "pair_q_idx must be a 1-D integer tensor .*got list"),
     ("pair_d_idx", ValueError, r"pair_d_idx must be a 1-D integer tensor .*got \(1, 1\)")],
)  # fmt: skip
def test_offsets_and_pair_indices_are_checked_by_name(argument, error, message):
    Q, D = torch.randn(7, 16, device=DEVICE), torch.randn(9, 16, device=DEVICE)
    arguments = {"cu_seqlens_q": _offsets([3, 4]), "cu_seqlens_d": _offsets([4, 5]),
                 "pair_q_idx": torch.tensor([0], device=DEVICE),
                 "pair_d_idx": torch.tensor([1], device=DEVICE)}  # fmt: skip
    bad = {"cu_seqlens_q": [0, 3, 7], "cu_seqlens_d": arguments["cu_seqlens_d"][None],
           "pair_q_idx": [0], "pair_d_idx": arguments["pair_d_idx"][None]}  # fmt: skip
    arguments[argument] = bad[argument]
    with pytest.raises(error, match=message):
        score_pairs_packed(Q, D, **arguments)
