"""Every generated forward variant against the float64 reference.

Without a GPU these run under the Triton interpreter (conftest sets TRITON_INTERPRET=1);
with one, the same tests run the compiled kernels. Outputs are poisoned with NaN before
each launch, so an element the kernel failed to write fails the comparison.
"""

from __future__ import annotations

import pytest
import torch
from helpers import (
    assert_close_to_reference,
    inference_variant_names,
    padded_variant_names,
    poisoned,
    random_mask,
    relative_error,
    stable_seed,
)

from lik.runtime import (
    backends,
    configs,
    dispatch,
    heuristics,
    maxsim,
    maxsim_pairs,
    registry,
    workspace,
)
from lik.runtime.reference import maxsim_pairs_reference, maxsim_reference
from lik_gen.ir import Variant

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETER = DEVICE == "cpu"
TORCH_DTYPE = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
pytestmark = pytest.mark.skipif(
    backends.device_backend(torch.device(DEVICE)) not in backends.GENERATED_TRITON,
    reason="no Triton path on this machine",
)


def _case(variant: Variant, Nq, Nd, Lq, Ld, dim, generator, p_valid=0.7):
    """Inputs, masks, output shape and float64 reference for one variant's layout."""
    dtype = TORCH_DTYPE[variant.dtype.value]
    layout = variant.layout.value
    d_shape = {"dense": (Nd, Ld), "kd": (Nq, Nd, Ld), "pairs": (Nq, Ld)}[layout]
    Q = torch.randn(Nq, Lq, dim, generator=generator)
    D = torch.randn(*d_shape, dim, generator=generator)
    zero = variant.mask.as_zero
    if zero:  # lean apart: many query tokens' best is below 0, where masked tokens' 0 wins
        Q[..., 0] += 5.0
        D[..., 0] -= 5.0
    Q, D = Q.to(DEVICE, dtype), D.to(DEVICE, dtype)
    q_mask = (
        random_mask((Nq, Lq), p_valid, DEVICE, generator=generator) if variant.mask.has_q else None
    )
    d_mask = (
        random_mask(d_shape, p_valid, DEVICE, generator=generator) if variant.mask.has_d else None
    )
    reference = maxsim_pairs_reference if layout == "pairs" else maxsim_reference
    ref = reference(Q.double(), D.double(), q_mask, d_mask, normalize=variant.normalize,
                    masked_as_zero=zero)  # fmt: skip
    out_shape = {"dense": (Nq, Nd), "kd": (Nq, Nd), "pairs": (Nq,)}[layout]
    return Q, D, q_mask, d_mask, out_shape, ref


def _run(variant: Variant, Q, D, q_mask, d_mask, out_shape):
    out = poisoned(out_shape, DEVICE)
    return dispatch.forward(variant.layout.value, Q, D, q_mask, d_mask, variant.normalize, out,
                            masked_as_zero=variant.mask.as_zero)  # fmt: skip


@pytest.mark.parametrize("name", inference_variant_names(registry.names()))
def test_variant_matches_reference(monkeypatch, name):
    variant = Variant.parse(name)
    launched = []
    load = registry.load
    monkeypatch.setattr(registry, "load", lambda n: launched.append(n) or load(n))
    generator = torch.Generator().manual_seed(stable_seed(name))
    # Odd sizes: Ld spans a partial second doc tile, d is not a power of two.
    Q, D, q_mask, d_mask, shape, ref = _case(variant, 3, 5, 7, 37, 48, generator)
    out = _run(variant, Q, D, q_mask, d_mask, shape)
    assert launched == [name], f"launched {launched}"
    assert_close_to_reference(out, ref, Q.dtype, interpreter=INTERPRETER, what=name)


TOPK_VARIANTS = [n for n in padded_variant_names(registry.names()) if n.startswith("topk_")]


