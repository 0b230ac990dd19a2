"""colpali-engine integration: with lik routing on, maxsim_inbatch, maxsim_kd,
score_multi_vector and the five Colbert loss heads (hard and smooth max) give
colpali-engine's own numbers and input gradients; unsupported inputs and LIK_DISABLE=1 go
to the library;
disable() puts the originals back by identity.

Inputs are zero-padded random fp32 batches whose query and doc tokens lean apart, so zero
padding often wins a max. On the CPU reference path (TRITON_INTERPRET off) gradients
match on every row. Under the interpreter the generated backward gives a max that several
zero rows tie for to one of them (torch's amax splits it), so there gradients are compared
on the rows that are not padding; colpali-engine's models zero those rows themselves.
"""

from __future__ import annotations

import sys
import warnings

import pytest
import torch

maxsim_module = pytest.importorskip("colpali_engine.utils.maxsim")
losses = pytest.importorskip("colpali_engine.loss.late_interaction_losses")
processing_utils = pytest.importorskip("colpali_engine.utils.processing_utils")

from lik import integrations, runtime  # noqa: E402
from lik.integrations import colpali as lik_colpali  # noqa: E402
from lik.runtime import backends, variants  # noqa: E402
from lik.runtime.reference import maxsim_reference  # noqa: E402

FP32 = {"rtol": 1e-5, "atol": 1e-5}
ORIGINAL_FUNCTIONS = {
    "maxsim_inbatch": maxsim_module.maxsim_inbatch,
    "maxsim_kd": maxsim_module.maxsim_kd,
}
NEGATIVE_LOSSES = (losses.ColbertNegativeCELoss, losses.ColbertPairwiseNegativeCELoss)
ORIGINAL_FORWARDS = {cls: cls.forward for cls in NEGATIVE_LOSSES}
HAS_KERNEL = integrations.has_kernel

# Sizes: small enough for the interpreter (B <= 3, L <= 10, d <= 32).
B, K, LQ, LD, DIM = 3, 2, 6, 9, 24


@pytest.fixture(autouse=True)
def integration_off_afterwards():
    yield
    lik_colpali.disable()


@pytest.fixture(autouse=True)
def reference_path_counts_as_a_kernel(monkeypatch):
    """The adapters are compared on the CPU reference path as well as under the
    interpreter. Outside tests an integration leaves CPU calls without the interpreter
    to the library (test_a_cpu_without_the_interpreter_stays_with_the_library)."""
    monkeypatch.setattr(integrations, "has_kernel", lambda device: device.type in ("cpu", "cuda"))


@pytest.fixture
def lik_calls(monkeypatch):
    """Names of the lik entry points that calls reached (empty: the library scored alone)."""
    calls = []
    for module, name in ((runtime, "maxsim"), (runtime, "maxsim_pairs"),
                         (variants, "maxsim_smooth")):  # fmt: skip
        real = getattr(module, name)

        def recording(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, recording)
    return calls


def _generator(seed=0):
    return torch.Generator().manual_seed(seed)


def _padded(*shape, generator, lean):
    """Unit token vectors [..., L, d], zero-padded after a random length (the first item
    unpadded). Queries lean one way along axis 0 and docs the other, so many query tokens
    have no real doc token above 0 and the padding's 0 wins."""
    tokens = torch.randn(*shape, generator=generator)
    tokens[..., 0] += 2.0 * lean
    tokens = torch.nn.functional.normalize(tokens, dim=-1)
    rows = tokens.view(-1, *shape[-2:])
    lengths = torch.randint(1, shape[-2] + 1, (rows.shape[0],), generator=generator)
    lengths[0] = shape[-2]
    rows[torch.arange(shape[-2]) >= lengths[:, None]] = 0
    return tokens


def _queries(*shape, generator):
    return _padded(*shape, generator=generator, lean=1.0)


def _docs(*shape, generator):
    return _padded(*shape, generator=generator, lean=-1.0)


def _assert_padding_matters(query, doc, colpali_scores):
    """The inputs tell the conventions apart: masking the zero rows out (lik's own masks)
    would give other scores than letting them compete as 0 (colpali-engine)."""
    own = maxsim_reference(query, doc, (query != 0).any(-1), (doc != 0).any(-1))
    assert not torch.allclose(own, colpali_scores.detach(), rtol=1e-3, atol=1e-3)


