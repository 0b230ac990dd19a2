"""Training: generated backward kernels (unified and lowmem) against float64 reference
gradients, on CPU under the interpreter (or compiled, with a GPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import TOLERANCE, padded_variant_names, relative_error, stable_seed

from lik.runtime import api, backends, configs, maxsim, maxsim_pairs, registry, tuning
from lik.runtime.reference import maxsim_pairs_reference, maxsim_reference
from lik_gen.ir import Variant

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETER = DEVICE == "cpu"
TORCH_DTYPE = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
pytestmark = pytest.mark.skipif(
    backends.device_backend(torch.device(DEVICE)) not in backends.GENERATED_TRITON,
    reason="no Triton path on this machine",
)
TRAINING_VARIANTS = [
    n for n in padded_variant_names(registry.names()) if n.endswith(("_unified", "_lowmem"))
]


def _gradient_tolerance(dtype):
    # Gradients come back in the input dtype: one rounding to bf16 is ~4e-3 relative.
    return 1e-5 if INTERPRETER and dtype == torch.float32 else TOLERANCE[dtype]


def _inputs(layout, dtype, Nq, Nd, Lq, Ld, dim, seed, has_q_mask, has_d_mask, lean=False):
    """Random inputs; lean: queries and docs lean apart along the first axis, so that many
    query tokens' best similarities are below 0 (where a doc mask read as zeros decides)."""
    g = torch.Generator().manual_seed(seed)
    d_shape = {"dense": (Nd, Ld), "kd": (Nq, Nd, Ld), "pairs": (Nq, Ld)}[layout]
    Q = torch.randn(Nq, Lq, dim, generator=g)
    D = torch.randn(*d_shape, dim, generator=g)
    if lean:
        Q[..., 0] += 2.0
        D[..., 0] -= 2.0
    Q, D = Q.to(DEVICE, dtype), D.to(DEVICE, dtype)
    q_mask = (torch.rand(Nq, Lq, generator=g) < 0.75).to(DEVICE) if has_q_mask else None
    d_mask = None
    if has_d_mask:
        d_mask = (torch.rand(*d_shape, generator=g) < 0.6).to(DEVICE)
        d_mask.view(-1, Ld)[1] = False  # one fully masked doc
    weights = torch.randn(Nq, *((Nd,) if layout != "pairs" else ()), generator=g).to(DEVICE)
    return Q, D, q_mask, d_mask, weights


def _run(layout, Q, D, q_mask, d_mask, weights, normalize, backward, masked_as_zero=False):
    Qg, Dg = Q.clone().requires_grad_(), D.clone().requires_grad_()
    if masked_as_zero:  # the doc mask read as zeros: the internal entry (no normalize)
        assert not normalize
        out = api.maxsim_masked_as_zero(Qg, Dg, q_mask, d_mask, pairs=layout == "pairs",
                                        backward=backward)  # fmt: skip
    else:
        score = maxsim_pairs if layout == "pairs" else maxsim
        out = score(Qg, Dg, q_mask, d_mask, normalize=normalize, backward=backward)
    (out * weights).sum().backward()
    return out, Qg.grad, Dg.grad


def _reference(layout, Q, D, q_mask, d_mask, weights, normalize, masked_as_zero=False):
    Qr, Dr = Q.double().requires_grad_(), D.double().requires_grad_()
    reference = maxsim_pairs_reference if layout == "pairs" else maxsim_reference
    out = reference(Qr, Dr, q_mask, d_mask, normalize=normalize, masked_as_zero=masked_as_zero)
    (out * weights.double()).sum().backward()
    return out, Qr.grad, Dr.grad


@pytest.mark.parametrize("name", TRAINING_VARIANTS)
def test_training_variant_gradients(name):
    variant = Variant.parse(name)
    layout, dtype = variant.layout.value, TORCH_DTYPE[variant.dtype.value]
    zero = variant.mask.as_zero
    inputs = _inputs(layout, dtype, 3, 4, 5, 19, 24, stable_seed(name), variant.mask.has_q,
                     variant.mask.has_d, lean=zero)  # fmt: skip
    out, gq, gd = _run(layout, *inputs, variant.normalize, variant.backward.value, zero)
    ref, rq, rd = _reference(layout, *inputs, variant.normalize, zero)
    assert gq.dtype == dtype and gd.dtype == dtype
    assert relative_error(out, ref) < (1e-5 if INTERPRETER else TOLERANCE[dtype])
    tolerance = _gradient_tolerance(dtype)
    assert relative_error(gq, rq) < tolerance, f"grad_Q error {relative_error(gq, rq):.3g}"
    assert relative_error(gd, rd) < tolerance, f"grad_D error {relative_error(gd, rd):.3g}"


