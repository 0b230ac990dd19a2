"""Every value PyLate and colpali-engine accept, lik scores or hands back (issue: the
integrations' input table), and nothing of lik's own is warned through them.

Each row of a table is one call of a wrapped function with one kind of argument value:
tensors or lists, every mask dtype, fp32/fp16/bf16/float64, odd head dims, empty
batches, tau as a number, a tensor or 0, and the backend switches. The row records who
answers it with the integration enabled: "lik" (a lik entry point returned the scores)
or "original" (the library's own function, unchanged). Either way the enabled call
returns what the plain call returns (bit for bit from the original, at lik's tolerance
from lik), or raises the error the plain call raises.

The calls run on CPU tensors under the Triton interpreter, where lik has kernels (on a
CPU without it every call is the library's: tests/test_integration_pylate.py and
tests/test_integration_colpali.py check that rule).
"""

from __future__ import annotations

import importlib.util
import warnings

import pytest
import torch

from lik import runtime
from lik.runtime import api, backends, norm_warning, variants

LIK, ORIGINAL = "lik", "original"
ENTRY_POINTS = (
    (runtime, "maxsim"), (runtime, "maxsim_pairs"), (runtime, "maxsim_varlen"),
    (runtime, "score_pairs_packed"), (variants, "maxsim_smooth"), (variants, "maxsim_weighted"),
    (api, "maxsim_masked_as_zero"),  # PyLate's bool doc masks, read as zeros
)  # fmt: skip


@pytest.fixture(autouse=True)
def interpreted(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if backends.device_backend(torch.device("cpu")) != "interpreter":
        pytest.skip("the tables run CPU tensors under the Triton interpreter")


@pytest.fixture
def lik_scored(monkeypatch):
    """Names of the lik entry points that returned scores (empty: the library answered)."""
    scored = []
    for module, name in ENTRY_POINTS:
        real = getattr(module, name)

        def recording(*args, _real=real, _name=name, **kwargs):
            out = _real(*args, **kwargs)
            scored.append(_name)
            return out

        monkeypatch.setattr(module, name, recording)
    return scored


def _g(seed=0):
    return torch.Generator().manual_seed(seed)


def _randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=_g(seed)).to(dtype)


def _outcome(call):
    """(result, None) or (None, the exception's type)."""
    try:
        return call(), None
    except Exception as error:  # the library's own errors are part of its behaviour
        return None, type(error)


def _check_row(integration, call, expected, lik_scored, tolerance=1e-5):
    plain, plain_error = _outcome(call)
    with integration.enabled():
        routed, routed_error = _outcome(call)
    who = LIK if lik_scored else ORIGINAL
    assert who == expected, f"answered by {who} ({lik_scored}), the table says {expected}"
    assert routed_error == plain_error
    if plain_error is not None:
        return
    assert routed.dtype == plain.dtype and routed.shape == plain.shape
    if who == ORIGINAL:
        torch.testing.assert_close(routed, plain, rtol=0, atol=0, equal_nan=True)
    else:
        torch.testing.assert_close(routed.double(), plain.double(), rtol=tolerance,
                                   atol=tolerance, equal_nan=True)  # fmt: skip


