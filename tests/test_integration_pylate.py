"""PyLate integration: with lik routing on, PyLate's score functions and losses give
PyLate's own numbers and input gradients; anything lik does not take, and LIK_DISABLE=1,
goes to PyLate unchanged; disable() puts the originals back by identity.

Inputs are random fp32 batches with padding (a doc with no padding, a fully masked doc,
masked query tokens), compared at fp32 tolerances. Paths: the CPU reference (TRITON_INTERPRET
off) and, where there is no GPU, the generated kernels under the interpreter (tiny shapes).
Bool doc masks reach lik as they are (ZERO: the masked-as-zero entry); masks of other
dtypes through zeroed copies (lik.maxsim).
"""

from __future__ import annotations

import sys

import pytest
import torch

colbert = pytest.importorskip("pylate.scores.colbert")

from lik import integrations, runtime  # noqa: E402
from lik.integrations import pylate as lik_pylate  # noqa: E402
from lik.runtime import api, backends  # noqa: E402
from lik.runtime.reference import maxsim_reference  # noqa: E402

FP32 = {"rtol": 1e-5, "atol": 1e-5}
ORIGINALS = {
    name: getattr(colbert, name)
    for name in ("colbert_scores", "colbert_kd_scores", "colbert_scores_pairwise")
}
ORIGINAL_CALL = colbert.ColBERTScores.__call__
HAS_KERNEL = integrations.has_kernel
ZERO = "maxsim_masked_as_zero"  # the entry a bool doc mask takes


@pytest.fixture(autouse=True)
def integration_off_afterwards():
    yield
    lik_pylate.disable()


@pytest.fixture(autouse=True)
def reference_path_counts_as_a_kernel(monkeypatch):
    """The adapters are compared on the CPU reference path as well as under the
    interpreter. Outside tests an integration leaves CPU calls without the interpreter
    to the library (test_a_cpu_without_the_interpreter_stays_with_the_library)."""
    monkeypatch.setattr(integrations, "has_kernel", lambda device: device.type in ("cpu", "cuda"))


@pytest.fixture
def lik_calls(monkeypatch):
    """Names of the lik entry points that calls reached (empty: PyLate scored alone)."""
    calls = []
    for module, name in ((runtime, "maxsim"), (runtime, "maxsim_pairs"), (api, ZERO)):
        real = getattr(module, name)

        def recording(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, recording)
    return calls


def _generator(seed=0):
    return torch.Generator().manual_seed(seed)


def _tokens(*shape, generator, lean):
    """Random token vectors leaning along the first axis. Queries lean one way and docs the
    other, so many query tokens find no valid doc token above 0 and padding decides."""
    tokens = torch.randn(*shape, generator=generator)
    tokens[..., 0] += 3.0 * lean
    return tokens


def _queries(*shape, generator):
    return _tokens(*shape, generator=generator, lean=1.0)


def _docs(*shape, generator):
    return _tokens(*shape, generator=generator, lean=-1.0)


def _assert_padding_matters(Q, D, q_mask, d_mask, pylate_scores):
    """The inputs tell the conventions apart: lik's own masks (a masked doc token never
    wins) would give other scores than PyLate's (it competes as 0)."""
    if d_mask is None:
        return
    q_valid = None if q_mask is None else q_mask.bool()
    own = maxsim_reference(Q, D, q_valid, d_mask.bool())
    assert not torch.allclose(own, pylate_scores.detach(), rtol=1e-3, atol=1e-3)


def _doc_mask(*shape, generator):
    """Random padding, plus a doc with none (its scores may go below 0) and one fully masked."""
    mask = torch.rand(*shape, generator=generator) < 0.6
    rows = mask.view(-1, shape[-1])
    rows[0] = True
    rows[-1] = False
    return mask


def _as_mask_dtype(mask, kind):
    return {"bool": mask, "float": mask.float(), "long": mask.long(), "none": None}[kind]


def _run_with_grads(call, tensors, seed=1):
    """call(*leaf copies) -> (scores, grads of a random weighting of the scores)."""
    leaves = [t.clone().requires_grad_() for t in tensors]
    out = call(*leaves)
    weights = torch.randn(out.shape, generator=_generator(seed))
    (out * weights).sum().backward()
    return out.detach(), [leaf.grad for leaf in leaves]


def _assert_same(actual, expected):
    (out, grads), (ref, ref_grads) = actual, expected
    assert out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, **FP32)
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref_grad, **FP32)


def _routed_and_original(call, tensors):
    """(call with lik routing on, the same call on PyLate alone), scores and gradients."""
    expected = _run_with_grads(call, tensors)
    with lik_pylate.enabled():
        actual = _run_with_grads(call, tensors)
    return actual, expected


