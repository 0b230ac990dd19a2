"""Input checks the reliability tables do not reach: a head-dim mismatch in both directions
(Q wider and D wider) on every public entry, bool flags of the ragged entries, and a
`tau` that fp32 cannot hold. A check that refused only one direction of a head-dim
mismatch would score D's first dims in silence."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import lik
from lik.runtime import fp8, head, plaid, variants
from lik.runtime.ragged import maxsim_padded, maxsim_varlen, pack_padded, score_pairs_packed
from lik.runtime.retrieval import retrieve_sharded

CU = torch.tensor([0, 3, 5], dtype=torch.int32)
N_CENTROIDS, NBITS, D_MODEL = 4, 2, 12


@pytest.fixture
def reference_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.fixture(scope="module")
def single_rank_group():
    """A one-process gloo group, so retrieve_sharded can be called in this process."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _q(d):
    return torch.randn(2, 5, d)


def _d(d):
    return torch.randn(3, 7, d)


def _fp8(wq, wd):
    Q8, sq = fp8.quantize_fp8_per_tensor(_q(wq))
    D8, sd = fp8.quantize_fp8_per_tensor(_d(wd))
    return fp8.maxsim_inference_fp8(Q8, D8, scale_Q=sq, scale_D=sd)


def _residual(wq, wd):
    """Centroids of D's width and residual bytes of Q's (d=8 and d=16 differ there)."""
    codes = torch.zeros(3, 7, dtype=torch.int64)
    residuals = torch.zeros(3, 7, plaid.packed_bytes(wq, NBITS), dtype=torch.uint8)
    centroids, weights = torch.randn(N_CENTROIDS, wd), torch.randn(1 << NBITS)
    return plaid.maxsim_residual(_q(wq), codes, residuals, torch.full((3,), 7), centroids,
                                 weights, NBITS)  # fmt: skip


def _residual_varlen(wq, wd):
    codes = torch.zeros(21, dtype=torch.int64)
    residuals = torch.zeros(21, plaid.packed_bytes(wq, NBITS), dtype=torch.uint8)
    cu = torch.tensor([0, 7, 14, 21], dtype=torch.int32)
    return plaid.maxsim_residual_varlen(_q(wq), codes, residuals, cu,
                                        torch.randn(N_CENTROIDS, wd), torch.randn(1 << NBITS),
                                        NBITS)  # fmt: skip


def _ids_call(wq, wd):
    ones_q, ones_d = torch.ones(2, 5, dtype=torch.long), torch.ones(3, 7, dtype=torch.long)
    return lik.MaxSimScorer(mask_pad_token=0).forward_with_ids(_q(wq), _d(wd), ones_q, ones_d)


def _qd(wq, wd):
    return [f"Q has {wq}", f"D has {wd}"]


# entry: (call(wq, wd), fragments(wq, wd) the error must hold). wq is Q's head dim, wd the
# width of what it is scored against.
HEAD_DIM_ENTRIES = {
    "maxsim dense": (lambda wq, wd: lik.maxsim(_q(wq), _d(wd)), _qd),
    "maxsim kd": (lambda wq, wd: lik.maxsim(_q(wq), torch.randn(2, 3, 7, wd)), _qd),
    "maxsim one doc": (lambda wq, wd: lik.maxsim(_q(wq), torch.randn(7, wd)), _qd),
    "maxsim one query": (lambda wq, wd: lik.maxsim(torch.randn(5, wq), _d(wd)), _qd),
    "maxsim_pairs": (lambda wq, wd: lik.maxsim_pairs(_q(wq), torch.randn(2, 7, wd)), _qd),
    "maxsim_varlen": (
        lambda wq, wd: maxsim_varlen(torch.randn(5, wq), torch.randn(5, wd), CU, CU),
        lambda wq, wd: [f"Q_packed has {wq}", f"D_packed has {wd}"],
    ),
    "score_pairs_packed": (
        lambda wq, wd: score_pairs_packed(
            torch.randn(5, wq), torch.randn(5, wd), CU, CU, torch.tensor([0]), torch.tensor([1])
        ),  # fmt: skip
        lambda wq, wd: [f"Q_packed has {wq}", f"D_packed has {wd}"],
    ),
    "maxsim_padded": (
        lambda wq, wd: maxsim_padded(
            _q(wq), torch.randn(2, 3, 7, wd), torch.tensor([5, 4]), torch.full((2, 3), 7)
        ),  # fmt: skip
        lambda wq, wd: ["documents must be", f"d={wq}", f"got (2, 3, 7, {wd})"],
    ),
    "pack_padded": (
        lambda wq, wd: pack_padded(
            _q(wq), torch.randn(2, 3, 7, wd), torch.tensor([5, 4]), torch.full((2, 3), 7)
        ),  # fmt: skip
        lambda wq, wd: ["documents must be", f"d={wq}", f"got (2, 3, 7, {wd})"],
    ),
    "retrieve": (lambda wq, wd: lik.retrieve(_q(wq), _d(wd), 2), _qd),
    "retrieve chunked": (lambda wq, wd: lik.retrieve(_q(wq), _d(wd), 2, chunk=1), _qd),
    "retrieve_sharded": (lambda wq, wd: retrieve_sharded(_q(wq), _d(wd), 2), _qd),
    "MaxSimScorer.forward": (lambda wq, wd: lik.MaxSimScorer()(_q(wq), _d(wd)), _qd),
    "MaxSimScorer.score": (lambda wq, wd: lik.MaxSimScorer().score(_q(wq), _d(wd)), _qd),
    "MaxSimScorer.retrieve": (
        lambda wq, wd: lik.MaxSimScorer().retrieve(_q(wq), _d(wd), 2),
        _qd,
    ),
    "MaxSimScorer.forward_with_ids": (_ids_call, _qd),
    "maxsim_weighted": (
        lambda wq, wd: variants.maxsim_weighted(_q(wq), _d(wd), torch.ones(2, 5)),
        _qd,
    ),
    "maxsim_weighted pairs": (
        lambda wq, wd: variants.maxsim_weighted(
            _q(wq), torch.randn(2, 7, wd), torch.ones(2, 5), pairs=True
        ),  # fmt: skip
        _qd,
    ),
    "maxsim_smooth": (lambda wq, wd: variants.maxsim_smooth(_q(wq), _d(wd)), _qd),
    "maxsim_topk_mean": (lambda wq, wd: variants.maxsim_topk_mean(_q(wq), _d(wd)), _qd),
    "maxsim_inference_fp8": (_fp8, _qd),
    "maxsim_residual": (
        _residual,
        lambda wq, wd: [f"centroids must be [n_centroids, {wq}]", f"got shape (4, {wd})"],
    ),
    "maxsim_residual_varlen": (
        _residual_varlen,
        lambda wq, wd: [f"centroids must be [n_centroids, {wq}]", f"got shape (4, {wd})"],
    ),
    "maxsim_from_hidden W": (
        lambda wq, wd: head.maxsim_from_hidden(
            _q(wq), torch.randn(3, 7, D_MODEL), torch.randn(wd, D_MODEL)
        ),  # fmt: skip
        lambda wq, wd: [
            f"W must be [d, d_model] = [{wq}, {D_MODEL}]",
            f"got shape ({wd}, {D_MODEL})",
        ],  # fmt: skip
    ),
    "maxsim_from_hidden b": (
        lambda wq, wd: head.maxsim_from_hidden(
            _q(wq), torch.randn(3, 7, D_MODEL), torch.randn(wq, D_MODEL), torch.randn(wd)
        ),  # fmt: skip
        lambda wq, wd: [f"b must be [d] = [{wq}]", f"got ({wd},)"],
    ),
}


