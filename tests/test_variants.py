"""Hooked token scores (weighted, smooth, top-k mean): generated kernels against the
float64 reference, forward and backward, under the interpreter on CPU and on a GPU."""

from __future__ import annotations

import pytest
import torch
from helpers import relative_error

from lik.runtime import backends, variants
from lik.runtime.reference import maxsim_scored_reference

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
SCORES = ("weighted", "smooth", "topk_mean")
# Gradient bounds: fp32 as the forward; half precision routes P (softmax weights, 1/k)
# through a half-precision dot, a few 1e-3 of relative error.
GRAD_TOLERANCE = {torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 2e-2}
FWD_TOLERANCE = {torch.float32: 1e-5 if not CUDA else 1e-3, torch.float16: 1e-2,
                 torch.bfloat16: 1e-2}  # fmt: skip


def _params(score, Nq, Lq, device, generator, *, tau=0.3, k=3):
    if score == "weighted":
        return {"weights": torch.rand(Nq, Lq, generator=generator).to(device)}
    if score == "smooth":
        return {"tau": tau}
    return {"k": k}


def _call(score, Q, D, q_mask, d_mask, params, *, normalize=False, pairs=False):
    kw = {"q_mask": q_mask, "d_mask": d_mask, "normalize": normalize, "pairs": pairs}
    if score == "weighted":
        return variants.maxsim_weighted(Q, D, params["weights"], **kw)
    if score == "smooth":
        return variants.maxsim_smooth(Q, D, tau=params["tau"], **kw)
    return variants.maxsim_topk_mean(Q, D, k=params["k"], **kw)


def _reference(score, Q, D, q_mask, d_mask, params, *, normalize=False, pairs=False):
    ref = {"tau": params.get("tau", 0.1), "k": params.get("k", 1), "weights": params.get("weights")}
    return maxsim_scored_reference(Q, D, q_mask, d_mask, score=score, normalize=normalize,
                                   pairs=pairs, **ref)  # fmt: skip


def _check(score, dtype, Nq, Nd, Lq, Ld, d, *, masks, normalize, pairs, seed=0, **param_kw):
    g = torch.Generator().manual_seed(seed)
    Q = torch.randn(Nq, Lq, d, generator=g).to(DEVICE, dtype).requires_grad_()
    D = torch.randn(Nd, Ld, d, generator=g).to(DEVICE, dtype).requires_grad_()
    q_mask = d_mask = None
    if masks:
        q_mask = (torch.rand(Nq, Lq, generator=g) < 0.8).to(DEVICE)
        d_mask = (torch.rand(Nd, Ld, generator=g) < 0.7).to(DEVICE)
        if Nd > 1:
            d_mask[1] = False  # a fully masked doc: scores 0, zero gradient
    params = _params(score, Nq, Lq, DEVICE, g, **param_kw)
    if score == "weighted":
        params["weights"] = params["weights"].requires_grad_()
    out = _call(score, Q, D, q_mask, d_mask, params, normalize=normalize, pairs=pairs)

    Q64 = Q.detach().double().requires_grad_()
    D64 = D.detach().double().requires_grad_()
    params64 = dict(params)
    if score == "weighted":
        params64["weights"] = params["weights"].detach().double().requires_grad_()
    ref = _reference(score, Q64, D64, q_mask, d_mask, params64, normalize=normalize, pairs=pairs)
    what = f"{score} {dtype} pairs={pairs} norm={normalize} masks={masks}"
    assert out.dtype == torch.float32 and out.shape == ref.shape, what
    assert torch.isfinite(out).all(), what
    assert relative_error(out, ref) < FWD_TOLERANCE[dtype], f"{what}: forward"

    grad = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    out.backward(grad.to(DEVICE, torch.float32))
    ref.backward(grad.to(DEVICE))
    for name, got, want in (("grad_Q", Q.grad, Q64.grad), ("grad_D", D.grad, D64.grad)):
        assert got.dtype == dtype, f"{what}: {name} dtype"
        assert relative_error(got, want) < GRAD_TOLERANCE[dtype], f"{what}: {name}"
    if score == "weighted":
        assert (
            relative_error(params["weights"].grad, params64["weights"].grad) < GRAD_TOLERANCE[dtype]
        )
    if masks and Nd > 1 and not pairs:
        assert (D.grad[1] == 0).all(), f"{what}: a fully masked doc takes no gradient"


needs_kernels = pytest.mark.skipif(
    backends.device_backend(torch.device(DEVICE)) not in backends.GENERATED_TRITON,
    reason="needs CUDA or the Triton interpreter",
)


@needs_kernels
@pytest.mark.parametrize("score", SCORES)
@pytest.mark.parametrize("pairs", [False, True])
@pytest.mark.parametrize("masks,normalize", [(False, False), (True, True)])
def test_forward_and_backward_match_float64(score, pairs, masks, normalize):
    # Odd sizes: Lq 7, Ld 37 spans two doc tiles with a ragged end, d 24 pads to 32.
    Nd = 3 if pairs else 5
    _check(score, torch.float32, 3, Nd, 7, 37, 24, masks=masks, normalize=normalize, pairs=pairs)