# Sizes: small enough for the interpreter (B <= 3, L <= 10, d <= 32).
NQ, ND, K, LQ, LD, DIM = 3, 3, 2, 6, 9, 24


@pytest.mark.parametrize("mask_kind", ["bool", "float", "long", "none"])
def test_colbert_scores(lik_path, lik_calls, mask_kind):
    g = _generator()
    Q, D = _queries(NQ, LQ, DIM, generator=g), _docs(ND, LD, DIM, generator=g)
    q_mask = _as_mask_dtype(torch.rand(NQ, LQ, generator=g) < 0.7, mask_kind)
    d_mask = _as_mask_dtype(_doc_mask(ND, LD, generator=g), mask_kind)

    def call(Q, D):
        return colbert.colbert_scores(Q, D, queries_mask=q_mask, documents_mask=d_mask)

    actual, expected = _routed_and_original(call, [Q, D])
    _assert_same(actual, expected)
    _assert_padding_matters(Q, D, q_mask, d_mask, expected[0])
    assert lik_calls == [ZERO if mask_kind == "bool" else "maxsim"]


@pytest.mark.parametrize("mask_kind", ["bool", "float", "none"])
def test_colbert_kd_scores(lik_path, lik_calls, mask_kind):
    g = _generator(1)
    Q, D = _queries(NQ, LQ, DIM, generator=g), _docs(NQ, K, LD, DIM, generator=g)
    q_mask = _as_mask_dtype(torch.rand(NQ, LQ, generator=g) < 0.7, mask_kind)
    d_mask = _as_mask_dtype(_doc_mask(NQ, K, LD, generator=g), mask_kind)

    def call(Q, D):
        return colbert.colbert_kd_scores(Q, D, queries_mask=q_mask, documents_mask=d_mask)

    actual, expected = _routed_and_original(call, [Q, D])
    _assert_same(actual, expected)
    _assert_padding_matters(Q, D, q_mask, d_mask, expected[0])
    assert lik_calls == [ZERO if mask_kind == "bool" else "maxsim"]


def test_colbert_scores_pairwise(lik_path, lik_calls):
    g = _generator(2)
    Q, D = _queries(NQ, LQ, DIM, generator=g), _docs(NQ, LD, DIM, generator=g)
    actual, expected = _routed_and_original(
        lambda Q, D: colbert.colbert_scores_pairwise(Q, D), [Q, D]
    )
    _assert_same(actual, expected)
    assert lik_calls == ["maxsim_pairs"]


@pytest.mark.parametrize("with_query_mask", [True, False])
def test_colbert_scores_class_is_one_lik_call(lik_path, lik_calls, with_query_mask):
    g = _generator(3)
    Q, D = _queries(NQ, LQ, DIM, generator=g), _docs(2, K, LD, DIM, generator=g)
    q_mask = torch.rand(NQ, LQ, generator=g) < 0.7 if with_query_mask else None
    d_mask = _doc_mask(2, K, LD, generator=g)
    metric = colbert.ColBERTScores()  # made before enabling, as a loss holds it

    def call(Q, D):
        return metric(Q, D, queries_mask=q_mask, documents_mask=d_mask)

    actual, expected = _routed_and_original(call, [Q, D])
    _assert_same(actual, expected)
    assert actual[0].shape == (NQ, 2 * K)
    _assert_padding_matters(Q, D.flatten(0, 1), q_mask, d_mask.flatten(0, 1), expected[0])
    assert lik_calls == [ZERO]


def test_forward_only_calls(lik_path, lik_calls):
    g = _generator(4)
    Q, D = _queries(NQ, LQ, DIM, generator=g), _docs(ND, LD, DIM, generator=g)
    d_mask = _doc_mask(ND, LD, generator=g)
    expected = colbert.colbert_scores(Q, D, documents_mask=d_mask)
    with lik_pylate.enabled(), torch.no_grad():
        actual = colbert.colbert_scores(Q, D, documents_mask=d_mask)
    torch.testing.assert_close(actual, expected, **FP32)
    assert lik_calls == [ZERO]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_keeps_pylates_dtype(lik_calls, monkeypatch, dtype):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    g = _generator(5)
    Q, D = _queries(NQ, LQ, DIM, generator=g), _docs(ND, LD, DIM, generator=g)
    Q, D = torch.nn.functional.normalize(Q, dim=-1), torch.nn.functional.normalize(D, dim=-1)
    Q, D = Q.to(dtype), D.to(dtype)
    d_mask = _doc_mask(ND, LD, generator=g)
    for mask in (d_mask, d_mask.float()):  # a float mask promotes PyLate's scores to fp32
        expected = colbert.colbert_scores(Q, D, documents_mask=mask)
        with lik_pylate.enabled():
            actual = colbert.colbert_scores(Q, D, documents_mask=mask)
        assert actual.dtype == expected.dtype
        torch.testing.assert_close(actual.float(), expected.float(), rtol=2e-2, atol=2e-2)
    assert lik_calls == [ZERO, "maxsim"]


