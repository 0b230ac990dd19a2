"""lik.runtime.cpu (the CPU backend) against the float64 reference: every layout and dtype,
masks (prefix, with holes, fully masked docs and queries), normalize, masked_as_zero,
odd and empty shapes, the saved argmax, gradients, non-finite values and chunking; bf16
scoring's bf16 matmuls and the fp32 recompute of their winners."""

from __future__ import annotations

import pytest
import torch
from helpers import TOLERANCE, relative_error, stable_seed

from lik.runtime import cpu
from lik.runtime.reference import maxsim_pairs_reference, maxsim_reference

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The CPU matmuls are IEEE fp32 (no tf32): fp32 is held to DESIGN.md's "ieee" bound.
FP32_TOLERANCE = 1e-5
MASKS = ("none", "q", "d_prefix", "d_holes", "qd")


def _shapes(layout, nq, lq, nd, ld, d):
    """(Q shape, D shape, out shape) of a layout; nd is K for kd and ignored for pairs."""
    if layout == "dense":
        return (nq, lq, d), (nd, ld, d), (nq, nd)
    if layout == "kd":
        return (nq, lq, d), (nq, nd, ld, d), (nq, nd)
    return (nq, lq, d), (nq, ld, d), (nq,)


def _masks(kind, q_shape, d_shape, generator):
    """(q_mask, d_mask) for a mask kind; d masks leave a doc fully masked where there are
    several docs, and q masks a query fully masked where there are several queries."""
    q_mask = d_mask = None
    if kind in ("q", "qd"):
        q_mask = torch.rand(q_shape[:-1], generator=generator) < 0.7
        if q_shape[0] > 1:
            q_mask[-1] = False
    if kind in ("d_holes", "qd"):
        d_mask = torch.rand(d_shape[:-1], generator=generator) < 0.6
    elif kind == "d_prefix":
        ld = d_shape[-2]
        lengths = torch.randint(0, ld + 1, d_shape[:-2], generator=generator)
        d_mask = torch.arange(ld) < lengths[..., None]
    if d_mask is not None and d_mask[..., 0, :].numel() > 1:
        d_mask.view(-1, d_shape[-2])[1] = False
    return q_mask, d_mask


def _reference(layout, Q, D, q_mask, d_mask, normalize, masked_as_zero=False):
    fn = maxsim_pairs_reference if layout == "pairs" else maxsim_reference
    return fn(Q, D, q_mask, d_mask, normalize=normalize, masked_as_zero=masked_as_zero)


def _forward(layout, Q, D, q_mask, d_mask, normalize, *, training=False, masked_as_zero=False):
    """(scores, argmax or None) from poisoned outputs: every element must be written."""
    out_shape = {"dense": (Q.shape[0], D.shape[0]), "kd": (Q.shape[0], D.shape[1]),
                 "pairs": (Q.shape[0],)}[layout]  # fmt: skip
    out = torch.full(out_shape, float("nan"))
    argmax = None
    if training:
        argmax = torch.full(out_shape + (Q.shape[1],), -7, dtype=torch.int16)
    result = cpu.forward(layout, Q, D, q_mask, d_mask, normalize, out,
                         backward="lowmem" if training else "none", argmax=argmax,
                         masked_as_zero=masked_as_zero)  # fmt: skip
    assert result is out
    if argmax is not None:
        assert not (argmax == -7).any(), "argmax entries left unwritten"
    return out, argmax


def _eager(layout, Q, D, q_mask, d_mask, normalize):
    """What a user would write in the inputs' dtype (tests/test_gpu.py's same-dtype idiom)."""
    if normalize:
        Q, D = torch.nn.functional.normalize(Q, dim=-1), torch.nn.functional.normalize(D, dim=-1)
    spec = {"dense": "isk,jtk->ijst", "kd": "isk,ijtk->ijst", "pairs": "isk,itk->ist"}[layout]
    sim = torch.einsum(spec, Q, D)
    if d_mask is not None:
        if layout == "dense":
            dm = d_mask[None, :, None, :]
        else:
            dm = d_mask[:, :, None, :] if layout == "kd" else d_mask[:, None, :]
        sim = sim.masked_fill(~dm, float("-inf"))
    best = sim.amax(-1).float()
    best = torch.where(torch.isneginf(best), torch.zeros_like(best), best)
    if q_mask is not None:
        best = best * (q_mask[:, None, :] if layout != "pairs" else q_mask).float()
    return best.sum(-1)


