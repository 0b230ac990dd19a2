"""bench_host's timer and rows, on the CPU: the timer's retries (a round the GPU caught
up with runs again with fewer calls behind a longer spin, and gives up with an error),
and every row's calls running on lik's CPU paths."""

import sys
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
bench_host = pytest.importorskip("bench_host")


class _FakeCuda:
    """torch.cuda as host_us uses it: spins are recorded; the first `caught_up` rounds
    find their spin already over."""

    def __init__(self, caught_up: int):
        self.caught_up, self.spins = caught_up, []
        outer = self

        class Event:
            def record(self):
                pass

            def query(self):
                outer.caught_up -= 1
                return outer.caught_up >= 0

        self.Event = Event

    def _sleep(self, cycles):
        self.spins.append(cycles)

    def synchronize(self):
        pass


def _timed(monkeypatch, caught_up: int, calls: int):
    fake = _FakeCuda(caught_up)
    monkeypatch.setattr(bench_host.torch, "cuda", fake)
    counted = types.SimpleNamespace(calls=0)

    def fn():
        counted.calls += 1

    return fake, counted, lambda: bench_host.host_us(fn, calls)


def test_a_caught_up_round_runs_again_with_half_the_calls_behind_twice_the_spin(monkeypatch):
    fake, counted, run = _timed(monkeypatch, caught_up=2, calls=40)
    assert run() >= 0
    spin = bench_host.SPIN_CYCLES
    assert fake.spins == [spin, 2 * spin] + [4 * spin] * bench_host.ROUNDS
    # 3 warm-up calls, then rounds of 40, 20 and (ROUNDS times) 10 calls.
    assert counted.calls == 3 + 40 + 20 + 10 * bench_host.ROUNDS


def test_calls_the_gpu_always_catches_up_with_give_up_with_an_error(monkeypatch):
    _, counted, run = _timed(monkeypatch, caught_up=10**6, calls=40)
    with pytest.raises(RuntimeError, match="wait on the GPU"):
        run()
    assert counted.calls < 3 + 40 * (bench_host.MAX_DOUBLINGS + 1)  # fewer calls each retry


def test_every_row_runs_on_the_cpu(monkeypatch):
    """The rows' calls as bench_host builds them (peers left out where not installed),
    each once on lik's CPU paths: a row that breaks is caught here, not on a GPU."""
    monkeypatch.setattr(bench_host, "DEVICE", "cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the CPU backend and the reference: fast
    x = bench_host.Inputs("cpu")
    rows = {**bench_host.core_rows(x), **bench_host.floor_rows(x)}
    rows.update({entry: (forward, None) for entry, forward in bench_host.other_rows(x).items()})
    assert ("maxsim in-batch", "lik") in rows and "retrieve (top 4)" in rows
    for forward, training in rows.values():
        forward()
        if training is not None:
            training()


def test_the_report_gives_lik_above_the_lower_of_the_two_floor_measurements(monkeypatch):
    floor = bench_host.FLOOR
    plain = "two plain torch ops (a product, its sum)"
    report = {
        "gpu": "a GPU", "env": {}, "shape": {"Nq": 8}, "calls": 50, "rounds": 5,
        "core": {"maxsim in-batch": {"lik": {"forward": 15.0, "step": 170.0},
                                     "LIK 0.4.5": {"forward": 24.0, "step": 250.0}},
                 "maxsim kd": {"lik": {"forward": "error: x", "step": None}}},
        "other": {},
        "floors_first": {floor: {"forward": 6.0, "step": 90.0},
                         plain: {"forward": 11.0, "step": 150.0}},
        "floors": {floor: {"forward": 5.0, "step": 100.0},
                   plain: {"forward": 12.0, "step": 160.0}},
    }  # fmt: skip
    rows = bench_host.above_floor(report)
    assert rows == [["maxsim in-batch", "10.0", "3.00x", "80.0", "1.89x"],
                    ["maxsim kd", "-", "-", "-", "-"]]  # fmt: skip
    monkeypatch.setattr(bench_host, "provenance", lambda env: "provenance")
    text = bench_host.markdown(report)
    assert f"| {floor} | 6.0 | 5.0 | 90.0 | 100.0 |" in text
    assert "| maxsim in-batch | 10.0 | 3.00x | 80.0 | 1.89x |" in text