@pytest.mark.parametrize("name", TOPK_VARIANTS)
def test_topk_variant_keeps_each_doc_block_s_best(monkeypatch, name):
    # The retrieval epilogue: each doc block's best per query (empty slots -inf with
    # negative ids), over 13 docs of 37 tokens in blocks of 4 (the last one of 1 doc),
    # against float64 scores.
    monkeypatch.setattr(heuristics, "TOPK_DOCS_PER_PROGRAM", (4, 4))
    variant = Variant.parse(name)
    generator = torch.Generator().manual_seed(stable_seed(name))
    Q, D, q_mask, d_mask, _, full = _case(variant, 3, 13, 7, 37, 48, generator)
    scores, ids = dispatch.topk_candidates(Q, D, q_mask, d_mask, variant.normalize, 3)
    k = scores.shape[-1]  # slots: 3 rounded up to a power of two
    assert (k, scores.shape[1]) == (4, 4) and ids.shape == scores.shape
    blocks = scores.shape[1]
    per_block = -(-13 // blocks)
    tolerance = 1e-5 if Q.dtype == torch.float32 else 1e-3
    for q in range(3):
        for b in range(blocks):
            docs = torch.arange(b * per_block, min(13, (b + 1) * per_block))
            want = torch.sort(full[q, docs].float(), descending=True).values[:k]
            kept = ids[q, b] >= 0
            got_ids = ids[q, b][kept].cpu()
            assert len(got_ids) == min(k, len(docs)), (q, b, ids[q, b])
            assert set(got_ids.tolist()) <= set(docs.tolist())
            got = torch.sort(scores[q, b][kept].cpu(), descending=True).values
            assert torch.allclose(got, want.cpu(), rtol=tolerance, atol=tolerance), (got, want)
            # each kept id's score is that doc's score
            assert torch.allclose(scores[q, b][kept].cpu(), full[q, got_ids].float().cpu(),
                                  rtol=tolerance, atol=tolerance)  # fmt: skip


@pytest.mark.parametrize("docs_per_program", [2, 8])
@pytest.mark.parametrize(
    "name", ["maxsim_dense_qdmask_bf16_triton_norm", "maxsim_dense_nomask_fp32_triton"]
)
def test_streamed_doc_blocks(monkeypatch, name, docs_per_program):
    # Dense inference streams blocks of docs per program: blocks of 2 and 8 over Nd = 7
    # docs (the last block runs past Nd), each two tiles long (Ld 37), 5 queries in groups.
    monkeypatch.setattr(heuristics, "stream_docs_per_program", lambda nd, groups: docs_per_program)
    monkeypatch.setattr(configs, "_call_configs", {})  # a cached config would skip the patch
    variant = Variant.parse(name)
    Q, D, q_mask, d_mask, shape, ref = _case(
        variant, 5, 7, 7, 37, 48, torch.Generator().manual_seed(5)
    )
    out = _run(variant, Q, D, q_mask, d_mask, shape)
    (config,) = configs._call_configs.values()
    assert config.docs_per_program == docs_per_program
    assert_close_to_reference(out, ref, Q.dtype, interpreter=INTERPRETER, what=name)


@pytest.mark.parametrize(
    "name", ["maxsim_dense_qdmask_bf16_triton_norm", "maxsim_dense_nomask_fp32_triton"]
)
def test_docs_loaded_once(monkeypatch, name):
    # The small-rerank loads (unpipelined, evict-first hint): 1 query, 7 docs of 37 tokens.
    monkeypatch.setattr(heuristics, "loads_docs_once", lambda config, nq, doc_bytes: True)
    monkeypatch.setattr(configs, "_call_configs", {})
    variant = Variant.parse(name)
    Q, D, q_mask, d_mask, shape, ref = _case(
        variant, 1, 7, 7, 37, 48, torch.Generator().manual_seed(4)
    )
    out = _run(variant, Q, D, q_mask, d_mask, shape)
    assert any(c.evict_docs for c in configs._call_configs.values())
    assert_close_to_reference(out, ref, Q.dtype, interpreter=INTERPRETER, what=name)


@pytest.mark.parametrize("peel", [False, True])
@pytest.mark.parametrize("docs_per_program", [2, 4])
@pytest.mark.parametrize(
    "name", ["maxsim_dense_qdmask_bf16_triton_norm", "maxsim_dense_nomask_fp32_triton"]
)
def test_nested_doc_blocks(monkeypatch, name, docs_per_program, peel):
    # Docs of several tiles walked a few per program, each with its own tile loop: Nd = 7
    # in blocks of 2 or 4 (the last block runs past Nd), Ld 77 (two 32-token tiles and
    # 13 tokens, peeled into a 16-token tile or scored in the loop). Doc 3 is fully masked
    # (scores 0) and doc 5 holds a NaN (scores NaN), so each doc's running max is fresh.
    monkeypatch.setattr(heuristics, "streamed_blocks", lambda config, nq, nd, ld: 1)
    monkeypatch.setattr(
        heuristics, "nested_docs_per_program", lambda config, nq, nd: docs_per_program
    )
    monkeypatch.setattr(heuristics, "peels_tail", lambda config, ld: peel)
    monkeypatch.setattr(configs, "_call_configs", {})  # a cached config would skip the patches
    variant = Variant.parse(name)
    Q, D, q_mask, d_mask, shape, _ = _case(
        variant, 5, 7, 7, 77, 48, torch.Generator().manual_seed(3)
    )
    D[5, 40, 7] = float("nan")
    if d_mask is not None:
        d_mask[3], d_mask[5, 40] = False, True
    ref = maxsim_reference(Q.double(), D.double(), q_mask, d_mask, normalize=variant.normalize)
    out = _run(variant, Q, D, q_mask, d_mask, shape)
    (config,) = configs._call_configs.values()
    assert (config.docs_per_program, config.peel_tail) == (docs_per_program, peel)
    assert out[:, 5].isnan().all() and ref[:, 5].isnan().all()
    finite = [0, 1, 2, 3, 4, 6]
    assert_close_to_reference(
        out[:, finite], ref[:, finite], Q.dtype, interpreter=INTERPRETER, what=name
    )


@pytest.mark.parametrize("peel", [False, True])
@pytest.mark.parametrize("splits", [1, 2, 3, 4])
@pytest.mark.parametrize(
    "name", ["maxsim_dense_qdmask_bf16_triton_norm", "maxsim_dense_nomask_fp32_triton"]
)
def test_split_long_docs(monkeypatch, name, splits, peel):
    # Few long docs split into token ranges whose row maxima the last range to finish
    # reduces: Ld 77 is three tiles, so 4 ranges leave one empty; doc 0 is fully masked
    # (scores 0) and one doc token is NaN (its doc scores NaN whichever range holds it).
    # With peel, whole tiles skip the length mask and the partial last tile is scored after
    # them (13 tokens past two 32-token tiles: in a 16-token tile). Twice: the arrival
    # counters are back at 0 after each call, so the second call scores the same.
    monkeypatch.setattr(heuristics, "doc_splits", lambda config, nq, nd, ld, wave: splits)
    monkeypatch.setattr(heuristics, "peels_tail", lambda config, ld: peel)
    monkeypatch.setattr(configs, "_call_configs", {})  # a cached config would skip the patches
    variant = Variant.parse(name)
    generator = torch.Generator().manual_seed(9)
    Q, D, q_mask, d_mask, shape, _ = _case(variant, 5, 3, 7, 77, 48, generator)
    D[2, 70, 5] = float("nan")
    if d_mask is not None:
        d_mask[0], d_mask[2, 70] = False, True
    ref = maxsim_reference(Q.double(), D.double(), q_mask, d_mask, normalize=variant.normalize)
    out = _run(variant, Q, D, q_mask, d_mask, shape)
    (config,) = configs._call_configs.values()
    assert (config.doc_splits, config.peel_tail) == (splits, peel)
    assert ref[:, 2].isnan().any() and torch.equal(out[:, 2].isnan().cpu(), ref[:, 2].isnan().cpu())
    assert_close_to_reference(out[:, :2], ref[:, :2], Q.dtype, interpreter=INTERPRETER, what=name)
    if splits > 1:
        assert not any(c.any() for c in workspace._counters.values()), "counters left set"
        again = _run(variant, Q, D, q_mask, d_mask, shape)
        assert torch.equal(again.isnan(), out.isnan())
        assert torch.equal(again.nan_to_num(), out.nan_to_num())


@pytest.mark.parametrize("ranges", [20, 70])
def test_split_long_docs_reduce_every_range(monkeypatch, ranges):
    # The last range to finish reads every range's row maxima, the last ones too: Ld
    # 32 * ranges - 10 in ranges of one 32-token tile, where the last few ranges hold the
    # max of some rows, and one token there wins clearly. 20 ranges are reduced in one
    # unrolled step; 70 in two steps of 64, the second past the last range.
    monkeypatch.setattr(heuristics, "doc_splits", lambda config, nq, nd, ld, wave: ranges)
    variant = Variant.parse("maxsim_dense_nomask_bf16_triton")
    generator = torch.Generator().manual_seed(11)
    ld = 32 * ranges - 10
    Q, D, q_mask, d_mask, shape, _ = _case(variant, 2, 3, 9, ld, 32, generator)
    D[:, ld - 10] = 4 * Q[1, 0]  # one clear winner in the last range
    ref = maxsim_reference(Q.double(), D.double())
    winners = torch.einsum("qsd,ntd->qnst", Q.double(), D.double()).argmax(-1)
    assert (winners >= 32 * (ranges - 4)).float().mean() > 0.1
    configs._call_configs.clear()
    out = _run(variant, Q, D, q_mask, d_mask, shape)
    (config,) = configs._call_configs.values()
    assert config.doc_splits == ranges and (config.block_l == 32 or not INTERPRETER)
    assert_close_to_reference(out, ref, Q.dtype, interpreter=INTERPRETER, what=f"{ranges} ranges")
    assert not any(c.any() for c in workspace._counters.values()), "counters left set"


EDGE_SHAPES = {
    "Lq=1": (2, 3, 1, 19, 48),
    "Ld=1": (2, 3, 5, 1, 48),
    "d=96": (2, 3, 9, 21, 96),
    "d=128 pretty": (2, 4, 16, 64, 128),
    "Nd=1": (2, 1, 6, 11, 48),
    "Nq=1": (1, 3, 6, 11, 32),
    "d=8": (2, 3, 4, 9, 8),
}
EDGE_VARIANTS = [
    "maxsim_dense_qdmask_bf16_triton_norm",
    "maxsim_kd_dmask_fp32_triton",
    "maxsim_pairs_qmask_fp16_triton_norm",
]


@pytest.mark.parametrize("name", EDGE_VARIANTS)
@pytest.mark.parametrize("shape", list(EDGE_SHAPES), ids=list(EDGE_SHAPES))
def test_edge_shapes(name, shape):
    variant = Variant.parse(name)
    generator = torch.Generator().manual_seed(7)
    Q, D, q_mask, d_mask, out_shape, ref = _case(variant, *EDGE_SHAPES[shape], generator)
    out = _run(variant, Q, D, q_mask, d_mask, out_shape)
    assert_close_to_reference(out, ref, Q.dtype, interpreter=INTERPRETER, what=f"{name} {shape}")


@pytest.mark.parametrize("name", EDGE_VARIANTS)
def test_fully_masked_docs_score_zero(name):
    variant = Variant.parse(name)
    generator = torch.Generator().manual_seed(3)
    Q, D, q_mask, d_mask, out_shape, _ = _case(variant, 3, 4, 5, 13, 32, generator)
    d_mask = torch.zeros(D.shape[:-1], dtype=torch.bool, device=DEVICE)
    d_mask.view(-1, D.shape[-2])[0] = True  # one doc keeps every token
    ref = (maxsim_pairs_reference if variant.layout.value == "pairs" else maxsim_reference)(
        Q.double(), D.double(), q_mask, d_mask, normalize=variant.normalize
    )
    out = _run(variant, Q, D, q_mask, d_mask, out_shape)
    has_valid_token = d_mask.any(-1).expand_as(out)  # dense broadcasts docs over queries
    assert torch.all(out[~has_valid_token] == 0), "fully masked docs must score exactly 0"
    assert torch.all(out[has_valid_token] != 0)
    assert_close_to_reference(out, ref, Q.dtype, interpreter=INTERPRETER, what=name)


def test_all_query_tokens_masked_scores_zero():
    Q = torch.randn(2, 5, 32, device=DEVICE)
    D = torch.randn(3, 9, 32, device=DEVICE)
    q_mask = torch.zeros(2, 5, dtype=torch.bool, device=DEVICE)
    assert torch.all(maxsim(Q, D, q_mask) == 0)


@pytest.mark.parametrize("empty", ["Nq=0", "Nd=0", "Lq=0", "Ld=0", "B=0"])
def test_empty_batches(empty):
    sizes = {"Nq": 2, "Nd": 3, "Lq": 4, "Ld": 5}
    if empty != "B=0":
        sizes[empty.split("=")[0]] = 0
    Q = torch.randn(sizes["Nq"], sizes["Lq"], 16, device=DEVICE)
    D = torch.randn(sizes["Nd"], sizes["Ld"], 16, device=DEVICE)
    if empty == "B=0":
        out = maxsim_pairs(Q[:0], D[:0])
        assert out.shape == (0,)
        return
    out = maxsim(Q, D)
    assert out.shape == (sizes["Nq"], sizes["Nd"])
    assert torch.all(out == 0)


def test_long_queries_are_chunked_exactly():
    """Lq > 512 splits into 512-token launches whose sums add up to the whole."""
    generator = torch.Generator().manual_seed(11)
    Q = torch.randn(2, 520, 16, generator=generator).to(DEVICE)
    D = torch.randn(2, 9, 16, generator=generator).to(DEVICE)
    q_mask = random_mask((2, 520), 0.8, DEVICE, generator=generator)
    ref = maxsim_reference(Q.double(), D.double(), q_mask)
    out = maxsim(Q, D, q_mask)
    assert_close_to_reference(out, ref, torch.float32, interpreter=INTERPRETER, what="Lq=520")


@pytest.mark.parametrize("backward", ["unified", "lowmem"])
def test_queries_past_the_shared_memory_chunk_are_scored_in_chunks(monkeypatch, backward):
    """Where a query tile would not fit shared memory (fp32 at head dim 256 takes 64 query
    tokens on an H100 or H200), long queries are scored and differentiated in shorter
    chunks that add up to the whole (the chunk forced to 16 here)."""
    monkeypatch.setattr(heuristics, "query_chunk", lambda module, Q: 16)
    generator = torch.Generator().manual_seed(12)
    Q = torch.randn(2, 40, 24, generator=generator).to(DEVICE)
    D = torch.randn(3, 11, 24, generator=generator).to(DEVICE)
    q_mask = random_mask((2, 40), 0.8, DEVICE, generator=generator)
    weights = torch.randn(2, 3, generator=generator).to(DEVICE)
    Qk, Dk = (t.clone().requires_grad_() for t in (Q, D))
    out = maxsim(Qk, Dk, q_mask, normalize=True, backward=backward)
    (out * weights).sum().backward()
    Qr, Dr = (t.double().requires_grad_() for t in (Q, D))
    ref = maxsim_reference(Qr, Dr, q_mask, normalize=True)
    (ref * weights.double()).sum().backward()
    assert_close_to_reference(out, ref, torch.float32, interpreter=INTERPRETER, what="chunked")
    for got, want in ((Qk.grad, Qr.grad), (Dk.grad, Dr.grad)):
        assert relative_error(got, want) < 1e-3


def test_docs_stored_token_major_reach_the_kernel_head_contiguous(monkeypatch):
    """A doc tile is read along the head dim: docs whose head dim is not their contiguous
    axis are copied first (uncoalesced loads otherwise, and an illegal address under
    Triton 3.6's nested-docs loop); views with a unit head stride are not."""
    launched = []
    real = dispatch.launch_keyed

    def recording(*args, **kwargs):
        launched.append(kwargs["D"].stride())
        return real(*args, **kwargs)

    monkeypatch.setattr(dispatch, "launch_keyed", recording)
    generator = torch.Generator().manual_seed(6)
    Q = torch.randn(3, 7, 20, generator=generator).to(DEVICE)
    D = torch.randn(5, 20, 9, generator=generator).to(DEVICE).transpose(1, 2)  # [5, 9, 20]
    ref = maxsim_reference(Q.double(), D.double())
    out = maxsim(Q, D)
    assert launched[-1][-1] == 1
    assert_close_to_reference(out, ref, torch.float32, interpreter=INTERPRETER, what="token-major")
    view = torch.randn(9, 5, 20, generator=generator).to(DEVICE).transpose(0, 1)
    maxsim(Q, view)
    assert launched[-1] == view.stride()  # no copy


def test_non_contiguous_inputs():
    """Strides are kernel arguments: slices and transposed views need no copy."""
    generator = torch.Generator().manual_seed(5)
    Q_big = torch.randn(4, 9, 64, generator=generator).to(DEVICE)
    D_big = torch.randn(21, 6, 64, generator=generator).to(DEVICE)
    Q = Q_big[::2, 1:8, :48]  # strided rows, offset tokens, narrower head
    D = D_big.transpose(0, 1)[:, :, :48]  # [6, 21, 48] with permuted strides
    d_mask = random_mask((21, 6), 0.6, DEVICE, generator=generator).t()
    assert not Q.is_contiguous() and not D.is_contiguous()
    ref = maxsim_reference(Q.double(), D.double(), None, d_mask)
    out = maxsim(Q, D, None, d_mask)
    assert_close_to_reference(out, ref, torch.float32, interpreter=INTERPRETER, what="strided")


def test_integer_masks_match_bool_masks():
    # Attention masks come as integers (nonzero = valid); on the reference path too:
    # tests/test_runtime.py.
    generator = torch.Generator().manual_seed(9)
    Q = torch.randn(2, 6, 32, generator=generator).to(DEVICE)
    D = torch.randn(3, 10, 32, generator=generator).to(DEVICE)
    q_mask = random_mask((2, 6), 0.6, DEVICE, generator=generator)
    d_mask = random_mask((3, 10), 0.6, DEVICE, generator=generator)
    as_bool = maxsim(Q, D, q_mask, d_mask)
    as_int = maxsim(Q, D, q_mask.int(), d_mask.long())
    assert torch.equal(as_bool, as_int)


def test_single_query_and_single_doc_squeeze():
    generator = torch.Generator().manual_seed(2)
    Q = torch.randn(6, 32, generator=generator).to(DEVICE)
    D = torch.randn(3, 10, 32, generator=generator).to(DEVICE)
    one_doc = D[1]
    assert maxsim(Q, D).shape == (3,)
    assert maxsim(Q[None], one_doc).shape == (1,)
    assert maxsim(Q, one_doc).shape == ()
    full = maxsim(Q[None], D)
    assert torch.allclose(maxsim(Q, one_doc), full[0, 1])


def test_forwards_are_bitwise_reproducible():
    generator = torch.Generator().manual_seed(4)
    Q = torch.randn(3, 7, 48, generator=generator).to(DEVICE, torch.bfloat16)
    D = torch.randn(5, 30, 48, generator=generator).to(DEVICE, torch.bfloat16)
    first = maxsim(Q, D, normalize=True)
    assert torch.equal(first, maxsim(Q, D, normalize=True))