def _unrouted_cases():
    g = _generator(6)
    Q, D = torch.randn(2, 4, 8, generator=g), torch.randn(3, 5, 8, generator=g)
    wide_Q, wide_D = torch.randn(1, 2, 520, generator=g), torch.randn(1, 3, 520, generator=g)
    return {
        "float64": lambda: colbert.colbert_scores(Q.double(), D.double()),
        "explicit torch backend": lambda: colbert.colbert_scores(Q, D, backend="torch"),
        "lists": lambda: colbert.colbert_scores(Q.tolist(), D.tolist()),
        "broadcast mask": lambda: colbert.colbert_scores(
            Q, D, documents_mask=torch.ones(1, 5, dtype=torch.bool)
        ),
        "head dim above lik's limit": lambda: colbert.colbert_scores(wide_Q, wide_D),
        "pairwise, unequal batches": lambda: colbert.colbert_scores_pairwise(Q, D),
        "kd float64": lambda: colbert.colbert_kd_scores(Q[:1].double(), D[None].double()),
    }


@pytest.mark.parametrize("case", list(_unrouted_cases()))
def test_unsupported_inputs_go_to_pylate(lik_calls, case):
    call = _unrouted_cases()[case]
    expected = call()
    with lik_pylate.enabled():
        actual = call()
    assert lik_calls == []
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def test_pylate_backend_variable_and_lik_disable(lik_calls, monkeypatch):
    Q, D = torch.randn(2, 4, 8), torch.randn(3, 5, 8)
    lik_pylate.enable()
    monkeypatch.setenv("PYLATE_SCORES_BACKEND", "torch")
    colbert.colbert_scores(Q, D)
    assert lik_calls == []
    monkeypatch.setenv("PYLATE_SCORES_BACKEND", "auto")
    monkeypatch.setenv("LIK_DISABLE", "1")  # read on every call
    colbert.colbert_scores(Q, D)
    colbert.ColBERTScores()(Q, D[:, None])
    assert lik_calls == []
    monkeypatch.setenv("LIK_DISABLE", "0")
    colbert.colbert_scores(Q, D)
    assert lik_calls == ["maxsim"]


def _pylate_holders():
    """Every (module, name) in PyLate that holds one of the original score functions."""
    return [
        (module, name)
        for module_name, module in list(sys.modules.items())
        if module_name.startswith("pylate")
        for name, value in vars(module).items()
        if any(value is original for original in ORIGINALS.values())
    ]


def test_enable_and_disable_swap_by_identity():
    pytest.importorskip("pylate.losses")
    from pylate.losses import distillation
    from pylate.scores import similarity_functions

    holders = _pylate_holders()
    assert (similarity_functions, "colbert_scores") in holders
    assert (distillation, "colbert_kd_scores") in holders
    lik_pylate.enable()
    lik_pylate.enable()  # idempotent
    assert lik_pylate.is_enabled()
    for module, name in holders:
        twin = getattr(module, name)
        assert twin is not ORIGINALS[name] and twin.__wrapped__ is ORIGINALS[name]
    assert colbert.ColBERTScores.__call__.__wrapped__ is ORIGINAL_CALL
    default_metric = distillation.Distillation.__init__.__defaults__[0]
    assert default_metric is colbert.colbert_kd_scores
    lik_pylate.disable()
    for module, name in holders:
        assert getattr(module, name) is ORIGINALS[name]
    assert colbert.ColBERTScores.__call__ is ORIGINAL_CALL
    assert distillation.Distillation.__init__.__defaults__[0] is ORIGINALS["colbert_kd_scores"]


def test_context_manager_restores_the_previous_state():
    with lik_pylate.enabled():
        assert colbert.colbert_scores is not ORIGINALS["colbert_scores"]
    assert colbert.colbert_scores is ORIGINALS["colbert_scores"]
    lik_pylate.enable()
    with lik_pylate.enabled():
        pass
    assert lik_pylate.is_enabled(), "a block inside enable() leaves it enabled"


def test_a_twin_kept_after_disable_calls_the_original(lik_calls):
    lik_pylate.enable()
    twin = colbert.colbert_scores
    lik_pylate.disable()
    twin(torch.randn(2, 4, 8), torch.randn(3, 5, 8))
    assert lik_calls == []


# Losses, through a stand-in model: token ids -> rows of a learnable table. Gradients are
# compared on the table, i.e. what reaches the model's weights.