def _check_scores(out, ref, dtype, what):
    assert out.dtype == torch.float32 and out.shape == ref.shape, what
    assert not torch.isnan(out).any(), f"{what}: NaN in the scores"
    bound = FP32_TOLERANCE if dtype == torch.float32 else TOLERANCE[dtype]
    err = relative_error(out, ref)
    assert err < bound, f"{what}: relative error {err:.3g} >= {bound:g}"
    return err


@pytest.mark.parametrize("layout", ("dense", "kd", "pairs"))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("normalize", (False, True))
def test_scores_match_reference(layout, dtype, mask, normalize):
    g = torch.Generator().manual_seed(stable_seed(layout, str(dtype), mask, normalize))
    q_shape, d_shape, _ = _shapes(layout, 8, 32, 6, 48, 64)
    Q = torch.randn(q_shape, generator=g).to(dtype)
    D = torch.randn(d_shape, generator=g).to(dtype)
    q_mask, d_mask = _masks(mask, q_shape, d_shape, g)
    out, _ = _forward(layout, Q, D, q_mask, d_mask, normalize)
    ref = _reference(layout, Q.double(), D.double(), q_mask, d_mask, normalize)
    err = _check_scores(out, ref, dtype, f"{layout} {dtype} {mask} normalize={normalize}")
    if dtype != torch.float32:
        eager_err = relative_error(_eager(layout, Q, D, q_mask, d_mask, normalize), ref)
        assert err <= 1.1 * eager_err + 1e-6, f"error {err:.3g} vs same-dtype eager {eager_err:.3g}"


