"""PLAID residual decompression (lik.runtime.plaid): the bit order, every generated residual
variant against the float64 reference, the public entries' edge cases and errors, grad_Q,
the approximate score, and an index built by fast-plaid itself.

Without a GPU the kernels run under the Triton interpreter (conftest sets it). The synthetic
indexes are packed here the way ColBERTv2 packs them (bucket bits least significant first
per dim, then numpy.packbits), independently of lik's reference and kernel decoders.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import TOLERANCE, poisoned, relative_error

from lik.runtime import backends, configs, plaid, registry
from lik.runtime.reference import (
    decompress_residual_reference,
    maxsim_residual_reference,
    maxsim_residual_varlen_reference,
    plaid_approx_score_reference,
    unpack_residual_buckets,
)
from lik_gen.ir import Variant

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETER = DEVICE == "cpu"
KERNELS = backends.device_backend(torch.device(DEVICE)) in backends.GENERATED_TRITON
needs_kernels = pytest.mark.skipif(not KERNELS, reason="no Triton path on this machine")
TORCH_DTYPE = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
FIXTURES = Path(__file__).parent / "fixtures" / "plaid"
RESIDUAL_VARIANTS = sorted(n for n in registry.names() if n.endswith(("_res2", "_res4", "_res8")))


def pack_residuals(buckets: torch.Tensor, nbits: int) -> torch.Tensor:
    """ColBERTv2's packing: bucket bits least significant first per dim, the token's bit
    stream through numpy.packbits (first bit -> most significant bit of byte 0)."""
    *lead, dim = buckets.shape
    bits = (buckets.long().unsqueeze(-1) >> torch.arange(nbits)) & 1
    stream = bits.reshape(-1, dim * nbits).numpy().astype(np.uint8)
    width = -(-dim * nbits // 8)
    return torch.from_numpy(np.packbits(stream, axis=-1)).reshape(*lead, width)


def synthetic_index(generator, B, Ld, dim, nbits, n_centroids=11, dtype=torch.float16):
    """Codes [B, Ld] int64, packed residuals, centroids [n_c, dim], bucket_weights."""
    codes = torch.randint(0, n_centroids, (B, Ld), generator=generator)
    buckets = torch.randint(0, 2**nbits, (B, Ld, dim), generator=generator)
    centroids = torch.randn(n_centroids, dim, generator=generator)
    centroids = torch.nn.functional.normalize(centroids, dim=-1)
    # Sorted weights around 0, as PLAID's quantile buckets are; large enough that a wrong
    # bucket moves scores.
    weights = torch.sort(torch.randn(2**nbits, generator=generator) * 0.2).values
    return codes, pack_residuals(buckets, nbits), centroids.to(dtype), weights.to(dtype)


def _to(device, *tensors):
    return [t.to(device) for t in tensors]


def _flatten(codes, residuals, lengths):
    """The varlen layout of a padded batch: valid tokens packed, int32 offsets."""
    keep = torch.arange(codes.shape[1]) < lengths[:, None]
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = lengths.cumsum(0)
    return codes[keep], residuals[keep], cu


def _bound(dtype: torch.dtype) -> float:
    return 1e-5 if INTERPRETER and dtype == torch.float32 else TOLERANCE[dtype]


# ---------------------------------------------------------------------------------------
# Bit order


@pytest.mark.parametrize(
    "nbits, buckets, packed",
    [
        # dims 0..3 = 1, 2, 3, 0: bits (1,0) (0,1) (1,1) (0,0) -> 0b10011100
        (2, [1, 2, 3, 0], [0x9C]),
        (2, [3, 0, 0, 0, 0, 0, 0, 1], [0xC0, 0x02]),
        # dims 0, 1 = 1, 8: bits (1,0,0,0) (0,0,0,1) -> 0b10000001
        (4, [1, 8], [0x81]),
        (4, [6, 3], [0x6C]),
        # one dim per byte, bits reversed
        (8, [1, 0x0F, 0xC8], [0x80, 0xF0, 0x13]),
    ],
)
def test_documented_bit_order(nbits, buckets, packed):
    buckets, packed = torch.tensor(buckets), torch.tensor(packed, dtype=torch.uint8)
    assert pack_residuals(buckets, nbits).tolist() == packed.tolist()
    assert unpack_residual_buckets(packed, nbits, len(buckets)).tolist() == buckets.tolist()


@pytest.mark.parametrize("nbits", [2, 4, 8])
@pytest.mark.parametrize("dim", [13, 20, 128])
def test_unpack_inverts_packbits(nbits, dim):
    buckets = torch.randint(0, 2**nbits, (4, 5, dim), generator=torch.Generator().manual_seed(dim))
    packed = pack_residuals(buckets, nbits)
    assert packed.shape == (4, 5, plaid.packed_bytes(dim, nbits))
    assert torch.equal(unpack_residual_buckets(packed, nbits, dim), buckets)


# ---------------------------------------------------------------------------------------
# Every generated residual variant


def _config(name, Q):
    """The generated module and the launch config the runtime would pick for Q."""
    module = registry.load(name)
    return module, configs.call_config(name, module, Q, Q.shape[1], Q.shape[0])


def test_every_residual_variant_is_declared():
    expected = {
        f"maxsim_{layout}_nomask_{dtype}_triton_norm_res{nbits}"
        for layout in ("dense", "varlen")
        for dtype in ("fp32", "fp16", "bf16")
        for nbits in (2, 4, 8)
    }
    assert set(RESIDUAL_VARIANTS) == expected


# Head dims per storage of the packed residuals: as bytes, 20 is not a power of two (and
# 5 or 10 bytes per token at nbits 2 or 4); as int32 words (RESIDUAL_WORDS) a token needs a
# whole number of words, and d 63 at nbits 2 or 4 leaves the last word partly unused.
# "words, d = BLOCK_K": no dim past d (EVEN_K), where the kernel leaves the tokens past a
# doc's length unmasked in the tile and relies on the forward's similarity mask.
RESIDUAL_DIMS = {
    "bytes": {2: 20, 4: 20, 8: 20},
    "words": {2: 63, 4: 63, 8: 20},
    "words, d = BLOCK_K": {2: 64, 4: 32, 8: 32},
}


@needs_kernels
@pytest.mark.parametrize("storage", list(RESIDUAL_DIMS))
@pytest.mark.parametrize("name", RESIDUAL_VARIANTS)
def test_variant_matches_reference(name, storage):
    variant = Variant.parse(name)
    nbits = int(name[-1])
    dtype = TORCH_DTYPE[variant.dtype.value]
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    # Odd sizes: 3 queries (a partial query group), Ld 37 (a partial second doc tile),
    # lengths Ld, 0 and 1 among the docs.
    B, Ld, dim, Nq, Lq = 3, 37, RESIDUAL_DIMS[storage][nbits], 3, 5
    codes, residuals, centroids, weights = synthetic_index(g, B, Ld, dim, nbits, dtype=dtype)
    stored = residuals.view(torch.int32) if storage.startswith("words") else residuals
    lengths = torch.tensor([Ld, 0, 1])
    Q = torch.randn(Nq, Lq, dim, generator=g)
    ref = maxsim_residual_reference(Q.double(), codes, residuals, lengths, centroids.double(),
                                    weights.double(), nbits)  # fmt: skip
    out = poisoned((Nq, B), DEVICE)
    Qd, c, w = _to(DEVICE, Q, centroids, weights)
    module, config = _config(name, Qd)
    if variant.layout.value == "dense":
        module.launch(out, Qd, *_to(DEVICE, codes, stored), c, w, lengths.to(DEVICE),
                      config=config)  # fmt: skip
    else:
        flat_codes, flat_residuals, cu = _to(DEVICE, *_flatten(codes, stored, lengths))
        packed = Qd.reshape(Nq * Lq, dim)
        cu_q = torch.arange(Nq + 1, dtype=torch.int32, device=DEVICE) * Lq
        module.launch(out, packed, flat_codes, flat_residuals, c, w, cu_q, cu,
                      max_seqlen_q=Lq, config=config)  # fmt: skip
    assert not torch.isnan(out).any(), f"{name}: unwritten (poisoned) scores"
    assert out[:, 1].eq(0).all(), "an empty doc scores exactly 0"
    assert relative_error(out, ref) < _bound(dtype), name


# Every loop shape of the streaming dense forward, each with its own way of walking a doc's
# tiles (and, for nbits 2, of carrying the next tile's centroid ids): one loop per doc,
# docs in a row, whole tiles then a BLOCK_L tail or TAIL_L tails, token ranges with their
# reduce, and the flat (doc, tile) loop. Ld 37 in 16- or 32-token tiles.
DENSE_LOOPS = {
    "per doc": dict(block_l=16),
    "2 docs per program": dict(block_l=16, docs_per_program=2),
    "peeled, BLOCK_L tail": dict(block_l=16, peel_tail=True),
    "peeled, TAIL_L tails": dict(block_l=32, peel_tail=True),
    "2 ranges": dict(block_l=16, doc_splits=2),
    "2 ranges, peeled": dict(block_l=16, doc_splits=2, peel_tail=True),
    "flat": dict(block_l=32, flat_docs=True, docs_per_program=2),
}


@needs_kernels
@pytest.mark.parametrize("loop", list(DENSE_LOOPS))
@pytest.mark.parametrize("nbits", [2, 4])
def test_dense_residual_loop_shapes(nbits, loop):
    import dataclasses

    name = f"maxsim_dense_nomask_fp16_triton_norm_res{nbits}"
    g = torch.Generator().manual_seed(nbits)
    B, Ld, dim, Nq, Lq = 5, 37, 32, 2, 5
    codes, residuals, centroids, weights = synthetic_index(g, B, Ld, dim, nbits,
                                                           dtype=torch.float16)  # fmt: skip
    lengths = torch.tensor([Ld, 0, 1, 33, 16])  # whole tiles only, tails of 1-5 tokens
    Q = torch.randn(Nq, Lq, dim, generator=g)
    ref = maxsim_residual_reference(Q.double(), codes, residuals, lengths, centroids.double(),
                                    weights.double(), nbits)  # fmt: skip
    Qd, c, w = _to(DEVICE, Q, centroids, weights)
    module, config = _config(name, Qd)
    config = dataclasses.replace(config, **DENSE_LOOPS[loop])
    out = poisoned((Nq, B), DEVICE)
    module.launch(out, Qd, *_to(DEVICE, codes, residuals.view(torch.int32)), c, w,
                  lengths.to(DEVICE), config=config)  # fmt: skip
    assert not torch.isnan(out).any(), f"{loop}: unwritten (poisoned) scores"
    assert relative_error(out, ref) < _bound(torch.float16), loop


# ---------------------------------------------------------------------------------------
# Public entries


def _index(nbits=4, B=4, Ld=9, dim=24, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    codes, residuals, centroids, weights = synthetic_index(g, B, Ld, dim, nbits, dtype=dtype)
    lengths = torch.randint(1, Ld + 1, (B,), generator=g)
    return codes, residuals, lengths, centroids, weights, g


def _both(Q, codes, residuals, lengths, centroids, weights, nbits, **kwargs):
    """maxsim_residual and maxsim_residual_varlen on one batch, and the float64 reference."""
    dense = plaid.maxsim_residual(*_to(DEVICE, Q, codes, residuals, lengths, centroids, weights),
                                  nbits, **kwargs)  # fmt: skip
    flat = _to(DEVICE, *_flatten(codes, residuals, lengths))
    varlen = plaid.maxsim_residual_varlen(Q.to(DEVICE), *flat, *_to(DEVICE, centroids, weights),
                                          nbits, **kwargs)  # fmt: skip
    ref = maxsim_residual_reference(Q.double(), codes, residuals, lengths, centroids.double(),
                                    weights.double(), nbits)  # fmt: skip
    return dense, varlen, ref


EDGE = {  # name: (Nq or None for a [Lq, d] query, Lq, B, Ld, dim, nbits)
    "single query [Lq, d]": (None, 5, 3, 6, 16, 4),
    "Lq=1": (2, 1, 3, 6, 16, 2),
    "Ld=1": (2, 4, 3, 1, 16, 8),
    "d=13 (partial byte)": (2, 4, 3, 6, 13, 2),
    "B=0": (2, 4, 0, 6, 16, 4),
    "Nq=0": (0, 4, 3, 6, 16, 4),
    "Lq=0": (2, 0, 3, 6, 16, 4),
}


@needs_kernels
@pytest.mark.parametrize("case", list(EDGE), ids=list(EDGE))
def test_edge_shapes(case):
    Nq, Lq, B, Ld, dim, nbits = EDGE[case]
    codes, residuals, lengths, centroids, weights, g = _index(nbits, B, Ld, dim)
    Q = torch.randn(*(() if Nq is None else (Nq,)), Lq, dim, generator=g)
    dense, varlen, ref = _both(Q, codes, residuals, lengths, centroids, weights, nbits)
    expected_shape = ((B,) if Nq is None else (Nq, B))
    for out in (dense, varlen):
        assert out.shape == expected_shape and out.dtype == torch.float32
        assert not torch.isnan(out).any()
        assert relative_error(out, ref) < _bound(torch.float16), case


def test_residuals_reach_the_kernel_as_words_when_torch_can_view_them():
    aligned = torch.zeros(5, 7, 32, dtype=torch.uint8)
    assert plaid._residual_words(aligned).dtype == torch.int32
    assert plaid._residual_words(aligned).shape == (5, 7, 8)
    assert plaid._residual_words(aligned[:, 2:]).dtype == torch.int32  # whole rows off
    for bytes_only in (
        torch.zeros(5, 7, 6, dtype=torch.uint8),  # 6 bytes per token
        torch.zeros(5 * 7 * 32 + 1, dtype=torch.uint8)[1:].view(5, 7, 32),  # odd address
        torch.zeros(5, 7, 33, dtype=torch.uint8)[:, :, :32],  # 33-byte rows
    ):
        assert plaid._residual_words(bytes_only) is bytes_only


@needs_kernels
@pytest.mark.parametrize("nbits", [2, 4, 8])
def test_misaligned_residuals_score_like_aligned_ones(nbits):
    """The public entries read residuals at any address: an index sliced at an odd byte
    offset takes the byte path and scores like an aligned copy (the word path)."""
    codes, residuals, lengths, centroids, weights, g = _index(nbits, B=5, Ld=11, dim=64)
    Q = torch.randn(3, 6, 64, generator=g)
    aligned = residuals.to(DEVICE)
    shifted = torch.empty(residuals.numel() + 1, dtype=torch.uint8, device=DEVICE)[1:]
    shifted = shifted.view(residuals.shape).copy_(aligned)
    ref = maxsim_residual_reference(Q.double(), codes, residuals, lengths, centroids.double(),
                                    weights.double(), nbits)  # fmt: skip
    Qd, c, lens, cent, w = _to(DEVICE, Q, codes, lengths, centroids, weights)
    for stored in (aligned, shifted):
        assert (plaid._residual_words(stored) is stored) == (stored is shifted)
        out = plaid.maxsim_residual(Qd, c, stored, lens, cent, w, nbits)
        assert relative_error(out, ref) < _bound(torch.float16)


@needs_kernels
def test_scores_follow_weights_written_in_place():
    codes, residuals, lengths, centroids, weights, g = _index(nbits=8, B=3, Ld=5, dim=16)
    Q = torch.randn(2, 4, 16, generator=g)
    Qd, c, r, lens, cent, w = _to(DEVICE, Q, codes, residuals, lengths, centroids, weights)
    for step in range(2):
        if step:
            w.mul_(-3)
        ref = maxsim_residual_reference(Q.double(), codes, residuals, lengths,
                                        centroids.double(), w.cpu().double(), 8)  # fmt: skip
        out = plaid.maxsim_residual(Qd, c, r, lens, cent, w, 8)
        assert relative_error(out, ref) < _bound(torch.float16), step


@needs_kernels
def test_query_dtypes_and_int32_codes():
    codes, residuals, lengths, centroids, weights, g = _index(nbits=2, dtype=torch.float32)
    for q_dtype in (torch.float32, torch.float16, torch.bfloat16):
        Q = torch.randn(2, 6, 24, generator=g).to(q_dtype)
        dense, varlen, ref = _both(Q, codes.int(), residuals, lengths.int(), centroids, weights, 2)
        bound = _bound(torch.float32) if q_dtype == torch.float32 else TOLERANCE[q_dtype]
        for out in (dense, varlen):
            assert relative_error(out, ref) < bound, q_dtype


@needs_kernels
@pytest.mark.parametrize("nbits, dim", [(4, 24), (2, 32), (4, 32)])  # d 32: EVEN_K
def test_bad_lengths_and_codes_poison_only_their_doc(nbits, dim):
    codes, residuals, lengths, centroids, weights, g = _index(nbits=nbits, B=6, Ld=9, dim=dim)
    lengths = torch.tensor([9, -1, 10, 4, 4, 0])
    codes[3, 2] = 11  # == n_centroids, on a valid token
    codes[4, 6] = -5  # past doc 4's length: never read as a token
    Q = torch.randn(2, 5, dim, generator=g)
    out = plaid.maxsim_residual(*_to(DEVICE, Q, codes, residuals, lengths, centroids, weights),
                                nbits)  # fmt: skip
    nan = torch.isnan(out).all(0).cpu()
    assert nan.tolist() == [False, True, True, True, False, False]
    ref = maxsim_residual_reference(Q.double(), codes, residuals, lengths, centroids.double(),
                                    weights.double(), nbits)  # fmt: skip
    assert torch.equal(torch.isnan(ref), torch.isnan(out.cpu()))
    keep = ~nan
    assert relative_error(out[:, keep], ref[:, keep]) < _bound(torch.float16)
    assert out[:, 5].eq(0).all()


@needs_kernels
def test_varlen_offsets_checked_on_device_or_host():
    codes, residuals, lengths, centroids, weights, g = _index(nbits=2, B=3, Ld=5)
    flat_codes, flat_residuals, cu = _flatten(codes, residuals, lengths)
    total = int(cu[-1])
    Q = torch.randn(1, 4, 24, generator=g)
    # Doc 1 runs backwards, doc 2 past the packed tokens (doc 3 ends at them): only those
    # two score NaN. Offsets ending short or past the tokens, or not starting at 0, would
    # leave tokens out: every score is NaN.
    cases = {(0, 2, 1, total + 3, total): [False, True, True, True],
             (0, 2, total + 3): [True, True], (0, 2, total - 1): [True, True],
             (1, 2, total): [True, True]}  # fmt: skip
    for offsets, nan in cases.items():
        bad_cu = torch.tensor(offsets, dtype=torch.int32)
        args = _to(DEVICE, Q, flat_codes, flat_residuals, bad_cu, centroids, weights)
        with pytest.raises(ValueError, match="cu_seqlens_d"):
            plaid.maxsim_residual_varlen(*args, 2)
        entry = plaid.maxsim_residual_varlen(*args, 2, max_seqlen_d=8)
        reference = maxsim_residual_varlen_reference(*args, 2)
        for out in (entry, reference):
            assert out[0].isnan().tolist() == nan, offsets


@needs_kernels
def test_long_query_is_chunked_exactly():
    codes, residuals, lengths, centroids, weights, g = _index(nbits=4, B=2, Ld=4, dim=16)
    Q = torch.randn(1, 514, 16, generator=g)  # two launches: 512 + 2 query tokens
    dense, varlen, ref = _both(Q, codes, residuals, lengths, centroids, weights, 4)
    assert relative_error(dense, ref) < _bound(torch.float16)
    assert relative_error(varlen, ref) < _bound(torch.float16)


def test_grad_q_matches_reference():
    codes, residuals, lengths, centroids, weights, g = _index(nbits=4, B=3, Ld=6, dim=16)
    Q = torch.randn(2, 5, 16, generator=g)
    grad = torch.randn(2, 3, generator=g)
    Qk = Q.clone().to(DEVICE).requires_grad_()
    out = plaid.maxsim_residual(Qk, *_to(DEVICE, codes, residuals, lengths, centroids, weights), 4)
    (out * grad.to(DEVICE)).sum().backward()
    Qr = Q.double().requires_grad_()
    ref = maxsim_residual_reference(Qr, codes, residuals, lengths, centroids.double(),
                                    weights.double(), 4)  # fmt: skip
    (ref * grad.double()).sum().backward()
    assert relative_error(Qk.grad, Qr.grad) < 1e-3
    assert Qk.grad.dtype == Q.dtype


def test_zero_length_doc_with_grad_raises():
    codes, residuals, lengths, centroids, weights, g = _index(nbits=2, B=3, Ld=4, dim=16)
    lengths[1] = 0
    Q = torch.randn(1, 3, 16, generator=g, requires_grad=True)
    with pytest.raises(ValueError, match=r"doc_lengths\[1\] is 0"):
        plaid.maxsim_residual(Q, codes, residuals, lengths, centroids, weights, 2)
    with torch.no_grad():  # without grad an empty doc simply scores 0
        out = plaid.maxsim_residual(Q, codes, residuals, lengths, centroids, weights, 2)
    assert out[0, 1] == 0


def _good():
    codes, residuals, lengths, centroids, weights, g = _index(nbits=4, B=2, Ld=3, dim=16)
    return dict(Q=torch.randn(2, 3, 16), codes=codes, residuals=residuals, doc_lengths=lengths,
                centroids=centroids, bucket_weights=weights, nbits=4)  # fmt: skip


BAD_CALLS = {
    "Q rank": ("Q", lambda a: a["Q"][0, 0], ValueError, "Q must be"),
    "Q dtype": ("Q", lambda a: a["Q"].double(), TypeError, "Q must be"),
    "codes dtype": ("codes", lambda a: a["codes"].float(), TypeError, "codes must be int32"),
    "codes rank": ("codes", lambda a: a["codes"][0], ValueError, "codes must be"),
    "residuals dtype": ("residuals", lambda a: a["residuals"].int(), TypeError, "residuals"),
    "residuals width": ("residuals", lambda a: a["residuals"][..., :-1], ValueError,
                        r"residuals must be .*8\] uint8"),
    "residuals tokens": ("residuals", lambda a: a["residuals"][:, :2], ValueError, "residuals"),
    "lengths shape": ("doc_lengths", lambda a: a["doc_lengths"][:1], ValueError, "doc_lengths"),
    "lengths dtype": ("doc_lengths", lambda a: a["doc_lengths"].float(), TypeError,
                      "doc_lengths must be int32"),
    "centroids dim": ("centroids", lambda a: a["centroids"][:, :8], ValueError, "centroids"),
    "centroids empty": ("centroids", lambda a: a["centroids"][:0], ValueError, "centroids"),
    "weights count": ("bucket_weights", lambda a: a["bucket_weights"][:4], ValueError,
                      r"bucket_weights must be \[16\]"),
    "nbits": ("nbits", lambda a: 3, ValueError, "nbits must be one of"),
    "nbits bool": ("nbits", lambda a: True, ValueError, "nbits must be one of"),
    "not a tensor": ("codes", lambda a: [[1]], TypeError, "codes must be a torch.Tensor"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_CALLS), ids=list(BAD_CALLS))
def test_bad_inputs_raise_naming_the_argument(case):
    key, bad, error, message = BAD_CALLS[case]
    args = _good()
    args[key] = bad(args)
    nbits = args.pop("nbits")
    with pytest.raises(error, match=message):
        plaid.maxsim_residual(*args.values(), nbits)


def test_normalize_false_and_device_mismatch_raise():
    args = _good()
    nbits = args.pop("nbits")
    with pytest.raises(ValueError, match="normalize must be True"):
        plaid.maxsim_residual(*args.values(), nbits, normalize=False)
    if torch.cuda.is_available():
        args["centroids"] = args["centroids"].cuda()
        with pytest.raises(ValueError, match="centroids must be on"):
            plaid.maxsim_residual(*args.values(), nbits)


def test_varlen_bad_inputs():
    codes, residuals, lengths, centroids, weights, g = _index(nbits=4, B=2, Ld=3, dim=16)
    flat_codes, flat_residuals, cu = _flatten(codes, residuals, lengths)
    Q = torch.randn(2, 3, 16)
    book = (centroids, weights, 4)
    with pytest.raises(ValueError, match="residuals_flat"):
        plaid.maxsim_residual_varlen(Q, flat_codes, flat_residuals[:-1], cu, *book)
    with pytest.raises(TypeError, match="cu_seqlens_d must be int32"):
        plaid.maxsim_residual_varlen(Q, flat_codes, flat_residuals, cu.long(), *book)
    with pytest.raises(ValueError, match="max_seqlen_d"):
        plaid.maxsim_residual_varlen(Q, flat_codes, flat_residuals, cu, *book, max_seqlen_d=-1)


# ---------------------------------------------------------------------------------------
# Approximate (centroid-only) score


def test_approx_score_matches_a_loop():
    g = torch.Generator().manual_seed(5)
    n_c, Lq, B, Ld = 17, 6, 5, 8
    scores = torch.randn(n_c, Lq, generator=g)
    codes = torch.randint(0, n_c, (B, Ld), generator=g)
    lengths = torch.tensor([8, 0, 3, 1, 7])
    out = plaid.plaid_approx_score(*_to(DEVICE, scores, codes, lengths)).cpu()
    expected = torch.zeros(B)
    for b in range(B):
        for s in range(Lq):
            if lengths[b] > 0:
                expected[b] += max(scores[codes[b, t], s] for t in range(lengths[b]))
    assert out.dtype == torch.float32 and out.shape == (B,)
    assert torch.allclose(out, expected, atol=1e-5)
    assert out[1] == 0


def test_approx_score_poisons_bad_codes_and_lengths():
    scores = torch.randn(4, 3)
    codes = torch.tensor([[0, 1, 9], [0, 4, 1], [2, 2, 2], [1, 1, 1]])
    lengths = torch.tensor([2, 3, 4, -1])  # doc 0's bad code is padding
    out = plaid.plaid_approx_score(scores, codes, lengths)
    assert torch.isfinite(out[0]) and torch.isnan(out[1:]).all()
    ref = plaid_approx_score_reference(scores, codes, lengths)
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    with pytest.raises(ValueError, match="query_centroid_scores"):
        plaid.plaid_approx_score(scores[0], codes, lengths)
    with pytest.raises(TypeError, match="codes must be int32"):
        plaid.plaid_approx_score(scores, codes.float(), lengths)


def test_approx_score_with_no_centroids():
    # Every code is out of range: an empty doc scores 0, any other NaN (it raised
    # IndexError gathering from the empty table).
    codes, lengths = torch.zeros(3, 4, dtype=torch.int64), torch.tensor([0, 2, 4])
    out = plaid.plaid_approx_score(*_to(DEVICE, torch.randn(0, 5), codes, lengths)).cpu()
    assert out[0] == 0 and torch.isnan(out[1:]).all()


# ---------------------------------------------------------------------------------------
# An index built by fast-plaid (tests/fixtures/plaid/make_fixture.py)

FIXTURE_NBITS = (2, 4, 8)


def _fixture(nbits: int) -> dict:
    path = FIXTURES / f"fast_plaid_nbits{nbits}.pt"
    if not path.exists():
        pytest.skip(f"{path.name} not generated yet (tests/fixtures/plaid/make_fixture.py)")
    data = torch.load(path, weights_only=True)
    # The stored centroid rows back in place: codes keep the index's own centroid ids.
    centroids = torch.zeros(int(data["n_centroids"]), data["centroid_values"].shape[1],
                            dtype=data["centroid_values"].dtype)  # fmt: skip
    centroids[data["centroid_rows"]] = data["centroid_values"]
    data["centroids"] = centroids
    return data


def _padded(data):
    cu, lengths = data["cu_seqlens"].long(), data["doc_lengths"]
    index = (cu[:-1, None] + torch.arange(int(lengths.max()))).clamp(max=cu[-1] - 1)
    return data["codes"][index], data["residuals"][index]


@pytest.mark.parametrize("nbits", FIXTURE_NBITS)
def test_fast_plaid_decoding(nbits):
    """lik's decoder against fast-plaid's own reconstruction of the same stored tokens."""
    data = _fixture(nbits)
    count = int(data["cu_seqlens"][int(data["reconstructed_docs"])])
    args = (data["codes"][:count], data["residuals"][:count], data["centroids"].double())
    decoded = decompress_residual_reference(*args, data["bucket_weights"].double(), nbits)
    decoded = torch.nn.functional.normalize(decoded, dim=-1)
    # fast-plaid's reconstructions are normalized; normalizing again only drops fp16 noise.
    target = torch.nn.functional.normalize(data["reconstructed"].double(), dim=-1)
    err = relative_error(decoded, target)
    assert err < 3e-3, f"decoded tokens differ from fast-plaid's by {err:.3g}"
    # The fixture can tell bit orders apart: reading each byte LSB first instead is far off.
    swapped = data["residuals"][:count].clone()
    for bit in range(4):
        low, high = (swapped >> bit) & 1, (swapped >> (7 - bit)) & 1
        swapped = swapped ^ ((low ^ high) << bit) ^ ((low ^ high) << (7 - bit))
    wrong = decompress_residual_reference(data["codes"][:count], swapped, *args[2:],
                                          data["bucket_weights"].double(), nbits)  # fmt: skip
    wrong = torch.nn.functional.normalize(wrong, dim=-1)
    assert relative_error(wrong, target) > 10 * 3e-3


@pytest.mark.parametrize("nbits", FIXTURE_NBITS)
def test_fast_plaid_scores(nbits):
    """lik's scores from fast-plaid's stored codes, residuals, centroids and bucket weights
    against fast-plaid's exact (full decompression) scores of the same candidates."""
    data = _fixture(nbits)
    expected = data["scores"]
    assert torch.isfinite(expected).all(), "fast-plaid left candidates unscored"
    Q, centroids, weights = data["queries"], data["centroids"], data["bucket_weights"]
    codes, residuals = _padded(data)
    lengths = data["doc_lengths"]
    ref = maxsim_residual_reference(Q.double(), codes, residuals, lengths, centroids.double(),
                                    weights.double(), nbits)  # fmt: skip
    # fast-plaid decodes and scores in fp16: hold it to the fp16 tolerance.
    assert relative_error(ref, expected) < TOLERANCE[torch.float16]
    if not KERNELS:
        return
    if INTERPRETER:  # the interpreter is slow: one query against the first 10 candidates
        Q, expected, docs = Q[:1], expected[:1, :10], 10
        codes, residuals, lengths = codes[:docs], residuals[:docs], lengths[:docs]
    else:
        docs = len(lengths)
    cu = data["cu_seqlens"][: docs + 1]
    flat = data["codes"][: cu[-1]], data["residuals"][: cu[-1]], cu
    dense = plaid.maxsim_residual(*_to(DEVICE, Q, codes, residuals, lengths, centroids, weights),
                                  nbits)  # fmt: skip
    varlen = plaid.maxsim_residual_varlen(*_to(DEVICE, Q, *flat, centroids, weights), nbits)
    for out in (dense, varlen):
        assert relative_error(out, expected) < TOLERANCE[torch.float16]
        assert relative_error(out, ref[: len(Q), :docs]) < TOLERANCE[torch.float16]
    # Same ranking of the candidates as fast-plaid, up to near-ties.
    top = expected.argmax(dim=1)
    picked = dense.cpu().gather(1, top[:, None])[:, 0]
    assert torch.all(picked >= dense.cpu().max(dim=1).values - 1e-2)