@pytest.mark.parametrize("layout", ["dense", "kd", "pairs"])
@pytest.mark.parametrize("backward", ["unified", "lowmem"])
def test_masked_tokens_and_fully_masked_docs_get_zero_gradient(layout, backward):
    Q, D, q_mask, d_mask, weights = _inputs(layout, torch.float32, 2, 3, 6, 11, 16, 1, True, True)
    _, gq, gd = _run(layout, Q, D, q_mask, d_mask, weights, True, backward)
    assert torch.all(gq[~q_mask] == 0)
    assert torch.all(gd[~d_mask] == 0)
    assert torch.all(gd.view(-1, 11, 16)[1] == 0), "fully masked doc: no stale index-0 winner"


@pytest.mark.parametrize("layout", ["dense", "kd"])
def test_unified_and_lowmem_agree(layout):
    inputs = _inputs(layout, torch.float32, 3, 5, 7, 23, 32, 2, True, True)
    _, uq, ud = _run(layout, *inputs, False, "unified")
    _, lq, ld = _run(layout, *inputs, False, "lowmem")
    assert relative_error(lq, uq) < 1e-5 and relative_error(ld, ud) < 1e-5


@pytest.mark.parametrize("backward", ["unified", "lowmem"])
def test_a_second_backward_of_one_forward_gives_the_same_gradients(backward):
    # retain_graph: the saved argmax must come out of the first backward unchanged
    # (lowmem is bitwise repeatable; unified's fp32 atomics may add in another order).
    Q, D, q_mask, _, weights = _inputs("dense", torch.float32, 3, 4, 6, 45, 32, 9, True, False)
    Qg, Dg = Q.clone().requires_grad_(), D.clone().requires_grad_()
    loss = (maxsim(Qg, Dg, q_mask, normalize=True, backward=backward) * weights).sum()
    first = torch.autograd.grad(loss, (Qg, Dg), retain_graph=True)
    second = torch.autograd.grad(loss, (Qg, Dg))
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b) if backward == "lowmem" else relative_error(a, b) < 1e-6


def _force_column_argmax(monkeypatch, column_argmax):
    """Every config the runtime looks up from here on keeps (or not) its argmax by column."""
    real = tuning.config_for

    def config_for(key, smem_bytes, entry=None):
        return dataclasses.replace(real(key, smem_bytes, entry), column_argmax=column_argmax)

    monkeypatch.setattr(configs, "config_for", config_for)
    monkeypatch.setattr(configs, "_configs", {})
    monkeypatch.setattr(configs, "_call_configs", {})


COLUMN_ARGMAX_VARIANTS = [
    n for n in TRAINING_VARIANTS if getattr(registry.load(n), "COLUMN_ARGMAX_OPTION", False)
]


@pytest.mark.parametrize("name", COLUMN_ARGMAX_VARIANTS)
def test_column_argmax_gradients(monkeypatch, name):
    # The dense training forward's argmax kept per tile column (config.column_argmax).
    _force_column_argmax(monkeypatch, True)
    variant = Variant.parse(name)
    dtype = TORCH_DTYPE[variant.dtype.value]
    inputs = _inputs("dense", dtype, 3, 4, 5, 83, 24, stable_seed(name), variant.mask.has_q,
                     False)  # fmt: skip
    out, gq, gd = _run("dense", *inputs, variant.normalize, variant.backward.value)
    ref, rq, rd = _reference("dense", *inputs, variant.normalize)
    assert any(c.column_argmax for c in configs._call_configs.values())
    assert relative_error(out, ref) < (1e-5 if INTERPRETER else TOLERANCE[dtype])
    tolerance = _gradient_tolerance(dtype)
    assert relative_error(gq, rq) < tolerance, f"grad_Q error {relative_error(gq, rq):.3g}"
    assert relative_error(gd, rd) < tolerance, f"grad_D error {relative_error(gd, rd):.3g}"


