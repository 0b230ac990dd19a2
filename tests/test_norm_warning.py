"""The one-shot "tokens look unnormalized" warning (API.md: LIK_SUPPRESS_NORM_WARN)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import lik
from lik.runtime import norm_warning

UNIT = F.normalize  # tokens as ColBERT-style models emit them


@pytest.fixture(autouse=True)
def fresh_check(monkeypatch):
    monkeypatch.delenv(norm_warning.ENV, raising=False)
    norm_warning._reset()
    yield
    norm_warning._reset()


def _warnings(call) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    return [str(w.message) for w in caught if "look unnormalized" in str(w.message)]


def _tokens(*shape, unit=False, dtype=torch.float32):
    t = torch.randn(*shape) * 3
    return (UNIT(t, dim=-1) if unit else t).to(dtype)


def test_unnormalized_tokens_warn_once_per_process():
    Q, D = _tokens(2, 8, 16), _tokens(3, 10, 16)
    first = _warnings(lambda: lik.maxsim(Q, D))
    assert len(first) == 1 and "normalize=True" in first[0] and norm_warning.ENV in first[0]
    assert _warnings(lambda: lik.maxsim(Q, D)) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_unit_tokens_do_not_warn_and_end_the_check(dtype):
    Q, D = _tokens(2, 8, 64, unit=True, dtype=dtype), _tokens(3, 10, 64, unit=True, dtype=dtype)
    assert _warnings(lambda: lik.maxsim(Q, D)) == []
    # Decided on the first call: later calls are not sampled (no cost on the hot path).
    assert _warnings(lambda: lik.maxsim(Q * 4, D)) == []


def test_normalize_true_neither_warns_nor_uses_up_the_check():
    Q, D = _tokens(2, 8, 16), _tokens(3, 10, 16)
    assert _warnings(lambda: lik.maxsim(Q, D, normalize=True)) == []
    assert len(_warnings(lambda: lik.maxsim(Q, D))) == 1


def test_masked_and_zero_tokens_are_not_sampled():
    # Unit tokens padded with zeros, and masked tokens of any norm, are fine.
    Q = _tokens(2, 8, 16, unit=True)
    D = _tokens(3, 10, 16, unit=True)
    D[:, 6:] = 0
    q_garbage = Q.clone()
    q_garbage[:, 5:] *= 7
    q_mask = torch.arange(8) < 5
    q_mask = q_mask.expand(2, 8)
    assert _warnings(lambda: lik.maxsim(q_garbage, D, q_mask=q_mask)) == []


def test_the_variable_turns_the_check_off(monkeypatch):
    monkeypatch.setenv(norm_warning.ENV, "1")
    assert _warnings(lambda: lik.maxsim(_tokens(2, 8, 16), _tokens(3, 10, 16))) == []


def _packed(call_name):
    Q, D = _tokens(7, 16), _tokens(9, 16)
    cu_q = torch.tensor([0, 3, 7], dtype=torch.int32)
    cu_d = torch.tensor([0, 4, 9], dtype=torch.int32)
    if call_name == "maxsim_varlen":
        return lambda: lik.runtime.maxsim_varlen(Q, D, cu_q, cu_d)
    pairs = torch.tensor([0, 1])
    return lambda: lik.runtime.score_pairs_packed(Q, D, cu_q, cu_d, pairs, pairs)


ENTRIES = {
    "maxsim_pairs": lambda: lik.maxsim_pairs(_tokens(2, 8, 16), _tokens(2, 10, 16)),
    "maxsim kd": lambda: lik.maxsim(_tokens(2, 8, 16), _tokens(2, 3, 10, 16)),
    "maxsim_varlen": _packed("maxsim_varlen"),
    "score_pairs_packed": _packed("score_pairs_packed"),
    "maxsim_padded": lambda: lik.runtime.maxsim_padded(
        _tokens(2, 8, 16), _tokens(2, 3, 10, 16), torch.tensor([8, 5]), torch.full((2, 3), 10)
    ),
    "maxsim_weighted": lambda: lik.runtime.maxsim_weighted(
        _tokens(2, 8, 16), _tokens(3, 10, 16), torch.rand(2, 8)
    ),
}


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_every_entry_that_scores_raw_dot_products_checks(entry, lik_path):
    assert len(_warnings(ENTRIES[entry])) == 1


@pytest.mark.gpu
def test_the_check_costs_no_host_sync():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    Q, D = _tokens(2, 8, 128).cuda(), _tokens(3, 10, 128).cuda()
    lik.maxsim(Q, D)  # compiles and loads outside the sync check
    norm_warning._reset()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        first = _warnings(lambda: lik.maxsim(Q, D))  # samples, copies behind an event
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()  # the sample has reached the host
    # An idle GPU may finish the copy before the first call returns, so that call may
    # already warn; either way the process is warned exactly once.
    later = _warnings(lambda: lik.maxsim(Q, D)) + _warnings(lambda: lik.maxsim(Q, D))
    assert len(first) + len(later) == 1