# ---------------------------------------------------------------------------------------
# GPU: realistic sizes, compiled kernels, no host sync




@pytest.mark.parametrize("name", RESIDUAL_VARIANTS)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_colbert_rerank_parity(name):
    variant = Variant.parse(name)
    nbits, dtype = int(name[-1]), TORCH_DTYPE[variant.dtype.value]
    g = torch.Generator().manual_seed(11)
    B, Ld, dim, Nq, Lq = 96, 300, 128, 2, 32
    codes, residuals, centroids, weights = synthetic_index(g, B, Ld, dim, nbits, 512, dtype)
    lengths = torch.randint(1, Ld + 1, (B,), generator=g)
    lengths[0] = Ld
    Q = torch.randn(Nq, Lq, dim, generator=g)
    ref = maxsim_residual_reference(Q.double(), codes, residuals, lengths, centroids.double(),
                                    weights.double(), nbits)  # fmt: skip
    if variant.layout.value == "dense":
        out = plaid.maxsim_residual(*_to("cuda", Q, codes, residuals, lengths, centroids, weights),
                                    nbits)  # fmt: skip
    else:
        flat = _to("cuda", *_flatten(codes, residuals, lengths))
        out = plaid.maxsim_residual_varlen(Q.cuda(), *flat, *_to("cuda", centroids, weights), nbits,
                                           max_seqlen_d=Ld)  # fmt: skip
    bound = 1e-3 if dtype == torch.float32 else TOLERANCE[dtype]
    assert relative_error(out, ref) < bound, name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_no_host_sync():
    codes, residuals, lengths, centroids, weights, g = _index(nbits=2, B=8, Ld=40, dim=128)
    Q = torch.randn(1, 32, 128, generator=g)
    tensors = _to("cuda", Q, codes, residuals, lengths, centroids, weights)
    flat = _to("cuda", *_flatten(codes, residuals, lengths))
    plaid.maxsim_residual(*tensors, 2)  # compile outside the check
    plaid.maxsim_residual_varlen(tensors[0], *flat, *tensors[4:], 2, max_seqlen_d=40)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        plaid.maxsim_residual(*tensors, 2)
        plaid.maxsim_residual_varlen(tensors[0], *flat, *tensors[4:], 2, max_seqlen_d=40)
        plaid.plaid_approx_score(torch.randn(11, 32, device="cuda"), tensors[1], tensors[3])
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_varlen_rerank_replays_in_a_cuda_graph_and_runs_on_any_stream():
    # The varlen entry's query offsets are cached per stream, and built afresh inside a
    # capture (a tensor made there holds its values only on replay): replays with new
    # queries, eager calls after the capture and calls on a side stream all score right.
    codes, residuals, lengths, centroids, weights, g = _index(nbits=4, B=16, Ld=70, dim=128)
    flat = _to("cuda", *_flatten(codes, residuals, lengths))
    tables = _to("cuda", centroids, weights)
    queries = [torch.randn(3, 40, 128, generator=g).cuda() for _ in range(3)]

    def rerank(Q):
        return plaid.maxsim_residual_varlen(Q, *flat, *tables, 4, max_seqlen_d=70)

    static_q = queries[0].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up off the capture stream
        expected = [rerank(Q) for Q in queries]
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = rerank(static_q)
    for Q, want in zip(queries, expected, strict=True):
        static_q.copy_(Q)
        graph.replay()
        assert torch.equal(static_out, want)
        assert torch.equal(rerank(Q), want)  # eager, on the default stream, after the capture
    with torch.cuda.stream(side):
        again = rerank(queries[2])
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(again, expected[2])
    # Eager repeats replayed the call's launch (dispatch.replayed_call).
    from lik.runtime import launch_plan

    assert any(key[0] == "residual_varlen" and entry for key, entry in launch_plan._calls.items())
    ref = maxsim_residual_reference(queries[1].cpu().double(), codes, residuals, lengths,
                                    centroids.double(), weights.double(), 4)  # fmt: skip
    assert relative_error(expected[1], ref) < _bound(torch.float16)