# Query words and doc words lean apart (as in _tokens), so padding often decides a max.
QUERY_WORDS, DOC_WORDS, PAD_ID, SKIP_ID = range(1, 20), range(20, 40), 0, 27


class TokenTable(torch.nn.Module):
    def __init__(self, dim, do_query_expansion=False):
        super().__init__()
        table = torch.randn(DOC_WORDS.stop, dim, generator=_generator(7))
        table[QUERY_WORDS.start : QUERY_WORDS.stop, 0] += 3.0
        table[DOC_WORDS.start : DOC_WORDS.stop, 0] -= 3.0
        self.table = torch.nn.Parameter(table)
        self.skiplist = [SKIP_ID]
        self.do_query_expansion = do_query_expansion

    def forward(self, features):
        return {"token_embeddings": self.table[features["input_ids"]]}


def _features(batch, length, generator, words=DOC_WORDS):
    """Tokenized texts: random ids (some in the skiplist) and trailing padding."""
    ids = torch.randint(words.start, words.stop, (batch, length), generator=generator)
    ids[ids % 5 == 0] = SKIP_ID
    lengths = torch.randint(2, length + 1, (batch,), generator=generator)
    lengths[0] = length
    attention = (torch.arange(length) < lengths[:, None]).long()
    return {"input_ids": ids * attention + PAD_ID * (1 - attention), "attention_mask": attention}


def _loss_and_table_grad(make_loss, features, labels=None, dim=DIM, expansion=False):
    model = TokenTable(dim, do_query_expansion=expansion)
    loss_fn = make_loss(model)
    loss = loss_fn(features, labels) if labels is not None else loss_fn(features)
    loss.backward()
    return loss.detach(), [model.table.grad]


def _compare_loss(make_loss, features, labels=None, expansion=False):
    expected = _loss_and_table_grad(make_loss, features, labels, expansion=expansion)
    with lik_pylate.enabled():
        actual = _loss_and_table_grad(make_loss, features, labels, expansion=expansion)
    _assert_same(actual, expected)


@pytest.mark.parametrize("expansion", [False, True])
def test_contrastive_loss(lik_path, lik_calls, expansion):
    losses = pytest.importorskip("pylate.losses")
    g = _generator(8)
    features = [_features(3, 6, g, QUERY_WORDS), _features(3, 9, g), _features(3, 9, g)]
    _compare_loss(
        lambda model: losses.Contrastive(model, score_mini_batch_size=2), features, None, expansion
    )
    assert lik_calls == [ZERO] * 2  # two query chunks


def test_cached_contrastive_loss(lik_path, lik_calls):
    losses = pytest.importorskip("pylate.losses")
    g = _generator(9)
    features = [_features(3, 6, g, QUERY_WORDS), _features(3, 9, g)]
    _compare_loss(lambda model: losses.CachedContrastive(model, mini_batch_size=2), features)
    assert lik_calls == [ZERO] * 2


def test_distillation_loss(lik_path, lik_calls):
    losses = pytest.importorskip("pylate.losses")
    g = _generator(10)
    candidates = 3  # min-max normalized scores of 2 candidates would be just 0 and 1
    features = [_features(3, 6, g, QUERY_WORDS), _features(3 * candidates, 9, g)]
    labels = torch.randn(3, candidates, generator=g)
    # Built inside the block, the loss takes the routed twin as its default score_metric.
    _compare_loss(lambda model: losses.Distillation(model), features, labels)
    assert lik_calls == [ZERO]


@pytest.mark.parametrize("interpret", ["0", "1"])
def test_a_cpu_without_the_interpreter_stays_with_the_library(lik_calls, monkeypatch, interpret):
    """lik's reference path is no kernel: there PyLate's torch path answers, as PyLate's
    own kernel backends leave CPU calls to it; under the interpreter lik scores."""
    monkeypatch.setattr(integrations, "has_kernel", HAS_KERNEL)
    monkeypatch.setenv("TRITON_INTERPRET", interpret)

    if interpret == "1" and backends.device_backend(torch.device("cpu")) != "interpreter":
        pytest.skip("no interpreter here")
    g = _generator(11)
    Q, D = _queries(2, 4, 8, generator=g), _docs(3, 5, 8, generator=g)
    d_mask = _doc_mask(3, 5, generator=g)
    expected = colbert.colbert_scores(Q, D, documents_mask=d_mask)
    with lik_pylate.enabled():
        actual = colbert.colbert_scores(Q, D, documents_mask=d_mask)
    if interpret == "0":
        assert lik_calls == []
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    else:
        assert lik_calls == [ZERO]
        torch.testing.assert_close(actual, expected, **FP32)