def _run_with_grads(call, tensors, seed=1):
    """call(*leaf copies) -> (result, grads of a random weighting of the result)."""
    leaves = [t.clone().requires_grad_() for t in tensors]
    out = call(*leaves)
    weights = torch.randn(out.shape, generator=_generator(seed))
    (out * weights).sum().backward()
    return out.detach(), [leaf.grad for leaf in leaves]


def _routed_and_original(call, tensors):
    """(call with lik routing on, the same call on colpali-engine alone)."""
    expected = _run_with_grads(call, tensors)
    with lik_colpali.enabled():
        actual = _run_with_grads(call, tensors)
    return actual, expected


def _assert_same(actual, expected, tensors, path):
    (out, grads), (ref, ref_grads) = actual, expected
    assert out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, **FP32)
    for grad, ref_grad, tensor in zip(grads, ref_grads, tensors, strict=True):
        if path != "reference":  # kernels resolve ties among zero rows differently (module doc)
            real = (tensor != 0).any(-1)
            grad, ref_grad = grad[real], ref_grad[real]
        torch.testing.assert_close(grad, ref_grad, **FP32)


def test_maxsim_inbatch(lik_path, lik_calls):
    g = _generator()
    Q, D = _queries(B, LQ, DIM, generator=g), _docs(B + 1, LD, DIM, generator=g)

    def call(Q, D):
        return maxsim_module.maxsim_inbatch(Q, D)

    actual, expected = _routed_and_original(call, [Q, D])
    _assert_same(actual, expected, [Q, D], lik_path)
    _assert_padding_matters(Q, D, expected[0])
    assert lik_calls == ["maxsim"]


def test_maxsim_kd(lik_path, lik_calls):
    g = _generator(1)
    Q, D = _queries(B, LQ, DIM, generator=g), _docs(B, K, LD, DIM, generator=g)

    def call(Q, D):
        return maxsim_module.maxsim_kd(Q, D)

    actual, expected = _routed_and_original(call, [Q, D])
    _assert_same(actual, expected, [Q, D], lik_path)
    _assert_padding_matters(Q, D, expected[0])
    assert lik_calls == ["maxsim"]


def test_score_multi_vector(lik_path, lik_calls):
    g = _generator(2)
    queries = [_queries(n, DIM, generator=g) for n in (4, 6, 3)]
    passages = [_docs(n, DIM, generator=g) for n in (9, 5, 7)]
    score = processing_utils.BaseVisualRetrieverProcessor.score_multi_vector
    expected = score(queries, passages, batch_size=2, device="cpu")
    with lik_colpali.enabled():
        actual = score(queries, passages, batch_size=2, device="cpu")
    torch.testing.assert_close(actual, expected, **FP32)
    assert lik_calls == ["maxsim"] * 4  # 2 query batches x 2 passage batches


IN_BATCH_LOSSES = {
    "ColbertLoss": lambda **kw: losses.ColbertLoss(**kw),
    "ColbertPairwiseCELoss": lambda **kw: losses.ColbertPairwiseCELoss(**kw),
    "ColbertSigmoidLoss": lambda **kw: losses.ColbertSigmoidLoss(**kw),
}
OPTIONS = {
    "defaults": {},
    "raw scores": {"normalize_scores": False},
    "negative filtering": {"pos_aware_negative_filtering": True, "normalize_scores": False},
}


@pytest.mark.parametrize("options", list(OPTIONS))
@pytest.mark.parametrize("loss_name", list(IN_BATCH_LOSSES))
def test_in_batch_loss_heads(lik_path, lik_calls, loss_name, options):
    g = _generator(3)
    Q, D = _queries(B, LQ, DIM, generator=g), _docs(B, LD, DIM, generator=g)
    loss = IN_BATCH_LOSSES[loss_name](**OPTIONS[options])
    actual, expected = _routed_and_original(loss, [Q, D])
    _assert_same(actual, expected, [Q, D], lik_path)
    assert lik_calls == ["maxsim"]


def test_in_batch_loss_with_offset(lik_path, lik_calls):
    """Multi-GPU form: docs from every rank, this rank's positives start at offset."""
    g = _generator(4)
    Q, D = _queries(2, LQ, DIM, generator=g), _docs(4, LD, DIM, generator=g)
    loss = losses.ColbertLoss()
    actual, expected = _routed_and_original(lambda Q, D: loss(Q, D, offset=2), [Q, D])
    _assert_same(actual, expected, [Q, D], lik_path)
    assert lik_calls == ["maxsim"]


