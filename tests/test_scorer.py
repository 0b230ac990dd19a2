"""MaxSimScorer: the module form of maxsim and retrieve."""

from __future__ import annotations

import pytest
import torch
from helpers import INTERPRETER_FP32_TOLERANCE, relative_error

from lik.runtime import maxsim
from lik.runtime.reference import maxsim_reference
from lik.runtime.retrieval import retrieve
from lik.runtime.scorer import MaxSimScorer

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PAD = 0


def _inputs(seed=0, Nq=2, Nd=5, Lq=4, Ld=6, d=16):
    generator = torch.Generator().manual_seed(seed)
    Q = torch.randn(Nq, Lq, d, generator=generator).to(DEVICE)
    D = torch.randn(Nd, Ld, d, generator=generator).to(DEVICE)
    return Q, D


def _token_ids(shape, valid_lengths):
    """Ids 1..L for real tokens, PAD after each row's valid length."""
    ids = torch.arange(1, shape[1] + 1).expand(shape).clone()
    for row, length in enumerate(valid_lengths):
        ids[row, length:] = PAD
    return ids.to(DEVICE)


def test_forward_and_score_equal_maxsim():
    Q, D = _inputs()
    scorer = MaxSimScorer()
    expected = maxsim(Q, D, normalize=True)
    assert torch.equal(scorer(Q, D), expected)
    assert torch.equal(scorer.score(Q, D), expected)
    plain = MaxSimScorer(normalize=False)
    assert torch.equal(plain(Q, D), maxsim(Q, D))


def test_forward_matches_float64_reference_with_masks():
    Q, D = _inputs(1)
    q_mask = torch.tensor([[True, True, False, True], [True, False, True, True]], device=DEVICE)
    d_mask = torch.rand(5, 6, generator=torch.Generator().manual_seed(2)) < 0.7
    d_mask = d_mask.to(DEVICE)
    out = MaxSimScorer()(Q, D, q_mask, d_mask)
    ref = maxsim_reference(Q.double(), D.double(), q_mask, d_mask, normalize=True)
    assert relative_error(out, ref) < INTERPRETER_FP32_TOLERANCE * 10


def test_forward_with_ids_builds_masks_from_the_pad_token():
    Q, D = _inputs(3)
    q_ids, d_ids = _token_ids((2, 4), [3, 4]), _token_ids((5, 6), [6, 2, 5, 1, 4])
    scorer = MaxSimScorer(mask_pad_token=PAD)
    out = scorer.forward_with_ids(Q, D, q_ids, d_ids)
    assert torch.equal(out, scorer(Q, D, q_ids != PAD, d_ids != PAD))


def test_forward_with_ids_needs_a_pad_token():
    Q, D = _inputs()
    with pytest.raises(ValueError, match="mask_pad_token"):
        MaxSimScorer().forward_with_ids(
            Q, D, _token_ids((2, 4), [4, 4]), _token_ids((5, 6), [6] * 5)
        )


def test_forward_with_ids_checks_id_shapes():
    Q, D = _inputs()
    with pytest.raises(ValueError, match=r"d_ids must have shape \(5, 6\)"):
        MaxSimScorer(mask_pad_token=PAD).forward_with_ids(
            Q, D, _token_ids((2, 4), [4, 4]), _token_ids((5, 5), [5] * 5)
        )


def test_retrieve_uses_the_scorer_options():
    Q, D = _inputs(4, Nd=9)
    for normalize in (True, False):
        scorer = MaxSimScorer(normalize=normalize)
        got = scorer.retrieve(Q, D, 3, chunk=4)
        expected = retrieve(Q, D, 3, normalize=normalize)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_score_runs_without_grad():
    Q, D = _inputs()
    out = MaxSimScorer().score(Q.requires_grad_(), D)
    assert not out.requires_grad


def test_forward_respects_the_callers_grad_mode():
    Q, D = _inputs()
    Q.requires_grad_()
    scorer = MaxSimScorer()
    with torch.no_grad():
        assert not scorer(Q, D).requires_grad
    try:
        out = scorer(Q, D)
    except NotImplementedError as exc:
        # A path without backward kernels yet must say so, not return a detached result.
        assert "gradients" in str(exc)
        return
    assert out.requires_grad
    out.sum().backward()
    assert Q.grad is not None


def test_forward_gradients_on_the_reference_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    Q, D = torch.randn(2, 3, 8, requires_grad=True), torch.randn(4, 5, 8)
    MaxSimScorer()(Q, D).sum().backward()
    assert Q.grad is not None and Q.grad.abs().sum() > 0


def test_is_a_module_with_readable_repr():
    scorer = MaxSimScorer(normalize=False, backward="lowmem", mask_pad_token=PAD)
    assert isinstance(scorer, torch.nn.Module) and list(scorer.parameters()) == []
    assert repr(scorer) == "MaxSimScorer(normalize=False, backward='lowmem', mask_pad_token=0)"


@pytest.mark.parametrize(
    "kwargs, error, fragment",
    [
        ({"backward": "fast"}, ValueError, "backward must be one of"),
        ({"mask_pad_token": "pad"}, TypeError, "mask_pad_token must be None or an int"),
        ({"mask_pad_token": True}, TypeError, "mask_pad_token"),
    ],
)
def test_bad_options_raise_named_errors(kwargs, error, fragment):
    with pytest.raises(error, match=fragment):
        MaxSimScorer(**kwargs)
