"""The fused projection head (lik.runtime.head.maxsim_from_hidden) against float64.

Without a GPU the generated kernels run under the Triton interpreter (conftest); with
one, the same tests run compiled, and the `gpu`-marked tests below add realistic shapes,
bf16 parity against eager PyTorch, and gradients at training sizes.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    INTERPRETER_FP32_TOLERANCE,
    TOLERANCE,
    assert_close_to_reference,
    jit_functions,
    poisoned,
    relative_error,
)

from lik.runtime import backends, head, registry
from lik.runtime.head import HeadConfig, maxsim_from_hidden
from lik.runtime.reference import maxsim_from_hidden_reference, maxsim_reference
from lik_gen.ir import Variant

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETER = DEVICE == "cpu"
KERNELS = backends.device_backend(torch.device(DEVICE)) in backends.GENERATED_TRITON
needs_kernels = pytest.mark.skipif(not KERNELS, reason="no Triton path on this machine")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
TORCH_DTYPE = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
HEAD_NAMES = [n for n in registry.names() if n.startswith("head_")]
ROOT = pathlib.Path(__file__).resolve().parents[1]
# The structural kernels (generated files) that serve the head variants.
HEAD_SOURCES = sorted({ROOT / "generated" / registry.kernel_file(n) for n in HEAD_NAMES})


def _inputs(Nq, Lq, d, Nd, Ld, d_model, dtype, *, seed, bias=True, mask=False, grad=False):
    """Random Q, H, W (scaled like an nn.Linear init), b and d_mask; one doc fully
    masked when there are several."""
    g = torch.Generator().manual_seed(seed)
    Q = torch.randn(Nq, Lq, d, generator=g)
    H = torch.randn(Nd, Ld, d_model, generator=g)
    W = torch.randn(d, d_model, generator=g) / max(1, d_model) ** 0.5
    b = torch.randn(d, generator=g) if bias else None
    d_mask = None
    if mask:
        d_mask = torch.rand(Nd, Ld, generator=g) < 0.7
        if Nd > 1:
            d_mask[1] = False
        d_mask = d_mask.to(DEVICE)
    tensors = [t.to(DEVICE, dtype) if t is not None else None for t in (Q, H, W, b)]
    if grad:
        tensors = [t.requires_grad_() if t is not None else None for t in tensors]
    return (*tensors, d_mask)


def _reference(Q, H, W, b, d_mask, normalize):
    def f64(t):
        return None if t is None else t.detach().double().cpu()

    mask = None if d_mask is None else d_mask.cpu()
    return maxsim_from_hidden_reference(f64(Q), f64(H), f64(W), f64(b), mask, normalize=normalize)


def _bound(dtype):
    interpreted_fp32 = INTERPRETER and dtype == torch.float32
    return INTERPRETER_FP32_TOLERANCE if interpreted_fp32 else TOLERANCE[dtype]


# --------------------------------------------------------------------------------------
# Forward: every generated variant, odd shapes, several query tiles


@needs_kernels
@pytest.mark.parametrize("name", HEAD_NAMES)
def test_every_variant_matches_float64(name):
    variant = Variant.parse(name)
    dtype = TORCH_DTYPE[variant.dtype.value]
    # d_model and d not powers of two; Ld spans a partial second doc tile. Half the
    # variants run with a bias, in a pattern that covers both for each dtype and mask.
    bias = HEAD_NAMES.index(name) % 2 == 0
    Q, H, W, b, d_mask = _inputs(
        3, 7, 24, 3, 37, 40, dtype, seed=len(name), bias=bias, mask=variant.mask.has_d
    )
    out = maxsim_from_hidden(Q, H, W, b, d_mask, normalize=variant.normalize)
    ref = _reference(Q, H, W, b, d_mask, variant.normalize)
    assert_close_to_reference(out, ref, dtype, interpreter=INTERPRETER, what=name)
    if d_mask is not None:  # the fully masked doc scores exactly 0
        assert torch.all(out[:, 1] == 0)


def test_both_bias_forms_of_one_variant_are_covered():
    for mask in ("nomask", "dmask"):
        for dtype in TORCH_DTYPE:
            names = [n for n in HEAD_NAMES if f"_{mask}_{dtype}_" in n]
            assert {HEAD_NAMES.index(n) % 2 for n in names} == {0, 1}, names


EDGE_SHAPES = {  # (Nq, Lq, d, Nd, Ld, d_model)
    "Lq=1": (2, 1, 16, 2, 19, 24),
    "Ld=1": (2, 5, 16, 3, 1, 24),
    "Nd=1": (2, 6, 16, 1, 21, 33),
    "Nq=1": (1, 6, 20, 2, 11, 17),
    "d=8 d_model=5": (2, 4, 8, 2, 9, 5),
}


@needs_kernels
@pytest.mark.parametrize("shape", list(EDGE_SHAPES), ids=list(EDGE_SHAPES))
def test_edge_shapes(shape):
    Q, H, W, b, d_mask = _inputs(*EDGE_SHAPES[shape], torch.float32, seed=3, mask=True)
    out = maxsim_from_hidden(Q, H, W, b, d_mask)
    assert_close_to_reference(out, _reference(Q, H, W, b, d_mask, True), torch.float32,
                              interpreter=INTERPRETER, what=shape)  # fmt: skip


@needs_kernels
def test_several_query_tiles_and_token_chunks_per_program():
    """Queries that span several (query group, token chunk) tiles share each projected doc
    tile; the per-token maxima round-trip through the scratch rows and sum per query."""
    Q, H, W, b, d_mask = _inputs(5, 21, 16, 2, 40, 24, torch.float32, seed=4, mask=True)
    name = "head_dense_dmask_fp32_triton_norm"
    module = registry.load(name)
    # 3 query groups x 2 token chunks of 16 (Lq = 21), doc tiles of 16 tokens.
    config = HeadConfig(block_q=16, block_l=16, block_m=16, block_k=16, query_group=2,
                        num_warps=4, num_stages=1, interpret=INTERPRETER)  # fmt: skip
    out = poisoned((5, 2), DEVICE)
    argmax = torch.full((5, 2, 21), 12345, dtype=torch.int16, device=DEVICE)
    module.launch(out, Q, H, W, b=b, d_mask=d_mask.view(torch.uint8), argmax=argmax,
                  config=config)  # fmt: skip
    ref = _reference(Q, H, W, b, d_mask, True)
    assert_close_to_reference(out, ref, torch.float32, interpreter=INTERPRETER, what=name)
    # Every winner written, each a valid token of its doc (or -1 for the masked doc).
    assert torch.all(argmax[:, 1] == -1)
    winners = argmax[:, 0].long()
    assert torch.all((winners >= 0) & (winners < 40))
    assert torch.all(d_mask[0][winners])


@needs_kernels
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_every_output_and_argmax_entry_is_written(bias):
    Q, H, W, b, _ = _inputs(3, 5, 16, 4, 9, 24, torch.bfloat16, seed=5, bias=bias)
    module = registry.load("head_dense_nomask_bf16_triton_norm")
    out = poisoned((3, 4), DEVICE)
    argmax = torch.full((3, 4, 5), 12345, dtype=torch.int16, device=DEVICE)
    module.launch(out, Q, H, W, b=b, argmax=argmax, config=head.head_config(module, Q))
    assert not torch.isnan(out).any()
    assert torch.all((argmax >= 0) & (argmax < 9))
    ref = _reference(Q, H, W, b, None, True)
    assert relative_error(out, ref) < _bound(torch.bfloat16)


@needs_kernels
@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointer"])
def test_launches_in_doc_chunks_with_even_d_model(monkeypatch, tma):
    """Partial maxima over the limit split the batch into per-doc-chunk launches; d_model
    a multiple of the d_model step takes the unmasked projection loop; H is read through a
    TMA descriptor or by pointer. Scores and winners equal those of one launch, and match
    float64."""
    Q, H, W, b, d_mask = _inputs(3, 5, 16, 5, 70, 64, torch.float32, seed=19, mask=True)
    module = registry.load("head_dense_dmask_fp32_triton_norm")
    config = dataclasses.replace(head.head_config(module, Q), tma=tma)
    assert module._tma_operand(H, config)[1] is tma
    whole, whole_argmax = head._forward(Q, H, W, b, d_mask, True, True, config)
    calls = []
    real_launch = module.launch

    def counting(*args, **kwargs):
        calls.append(args[2].shape[0])
        return real_launch(*args, **kwargs)

    monkeypatch.setattr(module, "launch", counting)
    monkeypatch.setattr(head, "PARTIAL_LIMIT_BYTES", 1)
    out, argmax = head._forward(Q, H, W, b, d_mask, True, True, config)
    assert calls == [1] * 5
    # Flat-token tiles start elsewhere in a one-doc launch, which moves each doc token to
    # another tile row: a last-bit change of its similarities under the interpreter's
    # numpy dots (9.5e-7 here), as between flat and per-doc tiles below.
    assert torch.allclose(out, whole, rtol=1e-6, atol=1e-6)
    assert torch.equal(argmax, whole_argmax)
    assert_close_to_reference(out, _reference(Q, H, W, b, d_mask, True), torch.float32,
                              interpreter=INTERPRETER, what="doc chunks")  # fmt: skip
    # Each winner is a valid token whose similarity is its query token's max.
    D = F.normalize(F.linear(H.double(), W.double(), b.double()), dim=-1)
    sim = torch.einsum("isk,jtk->ijst", Q.double(), D).masked_fill(
        ~d_mask[None, :, None, :], float("-inf")
    )
    winners = argmax[:, [0, 2, 3, 4]].long()
    picked = sim[:, [0, 2, 3, 4]].gather(-1, winners[..., None])[..., 0]
    assert torch.allclose(picked, sim[:, [0, 2, 3, 4]].amax(-1), atol=1e-4)
    assert torch.all(argmax[:, 1] == -1)


def test_tma_reads_only_hidden_states_large_enough_to_pace_the_gpu():
    """A TMA descriptor costs host time per call: small calls read H by pointer."""
    Q = torch.zeros(1, 32, 128)
    module = registry.load("head_dense_nomask_fp32_triton_norm")
    limit = head.TMA_MIN_HIDDEN_BYTES
    assert not head.head_config(module, Q, 300, limit - 1).tma
    assert head.head_config(module, Q, 300, limit).tma
    assert head.head_config(module, Q, 300).tma  # size unknown: the large-call default


FLAT_CASES = {  # (Nd, Ld) against doc blocks of 16 tokens
    "several docs per tile": (9, 5),
    "docs across tile edges": (4, 37),
    "one token docs": (5, 1),
    "Ld a multiple of the block": (3, 32),  # per-doc blocks: nothing to gain
}


@needs_kernels
@pytest.mark.parametrize("case", list(FLAT_CASES))
@pytest.mark.parametrize("layout", ["contiguous", "doc-strided"])
def test_flat_token_tiles_match_per_doc_blocks(case, layout):
    """Blocks of the flat token axis (a block may end one doc and start others) give the
    scores and winners of per-doc blocks, and match float64; H whose docs are not back to
    back (a slice of longer docs) cannot be one TMA matrix and is read by pointer."""
    Nd, Ld = FLAT_CASES[case]
    Q, H, W, b, d_mask = _inputs(3, 5, 16, Nd, Ld + 3, 24, torch.float32, seed=23, mask=True)
    if layout == "doc-strided":
        H, d_mask = H[:, :Ld], d_mask[:, :Ld]
    else:
        H, d_mask = H[:, 3:].contiguous(), d_mask[:, 3:]
    d_mask[0] = True  # a doc with every token valid beside the fully masked doc 1
    module = registry.load("head_dense_dmask_fp32_triton_norm")
    config = HeadConfig(block_q=16, block_l=16, block_m=16, block_k=16, query_group=2,
                        num_warps=4, num_stages=1, interpret=INTERPRETER)  # fmt: skip
    per_doc = dataclasses.replace(config, flat_tokens=False)
    flat = module.flat_tokens(Ld, config)
    assert flat is (Ld % 16 != 0)
    assert module._tma_operand(H, config)[1] is (layout == "contiguous" or not flat)
    out, argmax = head._forward(Q, H, W, b, d_mask, True, True, config)
    blocks_out, blocks_argmax = head._forward(Q, H, W, b, d_mask, True, True, per_doc)
    assert_close_to_reference(out, _reference(Q, H, W, b, d_mask, True), torch.float32,
                              interpreter=INTERPRETER, what=case)  # fmt: skip
    assert torch.allclose(out, blocks_out, rtol=1e-6, atol=1e-6)
    assert torch.equal(argmax, blocks_argmax)
    inference, _ = head._forward(Q, H, W, b, d_mask, True, False, config)
    assert torch.allclose(inference, out, rtol=1e-6, atol=1e-6)
    if Nd > 1:
        assert torch.all(argmax[:, 1] == -1)
    winners = argmax.long()
    assert torch.all((winners[:, [0]] >= 0) & (winners[:, [0]] < Ld))


@needs_kernels
def test_single_query_and_empty_batches():
    Q, H, W, b, d_mask = _inputs(1, 6, 16, 2, 9, 24, torch.float32, seed=6, mask=True)
    out = maxsim_from_hidden(Q[0], H, W, b, d_mask)
    assert out.shape == (2,)
    ref = _reference(Q, H, W, b, d_mask, True)[0]
    assert relative_error(out, ref) < _bound(torch.float32)
    assert maxsim_from_hidden(Q, H[:0], W, b, d_mask[:0]).shape == (1, 0)
    assert maxsim_from_hidden(Q[:0], H, W, b, d_mask).shape == (0, 2)
    empty_docs = maxsim_from_hidden(Q, H[:, :0], W, b, d_mask[:, :0])
    assert empty_docs.shape == (1, 2) and torch.all(empty_docs == 0)


@needs_kernels
@pytest.mark.parametrize("save_argmax", [False, True], ids=["inference", "training"])
def test_non_finite_hidden_states(save_argmax):
    """A NaN in a valid doc token makes that doc's score NaN; one in a masked token is
    ignored."""
    Q, H, W, b, d_mask = _inputs(2, 4, 16, 3, 9, 24, torch.float32, seed=7, mask=True)
    d_mask[0] = True
    d_mask[2, 3] = False
    H[0, 5, 2] = float("nan")
    H[2, 3, 0] = float("nan")
    out, _ = head._forward(Q, H, W, b, d_mask, True, save_argmax=save_argmax)
    assert torch.isnan(out[:, 0]).all()
    assert torch.isfinite(out[:, 1:]).all()
    ref = _reference(Q, H, W, b, d_mask, True)
    assert relative_error(out[:, 1:], ref[:, 1:]) < _bound(torch.float32)


# --------------------------------------------------------------------------------------
# Gradients


def _grads(Q, H, W, b, d_mask, normalize, grad_out):
    inputs = [t for t in (Q, H, W, b) if t is not None]
    out = maxsim_from_hidden(Q, H, W, b, d_mask, normalize=normalize)
    grads = torch.autograd.grad(out, inputs, grad_out)
    ref_inputs = [t.detach().double().cpu().requires_grad_() for t in inputs]
    Qr, Hr, Wr = ref_inputs[:3]
    br = ref_inputs[3] if b is not None else None
    mask = None if d_mask is None else d_mask.cpu()
    ref = maxsim_from_hidden_reference(Qr, Hr, Wr, br, mask, normalize=normalize)
    ref_grads = torch.autograd.grad(ref, ref_inputs, grad_out.double().cpu())
    return out, ref, grads, ref_grads


@pytest.fixture(params=["composed", "fused"])
def training_path(request, monkeypatch):
    """Both training paths: small calls compose the projection with lik's maxsim; with a
    limit of -1 every call takes the fused forward and its winner-gathering backward."""
    if request.param == "fused":
        monkeypatch.setattr(head, "COMPOSED_TRAINING_MAX_DOC_VALUES", -1)
    return request.param


GRAD_CASES = {  # (Nq, Lq, Nd, Ld): few winners per doc (winner rows projected) or many
    "rerank": (2, 5, 3, 37),
    "in-batch": (3, 9, 3, 11),
}


@needs_kernels
@pytest.mark.parametrize("case", list(GRAD_CASES))
@pytest.mark.parametrize(
    "bias, mask, normalize", [(True, True, True), (False, False, False), (True, False, True)]
)
def test_gradients_match_float64(case, bias, mask, normalize, training_path):
    Nq, Lq, Nd, Ld = GRAD_CASES[case]
    Q, H, W, b, d_mask = _inputs(Nq, Lq, 24, Nd, Ld, 40, torch.float32, seed=8, bias=bias,
                                 mask=mask, grad=True)  # fmt: skip
    grad_out = torch.randn(Nq, Nd, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    out, ref, grads, ref_grads = _grads(Q, H, W, b, d_mask, normalize, grad_out)
    assert_close_to_reference(out, ref, torch.float32, interpreter=INTERPRETER, what=case)
    for label, grad, ref_grad in zip("QHWb", grads, ref_grads, strict=False):
        assert grad.dtype == torch.float32 and grad.shape == ref_grad.shape
        err = relative_error(grad, ref_grad)
        assert err < _bound(torch.float32), f"grad_{label}: relative error {err:.3g}"
    if mask:  # the fully masked doc passes no gradient to its hidden states
        assert torch.all(grads[1][1] == 0)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_gradients_match_float64(dtype, training_path):
    """Both paths compare doc tokens in fp32: the composed one once rounded its projected
    docs to the inputs' dtype, which moved near-tied winners and their gradient rows
    (in-batch bf16 cases like these: errors up to 0.31 against float64)."""
    worst = 0.0
    for seed in range(8):
        Q, H, W, b, _ = _inputs(3, 9, 64, 4, 24, 100, dtype, seed=seed, grad=True)
        Q = F.normalize(Q.detach().float(), dim=-1).to(dtype).requires_grad_()
        grad_out = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
        _, _, grads, ref_grads = _grads(Q, H, W, b, None, True, grad_out)
        for grad, ref_grad, t in zip(grads, ref_grads, (Q, H, W, b), strict=True):
            assert grad.dtype == t.dtype
            worst = max(worst, relative_error(grad, ref_grad))
    assert worst < TOLERANCE[dtype], f"worst gradient relative error {worst:.3g}"


@needs_kernels
def test_fully_masked_batch_gives_zero_gradients(training_path):
    Q, H, W, b, d_mask = _inputs(2, 4, 16, 2, 9, 24, torch.float32, seed=10, mask=True, grad=True)
    d_mask[:] = False
    out = maxsim_from_hidden(Q, H, W, b, d_mask)
    assert torch.all(out == 0)
    grads = torch.autograd.grad(out.sum(), (Q, H, W, b))
    assert all(torch.all(g == 0) for g in grads)


@needs_kernels
def test_training_calls_pick_their_path_by_hidden_state_count(monkeypatch):
    """Training calls with small projected docs run lik's maxsim on them; larger ones, and
    every call without gradients, the fused kernel (which never writes D)."""
    fused, composed = [], []
    forward, score = head._forward, head.maxsim
    monkeypatch.setattr(head, "_forward", lambda *a, **k: fused.append(1) or forward(*a, **k))
    monkeypatch.setattr(head, "maxsim", lambda *a, **k: composed.append(1) or score(*a, **k))
    Q, H, W, b, _ = _inputs(2, 4, 16, 3, 9, 24, torch.float32, seed=14, grad=True)
    maxsim_from_hidden(Q, H, W, b)
    assert (len(composed), len(fused)) == (1, 0)
    doc_values = H.shape[0] * H.shape[1] * W.shape[0]
    monkeypatch.setattr(head, "COMPOSED_TRAINING_MAX_DOC_VALUES", doc_values - 1)
    maxsim_from_hidden(Q, H, W, b)
    assert (len(composed), len(fused)) == (1, 1)
    with torch.no_grad():
        maxsim_from_hidden(Q, H, W, b)
    assert (len(composed), len(fused)) == (1, 2)


@needs_kernels
def test_gradient_to_some_inputs_only_and_half_precision_dtypes(training_path):
    Q, H, W, b, d_mask = _inputs(2, 5, 16, 2, 21, 24, torch.bfloat16, seed=11, mask=True)
    W.requires_grad_()
    out = maxsim_from_hidden(Q, H, W, b, d_mask)
    (grad_w,) = torch.autograd.grad(out.sum(), (W,))
    assert grad_w.dtype == torch.bfloat16
    Wr = W.detach().double().cpu().requires_grad_()
    ref = maxsim_from_hidden_reference(Q.double().cpu(), H.double().cpu(), Wr, b.double().cpu(),
                                       d_mask.cpu())  # fmt: skip
    (ref_w,) = torch.autograd.grad(ref.sum(), (Wr,))
    assert relative_error(grad_w, ref_w) < _bound(torch.bfloat16)


def test_a_config_that_does_not_fit_is_shrunk_and_other_errors_propagate(monkeypatch):
    class OutOfResources(Exception):
        pass

    module = registry.load("head_dense_nomask_fp32_triton")
    tried = []

    def launch(out, Q, H, W, *, b=None, d_mask=None, argmax=None, config):
        tried.append(config)
        if len(tried) < 3:
            raise OutOfResources("shared memory")
        out.fill_(1.0)

    monkeypatch.setattr(module, "launch", launch)
    Q, H, W, b, _ = _inputs(1, 3, 16, 2, 5, 8, torch.float32, seed=18)
    start = HeadConfig(16, 64, 64, 16, 1, 8, 2)
    out, _ = head._forward(Q, H, W, b, None, False, save_argmax=False, config=start)
    assert torch.all(out == 1)
    assert [(c.num_stages, c.block_m) for c in tried] == [(2, 64), (1, 64), (1, 32)]

    def broken(*args, **kwargs):
        raise RuntimeError("not a resource problem")

    monkeypatch.setattr(module, "launch", broken)
    with pytest.raises(RuntimeError, match="not a resource problem"):
        head._forward(Q, H, W, b, None, False, save_argmax=False, config=start)


@needs_kernels
def test_no_argmax_is_saved_without_grad(monkeypatch):
    saved = []
    real = head._forward

    def spy(*args, **kwargs):
        saved.append(kwargs["save_argmax"])
        return real(*args, **kwargs)

    monkeypatch.setattr(head, "_forward", spy)
    monkeypatch.setattr(head, "COMPOSED_TRAINING_MAX_DOC_VALUES", -1)  # training: fused too
    Q, H, W, b, _ = _inputs(1, 3, 16, 1, 5, 8, torch.float32, seed=12, grad=True)
    with torch.no_grad():
        maxsim_from_hidden(Q, H, W, b)
    maxsim_from_hidden(Q.detach(), H.detach(), W.detach(), b.detach())
    maxsim_from_hidden(Q, H, W, b)
    assert saved == [False, False, True]


def test_reference_path_matches_and_carries_gradients(monkeypatch):
    """Devices without a Triton path (plain CPU) run the reference, autograd included."""
    monkeypatch.setattr(backends, "device_backend", lambda device: "reference")
    Q, H, W, b, d_mask = _inputs(2, 3, 8, 2, 5, 6, torch.float32, seed=13, mask=True, grad=True)
    out = maxsim_from_hidden(Q, H, W, b, d_mask)
    assert out.dtype == torch.float32
    # Against the plain composition in float64 (not the reference function the path runs).
    exact = [t.detach().double().requires_grad_() for t in (Q, H, W, b)]
    want = _eager(*exact, d_mask, True)
    assert relative_error(out, want) < 1e-6
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(out.device)
    grads = torch.autograd.grad((out * weights).sum(), (Q, H, W, b))
    want_grads = torch.autograd.grad((want * weights.double()).sum(), exact)
    for name, got, expected in zip("QHWb", grads, want_grads, strict=True):
        assert relative_error(got, expected) < 1e-5, name


def test_normalize_applies_to_the_projected_docs_only(monkeypatch):
    """normalize=True L2-normalizes the projected doc tokens; queries are used as given,
    so unit queries reproduce maxsim(Q, F.linear(H, W, b), normalize=True)."""
    monkeypatch.setattr(backends, "device_backend", lambda device: "reference")
    Q, H, W, b, _ = _inputs(2, 3, 8, 2, 5, 6, torch.float32, seed=14)
    doubled = maxsim_from_hidden(2 * Q, H, W, b)
    assert torch.allclose(doubled, 2 * maxsim_from_hidden(Q, H, W, b), atol=1e-5)
    unit = F.normalize(Q, dim=-1)
    expected = maxsim_reference(unit, F.linear(H, W, b), normalize=True)
    assert torch.allclose(maxsim_from_hidden(unit, H, W, b), expected, atol=1e-5)


# --------------------------------------------------------------------------------------
# Input checks


def _valid_arguments():
    Q, H, W, b, d_mask = _inputs(2, 3, 8, 2, 5, 6, torch.float32, seed=15, mask=True)
    return {"Q": Q, "H_d": H, "W": W, "b": b, "d_mask": d_mask, "normalize": True}


# One argument replaced by a bad value -> the error and a fragment of its message.
BAD_CALLS = {
    "Q rank": ("Q", lambda Q: Q[0, 0], ValueError, "Q must be"),
    "Q type": ("Q", lambda Q: Q.tolist(), TypeError, "Q must be"),
    "H rank": ("H_d", lambda H: H[0], ValueError, "H_d must be"),
    "W shape": ("W", lambda W: W.T, ValueError, r"W must be \[d, d_model\]"),
    "b shape": ("b", lambda b: b[:-1], ValueError, "b must be"),
    "H dtype": ("H_d", lambda H: H.double(), TypeError, "H_d"),
    "W dtype": ("W", lambda W: W.half(), TypeError, "share a dtype"),
    "mask shape": ("d_mask", lambda m: m[:, :-1], ValueError, "d_mask must have shape"),
    "mask dtype": ("d_mask", lambda m: m.float(), TypeError, "d_mask must be bool"),
    "normalize": ("normalize", lambda n: "yes", TypeError, "normalize"),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_inputs_name_the_argument(case):
    argument, spoil, error, message = BAD_CALLS[case]
    arguments = _valid_arguments()
    arguments[argument] = spoil(arguments[argument])
    with pytest.raises(error, match=message):
        maxsim_from_hidden(**arguments)


# --------------------------------------------------------------------------------------
# Generated sources


def test_one_head_source_serves_every_mask_normalize_and_dtype():
    """Mask presence, normalize and dtype are constexpr values of one structural kernel:
    the manifest maps each of the 12 names to the same file, with the name's values, and
    the registry binds each name's normalize to that one module's launcher."""
    assert len(HEAD_NAMES) == 12
    assert [path.name for path in HEAD_SOURCES] == ["head_dense_triton.py"]
    modules = set()
    for name in HEAD_NAMES:
        variant = Variant.parse(name)
        assert registry.entry(name)["values"] == variant.values()
        bound = registry.load(name)
        assert bound.launch.keywords == {"normalize": variant.normalize}
        modules.add(bound.module)
    assert len(modules) == 1


def test_every_head_kernel_argument_is_used_and_program_ids_are_int64():
    """No placeholder arguments (each parameter of every @triton.jit function appears in
    its body), and 64-bit program ids: H offsets pass 2**31 elements on large batches."""
    for path in HEAD_SOURCES:
        kernels = 0
        for node in jit_functions(path):
            used = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
            unused = [a.arg for a in node.args.args if a.arg not in used]
            assert not unused, f"{path.name}: {node.name} never reads {unused}"
            if node.name.endswith("_kernel"):
                kernels += 1
                assert "tl.program_id(0).to(tl.int64)" in ast.unparse(node), node.name
        assert kernels == 2, path.name  # the forward and the reduce


def test_optional_inputs_are_constexpr_flags_of_one_kernel():
    """Bias, doc mask and saved argmax are optional launcher inputs passed as None when a
    call lacks them (never a placeholder tensor), each read by the kernel under its
    constexpr flag, as normalize is."""
    (path,) = HEAD_SOURCES
    nodes = {node.name: node for node in jit_functions(path)}
    forward = nodes["head_dense_triton_fwd_kernel"]
    annotated = [a for a in forward.args.args if a.annotation is not None]
    constexprs = {a.arg for a in annotated if ast.unparse(a.annotation) == "tl.constexpr"}
    assert {"HAS_BIAS", "HAS_D_MASK", "SAVE_ARGMAX", "NORMALIZE", "DOT_DTYPE"} <= constexprs
    launch = next(n for n in ast.parse(path.read_text()).body
                  if isinstance(n, ast.FunctionDef) and n.name == "launch")  # fmt: skip
    keywords = dict(zip((a.arg for a in launch.args.kwonlyargs), launch.args.kw_defaults,
                        strict=True))  # fmt: skip
    for optional in ("b", "d_mask", "argmax"):
        assert isinstance(keywords[optional], ast.Constant) and keywords[optional].value is None
    assert keywords["normalize"] is None and keywords["config"] is None  # required


# --------------------------------------------------------------------------------------
# GPU: realistic shapes, bf16 parity with eager PyTorch, training sizes


def _eager(Q, H, W, b, d_mask, normalize):
    """What a user would write in the inputs' dtype: linear, normalize, einsum, amax."""
    D = F.linear(H, W, b)
    if normalize:
        D = F.normalize(D, dim=-1)
    sim = torch.einsum("isk,jtk->ijst", Q, D)
    if d_mask is not None:
        sim = sim.masked_fill(~d_mask[None, :, None, :], float("-inf"))
    best = sim.amax(-1)
    best = best if best.dtype == torch.float64 else best.float()
    return torch.where(torch.isneginf(best), torch.zeros_like(best), best).sum(-1)


