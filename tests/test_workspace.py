"""Counters that split launches leave at 0 (lik.runtime.workspace), on the CPU: cached per
device, grown when a launch needs more, zero when handed out."""

from __future__ import annotations

import torch

from lik.runtime import workspace


def test_counters_are_cached_grown_and_zero(monkeypatch):
    monkeypatch.setattr(workspace, "_counters", {})
    cpu = torch.device("cpu")
    first = workspace.zeroed_counters(10, cpu)
    assert first.dtype == torch.int32 and first.numel() >= 10 and not first.any()
    assert workspace.zeroed_counters(5, cpu) is first  # no allocation per call
    bigger = workspace.zeroed_counters(first.numel() + 1, cpu)
    assert bigger is not first and bigger.numel() > first.numel() and not bigger.any()
    assert workspace.zeroed_counters(3, cpu) is bigger


def test_cpu_buffers_share_one_stream_key():
    cpu = torch.device("cpu")
    assert workspace.stream_key(cpu) == (cpu, 0)