@pytest.mark.parametrize("backward", ["unified", "lowmem"])
@pytest.mark.parametrize("column_argmax", [False, True])
@pytest.mark.parametrize("Ld", [64, 73, 87])  # 32-token tiles, then none, 9 or 23 tokens
def test_the_earliest_tied_doc_token_wins(monkeypatch, backward, column_argmax, Ld):
    # The dense training forward peels the partial last tile (9 tokens in a 16-token
    # tile, 23 in a 32-token one). Doc token 5 ties token 37 (its column, the next tile),
    # token 40 (another column) and, past Ld 70, token 70 (the partial tile): only token
    # 5 may take a gradient, whichever form the argmax takes. Small integers make every
    # similarity with doc 0's token 5 exact, whatever the dot's order.
    _force_column_argmax(monkeypatch, column_argmax)
    Q, D, q_mask, d_mask, weights = _inputs("dense", torch.float32, 3, 4, 5, Ld, 16, 6, True,
                                            False)  # fmt: skip
    D[0, 5] = torch.tensor([2.0, -1, 0, 1, -2, 2, 1, 1, -1, 0, 2, -2, 1, 0, -1, 2])
    ties = [37, 40] + ([70] if Ld > 70 else [])
    D[:, ties] = D[:, 5:6]
    Q[:, :, :] = D[0, 5]
    out, gq, gd = _run("dense", Q, D, q_mask, d_mask, weights, False, backward)
    ref, rq, _ = _reference("dense", Q, D, q_mask, d_mask, weights, False)
    assert relative_error(out, ref) < 1e-5
    assert relative_error(gq, rq) < _gradient_tolerance(torch.float32)
    assert torch.all(gd[0, ties] == 0) and torch.any(gd[0, 5] != 0), "tie: the earliest wins"


def test_lowmem_is_bitwise_deterministic():
    inputs = _inputs("dense", torch.bfloat16, 4, 6, 9, 33, 48, 3, False, True)
    first = _run("dense", *inputs, True, "lowmem")
    second = _run("dense", *inputs, True, "lowmem")
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


def test_long_query_gradients_are_chunked_exactly():
    inputs = _inputs("dense", torch.float32, 2, 3, 530, 9, 16, 4, True, False)
    out, gq, gd = _run("dense", *inputs, False, "lowmem")
    ref, rq, rd = _reference("dense", *inputs, False)
    assert relative_error(gq, rq) < _gradient_tolerance(torch.float32)
    assert relative_error(gd, rd) < _gradient_tolerance(torch.float32)


def test_argmax_is_saved_only_when_an_input_requires_grad(monkeypatch):
    loaded = []
    real_load = registry.load
    monkeypatch.setattr(registry, "load", lambda name: loaded.append(name) or real_load(name))
    Q, D = torch.randn(2, 5, 16, device=DEVICE), torch.randn(3, 7, 16, device=DEVICE)
    maxsim(Q, D)
    with torch.no_grad():
        maxsim(Q.requires_grad_(), D)
    assert loaded == ["maxsim_dense_nomask_fp32_triton"] * 2
    maxsim(Q, D, backward="lowmem")
    assert loaded[-1] == "maxsim_dense_nomask_fp32_triton_lowmem"


def test_auto_backward_choice():
    # lowmem, but for lopsided in-batch calls; a caller's choice stands.
    assert api.choose_backward(None, "dense", 4, 4) == "lowmem"
    assert api.choose_backward("auto", "dense", 16, 16 * api.LOPSIDED_DOCS - 1) == "lowmem"
    assert api.choose_backward(None, "dense", 16, 16 * api.LOPSIDED_DOCS) == "unified"
    # Many queries over few docs turn sooner: H200, 256 x 8 and 128 x 4 ran 1.16x faster
    # unified (commit b29daf8), 256 x 16 1.25x faster lowmem.
    assert api.LOPSIDED_QUERIES < api.LOPSIDED_DOCS
    assert api.choose_backward(None, "dense", 8 * api.LOPSIDED_QUERIES, 8) == "unified"
    assert api.choose_backward(None, "dense", 8 * api.LOPSIDED_QUERIES - 1, 8) == "lowmem"
    assert api.choose_backward(None, "dense", 256, 16) == "lowmem"
    assert api.choose_backward(None, "dense", 8, 8 * api.LOPSIDED_QUERIES) == "lowmem"
    assert api.choose_backward(None, "dense", 256, 2) == "unified"
    assert api.choose_backward(None, "kd", 256, 2) == "lowmem"
    assert api.choose_backward(None, "pairs", 1, 1000) == "lowmem"
    assert api.choose_backward("unified", "kd", 64, 4) == "unified"
    assert api.choose_backward("lowmem", "dense", 1, 1000) == "lowmem"