GPU_SHAPES = {  # (Nq, Lq, d, Nd, Ld, d_model)
    "colbert": (4, 32, 128, 64, 300, 768),
    "odd": (3, 27, 96, 37, 301, 500),
    "long-query": (2, 300, 128, 8, 130, 256),
    "long-doc": (3, 32, 128, 5, 1100, 384),  # 256 doc tokens per program
}


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("shape", list(GPU_SHAPES))
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("mask", [False, True], ids=["nomask", "dmask"])
def test_gpu_forward_parity(shape, dtype, mask):
    torch_dtype = TORCH_DTYPE[dtype]
    Q, H, W, b, d_mask = _inputs(*GPU_SHAPES[shape], torch_dtype, seed=16, mask=mask)
    Q = F.normalize(Q.float(), dim=-1).to(torch_dtype)
    out = maxsim_from_hidden(Q, H, W, b, d_mask)
    ref = _reference(Q, H, W, b, d_mask, True)
    assert_close_to_reference(out, ref, torch_dtype, interpreter=False, what=f"{shape} {dtype}")
    if torch_dtype != torch.float32:
        eager = relative_error(_eager(Q, H, W, b, d_mask, True), ref)
        assert relative_error(out, ref) <= 1.1 * eager, "worse than same-dtype eager PyTorch"


