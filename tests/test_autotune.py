"""Call-time autotune of forward and backward keys without a committed entry
(lik.runtime.autotune).

Sweeps run on CUDA only; here the interpreter stands in (autotune.applies is told the
call is on a GPU), with a two-config grid so that each sweep stays short.
"""

from __future__ import annotations

import itertools
import json
import logging

import pytest
import torch
from helpers import weighted_gradients

from lik.runtime import autotune, backends, configs, maxsim
from lik.runtime.keys import KernelKey
from lik.runtime.reference import maxsim_reference
from lik.runtime.tuning import default_config, one_warpgroup_backward

pytestmark = pytest.mark.skipif(
    backends.device_backend(torch.device("cpu")) not in backends.GENERATED_TRITON,
    reason="no Triton path on this machine",
)
REAL_APPLIES = autotune.applies


@pytest.fixture
def tuner(monkeypatch, tmp_path):
    """A process with no configs looked up yet, an empty cache dir, CPU calls treated as
    GPU calls, and grids of the default plus one narrower doc tile."""
    monkeypatch.setenv("LIK_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("LIK_AUTOTUNE", raising=False)
    monkeypatch.setattr(configs, "_configs", {})
    monkeypatch.setattr(configs, "_call_configs", {})
    monkeypatch.setattr(autotune, "applies",
                        lambda key, device: REAL_APPLIES(key, torch.device("cuda")))  # fmt: skip
    monkeypatch.setattr(autotune, "candidates", lambda base, **_: [base, {**base, "block_l": 16}])
    autotune.forget()
    yield tmp_path / autotune.CACHE_FILE
    autotune.forget()


def _call(seed=0):
    g = torch.Generator().manual_seed(seed)
    Q, D = torch.randn(3, 7, 48, generator=g), torch.randn(5, 37, 48, generator=g)
    out = maxsim(Q, D)
    torch.testing.assert_close(out.double(), maxsim_reference(Q.double(), D.double()),
                               rtol=1e-5, atol=1e-5)  # fmt: skip
    return out


def _launched_block_l() -> set[int]:
    return {config.block_l for config in configs._call_configs.values()}


def test_a_key_without_an_entry_sweeps_once_and_later_processes_read_the_cache(tuner):
    before = autotune.sweeps
    _call()
    assert autotune.sweeps == before + 1
    entries = json.loads(tuner.read_text())["entries"]
    ((name, entry),) = entries.items()
    assert "maxsim_dense_nomask_fp32_triton|64|16|s|q4" in name  # card|table key|kernel|triton
    assert entry["block_l"] in (16, 32) and entry["shape"].startswith("call-time sweep")
    assert _launched_block_l() == {entry["block_l"]}  # the call launched the winner

    _call(seed=1)  # the same key again: no second sweep
    assert autotune.sweeps == before + 1

    # A new process: nothing in memory, the file read back, still no sweep.
    autotune.forget()
    configs._configs.clear()
    configs._call_configs.clear()
    _call(seed=2)
    assert autotune.sweeps == before + 1
    assert _launched_block_l() == {entry["block_l"]}


def test_committed_keys_captured_calls_and_switched_off_calls_never_sweep(tuner, monkeypatch):
    before = autotune.sweeps
    with monkeypatch.context() as patch:
        patch.setattr(configs, "committed_source", lambda key: ("hopper.toml", key.table_key()))
        _call()
    with monkeypatch.context() as patch:
        patch.setattr(autotune, "capturing", lambda device: True)
        configs._call_configs.clear()
        _call()
    with monkeypatch.context() as patch:
        patch.setenv("LIK_AUTOTUNE", "0")
        configs._configs.clear()
        configs._call_configs.clear()
        _call()
    assert autotune.sweeps == before
    assert not tuner.exists()


def test_an_unreadable_cache_is_set_aside_and_rewritten(tuner, caplog):
    tuner.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="lik.autotune"):
        _call()
    assert "ignoring unreadable autotune cache" in caplog.text
    data = json.loads(tuner.read_text())
    assert data["format"] == autotune.CACHE_FORMAT and len(data["entries"]) == 1