@pytest.mark.usefixtures("reference_path", "single_rank_group")
@pytest.mark.parametrize("wq, wd", [(16, 8), (8, 16)], ids=["Q wider", "D wider"])
@pytest.mark.parametrize("entry", list(HEAD_DIM_ENTRIES))
def test_every_entry_refuses_a_head_dim_mismatch_both_ways(entry, wq, wd):
    call, fragments = HEAD_DIM_ENTRIES[entry]
    with pytest.raises(ValueError) as caught:
        call(wq, wd)
    for fragment in fragments(wq, wd):
        assert fragment in str(caught.value), f"{fragment!r} not in {caught.value!r}"


@pytest.mark.usefixtures("reference_path")
@pytest.mark.parametrize("value", ["no", "yes", None, 0, 1, 1.0])
def test_pack_padded_validate_must_be_a_bool(value):
    queries, documents = torch.randn(1, 4, 8), torch.randn(1, 2, 5, 8)
    with pytest.raises(TypeError, match=f"validate must be a bool, got {value!r}"):
        pack_padded(queries, documents, torch.tensor([4]), torch.tensor([[5, 5]]), validate=value)


@pytest.mark.usefixtures("reference_path")
def test_pack_padded_validate_takes_bools():
    queries, documents = torch.randn(1, 4, 8), torch.randn(1, 2, 5, 8)
    for value in (False, True):
        batch = pack_padded(queries, documents, torch.tensor([4]), torch.tensor([[5, 3]]),
                            validate=value)  # fmt: skip
        assert batch.cu_seqlens_d.tolist() == [0, 5, 8]
    with pytest.raises(ValueError, match="lengths outside the padded axes"):
        pack_padded(queries, documents, torch.tensor([5]), torch.tensor([[5, 3]]), validate=True)


FP32 = torch.finfo(torch.float32)


@pytest.mark.usefixtures("reference_path")
@pytest.mark.parametrize(
    "tau",
    [1e-300, 1e300, 1e-40, FP32.tiny / 2, FP32.max * 2, 0.0, -0.1, float("nan"), float("inf")],
    ids=["1e-300", "1e300", "1e-40 (fp32 subnormal)", "half the smallest normal",
         "twice fp32 max", "0", "negative", "nan", "inf"],
)  # fmt: skip
def test_maxsim_smooth_refuses_a_tau_fp32_cannot_hold(tau):
    Q, D = _q(8), _d(8)
    with pytest.raises(ValueError, match="tau must be a finite positive number that fp32 holds"):
        variants.maxsim_smooth(Q, D, tau=tau)


# The interpreter's numpy divide overflows to -inf for the tokens that lose: the point.
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("tau", [FP32.tiny, 1e-30, 1e30], ids=["smallest normal", "1e-30", "1e30"])
def test_maxsim_smooth_scores_every_tau_it_takes(lik_path, tau):
    """At either end of what it takes the smooth max stays finite: near 0 it is MaxSim."""
    g = torch.Generator().manual_seed(2)
    Q, D = torch.randn(2, 5, 8, generator=g), torch.randn(3, 7, 8, generator=g)
    out = variants.maxsim_smooth(Q, D, tau=tau)
    assert out.isfinite().all(), out
    if tau < 1:
        assert torch.allclose(out, lik.maxsim(Q, D), rtol=1e-5, atol=1e-5)