def _rounded(x, dtype):
    """x rounded to dtype in the forward, straight through in the backward."""
    return x + (x.to(dtype).double() - x).detach()


def _reference_rounded_docs(Q, H, W, b, d_mask, dtype):
    """float64 reference whose normalized projected docs are rounded to `dtype` in the
    forward (straight through in the backward), as the fused kernel rounds its projected
    tile before the similarity dot. Without it, bf16 rounding flips a few near-tied
    argmaxes (~0.4% of 1000 query tokens at Ld 300), each moving a whole row of grad_H.
    The composed training path projects and scores in fp32: no rounding (float64)."""
    D = _rounded(F.normalize(F.linear(H, W, b), dim=-1), dtype)
    sim = torch.einsum("isk,jtk->ijst", Q, D)
    sim = sim.masked_fill(~d_mask[None, :, None, :], float("-inf"))
    best = sim.amax(-1)
    return torch.where(torch.isneginf(best), torch.zeros_like(best), best).sum(-1)


GPU_GRAD_CASES = {  # (Nq, Lq, d, Nd, Ld, d_model)
    "rerank": (2, 32, 128, 16, 300, 384),
    "in-batch": (16, 32, 128, 16, 64, 384),
}


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("case", list(GPU_GRAD_CASES))
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_gpu_gradients(case, dtype, training_path):
    torch_dtype = TORCH_DTYPE[dtype]
    Nq, Lq, d, Nd, Ld, d_model = GPU_GRAD_CASES[case]
    Q, H, W, b, d_mask = _inputs(Nq, Lq, d, Nd, Ld, d_model, torch_dtype, seed=17, mask=True,
                                 grad=True)  # fmt: skip
    grad_out = torch.randn(Nq, Nd, device=DEVICE)
    out = maxsim_from_hidden(Q, H, W, b, d_mask)
    grads = torch.autograd.grad(out, (Q, H, W, b), grad_out)
    ref_inputs = [t.detach().double().requires_grad_() for t in (Q, H, W, b)]
    docs_dtype = torch.float64 if training_path == "composed" else torch_dtype
    ref = _reference_rounded_docs(*ref_inputs, d_mask, docs_dtype)
    ref_grads = torch.autograd.grad(ref, ref_inputs, grad_out.double())
    assert_close_to_reference(out, ref, torch_dtype, interpreter=False, what=case)
    for label, grad, ref_grad in zip("QHWb", grads, ref_grads, strict=True):
        assert grad.dtype == torch_dtype
        err = relative_error(grad, ref_grad)
        assert err < TOLERANCE[torch_dtype], f"grad_{label}: relative error {err:.3g}"
    assert torch.all(grads[1][1] == 0)  # the fully masked doc


def test_a_config_that_does_not_fit_shrinks_down_to_16_query_tokens():
    # Stages, then d_model and doc tiles, stacked queries, and last the query tile (the
    # kernel walks a query's tokens in chunks of it): fp32 at head dim 256 needs 256 KB for
    # a 128-token query tile alone, more than an H100 or H200 has.
    config = HeadConfig(block_q=128, block_l=128, block_m=64, block_k=256, query_group=2,
                        num_warps=8, num_stages=3)  # fmt: skip
    steps = [config]
    while (smaller := head._smaller(steps[-1])) is not None:
        steps.append(smaller)
    last = steps[-1]
    assert (last.num_stages, last.block_m, last.block_l, last.query_group) == (1, 16, 16, 1)
    assert [s.block_q for s in steps if s.query_group == 1][-4:] == [128, 64, 32, 16]