def test_an_unwritable_cache_keeps_the_winner_for_the_process(tuner, monkeypatch, caplog):
    blocker = tuner.parent / "file"
    blocker.write_text("")
    monkeypatch.setenv("LIK_CACHE_DIR", str(blocker))  # a file where the folder should be
    before = autotune.sweeps
    with caplog.at_level(logging.WARNING, logger="lik.autotune"):
        _call()
        configs._call_configs.clear()
        _call(seed=1)
    assert "not written" in caplog.text
    assert autotune.sweeps == before + 1


def test_the_grid_is_the_default_and_its_neighbours():
    base = {"block_l": 64, "num_warps": 4, "num_stages": 3, "block_n": 8, "query_group": 4}
    grid = autotune.candidates(base, lq=32, max_query_group=8)
    assert grid[0] == base and len(grid) == len({json.dumps(e, sort_keys=True) for e in grid})
    assert {e["block_l"] for e in grid} == {32, 64, 128}
    assert {e["query_group"] for e in grid} == {4, 8}
    assert {e["num_stages"] for e in grid} == {2, 3}
    assert {e["num_warps"] for e in grid if e["query_group"] == 8} == {4, 8}
    assert len(grid) <= 25
    # One 32-token query: thin tiles take fewer warps; unpipelined variants stay so.
    thin = autotune.candidates({**base, "query_group": 1, "num_stages": 1}, lq=32,
                               max_query_group=1)  # fmt: skip
    assert {e["num_warps"] for e in thin} == {2, 4} and {e["num_stages"] for e in thin} == {1}

    # A backward: its default and the three tiles at 1 to 3 stages, queries as given; a
    # plain lowmem backward on one warpgroup (9 configs), others on two warp counts.
    def backward_grid(variant):
        key = KernelKey(variant, "hopper", 128, 32, "m", 8, "bwd")
        base = default_config(key)
        warps = (4,) if one_warpgroup_backward(key) else None
        grid = autotune.candidates(base, lq=32, max_query_group=4, backward=True, warps=warps)
        assert grid[0] == base and {e["query_group"] for e in grid} == {base["query_group"]}
        assert {(e["block_l"], e["num_stages"]) for e in grid} == set(
            itertools.product((32, 64, 128), (1, 2, 3)))  # fmt: skip
        return base, grid

    lowmem, grid = backward_grid("maxsim_dense_nomask_bf16_triton_lowmem")
    assert (lowmem["num_warps"], lowmem["num_stages"]) == (4, 1)
    assert {e["num_warps"] for e in grid} == {4} and len(grid) == 9
    unified, grid = backward_grid("maxsim_dense_nomask_bf16_triton_unified")
    assert (unified["num_warps"], unified["num_stages"]) == (8, 3)
    assert {e["num_warps"] for e in grid} == {4, 8} and len(grid) == 18
    weighted, _ = backward_grid("maxsim_dense_nomask_bf16_triton_lowmem_weighted")
    assert weighted["num_warps"] == 8


