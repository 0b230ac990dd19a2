"""Hooked token scores (weighted, smooth, top-k mean) on Metal, without a Mac.

The syntax check of every declared Metal variant (tests/test_metal.py) covers these
variants too. Here a few of them run on the CPU build of the Metal surface
(tests/metal/metal_cpu.h: the 32 lanes of a simdgroup in lockstep), reached through the
public lik.runtime.variants functions with only torch.mps.compile_shader replaced, and are
compared with the float64 reference, forward and backward (grad_Q, grad_D, grad_W).
Nothing here runs on Apple hardware or says anything about its speed.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers import TOLERANCE, relative_error
from test_metal import (
    _compiler,
    build_library,
    install_fake_compiler,
    kernel_of,
    load_library,
    torch_dtype,
)

from lik.runtime import metal, registry, variants
from lik.runtime.keys import variant_name
from lik.runtime.reference import maxsim_scored_reference
from lik_gen.ir import Backward, Score, Target, Variant
from lik_gen.plan_metal import MAX_BUFFERS, plan_metal

# Every score, layout, dtype, normalize, mask and backward value, and both argument forms
# (strides one by one, and packed into one array: the weighted backwards).
EXECUTED = (
    "maxsim_dense_qmask_fp32_metal_norm_lowmem_smooth",
    "maxsim_dense_dmask_fp32_metal_norm_lowmem_smooth",
    "maxsim_dense_qdmask_fp32_metal_norm_lowmem_weighted",
    "maxsim_pairs_qdmask_fp32_metal_lowmem_weighted",
    "maxsim_dense_qdmask_fp32_metal_norm_lowmem_smooth",
    "maxsim_pairs_nomask_fp16_metal_lowmem_smooth",
    "maxsim_dense_nomask_fp32_metal_smooth",
    "maxsim_dense_qdmask_bf16_metal_norm_lowmem_topkmean",
    "maxsim_dense_nomask_fp32_metal_lowmem_topkmean",
    "maxsim_dense_nomask_fp32_metal_topkmean",
)
# The CPU build computes in fp32 exactly as written; half inputs and gradients are bound
# by DESIGN.md's 1e-2.
FP32_FORWARD, FP32_GRAD = 1e-5, 1e-4


# --- the CPU build of the executed variants and a fake compile boundary -------------------


@pytest.fixture(scope="module")
def cpu_library(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("metal_scored")
    return load_library(build_library(_compiler(), tmp, EXECUTED), tmp)


@pytest.fixture
def fake_mps(cpu_library, monkeypatch):
    """CPU tensors routed like MPS ones, torch.mps.compile_shader replaced by the CPU build,
    and the Metal path forced (the tiny shapes here would run the eager reference).
    Yields the launches and the compiled variants."""
    calls, compiled = install_fake_compiler(cpu_library, monkeypatch)
    monkeypatch.setenv(metal.FORCE_ENV, "metal")
    yield calls, compiled


def scored_name(score, *, masked=False, dtype=torch.float32, normalize=False, train=False):
    return variant_name("dense", masked, masked, normalize, dtype, target="metal",
                        backward="lowmem" if train else "none", score=score)  # fmt: skip


@contextlib.contextmanager
def poisoned_outputs(monkeypatch):
    """torch.empty inside lik.runtime.metal returns NaN-filled tensors (int16: -7), so
    every score and gradient element must be written by the kernels."""
    real_empty = torch.empty

    def poisoned(*args, **kwargs):
        out = real_empty(*args, **kwargs)
        return out.fill_(float("nan") if out.dtype.is_floating_point else -7)

    with monkeypatch.context() as patch:
        patch.setattr(metal.torch, "empty", poisoned)
        yield


# --- inputs and the float64 ground truth --------------------------------------------------


def parse(name):
    v = Variant.parse(name)
    return {
        "layout": v.layout.value,
        "q_masked": v.mask.has_q,
        "d_masked": v.mask.has_d,
        "dtype": torch_dtype(v.dtype),
        "normalize": v.normalize,
        "train": v.backward is not Backward.NONE,
        "score": v.score.value,
    }


def make_inputs(v, Nq, Nd, Lq, Ld, dim, *, seed=0, k=3, tau=0.3):
    g = torch.Generator().manual_seed(seed)
    Nd = Nq if v["layout"] == "pairs" else Nd
    Q = torch.randn(Nq, Lq, dim, generator=g).to(v["dtype"])
    D = torch.randn(Nd, Ld, dim, generator=g).to(v["dtype"])
    q_mask = d_mask = None
    if v["q_masked"]:
        q_mask = torch.rand(Nq, Lq, generator=g) < 0.8
    if v["d_masked"]:
        d_mask = torch.rand(Nd, Ld, generator=g) < 0.7
        d_mask[0] = False  # a fully masked doc: scores 0, takes no gradient
    params = {"k": k} if v["score"] == "topk_mean" else {"tau": tau}
    if v["score"] == "weighted":
        params = {"weights": torch.rand(Nq, Lq, generator=g) + 0.5}
    return Q, D, q_mask, d_mask, params


def call(v, Q, D, q_mask, d_mask, params):
    options = {"normalize": v["normalize"], "pairs": v["layout"] == "pairs"}
    if v["score"] == "weighted":
        return variants.maxsim_weighted(Q, D, params["weights"], q_mask, d_mask, **options)
    if v["score"] == "smooth":
        return variants.maxsim_smooth(Q, D, q_mask, d_mask, tau=params["tau"], **options)
    return variants.maxsim_topk_mean(Q, D, q_mask, d_mask, k=params["k"], **options)


def reference(v, Q, D, q_mask, d_mask, params):
    return maxsim_scored_reference(
        Q, D, q_mask, d_mask, score=v["score"], weights=params.get("weights"),
        tau=params.get("tau", 0.1), k=params.get("k", 1), normalize=v["normalize"],
        pairs=v["layout"] == "pairs",
    )  # fmt: skip


def bounds(dtype):
    if dtype == torch.float32:
        return FP32_FORWARD, FP32_GRAD
    return TOLERANCE[dtype], TOLERANCE[dtype]


def check(v, Q, D, q_mask, d_mask, params, monkeypatch, *, name):
    """Runs the call (with autograd when the variant trains) and compares everything with
    the float64 reference. Returns (Q.grad, D.grad) of the kernels."""
    forward_bound, grad_bound = bounds(v["dtype"])
    weights = params.get("weights")
    if v["train"]:
        Q.requires_grad_()
        D.requires_grad_()
        if weights is not None:
            weights.requires_grad_()
    with poisoned_outputs(monkeypatch):
        out = call(v, Q, D, q_mask, d_mask, params)
    Q64, D64 = Q.detach().double().requires_grad_(), D.detach().double().requires_grad_()
    params64 = dict(params)
    if weights is not None:
        params64["weights"] = weights.detach().double().requires_grad_()
    ref = reference(v, Q64, D64, q_mask, d_mask, params64)
    assert out.dtype == torch.float32 and out.shape == ref.shape, name
    assert torch.isfinite(out).all(), f"{name}: unwritten or non-finite scores"
    assert relative_error(out, ref) < forward_bound, f"{name}: forward"
    if not v["train"]:
        return None, None
    grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    with poisoned_outputs(monkeypatch):
        out.backward(grad.float())
    ref.backward(grad)
    pairs = [("grad_Q", Q.grad, Q64.grad), ("grad_D", D.grad, D64.grad)]
    if weights is not None:
        pairs.append(("grad_W", weights.grad, params64["weights"].grad))
    for what, got, want in pairs:
        assert got.dtype == (weights.dtype if what == "grad_W" else v["dtype"]), what
        assert torch.isfinite(got).all(), f"{name}: {what} unwritten"
        assert relative_error(got, want) < grad_bound, f"{name}: {what}"
    return Q.grad, D.grad


# --- forward and backward against the float64 reference ----------------------------------


@pytest.mark.parametrize("name", EXECUTED)
@pytest.mark.parametrize(
    "shape",
    # Lq 11: two row blocks, the second ragged; Ld 37: five doc tiles and two 32-token
    # chunks in grad_Q, ragged; dim 40: five fragments, not a power of two.
    [(3, 4, 11, 37, 40), (2, 3, 1, 9, 8)],
    ids=["odd", "Lq1"],
)
def test_matches_float64_reference(fake_mps, monkeypatch, name, shape):
    calls, compiled = fake_mps
    v = parse(name)
    Q, D, q_mask, d_mask, params = make_inputs(v, *shape)
    _, grad_d = check(v, Q, D, q_mask, d_mask, params, monkeypatch, name=name)
    assert compiled == [name]
    roles = ["forward", "grad_q", "grad_d"] if v["train"] else ["forward"]
    assert [c[0] for c in calls] == [f"{kernel_of(name)}_{role}" for role in roles]
    if v["d_masked"] and v["train"]:
        assert (grad_d[0] == 0).all(), "a fully masked doc takes no gradient"


@pytest.mark.parametrize("k", [1, 5, 16])
def test_topk_mean_k_not_a_power_of_two_and_above_the_valid_tokens(fake_mps, monkeypatch, k):
    # k = 5: an odd count of slots; k = 16 > Ld = 13: the mean runs over the tokens there
    # are; k = 1 is MaxSim. The masked variant also has a fully masked doc.
    for name in (scored_name("topk_mean", train=True),
                 scored_name("topk_mean", masked=True, dtype=torch.bfloat16, normalize=True,
                             train=True)):  # fmt: skip
        v = parse(name)
        Q, D, q_mask, d_mask, params = make_inputs(v, 2, 3, 9, 13, 16, seed=k, k=k)
        check(v, Q, D, q_mask, d_mask, params, monkeypatch, name=f"{name} k={k}")


def test_topk_mean_ties_keep_the_earliest_tokens(fake_mps):
    # Doc tokens repeat (t, t + 4, t + 8, ...): the kept pair must be the earliest copies,
    # across lanes (4 apart) and tiles (8 apart), as the Triton hook keeps them.
    g = torch.Generator().manual_seed(4)
    base = torch.randn(1, 4, 8, generator=g)
    D = torch.cat([base] * 5, dim=1).requires_grad_()
    Q = torch.randn(1, 3, 8, generator=g)
    out = variants.maxsim_topk_mean(Q, D, k=2)
    ref = maxsim_scored_reference(Q.double(), D.detach().double(), score="topk_mean", k=2)
    assert relative_error(out, ref) < FP32_FORWARD
    out.sum().backward()
    assert (D.grad[0, 8:] == 0).all(), "only the two earliest copies take gradient"
    assert (D.grad[0, :8] != 0).any()


def test_weighted_ties_go_to_the_earliest_doc_token(fake_mps):
    g = torch.Generator().manual_seed(5)
    base = torch.randn(1, 4, 8, generator=g)
    D = torch.cat([base] * 3, dim=1).requires_grad_()
    Q, W = torch.randn(1, 5, 8, generator=g), torch.rand(1, 5, generator=g)
    # All-valid masks and normalize: the executed weighted variant (copies still tie).
    masks = torch.ones(1, 5, dtype=torch.bool), torch.ones(1, 12, dtype=torch.bool)
    variants.maxsim_weighted(Q, D, W, *masks, normalize=True).sum().backward()
    assert (D.grad[0, 4:] == 0).all() and (D.grad[0, :4] != 0).any()


@pytest.mark.parametrize("score", ["smooth", "topk_mean"])
def test_non_finite_inputs_never_score_finite(fake_mps, score):
    v = parse(scored_name(score))
    Q, D, _, _, params = make_inputs(v, 2, 3, 5, 13, 8)
    D[1, 6, 0] = float("nan")
    out = call(v, Q, D, None, None, params)
    assert torch.isfinite(out[:, [0, 2]]).all() and torch.isnan(out[:, 1]).all()


# Executed training variants with both masks, one per score (the call picks them).
PADDED_SCORES = (
    "maxsim_dense_qdmask_fp32_metal_norm_lowmem_weighted",
    "maxsim_pairs_qdmask_fp32_metal_lowmem_weighted",
    "maxsim_dense_qdmask_fp32_metal_norm_lowmem_smooth",
    "maxsim_dense_qdmask_bf16_metal_norm_lowmem_topkmean",
)


@pytest.mark.parametrize("poison", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("name", PADDED_SCORES)
def test_padding_never_reaches_scores_or_gradients(fake_mps, name, poison):
    """Masked tokens and the weights of masked query tokens holding NaN or inf give the
    scores and gradients (grad_W too) of zeros there, exactly; the gradient at a masked
    position is exactly 0."""
    _, compiled = fake_mps
    v = parse(name)
    Q, D, q_mask, d_mask, params = make_inputs(v, 3, 4, 7, 13, 16, seed=6)

    def filled(X, mask, value):
        return torch.where(mask[..., None], X, torch.tensor(value, dtype=X.dtype))

    def run(value):
        Qp = filled(Q, q_mask, value).requires_grad_()
        Dp = filled(D, d_mask, value).requires_grad_()
        given = dict(params)
        if "weights" in given:
            given["weights"] = torch.where(q_mask, given["weights"], value).requires_grad_()
        out = call(v, Qp, Dp, q_mask, d_mask, given)
        out.backward(torch.linspace(0.5, 1.5, out.numel()).view(out.shape))
        grads = [Qp.grad, Dp.grad] + ([given["weights"].grad] if "weights" in given else [])
        return out.detach(), grads

    out, grads = run(poison)
    want, want_grads = run(0.0)
    assert set(compiled) == {name}
    assert out.isfinite().all() and torch.equal(out, want)
    masks = (q_mask, d_mask, q_mask)[: len(grads)]
    for got, expected, mask in zip(grads, want_grads, masks, strict=True):
        assert got.isfinite().all() and torch.equal(got, expected)
        assert (got[~mask] == 0).all()


@pytest.mark.parametrize(
    "name",
    ["maxsim_dense_nomask_fp32_metal_smooth", "maxsim_dense_nomask_fp32_metal_topkmean",
     "maxsim_pairs_qdmask_fp32_metal_lowmem_weighted"],
)  # fmt: skip
def test_a_valid_row_of_neg_inf_similarities_is_a_real_neg_inf(fake_mps, name):
    """Every token score adds -inf for a query token whose valid similarities are all -inf,
    and 0 for one with no valid doc token (a fully masked doc, masked first tile)."""
    v = parse(name)
    Q, D, q_mask, d_mask, params = make_inputs(v, 2, 3, 3, 13, 8, seed=7)
    Q[0, 0] = torch.tensor([float("-inf")] + [0.0] * 7)
    D[..., 0] = D[..., 0].abs() + 0.5
    if d_mask is not None:
        d_mask[:] = True
        d_mask[0, :8] = False
        d_mask[1] = False
    if q_mask is not None:
        q_mask[:] = True
    out = call(v, Q.requires_grad_(v["train"]), D, q_mask, d_mask, params).detach()
    want = reference(v, Q.detach().double(), D.double(), q_mask, d_mask, params).float()
    assert want.isinf().any() and torch.equal(out.isnan(), want.isnan())
    assert torch.equal(out[want.isinf()], want[want.isinf()])
    finite = want.isfinite()
    assert relative_error(out[finite], want[finite]) < FP32_FORWARD


def test_strided_inputs_bind_their_strides(fake_mps, monkeypatch):
    # Q a non-contiguous view (every other query token), D transposed in memory: the
    # packed stride array and the one-by-one strides must both carry the real strides.
    name = "maxsim_dense_qdmask_fp32_metal_norm_lowmem_weighted"
    v = parse(name)
    Q, D, q_mask, d_mask, params = make_inputs(v, 3, 4, 14, 20, 24, seed=6)
    Q = Q[:, ::2]
    D = D.transpose(0, 1).contiguous().transpose(0, 1)
    q_mask = q_mask[:, ::2]
    params["weights"] = params["weights"][:, ::2]
    check(v, Q, D, q_mask, d_mask, params, monkeypatch, name=name)


@pytest.mark.parametrize("which", ["q_mask", "d_mask"])
def test_one_mask_runs_its_own_variant(fake_mps, monkeypatch, which):
    # A call with one mask runs the one-mask variant (the same kernel file, other
    # constants): no all-valid mask is allocated for the other side.
    calls, compiled = fake_mps
    name = f"maxsim_dense_{which[0]}mask_fp32_metal_norm_lowmem_smooth"
    v = parse(name)
    Q, D, q_mask, d_mask, params = make_inputs(v, 2, 3, 7, 10, 16, seed=7)
    masks = {"q_mask": q_mask, "d_mask": None} if which == "q_mask" else {
        "q_mask": None, "d_mask": d_mask}  # fmt: skip
    check(v, Q, D, masks["q_mask"], masks["d_mask"], params, monkeypatch, name=name)
    assert compiled == [name]


def test_backward_is_bitwise_reproducible(fake_mps):
    v = parse("maxsim_pairs_nomask_fp16_metal_lowmem_smooth")
    Q, D, _, _, params = make_inputs(v, 3, 3, 6, 19, 16, seed=8)
    Q.requires_grad_()
    D.requires_grad_()
    grads = []
    for _ in range(2):
        Q.grad = D.grad = None
        call(v, Q, D, None, None, params).sum().backward()
        grads.append((Q.grad.clone(), D.grad.clone()))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


# --- the runtime path: launches, fallbacks, envelope ---------------------------------------


def test_launch_grids_and_scalar_parameters(fake_mps):
    calls, _ = fake_mps
    v = parse(scored_name("topk_mean", train=True))
    Q, D, _, _, _ = make_inputs(v, 3, 2, 16, 48, 24)
    Q.requires_grad_()
    variants.maxsim_topk_mean(Q, D, k=3).sum().backward()
    name = kernel_of(scored_name("topk_mean", train=True))
    assert name == "maxsim_dense_metal_lowmem_topkmean"
    grids = {kernel: (threads, group) for kernel, _, threads, group in calls}
    assert grids[f"{name}_forward"] == (3 * 2 * 32, 128)  # one simdgroup per (query, doc)
    assert grids[f"{name}_grad_q"] == (3 * 16 * 32, 128)  # one per query token
    assert grids[f"{name}_grad_d"] == (2 * 48 * 32, 128)  # one per doc token
    for _, args, _, _ in calls:
        assert args[-1] == 3, "token_k is the kernels' trailing argument"


def test_empty_batches_score_zero_without_launching(fake_mps):
    calls, _ = fake_mps
    for Nq, Nd, Lq, Ld in ((0, 3, 4, 5), (2, 0, 4, 5), (2, 3, 0, 5), (2, 3, 4, 0)):
        Q = torch.randn(Nq, Lq, 8, requires_grad=True)
        D = torch.randn(Nd, Ld, 8, requires_grad=True)
        out = variants.maxsim_smooth(Q, D, tau=0.5)
        assert out.shape == (Nq, Nd) and (out == 0).all()
        out.sum().backward()
        assert (Q.grad == 0).all() and (D.grad == 0).all()
    assert calls == []


def test_compile_failure_is_reported_once_then_falls_back(fake_mps, monkeypatch):
    attempts = []

    def failing(source):
        attempts.append(source)
        raise RuntimeError("program_source:40:9: error: no matching function for call")

    monkeypatch.setattr(metal, "compile_shader", failing)
    monkeypatch.setattr(metal.torch, "compile", lambda fn, **kwargs: fn)
    metal._compiled_scored_reference.cache_clear()
    monkeypatch.delenv(metal.FORCE_ENV)
    g = torch.Generator().manual_seed(10)
    Q, D = torch.randn(4, 16, 24, generator=g), torch.randn(5, 20, 24, generator=g)
    with pytest.warns(RuntimeWarning, match="did not compile.*no matching function"):
        first = variants.maxsim_smooth(Q, D, tau=0.2)
    second = variants.maxsim_smooth(Q, D, tau=0.2)
    metal._compiled_scored_reference.cache_clear()
    assert len(attempts) == 1 and torch.equal(first, second)
    ref = maxsim_scored_reference(Q.double(), D.double(), score="smooth", tau=0.2)
    assert relative_error(first, ref) < FP32_FORWARD
    monkeypatch.setenv(metal.FORCE_ENV, "metal")
    with pytest.raises(metal.MetalCompileError, match="no matching function"):
        variants.maxsim_smooth(Q, D, tau=0.2)


@pytest.mark.parametrize("dim, Lq, Ld, launches", [(24, 16, 20, True), (12, 16, 20, False),
                                                   (24, 2, 3, False)])  # fmt: skip
def test_envelope_picks_the_path(fake_mps, monkeypatch, dim, Lq, Ld, launches):
    calls, _ = fake_mps
    monkeypatch.delenv(metal.FORCE_ENV)
    monkeypatch.setattr(metal.torch, "compile", lambda fn, **kwargs: fn)
    metal._compiled_scored_reference.cache_clear()
    g = torch.Generator().manual_seed(11)
    Q, D = torch.randn(4, Lq, dim, generator=g), torch.randn(5, Ld, dim, generator=g)
    out = variants.maxsim_topk_mean(Q, D, k=2)
    metal._compiled_scored_reference.cache_clear()
    ref = maxsim_scored_reference(Q.double(), D.double(), score="topk_mean", k=2)
    assert relative_error(out, ref) < FP32_FORWARD
    assert bool(calls) == launches


def test_forced_metal_outside_its_envelope_raises(fake_mps):
    Q, D = torch.randn(2, 4, 12), torch.randn(3, 5, 12)
    with pytest.raises(ValueError, match="head dim 12 is not a multiple of 8"):
        variants.maxsim_smooth(Q, D)


# --- the plan -------------------------------------------------------------------------------


def test_every_scored_metal_kernel_fits_metal_argument_table():
    declared = [Variant.parse(n) for n in registry.names()]
    kernels = {v.kernel for v in declared if v.target is Target.METAL and v.score != Score.MAX}
    assert len(kernels) == 12  # dense and pairs, three scores, forward and training
    packed = 0
    for kernel in kernels:
        ctx = plan_metal(kernel)
        for kernel in (ctx.forward, ctx.grad_q, ctx.grad_d):
            if kernel is None:
                continue
            assert len(kernel.args) <= MAX_BUFFERS, kernel.name
            packed += bool(kernel.packed_strides)
            # Strides travel one by one unless they would not fit.
            unpacked = len(kernel.args) + len(kernel.packed_strides) - bool(kernel.packed_strides)
            assert bool(kernel.packed_strides) == (unpacked > MAX_BUFFERS), kernel.name
    assert packed > 0, "no variant exercises the packed strides"