# PyLate 1.6: colbert_scores(Q, D, queries_mask, documents_mask, backend),
# colbert_kd_scores (same, D [Nq, K, Ld, d]), colbert_scores_pairwise(Q, D, backend),
# ColBERTScores()(Q, D [Qd, N, Ld, d], ...).
def _pylate_rows():
    from pylate.scores import colbert as c

    Q, D, D4 = _randn(2, 4, 8), _randn(3, 5, 8, seed=1), _randn(2, 3, 5, 8, seed=2)
    qm = torch.rand(2, 4, generator=_g(3)) < 0.7
    dm = torch.rand(3, 5, generator=_g(4)) < 0.6
    dm4 = torch.rand(2, 3, 5, generator=_g(5)) < 0.6
    half = {"tolerance": 2e-2}
    return {
        "fp32, no masks": (lambda: c.colbert_scores(Q, D), LIK),
        "bool masks": (lambda: c.colbert_scores(Q, D, qm, dm), LIK),
        "float masks": (lambda: c.colbert_scores(Q, D, qm.float(), dm.float()), LIK),
        "long masks": (lambda: c.colbert_scores(Q, D, qm.long(), dm.long()), LIK),
        "int32 and uint8 masks": (lambda: c.colbert_scores(Q, D, qm.int(), dm.to(torch.uint8)),
                                  LIK),  # fmt: skip
        "float64 masks (float64 scores)": (
            lambda: c.colbert_scores(Q, D, qm.double(), dm.double()), LIK),
        "real-valued masks": (lambda: c.colbert_scores(Q, D, qm * 0.5, dm * 2.0), LIK),
        "fp16": (lambda: c.colbert_scores(Q.half(), D.half(), qm, dm), LIK, half),
        "bf16": (lambda: c.colbert_scores(Q.bfloat16(), D.bfloat16(), qm, dm), LIK, half),
        "float64": (lambda: c.colbert_scores(Q.double(), D.double()), ORIGINAL),
        "mixed dtypes": (lambda: c.colbert_scores(Q, D.half()), ORIGINAL),
        "lists": (lambda: c.colbert_scores(Q.tolist(), D.tolist()), ORIGINAL),
        "head dim 1": (lambda: c.colbert_scores(Q[..., :1], D[..., :1], qm, dm), LIK),
        "head dim 3": (lambda: c.colbert_scores(Q[..., :3], D[..., :3]), LIK),
        "head dim 33": (lambda: c.colbert_scores(_randn(2, 3, 33), _randn(2, 4, 33, seed=1)),
                        LIK),  # fmt: skip
        "head dim 520": (lambda: c.colbert_scores(_randn(1, 2, 520), _randn(1, 3, 520)),
                         ORIGINAL),  # fmt: skip
        "head dims differ": (lambda: c.colbert_scores(Q, D[..., :6]), ORIGINAL),
        "no queries": (lambda: c.colbert_scores(Q[:0], D), ORIGINAL),
        "no docs": (lambda: c.colbert_scores(Q, D[:0]), ORIGINAL),
        "zero-width docs": (lambda: c.colbert_scores(Q, D[:, :0]), ORIGINAL),
        "a broadcast mask [1, Ld]": (lambda: c.colbert_scores(Q, D, None, dm[:1]), ORIGINAL),
        "non-contiguous": (lambda: c.colbert_scores(Q.transpose(0, 1).contiguous()
                                                    .transpose(0, 1), D), LIK),  # fmt: skip
        "backend='auto'": (lambda: c.colbert_scores(Q, D, backend="auto"), LIK),
        "backend='torch'": (lambda: c.colbert_scores(Q, D, backend="torch"), ORIGINAL),
        "kd, bool masks": (lambda: c.colbert_kd_scores(Q, D4, qm, dm4), LIK),
        "kd, float masks": (lambda: c.colbert_kd_scores(Q, D4, qm.float(), dm4.float()), LIK),
        "kd, float64": (lambda: c.colbert_kd_scores(Q.double(), D4.double()), ORIGINAL),
        "kd, candidates of other queries": (lambda: c.colbert_kd_scores(Q, D4[:1]), ORIGINAL),
        "pairwise": (lambda: c.colbert_scores_pairwise(Q, D[:2]), LIK),
        "pairwise, unequal batches": (lambda: c.colbert_scores_pairwise(Q, D), ORIGINAL),
        "pairwise, lists": (lambda: c.colbert_scores_pairwise(Q.tolist(), D[:2].tolist()),
                            ORIGINAL),  # fmt: skip
        "ColBERTScores": (lambda: c.ColBERTScores()(Q, D4, qm, dm4), LIK),
        "ColBERTScores, float64": (lambda: c.ColBERTScores()(Q.double(), D4.double()), ORIGINAL),
    }