def test_a_training_call_sweeps_its_forward_and_backward_keys_once(tuner, monkeypatch):
    grids = []  # the keywords of each sweep's grid: its backward's warps among them
    monkeypatch.setattr(autotune, "candidates", lambda base, **kw: grids.append(kw) or [
        base, {**base, "block_l": 16}])  # fmt: skip
    g = torch.Generator().manual_seed(3)
    Q, D = torch.randn(3, 7, 48, generator=g), torch.randn(5, 37, 48, generator=g)
    weights = torch.randn(3, 5, generator=g)
    reference = weighted_gradients(lambda q, d: maxsim_reference(q.double(), d.double()).float(),
                                   Q, D, weights)  # fmt: skip
    before = autotune.sweeps
    for _ in range(2):  # the second call reads both winners: no sweep
        trained = weighted_gradients(lambda q, d: maxsim(q, d, backward="lowmem"), Q, D, weights)
        for got, want in zip(trained, reference, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert autotune.sweeps == before + 2
    names = list(json.loads(tuner.read_text())["entries"])
    assert len(names) == 2 and sum("_lowmem|64|16|s|q4|bwd|" in name for name in names) == 1
    # The forward's grid takes its usual warps, lowmem's backward one warpgroup alone, and
    # a unified backward its usual warps.
    assert [(kw["backward"], kw["warps"]) for kw in grids] == [(False, None), (True, (4,))]
    weighted_gradients(lambda q, d: maxsim(q, d, backward="unified"), Q, D, weights)
    assert [(kw["backward"], kw["warps"]) for kw in grids[2:]] == [(False, None), (True, None)]


def test_a_sweep_keeps_the_fastest_entry_whose_scores_agree(monkeypatch, tmp_path, caplog):
    import time

    from lik.runtime.keys import KernelKey

    monkeypatch.setenv("LIK_CACHE_DIR", str(tmp_path))
    autotune.forget()
    key = KernelKey("maxsim_dense_nomask_bf16_triton", "hopper", 128, 32, "m", 2, card="GPU")
    scores = torch.arange(6.0)
    entries = [{"block_l": b, "num_warps": 4, "num_stages": 3, "query_group": 1, "block_n": 8}
               for b in (32, 64, 128)]  # fmt: skip
    naps = {32: 0.02, 64: 0.0, 128: 0.01}  # 64 is the fastest, but its scores are off

    def run(entry):
        time.sleep(naps[entry["block_l"]])
        return scores + 1 if entry["block_l"] == 64 else scores

    with caplog.at_level(logging.WARNING, logger="lik.autotune"):
        winner = autotune.sweep(key, entries, run, torch.device("cpu"), "a test")
    assert winner["block_l"] == 128 and winner["card"] == "GPU" and winner["shape"] == "a test"
    assert "left out, its outputs differ" in caplog.text
    assert autotune.cached_entry(key) == winner
    autotune.forget()
    assert autotune.cached_entry(key) == winner  # read back from the file
    autotune.forget()


def test_a_cached_entry_that_is_not_a_config_is_swept_again(tuner):
    _call()
    data = json.loads(tuner.read_text())
    (name,) = data["entries"]
    data["entries"][name] = {"block_l": "64", "num_warps": 4}  # edited by hand, wrongly
    tuner.write_text(json.dumps(data))
    autotune.forget()
    configs._configs.clear()
    configs._call_configs.clear()
    before = autotune.sweeps
    _call(seed=1)
    assert autotune.sweeps == before + 1
    assert isinstance(json.loads(tuner.read_text())["entries"][name]["block_l"], int)


def test_a_sweeps_candidates_compile_side_by_side_each_launched_once():
    import threading

    entries = [{"block_l": block_l} for block_l in (16, 32, 64, 128, 256)]
    launched = []

    def run(entry):
        launched.append((entry["block_l"], threading.current_thread() is threading.main_thread()))
        if entry["block_l"] == 64:
            raise RuntimeError("out of resources")  # left for the timed loop to report

    autotune.compile_side_by_side(entries, run, torch.device("cpu"))
    assert launched[0] == (16, True)  # the first on the calling thread, before any other
    assert sorted(block_l for block_l, _ in launched) == [16, 32, 64, 128, 256]
    assert not any(main for _, main in launched[1:])  # the rest from the pool


def test_configs_agree_within_two_bf16_units_or_the_given_tolerance():
    # One check for call-time sweeps and make tune: two units in the last place of a
    # bf16 output, 1e-3 of an fp32 one; a tolerance where a sweep gives one; NaN only
    # where asked (a call-time sweep's NaN scores).
    ref = torch.tensor([1.0, 2.0, 4.0])
    bf16 = ref.bfloat16()
    two_units = (ref * (1 + 2 * torch.finfo(torch.bfloat16).eps)).bfloat16()
    assert autotune.agree((two_units,), (bf16,))
    assert not autotune.agree((ref * 1.01,), (ref,))
    assert autotune.agree((ref * 1.01,), (ref,), tolerance=2e-2)
    nan = torch.tensor([float("nan"), 1.0])
    assert not autotune.agree((nan,), (nan,)) and autotune.agree((nan,), (nan,), equal_nan=True)