@pytest.mark.parametrize("layout", ("dense", "kd", "pairs"))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mask", ("d_prefix", "d_holes", "qd"))
def test_masked_as_zero_matches_reference(layout, dtype, mask):
    g = torch.Generator().manual_seed(stable_seed(layout, str(dtype), mask, "maz"))
    q_shape, d_shape, _ = _shapes(layout, 5, 16, 4, 24, 32)
    # Mostly negative similarities, so that the masked tokens' 0 wins often.
    Q = torch.randn(q_shape, generator=g).abs().to(dtype)
    D = (torch.randn(d_shape, generator=g) - 0.6).to(dtype)
    q_mask, d_mask = _masks(mask, q_shape, d_shape, g)
    out, argmax = _forward(layout, Q, D, q_mask, d_mask, False, masked_as_zero=True,
                           training=True)  # fmt: skip
    ref = _reference(layout, Q.double(), D.double(), q_mask, d_mask, False, masked_as_zero=True)
    _check_scores(out, ref, dtype, f"{layout} {dtype} {mask} masked_as_zero")
    plain = _reference(layout, Q.double(), D.double(), q_mask, d_mask, False)
    assert relative_error(plain, ref) > 1e-2, "the inputs do not exercise the zero"
    assert (argmax == -1).sum() > (argmax.numel() // 10), "the 0 should win somewhere"


@pytest.mark.parametrize("layout", ("dense", "kd", "pairs"))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mask", ("none", "qd"))
def test_argmax_recomputes_the_scores(layout, dtype, mask):
    """Scores rebuilt from the saved winners equal the scores; -1 exactly where no token
    wins (masked query tokens, fully masked docs)."""
    g = torch.Generator().manual_seed(stable_seed(layout, str(dtype), mask, "argmax"))
    q_shape, d_shape, _ = _shapes(layout, 4, 9, 5, 17, 24)
    Q = torch.randn(q_shape, generator=g).to(dtype)
    D = torch.randn(d_shape, generator=g).to(dtype)
    q_mask, d_mask = _masks(mask, q_shape, d_shape, g)
    out, argmax = _forward(layout, Q, D, q_mask, d_mask, False, training=True)
    Qd, Dd = Q.double(), D.double()
    if layout == "dense":
        sim = torch.einsum("isk,jtk->ijst", Qd, Dd)
    elif layout == "kd":
        sim = torch.einsum("isk,ijtk->ijst", Qd, Dd)
    else:
        sim = torch.einsum("isk,itk->ist", Qd, Dd)[:, None]
    index = argmax.long() if layout != "pairs" else argmax.long()[:, None]
    won = index >= 0
    picked = sim.gather(-1, index.clamp(min=0)[..., None])[..., 0]
    rebuilt = torch.where(won, picked, 0.0).sum(-1)
    rebuilt = rebuilt if layout != "pairs" else rebuilt[:, 0]
    torch.testing.assert_close(out.double(), rebuilt, rtol=1e-5, atol=1e-5)
    if d_mask is not None:  # a winner is a valid doc token
        if layout == "dense":
            dm = d_mask[None, :, None, :]
        else:
            dm = d_mask[:, :, None, :] if layout == "kd" else d_mask[:, None, None, :]
        dm = dm.expand(*index.shape[:-1], index.shape[-1], d_mask.shape[-1])
        assert dm.gather(-1, index.clamp(min=0)[..., None])[..., 0][won].all()
        no_valid = ~dm.any(-1)
        assert (index[no_valid] == -1).all()
    if q_mask is not None:
        qm = q_mask[:, None, :].expand_as(index)
        assert (index[~qm] == -1).all()
    assert won.any()


def _autograd_reference(layout, Q, D, q_mask, d_mask, normalize, masked_as_zero, weights):
    Qd = Q.detach().double().requires_grad_()
    Dd = D.detach().double().requires_grad_()
    scores = _reference(layout, Qd, Dd, q_mask, d_mask, normalize, masked_as_zero)
    (scores * weights.double()).sum().backward()
    return Qd.grad, Dd.grad


@pytest.mark.parametrize("layout", ("dense", "kd", "pairs"))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "mask, normalize, masked_as_zero",
    [("none", False, False), ("qd", False, False), ("qd", True, False), ("none", True, False),
     ("d_holes", False, True)],
)  # fmt: skip
def test_gradients_match_autograd(layout, dtype, mask, normalize, masked_as_zero):
    g = torch.Generator().manual_seed(stable_seed(layout, str(dtype), mask, normalize, "grad"))
    q_shape, d_shape, out_shape = _shapes(layout, 4, 12, 5, 20, 16)
    Q = torch.randn(q_shape, generator=g).to(dtype)
    D = torch.randn(d_shape, generator=g).to(dtype)
    q_mask, d_mask = _masks(mask, q_shape, d_shape, g)
    _, argmax = _forward(layout, Q, D, q_mask, d_mask, normalize, training=True,
                         masked_as_zero=masked_as_zero)  # fmt: skip
    weights = torch.randn(out_shape, generator=g)
    has_q, has_d = q_mask is not None, d_mask is not None
    grad_Q, grad_D = cpu.backward(layout, weights, argmax, Q, D, has_q, has_d, normalize,
                                  "lowmem", masked_as_zero)  # fmt: skip
    ref_Q, ref_D = _autograd_reference(layout, Q, D, q_mask, d_mask, normalize, masked_as_zero,
                                       weights)  # fmt: skip
    assert grad_Q.shape == Q.shape and grad_D.shape == D.shape
    bound = FP32_TOLERANCE if dtype == torch.float32 else TOLERANCE[dtype]
    for name, got, ref in (("grad_Q", grad_Q, ref_Q), ("grad_D", grad_D, ref_D)):
        assert torch.isfinite(got).all(), name
        err = relative_error(got.float(), ref)
        assert err < bound, f"{name}: relative error {err:.3g} >= {bound:g}"
    if d_mask is not None:  # masked doc tokens take exactly no gradient
        assert (grad_D[~d_mask] == 0).all()
    if q_mask is not None:
        assert (grad_Q[~q_mask] == 0).all()