# colpali-engine 0.3.18: maxsim_inbatch(query, doc), maxsim_kd(query, doc),
# score_multi_vector(qs, ps, batch_size, device), and the Colbert loss heads with
# use_smooth_max and tau.
def _colpali_rows():
    from colpali_engine.loss import late_interaction_losses as losses
    from colpali_engine.utils import maxsim as m
    from colpali_engine.utils.processing_utils import BaseVisualRetrieverProcessor

    Q, D, D4 = _randn(2, 4, 8), _randn(3, 5, 8, seed=1), _randn(2, 3, 5, 8, seed=2)
    score = BaseVisualRetrieverProcessor.score_multi_vector
    half = {"tolerance": 2e-2}

    def smooth(loss_class, tau, *extra):
        return lambda: loss_class(use_smooth_max=True, tau=tau)(Q, D[:2], *extra)

    return {
        "inbatch fp32": (lambda: m.maxsim_inbatch(Q, D), LIK),
        "inbatch fp16": (lambda: m.maxsim_inbatch(Q.half(), D.half()), LIK, half),
        "inbatch bf16": (lambda: m.maxsim_inbatch(Q.bfloat16(), D.bfloat16()), LIK, half),
        "inbatch float64": (lambda: m.maxsim_inbatch(Q.double(), D.double()), ORIGINAL),
        "inbatch mixed dtypes": (lambda: m.maxsim_inbatch(Q, D.half()), ORIGINAL),
        "inbatch lists": (lambda: m.maxsim_inbatch(Q.tolist(), D.tolist()), ORIGINAL),
        "inbatch head dim 1": (lambda: m.maxsim_inbatch(Q[..., :1], D[..., :1]), LIK),
        "inbatch head dim 5": (lambda: m.maxsim_inbatch(Q[..., :5], D[..., :5]), LIK),
        "inbatch head dim 520": (lambda: m.maxsim_inbatch(_randn(1, 2, 520), _randn(1, 3, 520)),
                                 ORIGINAL),  # fmt: skip
        "inbatch no queries": (lambda: m.maxsim_inbatch(Q[:0], D), ORIGINAL),
        "inbatch no docs": (lambda: m.maxsim_inbatch(Q, D[:0]), ORIGINAL),
        "kd fp32": (lambda: m.maxsim_kd(Q, D4), LIK),
        "kd float64": (lambda: m.maxsim_kd(Q.double(), D4.double()), ORIGINAL),
        "kd no candidates": (lambda: m.maxsim_kd(Q, D4[:, :0]), ORIGINAL),
        "score_multi_vector, lists": (
            lambda: score(list(Q), list(D), batch_size=2, device="cpu"), LIK),
        "score_multi_vector, one tensor": (lambda: score(Q, D, device="cpu"), LIK),
        "smooth tau 0.1": (smooth(losses.ColbertLoss, 0.1), LIK),
        "smooth tau 1 (an int)": (smooth(losses.ColbertLoss, 1), LIK),
        "smooth tau tensor(0.1)": (smooth(losses.ColbertLoss, torch.tensor(0.1)), ORIGINAL),
        "smooth tau 0": (smooth(losses.ColbertLoss, 0), ORIGINAL),
        "smooth tau 0.0": (smooth(losses.ColbertLoss, 0.0), ORIGINAL),
        "smooth tau -0.1": (smooth(losses.ColbertLoss, -0.1), ORIGINAL),
        "smooth tau 1e-40 (fp32 subnormal)": (smooth(losses.ColbertLoss, 1e-40), ORIGINAL),
        "smooth tau inf": (smooth(losses.ColbertLoss, float("inf")), ORIGINAL),
        "smooth tau True": (smooth(losses.ColbertLoss, True), ORIGINAL),
        "negative CE, smooth tau 0.1": (smooth(losses.ColbertNegativeCELoss, 0.1, D4[:, :2]),
                                        LIK),  # fmt: skip
        "negative CE, smooth tau tensor(0.1)": (
            smooth(losses.ColbertNegativeCELoss, torch.tensor(0.1), D4[:, :2]), ORIGINAL),
        "negative CE, smooth tau 0": (smooth(losses.ColbertNegativeCELoss, 0, D4[:, :2]),
                                      ORIGINAL),  # fmt: skip
        "pairwise negative CE, float64": (
            lambda: losses.ColbertPairwiseNegativeCELoss()(Q.double(), D[:2].double(),
                                                           D4[:, :2].double()), ORIGINAL),
    }  # fmt: skip


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


