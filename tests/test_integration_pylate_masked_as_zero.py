"""PyLate's masks through lik as they are: with routing on, colbert_scores,
colbert_kd_scores and colbert_scores_pairwise (pylate 1.6, the real package) give PyLate's
own numbers and gradients w.r.t. Q and D, while bool masks reach lik's masked-as-zero
entry without a zeroed copy of the embeddings.

Masks with holes, a fully masked doc, an all-valid doc, queries and docs that lean apart
(negative similarities: a masked doc token's 0 wins many query tokens), odd shapes (Lq 1,
Ld 1, head dims 48, 96 and 37). Both CPU paths: the reference and, without a GPU, the
generated kernels under the interpreter.
"""

from __future__ import annotations

import pytest
import torch

colbert = pytest.importorskip("pylate.scores.colbert")

from lik import integrations, runtime  # noqa: E402
from lik.integrations import pylate as lik_pylate  # noqa: E402
from lik.runtime import api  # noqa: E402
from lik.runtime.reference import maxsim_reference  # noqa: E402

FP32 = {"rtol": 1e-5, "atol": 1e-5}
ZERO = "maxsim_masked_as_zero"
# (Nq, Nd or K, Lq, Ld, d)
SHAPES = {
    "holes": (3, 4, 6, 9, 24),
    "Lq 1": (3, 4, 1, 9, 48),
    "Ld 1": (3, 4, 5, 1, 48),
    "d 96": (2, 3, 4, 11, 96),
    "d 37": (3, 3, 5, 7, 37),
}


@pytest.fixture(autouse=True)
def integration_off_afterwards():
    yield
    lik_pylate.disable()


@pytest.fixture(autouse=True)
def reference_path_counts_as_a_kernel(monkeypatch):
    """As in test_integration_pylate: the CPU reference path is compared too."""
    monkeypatch.setattr(integrations, "has_kernel", lambda device: device.type in ("cpu", "cuda"))


@pytest.fixture
def lik_calls(monkeypatch):
    """(name, its Q and D arguments) of every lik entry a call reached."""
    calls = []
    for module, name in ((runtime, "maxsim"), (runtime, "maxsim_pairs"), (api, ZERO)):
        real = getattr(module, name)

        def recording(Q, D, *args, _real=real, _name=name, **kwargs):
            calls.append((_name, Q, D))
            return _real(Q, D, *args, **kwargs)

        monkeypatch.setattr(module, name, recording)
    return calls


def _inputs(shape, kd=False, seed=0):
    """Embeddings leaning apart along their first axis, a query mask with holes, a doc
    mask with holes with one all-valid doc and one fully masked doc (bool)."""
    Nq, Nd, Lq, Ld, d = shape
    g = torch.Generator().manual_seed(seed)
    lean = 1.6 * d**0.25
    d_axes = (Nq, Nd, Ld) if kd else (Nd, Ld)
    Q, D = torch.randn(Nq, Lq, d, generator=g), torch.randn(*d_axes, d, generator=g)
    Q[..., 0] += lean
    D[..., 0] -= lean
    q_mask = torch.rand(Nq, Lq, generator=g) < 0.7
    q_mask[:, 0] = True
    d_mask = torch.rand(d_axes, generator=g) < 0.6
    d_mask.view(-1, Ld)[0] = True
    d_mask.view(-1, Ld)[-1] = False
    return Q, D, q_mask, d_mask


def _with_grads(call, Q, D, seed=1):
    leaves = [Q.clone().requires_grad_(), D.clone().requires_grad_()]
    out = call(*leaves)
    (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))).sum().backward()
    return out.detach(), leaves[0].grad, leaves[1].grad


def _routed_matches_pylate(call, Q, D, tolerance=FP32):
    want = _with_grads(call, Q, D)
    with lik_pylate.enabled():
        got = _with_grads(call, Q, D)
    assert got[0].dtype == want[0].dtype
    for actual, expected in zip(got, want, strict=True):
        torch.testing.assert_close(actual, expected, **tolerance)
    return want[0]


def _assert_zero_won(Q, D, q_mask, d_mask, pylate_scores):
    """The inputs tell the conventions apart (with one-token docs they cannot: a doc with
    a masked token has no valid one, and scores 0 either way)."""
    if D.shape[-2] > 1:
        own = maxsim_reference(Q, D, q_mask, d_mask)
        assert (pylate_scores > own + 1e-4).any(), "no masked token's 0 won: a weak case"