@needs_kernels
@pytest.mark.parametrize("score", SCORES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs(score, dtype):
    _check(score, dtype, 2, 3, 9, 20, 16, masks=True, normalize=True, pairs=False, seed=1)


@needs_kernels
@pytest.mark.parametrize("score", SCORES)
def test_tiny_shapes(score):
    # One query token, one doc token: every reduction has a single candidate.
    _check(score, torch.float32, 1, 2, 1, 1, 5, masks=False, normalize=False, pairs=False)


@needs_kernels
def test_topk_mean_with_fewer_valid_tokens_than_k():
    # k = 5 > Ld = 3: the mean runs over the tokens there are.
    _check("topk_mean", torch.float32, 2, 3, 4, 3, 8, masks=True, normalize=False, pairs=False, k=5)


@needs_kernels
@pytest.mark.parametrize("k", [1, 6, 16])
def test_topk_mean_k_values(k):
    # k = 6 pads to 8 slots (padding slots must never be filled); k = 1 is MaxSim.
    _check(
        "topk_mean", torch.float32, 2, 2, 5, 40, 16, masks=False, normalize=False, pairs=False, k=k
    )


@needs_kernels
def test_topk_mean_one_is_maxsim():
    import lik

    g = torch.Generator().manual_seed(3)
    Q, D = torch.randn(2, 6, 16, generator=g), torch.randn(3, 33, 16, generator=g)
    torch.testing.assert_close(variants.maxsim_topk_mean(Q, D, k=1), lik.maxsim(Q, D))


@needs_kernels
def test_topk_mean_ties_keep_the_earliest_tokens():
    # Doc tokens repeat: the top-2 holds two equal similarities, and the gradient must go
    # to the earliest copies (the reference's torch.topk picks some copies; the score is
    # the same, and the kernel's pick is documented: earliest first).
    g = torch.Generator().manual_seed(4)
    base = torch.randn(1, 4, 8, generator=g)
    D = torch.cat([base, base, base], dim=1).to(DEVICE).requires_grad_()  # t, t+4, t+8 equal
    Q = torch.randn(1, 3, 8, generator=g).to(DEVICE)
    out = variants.maxsim_topk_mean(Q, D, k=2)
    ref = maxsim_scored_reference(Q.double(), D.detach().double(), score="topk_mean", k=2)
    assert relative_error(out, ref) < 1e-5
    out.sum().backward()
    assert (D.grad[0, 8:] == 0).all(), "the third copy is never among the two earliest"
    assert (D.grad[0, :8] != 0).any()


def test_the_reference_topk_mean_also_takes_the_earliest_ties():
    g = torch.Generator().manual_seed(4)
    base = torch.randn(1, 4, 8, generator=g, dtype=torch.float64)
    D = torch.cat([base, base, base], dim=1).requires_grad_()
    Q = torch.randn(1, 3, 8, generator=g, dtype=torch.float64)
    maxsim_scored_reference(Q, D, score="topk_mean", k=2).sum().backward()
    assert (D.grad[0, 8:] == 0).all() and (D.grad[0, :8] != 0).any()


@needs_kernels
def test_smooth_tends_to_maxsim_for_small_tau():
    import lik

    g = torch.Generator().manual_seed(5)
    Q, D = torch.randn(2, 5, 16, generator=g), torch.randn(3, 21, 16, generator=g)
    smooth = variants.maxsim_smooth(Q, D, tau=1e-3)
    assert relative_error(smooth, lik.maxsim(Q, D)) < 1e-3


@needs_kernels
@pytest.mark.parametrize("score", SCORES)
def test_non_finite_inputs_never_score_finite(score):
    g = torch.Generator().manual_seed(6)
    Q, D = torch.randn(1, 3, 8, generator=g), torch.randn(2, 5, 8, generator=g)
    D[1, 2, 0] = float("nan")
    out = _call(score, Q, D, None, None, _params(score, 1, 3, "cpu", g))
    assert torch.isfinite(out[:, 0]).all() and torch.isnan(out[:, 1]).all()


@needs_kernels
@pytest.mark.parametrize("score", SCORES)
def test_empty_batches_and_lengths(score):
    g = torch.Generator().manual_seed(7)
    for Nq, Nd, Lq, Ld in ((0, 3, 4, 5), (2, 0, 4, 5), (2, 3, 0, 5), (2, 3, 4, 0)):
        Q = torch.randn(Nq, Lq, 8, generator=g).to(DEVICE).requires_grad_()
        D = torch.randn(Nd, Ld, 8, generator=g).to(DEVICE).requires_grad_()
        params = _params(score, Nq, Lq, DEVICE, g)
        out = _call(score, Q, D, None, None, params)
        assert out.shape == (Nq, Nd) and (out == 0).all()
        out.sum().backward()
        assert Q.grad.shape == Q.shape and D.grad.shape == D.shape


@pytest.mark.parametrize("score", SCORES)
def test_the_reference_backpropagates_through_empty_batches_and_lengths(score):
    # The path where no kernel runs (CPU without Triton, CPU tensors beside a GPU).
    g = torch.Generator().manual_seed(7)
    for Nq, Nd, Lq, Ld in ((0, 3, 4, 5), (2, 0, 4, 5), (2, 3, 0, 5), (2, 3, 4, 0)):
        Q = torch.randn(Nq, Lq, 8, generator=g, dtype=torch.float64, requires_grad=True)
        D = torch.randn(Nd, Ld, 8, generator=g, dtype=torch.float64, requires_grad=True)
        weights = torch.rand(Nq, Lq, generator=g, dtype=torch.float64)
        out = maxsim_scored_reference(Q, D, score=score, tau=0.3, k=3,
                                      weights=weights if score == "weighted" else None)
        assert out.shape == (Nq, Nd) and (out == 0).all()
        out.sum().backward()
        assert Q.grad.shape == Q.shape and D.grad.shape == D.shape


@needs_kernels
def test_long_queries_are_chunked_exactly():
    # Lq > 512 runs as two launches whose token scores add.
    g = torch.Generator().manual_seed(8)
    Q = torch.randn(1, 515, 16, generator=g, requires_grad=True)
    D = torch.randn(2, 3, 16, generator=g)
    out = variants.maxsim_smooth(Q, D, tau=0.5)
    ref = maxsim_scored_reference(Q.detach().double(), D.double(), score="smooth", tau=0.5)
    assert relative_error(out, ref) < 1e-5
    out.sum().backward()
    Q64 = Q.detach().double().requires_grad_()
    maxsim_scored_reference(Q64, D.double(), score="smooth", tau=0.5).sum().backward()
    assert relative_error(Q.grad, Q64.grad) < 1e-5


@needs_kernels
def test_backward_is_bitwise_reproducible():
    g = torch.Generator().manual_seed(9)
    Q = torch.randn(3, 6, 16, generator=g).to(DEVICE).requires_grad_()
    D = torch.randn(4, 19, 16, generator=g).to(DEVICE).requires_grad_()
    grads = []
    for _ in range(2):
        Q.grad = D.grad = None
        variants.maxsim_smooth(Q, D, tau=0.2).sum().backward()
        grads.append((Q.grad.clone(), D.grad.clone()))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def test_single_query_squeezes_like_maxsim():
    Q, D = torch.randn(4, 8), torch.randn(3, 5, 8)
    w = torch.rand(4)
    out = variants.maxsim_weighted(Q, D, w)
    ref = maxsim_scored_reference(Q[None].double(), D.double(), score="weighted",
                                  weights=w[None].double())[0]  # fmt: skip
    assert out.shape == (3,) and relative_error(out, ref) < 1e-5


def _smooth(Q, D, **kw):
    return variants.maxsim_smooth(Q, D, **kw)


BAD_CALLS = [
    (lambda Q, D: _smooth(Q, D, tau=0.0), "tau must be a finite positive"),
    (lambda Q, D: _smooth(Q, D, tau=float("inf")), "tau must be a finite positive"),
    (lambda Q, D: _smooth(Q, D, normalize="yes"), "normalize must be a bool"),
    (lambda Q, D: _smooth(Q, D, pairs=None), "pairs must be a bool"),
    (lambda Q, D: variants.maxsim_topk_mean(Q, D, k=0), r"k must be an integer in \[1, 16\]"),
    (lambda Q, D: variants.maxsim_topk_mean(Q, D, k=17), r"k must be an integer"),
    (lambda Q, D: variants.maxsim_weighted(Q, D, torch.rand(2, 5)), r"weights must have shape"),
    (lambda Q, D: variants.maxsim_weighted(Q, D, torch.ones(2, 4).long()), "weights must be float"),
    (lambda Q, D: _smooth(Q, D[:1], pairs=True), "one doc per query"),
    (lambda Q, D: _smooth(Q, D, d_mask=torch.ones(3, 4).bool()), r"d_mask must have shape"),
    (lambda Q, D: _smooth(Q, D.double()), "must share a dtype|must have dtype"),
]


@pytest.mark.parametrize("call,match", BAD_CALLS)
def test_bad_arguments_raise_naming_them(call, match):
    Q, D = torch.randn(2, 4, 8), torch.randn(3, 5, 8)
    with pytest.raises((ValueError, TypeError), match=match):
        call(Q, D)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("score", SCORES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pairs", [False, True])
def test_gpu_parity_at_training_shapes(score, dtype, pairs):
    # In-batch 24 x 24 at ColBERT sizes (Lq 32, Ld 180 over three doc tiles), masked.
    _check(score, dtype, 24, 24, 32, 180, 128, masks=True, normalize=True, pairs=pairs, seed=11)
