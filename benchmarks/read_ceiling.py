"""How fast this GPU reads a tensor once: a bound for memory-bound MaxSim shapes.

A MaxSim whose docs come from memory must read them at least once. How fast a kernel
can do only that, at the docs' size, bounds every implementation more tightly than the
copy rate of a 1 GiB buffer: a read of tens of MB pays launch and ramp-up time that a
large copy amortizes. Two kernels sum the tensor (so no load is dead code): one streams
it through a persistent grid, the other gives each program one block (a grid as long as
the tensor needs: every block's loads are issued at once). Each kernel reads plainly or
with an evict-first hint: L2 then keeps the lines that earlier work (do_bench's own L2
overwrite, before every timed call) left dirty instead of writing them back as the tensor
streams through, which a read of an L2 or two of data feels (H100, 77 MB: 0.037 ->
0.032 ms). The fastest of a small sweep of grid size, block, pipeline depth, warps and
hint is the ceiling, with PyTorch's own sum competing beside it. Reads through TMA
descriptors were measured too and lost to both (H100, commit 489f0ee).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
import triton
import triton.language as tl

# (programs per SM, elements per block, stages, warps, hint) swept; the one-block-per-program
# kernel sweeps blocks, warps and hint.
PROGRAMS_PER_SM = (2, 4, 8)
BLOCK_ELEMENTS = (4096, 8192)
STAGES = (3, 4)
WARPS = (4, 8)
EVICT_FIRST = (False, True)


@triton.jit
def _load(X, offs, n, EVICT_FIRST: tl.constexpr):
    if EVICT_FIRST:
        x = tl.load(X + offs, mask=offs < n, other=0.0, eviction_policy="evict_first")
    else:
        x = tl.load(X + offs, mask=offs < n, other=0.0)
    return x.to(tl.float32)


@triton.jit
def _stream_sum(X, Partial, n, BLOCK: tl.constexpr, EVICT_FIRST: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(pid * BLOCK, n, programs * BLOCK):
        total += _load(X, tl.cast(start, tl.int64) + tl.arange(0, BLOCK), n, EVICT_FIRST)
    tl.store(Partial + pid, tl.sum(total))


@triton.jit
def _block_sum(X, Partial, n, BLOCK: tl.constexpr, EVICT_FIRST: tl.constexpr):
    pid = tl.program_id(0)
    offs = tl.cast(pid, tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Partial + pid, tl.sum(_load(X, offs, n, EVICT_FIRST)))


def _stream_call(flat, partial, grid, block, stages, warps, evict):
    options = {"BLOCK": block, "EVICT_FIRST": evict, "num_stages": stages, "num_warps": warps}
    return lambda: _stream_sum[grid](flat, partial, flat.numel(), **options)


def _block_call(flat, partial, programs, block, warps, evict):
    options = {"BLOCK": block, "EVICT_FIRST": evict, "num_warps": warps}
    return lambda: _block_sum[(programs,)](flat, partial, flat.numel(), **options)


def readers(x: torch.Tensor) -> dict[str, Callable[[], object]]:
    """Ways to read x once, by name: PyTorch's sum and each swept kernel."""
    flat = x.reshape(-1)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    blocks = {block: triton.cdiv(flat.numel(), block) for block in BLOCK_ELEMENTS}
    partial = torch.empty(max(sms * max(PROGRAMS_PER_SM), *blocks.values()), device=x.device)
    calls = {"torch.sum": lambda: flat.sum(dtype=torch.float32)}
    for per_sm, block, stages, warps, evict in itertools.product(
        PROGRAMS_PER_SM, BLOCK_ELEMENTS, STAGES, WARPS, EVICT_FIRST
    ):
        hint = " evict-first" if evict else ""
        name = f"stream {per_sm}/SM block {block} stages {stages} warps {warps}{hint}"
        calls[name] = _stream_call(flat, partial, (sms * per_sm,), block, stages, warps, evict)
    for (block, programs), warps, evict in itertools.product(blocks.items(), WARPS, EVICT_FIRST):
        hint = " evict-first" if evict else ""
        calls[f"blocks of {block} warps {warps}{hint}"] = _block_call(
            flat, partial, programs, block, warps, evict
        )
    return calls


def fastest_read(x: torch.Tensor, time_ms: Callable[[Callable], float | None]):
    """(name, call) of the fastest way to read x once, each timed by time_ms(call)
    (None: it failed)."""
    calls = readers(x)
    times = {name: time_ms(call) for name, call in calls.items()}
    name = min((n for n, ms in times.items() if ms is not None), key=times.get)
    return name, calls[name]