def test_varlen_reference_matches_padded():
    codes, residuals, lengths, centroids, weights, g = _index(nbits=8, B=4, Ld=7, dim=16)
    lengths[2] = 0
    Q = torch.randn(2, 3, 16, generator=g)
    flat = _flatten(codes, residuals, lengths)
    a = maxsim_residual_varlen_reference(Q.double(), *flat, centroids.double(), weights.double(), 8)
    b = maxsim_residual_reference(Q.double(), codes, residuals, lengths, centroids.double(),
                                  weights.double(), 8)  # fmt: skip
    assert torch.allclose(a, b)


def test_residual_plan_refuses_what_it_cannot_build():
    from lik_gen.ir import Backward, Decompression, DType, Layout, Mask, Op, Target
    from lik_gen.plan import PlanError, plan
    from lik_gen.spec import CONTRADICTIONS

    base = Variant(Op.MAXSIM, Layout.DENSE, Mask.NONE, DType.FP16, Target.TRITON, normalize=True,
                   decompression=Decompression.RESIDUAL2)  # fmt: skip
    ctx = plan(base.kernel)
    assert ctx.doc.hook.endswith("residual.py.j2") and ctx.doc.nbits == 2
    with pytest.raises(PlanError, match="dense and varlen"):  # a kernel that has no template
        plan(Variant(**{**base.__dict__, "layout": Layout.KD}).kernel)
    for bad, message in (  # values no residual kernel takes: refused where declared
        ({"backward": Backward.UNIFIED}, "forward only"),
        ({"mask": Mask.D}, "not masks"),
        ({"dtype": DType.FP8E4M3}, "forward only"),
    ):
        variant = Variant(**{**base.__dict__, **bad})
        assert any(message in why for test, why in CONTRADICTIONS if test(variant)), bad