def test_gradient_only_for_the_input_that_requires_it():
    Q, D = torch.randn(2, 5, 16, device=DEVICE), torch.randn(3, 7, 16, device=DEVICE)
    Qg = Q.clone().requires_grad_()
    maxsim(Qg, D).sum().backward()
    ref = Q.double().requires_grad_()
    maxsim_reference(ref, D.double()).sum().backward()
    assert relative_error(Qg.grad, ref.grad) < _gradient_tolerance(torch.float32)


def test_torch_compile_sees_no_graph_break():
    """fullgraph=True fails on any graph break; the custom ops keep maxsim in one graph."""
    torch._dynamo.reset()
    head = torch.nn.Linear(16, 16).to(DEVICE)

    def loss_fn(q, d, d_mask):
        scores = maxsim(head(q), head(d), None, d_mask, normalize=True)
        return torch.nn.functional.cross_entropy(scores, torch.arange(2, device=q.device))

    q, d = torch.randn(2, 5, 16, device=DEVICE), torch.randn(2, 9, 16, device=DEVICE)
    d_mask = torch.rand(2, 9, device=DEVICE) < 0.7
    compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")
    loss = compiled(q, d, d_mask)
    loss.backward()
    compiled_grad = head.weight.grad.clone()
    head.zero_grad()
    eager = loss_fn(q, d, d_mask)
    eager.backward()
    assert torch.allclose(loss, eager)
    assert torch.allclose(compiled_grad, head.weight.grad, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [1e-20, 1e20])
def test_lowmem_dense_keeps_tiny_and_huge_upstream_gradients(dtype, scale):
    # A g far from 1 must neither flush to zero nor overflow on its way through the
    # one-hot dots (folding g into a 16-bit operand would, in fp16).
    Q, D, q_mask, d_mask, weights = _inputs("dense", dtype, 5, 6, 7, 23, 32, 3, True, False)
    weights = weights * scale
    _, gq, gd = _run("dense", Q, D, q_mask, d_mask, weights, False, "lowmem")
    _, rq, rd = _reference("dense", Q, D, q_mask, d_mask, weights, False)
    tolerance = _gradient_tolerance(dtype)
    assert relative_error(gq, rq) < tolerance, f"grad_Q error {relative_error(gq, rq):.3g}"
    assert relative_error(gd, rd) < tolerance, f"grad_D error {relative_error(gd, rd):.3g}"


@pytest.mark.skipif(
    INTERPRETER, reason="the interpreter runs dots in fp32 and truncates stores to bf16"
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_lowmem_dense_grad_d_is_one_rounding_from_exact(dtype):
    # Dense grad_D carries each winning row's own g through a 16-bit one-hot matrix as a
    # head and the tail it rounds off (fp16: scaled per step first), so what is left is
    # the final rounding to the input dtype. Upstream gradients span six decades here.
    Q, D, q_mask, d_mask, weights = _inputs("dense", dtype, 6, 5, 9, 21, 32, 5, True, False)
    spread = torch.rand(weights.shape, generator=torch.Generator().manual_seed(6)) * 6 - 3
    weights = weights * (10**spread).to(DEVICE)
    _, _, gd = _run("dense", Q, D, q_mask, d_mask, weights, False, "lowmem")
    _, _, rd = _reference("dense", Q, D, q_mask, d_mask, weights, False)
    one_rounding = relative_error(rd.to(dtype), rd)
    assert relative_error(gd, rd) <= 1.1 * one_rounding, (relative_error(gd, rd), one_rounding)


@pytest.mark.parametrize(
    ("Nq", "Lq"),
    [
        (40, 32),
        pytest.param(
            512, 64, marks=pytest.mark.skipif(INTERPRETER, reason="minutes under the interpreter")
        ),
    ],
)
def test_lowmem_dense_routes_long_winner_lists(Nq, Lq):
    # Many query tokens on few doc tokens: each (doc, tile) list takes several grad_D
    # steps and the route pass several scans; 512 x 64 slots need int32 slot indices.
    inputs = _inputs("dense", torch.float32, Nq, 2, Lq, 5, 16, 7, True, False)
    _, gq, gd = _run("dense", *inputs, False, "lowmem")
    _, rq, rd = _reference("dense", *inputs, False)
    assert relative_error(gq, rq) < _gradient_tolerance(torch.float32)
    assert relative_error(gd, rd) < _gradient_tolerance(torch.float32)
