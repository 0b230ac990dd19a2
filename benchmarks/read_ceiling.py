"""How fast this GPU reads a tensor once: a bound for memory-bound MaxSim shapes.

A MaxSim whose docs come from memory must read them at least once. How fast a kernel
can do only that, at the docs' size, bounds every implementation more tightly than the
copy rate of a 1 GiB buffer: a read of tens of MB pays launch and ramp-up time that a
large copy amortizes. The kernel below streams the tensor through a persistent grid and
sums it (so no load is dead code); the fastest of a small sweep of grid size, block and
pipeline depth is the ceiling, with PyTorch's own sum competing beside it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
import triton
import triton.language as tl

# (programs per SM, elements per block, stages, warps) swept.
PROGRAMS_PER_SM = (2, 4, 8)
BLOCK_ELEMENTS = (4096, 8192)
STAGES = (3, 4)
WARPS = (4, 8)


@triton.jit
def _stream_sum(X, Partial, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(pid * BLOCK, n, programs * BLOCK):
        offs = start.to(tl.int64) + tl.arange(0, BLOCK)
        total += tl.load(X + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(Partial + pid, tl.sum(total))


def readers(x: torch.Tensor) -> dict[str, Callable[[], object]]:
    """Ways to read x once, by name: PyTorch's sum and each swept streaming kernel."""
    flat = x.reshape(-1)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    partial = torch.empty(sms * max(PROGRAMS_PER_SM), device=x.device)
    calls = {"torch.sum": lambda: flat.sum(dtype=torch.float32)}
    for per_sm, block, stages, warps in itertools.product(
        PROGRAMS_PER_SM, BLOCK_ELEMENTS, STAGES, WARPS
    ):
        grid = (sms * per_sm,)
        calls[f"stream {per_sm}/SM block {block} stages {stages} warps {warps}"] = (
            lambda grid=grid, block=block, stages=stages, warps=warps: _stream_sum[grid](
                flat, partial, flat.numel(), BLOCK=block, num_stages=stages, num_warps=warps
            )
        )
    return calls


def fastest_read(x: torch.Tensor, time_ms: Callable[[Callable], float | None]):
    """(name, call) of the fastest way to read x once, each timed by time_ms(call)
    (None: it failed)."""
    calls = readers(x)
    times = {name: time_ms(call) for name, call in calls.items()}
    name = min((n for n, ms in times.items() if ms is not None), key=times.get)
    return name, calls[name]
