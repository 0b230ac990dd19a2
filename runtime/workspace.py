"""Buffers that launches share, cached per device and stream (`stream_key`).

A forward that splits long docs into token ranges counts, per (doc, query group), the
ranges that have finished; the last one reduces them all and sets its counter back to 0.
The counters therefore start every launch at 0 without a memset of their own: launches
on one stream run one after another, and each stream has its own counters.
"""

from __future__ import annotations

import torch

from lik.runtime.launch_plan import recorded

# (device, stream) -> int32 counters, all 0 between launches. Grown, never shrunk.
_counters: dict[tuple, torch.Tensor] = {}
# The current stream of a device index as a raw handle (an int), without building a
# Stream object. CUDA builds only: None otherwise.
raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def stream_key(device: torch.device) -> tuple | None:
    """(device, stream) that buffers for launches on the current stream are cached under
    (launches on one stream run in order, so they may share them); None inside a CUDA
    graph capture, where a buffer must be made afresh: a tensor made there holds its
    values only when the graph replays."""
    if device.type != "cuda":
        return (device, 0)
    if torch.cuda.is_current_stream_capturing():
        return None
    if raw_stream is None:
        return (device, torch.cuda.current_stream(device).cuda_stream)
    # The raw handle, as current_stream(device).cuda_stream gives it, without building a
    # Stream object: the whole key took 3.2-5.3 us that way on an H200 host, 0.8-1.4 now.
    index = device.index if device.index is not None else torch.cuda.current_device()
    return (device, raw_stream(index))


# What generated launchers allocate goes through these, so that a launch plan
# (lik.runtime.launch_plan) allocates it again on each replay.
empty = recorded(torch.empty)
zeros = recorded(torch.zeros)
# So do the casts and views of what they made that they pass on or return.
converted = recorded(torch.Tensor.to)
reshaped = recorded(torch.Tensor.reshape)


@recorded
def head_rows(t: torch.Tensor) -> torch.Tensor:
    """t as rows of its last (head dim) axis, [-1, d] with unit stride: a view where one
    exists, else a copy."""
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(1) == 1 else rows.contiguous()


@recorded
def zeroed_counters(count: int, device: torch.device) -> torch.Tensor:
    """int32 counters [>= count], all 0, for a launch on the current stream that leaves
    every counter it touches at 0 again (made afresh inside a capture: the graph then
    zeroes them on each replay)."""
    key = stream_key(device)
    if key is None:
        return torch.zeros(count, dtype=torch.int32, device=device)
    counters = _counters.get(key)
    if counters is None or counters.numel() < count:
        # Growing frees the old buffer: the caching allocator hands it out again only
        # after the launches already queued on this stream are done with it.
        counters = _counters[key] = torch.zeros(max(count, 1024), dtype=torch.int32, device=device)
    return counters