@pytest.mark.parametrize("shape", list(SHAPES))
def test_colbert_scores(lik_path, lik_calls, shape):
    Q, D, q_mask, d_mask = _inputs(SHAPES[shape])

    def call(q, d):
        return colbert.colbert_scores(q, d, queries_mask=q_mask, documents_mask=d_mask)

    pylate_scores = _routed_matches_pylate(call, Q, D)
    _assert_zero_won(Q, D, q_mask, d_mask, pylate_scores)
    assert [name for name, _, _ in lik_calls] == [ZERO]


@pytest.mark.parametrize("shape", list(SHAPES))
def test_colbert_kd_scores(lik_path, lik_calls, shape):
    Q, D, q_mask, d_mask = _inputs(SHAPES[shape], kd=True, seed=2)

    def call(q, d):
        return colbert.colbert_kd_scores(q, d, queries_mask=q_mask, documents_mask=d_mask)

    pylate_scores = _routed_matches_pylate(call, Q, D)
    _assert_zero_won(Q, D, q_mask, d_mask, pylate_scores)
    assert [name for name, _, _ in lik_calls] == [ZERO]


@pytest.mark.parametrize("shape", list(SHAPES))
def test_colbert_scores_pairwise(lik_path, lik_calls, shape):
    Nq, _, Lq, Ld, d = SHAPES[shape]
    Q, D, _, _ = _inputs((Nq, Nq, Lq, Ld, d), seed=3)
    # Looked up per call: the routed twin replaces the module's function while enabled.
    pylate_scores = _routed_matches_pylate(
        lambda q, d: colbert.colbert_scores_pairwise(q, d), Q, D
    )
    assert (pylate_scores < 0).any()  # negative similarities: no padding to floor them
    assert [name for name, _, _ in lik_calls] == ["maxsim_pairs"]


def test_without_a_query_mask_and_in_bf16(lik_path, lik_calls):
    Q, D, _, d_mask = _inputs(SHAPES["holes"], seed=4)
    Q, D = Q.to(torch.bfloat16), D.to(torch.bfloat16)

    def call(q, d):
        return colbert.colbert_scores(q, d, documents_mask=d_mask)

    pylate_scores = _routed_matches_pylate(call, Q, D, {"rtol": 2e-2, "atol": 5e-2})
    assert pylate_scores.dtype == torch.bfloat16
    assert [name for name, _, _ in lik_calls] == [ZERO]


def test_bool_masks_reach_lik_as_they_are(lik_path, monkeypatch):
    """No zeroed copy: the entry gets the caller's Q, D and masks themselves (for
    ColBERTScores, D's [groups * N] view)."""
    seen = []
    real = api.maxsim_masked_as_zero

    def recording(Q, D, q_mask, d_mask, **kwargs):
        seen.append((Q, D, q_mask, d_mask))
        return real(Q, D, q_mask, d_mask, **kwargs)

    monkeypatch.setattr(api, ZERO, recording)
    Q, D, q_mask, d_mask = _inputs(SHAPES["holes"], kd=True, seed=5)
    with lik_pylate.enabled():
        colbert.colbert_kd_scores(Q, D, queries_mask=q_mask, documents_mask=d_mask)
        colbert.ColBERTScores()(Q, D, queries_mask=q_mask, documents_mask=d_mask)
    (q1, d1, qm1, dm1), (q2, d2, qm2, dm2) = seen
    assert q1 is Q and d1 is D and qm1 is q_mask and dm1 is d_mask
    assert q2 is Q and qm2 is q_mask
    assert d2.data_ptr() == D.data_ptr() and dm2.data_ptr() == d_mask.data_ptr()


def test_where_lik_has_no_such_kernel_the_copies_answer(lik_path, lik_calls, monkeypatch):
    """An entry that declines (as on a device with no masked-as-zero kernel) leaves the
    call to the zeroed copies through lik.maxsim: PyLate's numbers still."""

    def no_kernel(*args, **kwargs):
        raise NotImplementedError("no masked-as-zero kernel here")

    monkeypatch.setattr(api, ZERO, no_kernel)
    Q, D, q_mask, d_mask = _inputs(SHAPES["holes"], seed=6)

    def call(q, d):
        return colbert.colbert_scores(q, d, queries_mask=q_mask, documents_mask=d_mask)

    _routed_matches_pylate(call, Q, D)
    assert [name for name, _, _ in lik_calls] == ["maxsim"]