PYLATE_ROWS = list(_pylate_rows()) if _installed("pylate") else []
COLPALI_ROWS = list(_colpali_rows()) if _installed("colpali_engine") else []


@pytest.mark.parametrize("row", PYLATE_ROWS)
def test_pylate_input_table(lik_scored, row):
    from lik.integrations import pylate as integration

    call, expected, *options = _pylate_rows()[row]
    _check_row(integration, call, expected, lik_scored, **(options[0] if options else {}))


@pytest.mark.parametrize("row", COLPALI_ROWS)
def test_colpali_input_table(lik_scored, row):
    from lik.integrations import colpali as integration

    call, expected, *options = _colpali_rows()[row]
    _check_row(integration, call, expected, lik_scored, **(options[0] if options else {}))


def test_tau_zero_is_colpali_engines_nan():
    """The row the issue found: colpali-engine answers tau=0 with nan, lik raised."""
    pytest.importorskip("colpali_engine")
    from colpali_engine.loss import late_interaction_losses as losses

    from lik.integrations import colpali as integration

    Q, D = _randn(2, 4, 8), _randn(2, 5, 8, seed=1)
    with integration.enabled():
        assert torch.isnan(losses.ColbertLoss(use_smooth_max=True, tau=0)(Q, D))
        assert torch.isfinite(losses.ColbertLoss(use_smooth_max=True, tau=torch.tensor(0.1))(Q, D))


def _lik_warnings(call) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    return [str(w.message) for w in caught if str(w.message).startswith("lik")]


@pytest.fixture
def armed_norm_warning(monkeypatch):
    monkeypatch.delenv(norm_warning.ENV, raising=False)
    norm_warning._reset()
    yield
    norm_warning._reset()


def _unnormalized(*shape, seed=0):
    return _randn(*shape, seed=seed) * 3  # norms far from 1: lik's check would warn


def test_nothing_of_lik_is_warned_through_pylate(armed_norm_warning, lik_scored):
    pytest.importorskip("pylate")
    from pylate.scores import colbert as c

    from lik.integrations import pylate as integration

    Q, D, D4 = _unnormalized(2, 4, 8), _unnormalized(3, 5, 8, seed=1), _unnormalized(2, 2, 5, 8)

    def calls():
        for _ in range(2):  # a CUDA process warns on its second call, a CPU on its first
            c.colbert_scores(Q, D)
            c.colbert_kd_scores(Q, D4)
            c.colbert_scores_pairwise(Q, D[:2])
            c.ColBERTScores()(Q, D4)

    with integration.enabled():
        assert _lik_warnings(calls) == []
    assert len(lik_scored) == 8
    # The check was not used up: the process's own lik calls are still checked.
    assert len(_lik_warnings(lambda: runtime.maxsim(Q, D))) == 1


def test_nothing_of_lik_is_warned_through_colpali(armed_norm_warning, lik_scored):
    pytest.importorskip("colpali_engine")
    from colpali_engine.loss import late_interaction_losses as losses
    from colpali_engine.utils import maxsim as m

    from lik.integrations import colpali as integration

    Q, D, D4 = _unnormalized(2, 4, 8), _unnormalized(2, 5, 8, seed=1), _unnormalized(2, 2, 5, 8)

    def calls():
        for _ in range(2):
            m.maxsim_inbatch(Q, D)
            m.maxsim_kd(Q, D4)
            losses.ColbertLoss(use_smooth_max=True)(Q, D)
            losses.ColbertNegativeCELoss()(Q, D, D4)

    with integration.enabled():
        assert _lik_warnings(calls) == []
    assert "maxsim_smooth" in lik_scored and "maxsim_pairs" in lik_scored
    assert len(_lik_warnings(lambda: runtime.maxsim(Q, D))) == 1