NEGATIVE_LOSS_OPTIONS = {
    "defaults": ({}, ["maxsim_pairs", "maxsim", "maxsim"]),
    "no in-batch term": ({"in_batch_term_weight": 0.0}, ["maxsim_pairs", "maxsim"]),
    "raw scores": ({"normalize_scores": False}, ["maxsim_pairs", "maxsim", "maxsim"]),
}


@pytest.mark.parametrize("options", list(NEGATIVE_LOSS_OPTIONS))
@pytest.mark.parametrize("loss_class", NEGATIVE_LOSSES, ids=lambda cls: cls.__name__)
def test_negative_doc_loss_heads(lik_path, lik_calls, loss_class, options):
    g = _generator(5)
    Q, D = _queries(B, LQ, DIM, generator=g), _docs(B, LD, DIM, generator=g)
    N = _docs(B, K, LD - 2, DIM, generator=g)
    kwargs, calls = NEGATIVE_LOSS_OPTIONS[options]
    loss = loss_class(**kwargs)
    actual, expected = _routed_and_original(loss, [Q, D, N])
    _assert_same(actual, expected, [Q, D, N], lik_path)
    assert lik_calls == calls  # positives as pairs, negatives as kd, then the in-batch term


@pytest.mark.parametrize("loss_class", NEGATIVE_LOSSES, ids=lambda cls: cls.__name__)
def test_negative_doc_loss_with_offset(lik_calls, monkeypatch, loss_class):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    g = _generator(6)
    Q, D = _queries(2, LQ, DIM, generator=g), _docs(4, LD, DIM, generator=g)
    N = _docs(2, K, LD, DIM, generator=g)
    loss = loss_class()
    actual, expected = _routed_and_original(lambda Q, D, N: loss(Q, D, N, offset=2), [Q, D, N])
    _assert_same(actual, expected, [Q, D, N], "cpu")
    assert "maxsim_pairs" in lik_calls


SMOOTH_LOSSES = (losses.ColbertLoss, losses.ColbertPairwiseCELoss, losses.ColbertSigmoidLoss)


@pytest.mark.parametrize(
    "loss_class", SMOOTH_LOSSES + NEGATIVE_LOSSES, ids=lambda cls: cls.__name__
)
def test_smooth_max_goes_through_lik(lik_path, lik_calls, loss_class):
    g = _generator(7)
    Q, D = _queries(B, LQ, DIM, generator=g), _docs(B, LD, DIM, generator=g)
    tensors = [Q, D] if loss_class in SMOOTH_LOSSES else [Q, D, _docs(B, K, LD, DIM, generator=g)]
    loss = loss_class(use_smooth_max=True)
    actual, expected = _routed_and_original(loss, tensors)
    _assert_same(actual, expected, tensors, lik_path)
    # In-batch heads: one smooth in-batch call. Negative-doc heads: positives (pairs),
    # negatives (as pairs of repeated queries), then the in-batch term.
    calls = 1 if loss_class in SMOOTH_LOSSES else 3
    assert lik_calls == ["maxsim_smooth"] * calls


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_keeps_the_library_dtype(lik_calls, monkeypatch, dtype):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    g = _generator(8)
    Q, D = _queries(B, LQ, DIM, generator=g).to(dtype), _docs(B, LD, DIM, generator=g).to(dtype)
    expected = maxsim_module.maxsim_inbatch(Q, D)
    with lik_colpali.enabled():
        actual = maxsim_module.maxsim_inbatch(Q, D)
    assert actual.dtype == expected.dtype == dtype
    torch.testing.assert_close(actual.float(), expected.float(), rtol=2e-2, atol=2e-2)
    assert lik_calls == ["maxsim"]


def _unrouted_cases():
    g = _generator(9)
    Q, D = _queries(2, 4, 8, generator=g), _docs(3, 5, 8, generator=g)
    wide_Q, wide_D = _queries(1, 2, 520, generator=g), _docs(1, 3, 520, generator=g)
    return {
        "float64": lambda: maxsim_module.maxsim_inbatch(Q.double(), D.double()),
        "kd float64": lambda: maxsim_module.maxsim_kd(Q[:1].double(), D[None].double()),
        "head dim above lik's limit": lambda: maxsim_module.maxsim_inbatch(wide_Q, wide_D),
    }