@pytest.mark.parametrize("layout", ("dense", "kd", "pairs"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("normalize", (False, True))
def test_non_finite_values(layout, dtype, normalize):
    """NaN and inf in masked tokens reach no score and no gradient; a NaN in a valid doc
    token makes the scores it takes part in NaN, as the reference does (bf16 scoring: the
    docs whose rounded max is not finite take the fp32 path)."""
    g = torch.Generator().manual_seed(stable_seed(layout, str(dtype), normalize, "nan"))
    q_shape, d_shape, out_shape = _shapes(layout, 3, 6, 4, 10, 8)
    Q = torch.randn(q_shape, generator=g).to(dtype)
    D = torch.randn(d_shape, generator=g).to(dtype)
    bound = FP32_TOLERANCE if dtype == torch.float32 else TOLERANCE[dtype]
    q_mask, d_mask = _masks("qd", q_shape, d_shape, g)
    Q[~q_mask] = float("nan")
    D[~d_mask] = float("inf")
    D.view(-1, d_shape[-2], d_shape[-1])[0][~d_mask.view(-1, d_shape[-2])[0]] = float("nan")
    out, argmax = _forward(layout, Q, D, q_mask, d_mask, normalize, training=True)
    ref = _reference(layout, Q.double(), D.double(), q_mask, d_mask, normalize)
    assert torch.isfinite(out).all() and torch.isfinite(ref).all()
    assert relative_error(out, ref) < FP32_TOLERANCE
    weights = torch.randn(out_shape, generator=g)
    grad_Q, grad_D = cpu.backward(layout, weights, argmax, Q, D, True, True, normalize, "unified")
    assert torch.isfinite(grad_Q).all() and torch.isfinite(grad_D).all()
    assert (grad_Q[~q_mask] == 0).all() and (grad_D[~d_mask] == 0).all()
    # A NaN in a valid doc token: every query token that scores against it is NaN.
    valid = d_mask.view(-1, d_shape[-2]).nonzero()[0]
    D.view(-1, d_shape[-2], d_shape[-1])[valid[0], valid[1], 0] = float("nan")
    out, _ = _forward(layout, Q, D, q_mask, d_mask, normalize)
    ref = _reference(layout, Q.double(), D.double(), q_mask, d_mask, normalize)
    assert torch.equal(torch.isnan(out), torch.isnan(ref)) and torch.isnan(out).any()
    finite = ~torch.isnan(ref)
    assert relative_error(out[finite], ref[finite]) < bound


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_valid_minus_inf_is_real_and_fully_masked_docs_score_zero(dtype):
    """A valid row of -inf similarities adds -inf (the mask decides, not the value); a doc
    with no valid token adds 0."""
    Q = torch.ones(1, 2, 4, dtype=dtype)
    D = torch.zeros(3, 2, 4)
    D[0] = float("-inf")  # doc 0: valid, every similarity -inf
    D[1] = torch.randn(2, 4)
    D = D.to(dtype)
    d_mask = torch.tensor([[True, True], [False, False], [True, False]])
    out, _ = _forward("dense", Q, D, None, d_mask, False)
    ref = _reference("dense", Q.double(), D.double(), None, d_mask, False)
    assert out[0, 0] == float("-inf") and ref[0, 0] == float("-inf")
    assert out[0, 1] == 0 and ref[0, 1] == 0
    assert out[0, 2] == ref[0, 2].float()


def _planted_near_tie(layout):
    """One query token q = e0 + e1 and a doc of 4 tokens (K = 1 for kd): similarity 0, then
    A and B, whose similarities 1 + 2**-9 and 1 + 2**-9 + 2**-11 are distinct in fp32 but
    both round to 1 in bf16, then a masked 2."""
    q_shape, d_shape, _ = _shapes(layout, 1, 1, 1, 4, 8)
    Q = torch.zeros(q_shape)
    Q[..., :2] = 1
    D = torch.zeros(d_shape)
    tokens = D.view(4, 8)
    tokens[0, :2] = torch.tensor([1.0, -1.0])
    tokens[1, :2] = torch.tensor([1.0, 2.0**-9])
    tokens[2, :2] = torch.tensor([1.0, 2.0**-9 + 2.0**-11])
    tokens[3, 0] = 2.0
    d_mask = torch.tensor([True, True, True, False]).view(*d_shape[:-1])
    return Q.bfloat16(), D.bfloat16(), d_mask


@pytest.mark.parametrize("layout", ("dense", "kd", "pairs"))
@pytest.mark.parametrize("normalize", (False, True))
def test_bf16_scoring_recomputes_the_rounded_winner(layout, normalize):
    """bf16 scoring multiplies in bf16 and recomputes the winner in fp32: where two tokens
    round to the same similarity, the first (A) wins and adds its exact similarity. fp32
    products would pick B, and bf16 similarities without the recompute would add 1. Training
    multiplies in fp32: B wins, and its index is saved for the backward."""
    Q, D, d_mask = _planted_near_tie(layout)
    q, a, b = Q.double().view(8), D.double().view(4, 8)[1], D.double().view(4, 8)[2]
    if normalize:
        q, a, b = (x / x.norm() for x in (q, a, b))
    for docs, mask in ((D[..., :3, :], None), (D, d_mask)):  # the 2 left out, or masked
        out, _ = _forward(layout, Q, docs, None, mask, normalize)
        assert out.item() == pytest.approx((q @ a).item(), rel=1e-6, abs=0)
        out, argmax = _forward(layout, Q, docs, None, mask, normalize, training=True)
        assert out.item() == pytest.approx((q @ b).item(), rel=1e-6, abs=0)
        assert argmax.item() == 2
    assert (q @ b - q @ a).item() > 1e-4  # the test tells the three apart


def _no_tie_pairs(sim, valid, band):
    """Which (query token, doc) maxima of sim [..., Ld] (float64) stand apart: the best
    valid token leads the next by more than `band` of its magnitude."""
    sim = sim.masked_fill(~valid, float("-inf"))
    top2 = sim.topk(2, dim=-1).values
    return (top2[..., 0] - top2[..., 1]) > band * top2[..., 0].abs()


@pytest.mark.parametrize("layout", ("dense", "kd", "pairs"))
@pytest.mark.parametrize("mask", ("none", "d_prefix", "d_holes"))
@pytest.mark.parametrize("normalize", (False, True))
def test_bf16_scores_are_exact_away_from_near_ties(layout, mask, normalize):
    """Queries of one token, so that each score is one max: where the best token leads the
    next by more than bf16 rounding (2**-6 of the max here), the score is its fp32 dot,
    within fp32 rounding of float64 (bf16 similarities would miss by up to 2**-8); where
    two lie within it, the score is one of theirs, so it misses the max by less than the
    rounding."""
    g = torch.Generator().manual_seed(stable_seed(layout, mask, normalize, "exact"))
    q_shape, d_shape, _ = _shapes(layout, 40, 1, 7, 33, 24)
    Q = torch.randn(q_shape, generator=g).bfloat16()
    D = torch.randn(d_shape, generator=g).bfloat16()
    _, d_mask = _masks(mask, q_shape, d_shape, g)
    out, _ = _forward(layout, Q, D, None, d_mask, normalize)
    ref = _reference(layout, Q.double(), D.double(), None, d_mask, normalize)
    Qd, Dd = Q.double(), D.double()
    if normalize:
        Qd, Dd = (torch.nn.functional.normalize(x, dim=-1) for x in (Qd, Dd))
    spec = {"dense": "isk,jtk->ijt", "kd": "isk,ijtk->ijt", "pairs": "isk,itk->it"}[layout]
    sim = torch.einsum(spec, Qd, Dd)
    valid = torch.ones(sim.shape, dtype=torch.bool)
    if d_mask is not None:
        valid = valid & (d_mask[None] if layout == "dense" else d_mask)
    has_valid = valid.any(-1)
    apart = _no_tie_pairs(sim, valid, 2.0**-6) & has_valid
    assert apart.sum() > 0.8 * has_valid.sum() and (has_valid & ~apart).any()
    err = (out.double() - ref).abs()
    assert (err[apart] <= 1e-6 * ref[apart].abs()).all(), err[apart].max()
    assert (err <= 2.0**-6 * ref.abs() + 1e-12).all(), err.max()
    assert (out[~has_valid] == 0).all()
    # Rounded similarities would miss by far more: the test tells them apart.
    rounded = torch.einsum(spec, Qd.bfloat16().double(), Dd.bfloat16().double()).bfloat16()
    rounded = rounded.double().masked_fill(~valid, float("-inf")).amax(-1)
    assert ((rounded - ref).abs()[apart] > 1e-5 * ref[apart].abs()).float().mean() > 0.5


# (nq, lq, nd, ld, d): single tokens, head dims of 1, 7 and 100, a single everything.
ODD_SHAPES = [(3, 1, 4, 5, 8), (3, 4, 4, 1, 8), (2, 3, 3, 5, 1), (2, 3, 3, 5, 7),
              (2, 5, 3, 6, 100), (1, 1, 1, 1, 1)]  # fmt: skip


@pytest.mark.parametrize("layout", ("dense", "kd", "pairs"))
@pytest.mark.parametrize("nq, lq, nd, ld, d", ODD_SHAPES)
def test_odd_shapes(layout, nq, lq, nd, ld, d):
    g = torch.Generator().manual_seed(nq * 1000 + lq * 100 + nd * 10 + ld + d)
    q_shape, d_shape, out_shape = _shapes(layout, nq, lq, nd, ld, d)
    Q, D = torch.randn(q_shape, generator=g), torch.randn(d_shape, generator=g)
    for q_mask, d_mask in ((None, None), _masks("qd", q_shape, d_shape, g)):
        out, argmax = _forward(layout, Q, D, q_mask, d_mask, False, training=True)
        ref = _reference(layout, Q.double(), D.double(), q_mask, d_mask, False)
        _check_scores(out, ref, torch.float32, f"{layout} {q_shape} {d_shape}")
        weights = torch.randn(out_shape, generator=g)
        grad_Q, grad_D = cpu.backward(layout, weights, argmax, Q, D, q_mask is not None,
                                      d_mask is not None, False, "lowmem")  # fmt: skip
        ref_Q, ref_D = _autograd_reference(layout, Q, D, q_mask, d_mask, False, False, weights)
        assert relative_error(grad_Q, ref_Q) < FP32_TOLERANCE
        assert relative_error(grad_D, ref_D) < FP32_TOLERANCE


@pytest.mark.parametrize("layout", ("dense", "kd", "pairs"))
@pytest.mark.parametrize("nq, lq, nd, ld, d", ODD_SHAPES)
def test_odd_shapes_bf16_scoring(layout, nq, lq, nd, ld, d):
    g = torch.Generator().manual_seed(nq * 1000 + lq * 100 + nd * 10 + ld + d)
    q_shape, d_shape, _ = _shapes(layout, nq, lq, nd, ld, d)
    Q = torch.randn(q_shape, generator=g).bfloat16()
    D = torch.randn(d_shape, generator=g).bfloat16()
    masked = _masks("qd", q_shape, d_shape, g)
    for (q_mask, d_mask), normalize in (((None, None), False), (masked, True)):
        out, _ = _forward(layout, Q, D, q_mask, d_mask, normalize)
        ref = _reference(layout, Q.double(), D.double(), q_mask, d_mask, normalize)
        _check_scores(out, ref, torch.bfloat16, f"{layout} {q_shape} {d_shape}")


@pytest.mark.parametrize(
    "layout, nq, lq, nd, ld",
    [("dense", 0, 4, 3, 5), ("dense", 2, 4, 0, 5), ("dense", 2, 4, 3, 0), ("dense", 2, 0, 3, 5),
     ("kd", 0, 4, 3, 5), ("kd", 2, 4, 0, 5), ("kd", 2, 4, 3, 0), ("pairs", 0, 4, 0, 5),
     ("pairs", 2, 4, 0, 0), ("pairs", 2, 0, 0, 5)],
)  # fmt: skip
def test_empty_batches(layout, nq, lq, nd, ld):
    """As dispatch.forward / dispatch.backward: zero scores, argmax -1, zero gradients."""
    q_shape, d_shape, out_shape = _shapes(layout, nq, lq, nd, ld, 8)
    Q, D = torch.randn(q_shape), torch.randn(d_shape)
    out, argmax = _forward(layout, Q, D, None, None, False, training=True)
    ref = _reference(layout, Q.double(), D.double(), None, None, False)
    assert out.shape == ref.shape and (out == 0).all() and (ref == 0).all()
    assert (argmax == -1).all()
    grad_Q, grad_D = cpu.backward(layout, torch.ones(out_shape), argmax, Q, D, False, False,
                                  False, "lowmem")  # fmt: skip
    assert grad_Q.shape == Q.shape and grad_D.shape == D.shape
    assert not grad_Q.any() and not grad_D.any()


@pytest.mark.parametrize("layout", ("dense", "kd", "pairs"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("normalize", (False, True))
@pytest.mark.parametrize("winner_budget", (1, None), ids=("recompute per step", "pooled"))
def test_chunked_equals_unchunked(monkeypatch, layout, dtype, normalize, winner_budget):
    """Budgets small enough to split docs, queries and query tokens into many steps give
    the scores, winners and gradients of one step, whether bf16 scoring recomputes each
    step's winners at once or pools many steps' into one recompute."""
    g = torch.Generator().manual_seed(stable_seed(layout, str(dtype), normalize, "chunk"))
    q_shape, d_shape, out_shape = _shapes(layout, 5, 7, 6, 11, 16)
    Q = torch.randn(q_shape, generator=g).to(dtype)
    D = torch.randn(d_shape, generator=g).to(dtype)
    q_mask, d_mask = _masks("qd", q_shape, d_shape, g)
    weights = torch.randn(out_shape, generator=g)

    def run(training):
        out, argmax = _forward(layout, Q, D, q_mask, d_mask, normalize, training=training)
        if not training:
            return out, None, None
        grads = cpu.backward(layout, weights, argmax, Q, D, True, True, normalize, "lowmem")
        return out, argmax, grads

    whole = [run(False), run(True)]
    monkeypatch.setattr(cpu, "SIM_BUDGET", 1)
    monkeypatch.setattr(cpu, "SIM_CAP", 3)
    monkeypatch.setattr(cpu, "DOC_BUDGET", 1)
    monkeypatch.setattr(cpu, "GRAD_BUDGET", 1)
    if winner_budget is not None:
        monkeypatch.setattr(cpu, "WINNER_BUDGET", winner_budget)
    chunked = [run(False), run(True)]
    for (out, argmax, grads), (out_c, argmax_c, grads_c) in zip(whole, chunked, strict=True):
        torch.testing.assert_close(out_c, out, rtol=1e-6, atol=1e-6)
        if argmax is not None:
            assert torch.equal(argmax_c, argmax)
            for a, b in zip(grads_c, grads, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mask", ("d_prefix", "d_holes", "qd"))
@pytest.mark.parametrize("normalize, masked_as_zero", [(False, False), (True, False),
                                                       (False, True)])  # fmt: skip
def test_packed_masks_equal_in_place(monkeypatch, dtype, mask, normalize, masked_as_zero):
    """Dense doc masks scored packed (valid tokens gathered, docs longest first) and in
    place (masked rows filled with -inf) agree, winners included, and match the reference;
    small budgets split the packed docs into many steps."""
    g = torch.Generator().manual_seed(stable_seed(str(dtype), mask, normalize, "pack"))
    q_shape, d_shape, _ = _shapes("dense", 3, 8, 9, 20, 16)
    Q = torch.randn(q_shape, generator=g).to(dtype)
    D = torch.randn(d_shape, generator=g).to(dtype)
    q_mask, d_mask = _masks(mask, q_shape, d_shape, g)
    d_mask[2, :] = False
    d_mask[3, :] = True
    runs = {}
    budgets = (cpu.SIM_BUDGET, cpu.PACK_BUDGET)
    for name, gain, (sims, packed) in (("in place", 10**9, budgets), ("packed", 0, budgets),
                                       ("packed, split", 0, (40, 40))):  # fmt: skip
        monkeypatch.setattr(cpu, "PACK_GAIN", dict.fromkeys(cpu.PACK_GAIN, gain))
        monkeypatch.setattr(cpu, "SIM_BUDGET", sims)
        monkeypatch.setattr(cpu, "PACK_BUDGET", packed)
        runs[name] = [
            _forward(
                "dense", Q, D, q_mask, d_mask, normalize, training=t, masked_as_zero=masked_as_zero
            )
            for t in (False, True)
        ]
    ref = _reference("dense", Q.double(), D.double(), q_mask, d_mask, normalize, masked_as_zero)
    base = runs.pop("in place")
    for name, run in runs.items():
        for (out, argmax), (out_b, argmax_b) in zip(run, base, strict=True):
            torch.testing.assert_close(out, out_b, rtol=1e-6, atol=1e-6, msg=name)
            assert (argmax is None) == (argmax_b is None)
            if argmax is not None:
                assert torch.equal(argmax, argmax_b), name
    for out, _ in base:
        _check_scores(out, ref, dtype, f"{dtype} {mask}")


@pytest.mark.parametrize("bound", ("similarities", "doc tokens"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_chunk_steps_are_bounded(monkeypatch, bound, dtype):
    """A step takes as many docs as the budgets allow: 1 query x 64 docs with room for 4
    docs' similarities, or 4 docs' tokens, per step takes 16 matmuls; bf16 scoring's
    budgets are the same bytes, 8 docs, so 8 matmuls, each in bf16."""
    calls = []
    real_mm = torch.mm

    def counting_mm(a, b, *, out=None):
        calls.append((a.shape[0], a.dtype))
        return real_mm(a, b, out=out)

    ld, lq, d = 8, 4, 16
    if bound == "similarities":
        monkeypatch.setattr(cpu, "SIM_BUDGET", 4 * ld * lq)
    else:
        monkeypatch.setattr(cpu, "DOC_BUDGET", 4 * ld * d)
    monkeypatch.setattr(torch, "mm", counting_mm)
    Q, D = torch.randn(1, lq, d).to(dtype), torch.randn(64, ld, d).to(dtype)
    out, _ = _forward("dense", Q, D, None, None, False)
    monkeypatch.setattr(torch, "mm", real_mm)
    docs = 4 * 4 // dtype.itemsize
    assert calls == [(docs * ld, dtype)] * (64 // docs)
    _check_scores(out, _reference("dense", Q.double(), D.double(), None, None, False),
                  dtype, "bounded")  # fmt: skip


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_non_contiguous_inputs(dtype):
    g = torch.Generator().manual_seed(7)
    Q = torch.randn(3, 16, 5, generator=g).to(dtype).transpose(1, 2)  # [3, 5, 16], strided
    D = torch.randn(4, 16, 9, generator=g).to(dtype).transpose(1, 2)[::2]  # [2, 9, 16]
    d_mask = torch.rand(2, 9, generator=g) < 0.7
    D_kd = torch.randn(3, 16, 2, 9, generator=g).to(dtype).permute(0, 2, 3, 1)  # [3, 2, 9, 16]
    for normalize in (False, True):
        out, _ = _forward("dense", Q, D, None, d_mask, normalize)
        ref = _reference("dense", Q.double(), D.double(), None, d_mask, normalize)
        _check_scores(out, ref, dtype, f"strided normalize={normalize}")
        out, _ = _forward("kd", Q, D_kd, None, None, normalize)
        ref = _reference("kd", Q.double(), D_kd.double(), None, None, normalize)
        _check_scores(out, ref, dtype, f"strided kd normalize={normalize}")


def test_deterministic_and_grad_mode_agnostic():
    g = torch.Generator().manual_seed(3)
    Q = torch.randn(4, 6, 8, generator=g).requires_grad_()
    D = torch.randn(5, 7, 8, generator=g).requires_grad_()
    with torch.no_grad():
        first = _forward("dense", Q, D, None, None, True, training=True)
    second = _forward("dense", Q.detach(), D.detach(), None, None, True, training=True)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    weights = torch.randn(4, 5, generator=g)
    a = cpu.backward("dense", weights, first[1], Q.detach(), D.detach(), False, False, True,
                     "unified")  # fmt: skip
    b = cpu.backward("dense", weights, first[1], Q.detach(), D.detach(), False, False, True,
                     "lowmem")  # fmt: skip
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_gradients_in_input_dtype():
    Q = torch.randn(2, 3, 8).bfloat16()
    D = torch.randn(4, 5, 8).bfloat16()
    _, argmax = _forward("dense", Q, D, None, None, False, training=True)
    grad_Q, grad_D = cpu.backward("dense", torch.ones(2, 4), argmax, Q, D, False, False, False,
                                  "lowmem")  # fmt: skip
    assert grad_Q.dtype == torch.bfloat16 and grad_D.dtype == torch.bfloat16


def test_int32_argmax():
    """Docs of 2**15 tokens or more save an int32 argmax (autograd._argmax_dtype)."""
    Q, D = torch.randn(2, 3, 4), torch.randn(2, 5, 4)
    out = torch.empty(2, 2)
    argmax = torch.full((2, 2, 3), -7, dtype=torch.int32)
    cpu.forward("dense", Q, D, None, None, False, out, backward="unified", argmax=argmax)
    assert argmax.min() >= 0 and argmax.max() < 5


def test_handles():
    for layout in ("dense", "kd", "pairs"):
        for dtype in DTYPES:
            assert cpu.handles(layout, dtype)
    assert not cpu.handles("varlen", torch.float32)
    assert not cpu.handles("packed_pairs", torch.float32)
    assert not cpu.handles("dense", torch.float64)
    assert not cpu.handles("dense", torch.float8_e4m3fn)
