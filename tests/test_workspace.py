"""Counters that split launches leave at 0 (lik.runtime.workspace): cached per device, grown
when a launch needs more, zero when handed out; keyed by the current stream (on a GPU)."""

from __future__ import annotations

import pytest
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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_stream_key_is_the_current_streams_handle():
    device = torch.device("cuda", torch.cuda.current_device())
    assert workspace.stream_key(device) == (device, torch.cuda.current_stream().cuda_stream)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert workspace.stream_key(device) == (device, side.cuda_stream)
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side), torch.cuda.graph(graph):
        assert workspace.stream_key(device) is None  # buffers made afresh in a capture
        torch.zeros(1, device=device)