@pytest.mark.parametrize("case", list(_unrouted_cases()))
def test_unsupported_inputs_go_to_the_library(lik_calls, case):
    call = _unrouted_cases()[case]
    expected = call()
    with lik_colpali.enabled():
        actual = call()
    assert lik_calls == []
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def test_backend_variable_and_lik_disable(lik_calls, monkeypatch):
    Q, D = _queries(2, 4, 8, generator=_generator()), _docs(3, 5, 8, generator=_generator())
    lik_colpali.enable()
    monkeypatch.setenv("COLPALI_SCORES_BACKEND", "torch")
    maxsim_module.maxsim_inbatch(Q, D)
    losses.ColbertNegativeCELoss()(Q[:2], D[:2], D[:2, None])
    assert lik_calls == []
    monkeypatch.setenv("COLPALI_SCORES_BACKEND", "auto")
    monkeypatch.setenv("LIK_DISABLE", "1")  # read on every call
    maxsim_module.maxsim_inbatch(Q, D)
    losses.ColbertNegativeCELoss()(Q[:2], D[:2], D[:2, None])
    assert lik_calls == []
    monkeypatch.delenv("LIK_DISABLE")
    maxsim_module.maxsim_inbatch(Q, D)
    assert lik_calls == ["maxsim"]


def _colpali_holders():
    """Every (module, name) in colpali-engine that holds maxsim_inbatch or maxsim_kd."""
    return [
        (module, name)
        for module_name, module in list(sys.modules.items())
        if module_name.startswith("colpali_engine")
        for name, value in vars(module).items()
        if any(value is original for original in ORIGINAL_FUNCTIONS.values())
    ]


def test_enable_and_disable_swap_by_identity():
    holders = _colpali_holders()
    assert (losses, "maxsim_inbatch") in holders and (losses, "maxsim_kd") in holders
    assert (processing_utils, "maxsim_inbatch") in holders
    lik_colpali.enable()
    lik_colpali.enable()  # idempotent
    assert lik_colpali.is_enabled()
    for module, name in holders:
        twin = getattr(module, name)
        assert twin is not ORIGINAL_FUNCTIONS[name]
        assert twin.__wrapped__ is ORIGINAL_FUNCTIONS[name]
    for cls, forward in ORIGINAL_FORWARDS.items():
        assert cls.forward.__wrapped__ is forward
    lik_colpali.disable()
    for module, name in holders:
        assert getattr(module, name) is ORIGINAL_FUNCTIONS[name]
    for cls, forward in ORIGINAL_FORWARDS.items():
        assert cls.forward is forward


def test_context_manager_restores_the_previous_state():
    with lik_colpali.enabled():
        assert maxsim_module.maxsim_kd is not ORIGINAL_FUNCTIONS["maxsim_kd"]
    assert maxsim_module.maxsim_kd is ORIGINAL_FUNCTIONS["maxsim_kd"]
    lik_colpali.enable()
    with lik_colpali.enabled():
        pass
    assert lik_colpali.is_enabled(), "a block inside enable() leaves it enabled"


def test_another_release_keeps_the_library_loss_forwards(monkeypatch):
    monkeypatch.setattr(lik_colpali, "_installed_release", lambda: "0.3.99")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lik_colpali.enable()
    assert any("0.3.99" in str(w.message) for w in caught)
    for cls, forward in ORIGINAL_FORWARDS.items():
        assert cls.forward is forward
    assert maxsim_module.maxsim_kd.__wrapped__ is ORIGINAL_FUNCTIONS["maxsim_kd"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("interpret", ["0", "1"])
def test_a_cpu_without_the_interpreter_stays_with_the_library(
    lik_calls, monkeypatch, interpret, dtype
):
    """lik's reference path is no kernel: there colpali-engine's einsum answers (bit for
    bit, as its own fp16/bf16 baseline tests expect), as its own kernel backend leaves
    CPU calls to it; under the interpreter lik scores."""
    monkeypatch.setattr(integrations, "has_kernel", HAS_KERNEL)
    monkeypatch.setenv("TRITON_INTERPRET", interpret)

    if interpret == "1" and backends.device_backend(torch.device("cpu")) != "interpreter":
        pytest.skip("no interpreter here")
    g = _generator(10)
    Q, D = _queries(2, 4, 8, generator=g).to(dtype), _docs(3, 5, 8, generator=g).to(dtype)
    expected = maxsim_module.maxsim_inbatch(Q, D)
    with lik_colpali.enabled():
        actual = maxsim_module.maxsim_inbatch(Q, D)
    assert actual.dtype == dtype
    if interpret == "0":
        assert lik_calls == []
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    else:
        assert lik_calls == ["maxsim"]
        torch.testing.assert_close(actual.float(), expected.float(), rtol=2e-2, atol=2e-2)
