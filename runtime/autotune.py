"""Call-time autotune for keys that no committed table covers, cached on disk.

A CUDA call whose forward or backward key has no committed entry (its own, its card's, its
unmasked twin's: lik.runtime.tuning.committed_source) times a small grid of launch configs
around the heuristic default on the call's own inputs, once, and keeps the fastest: in
memory for the process and in a JSON file that later processes read, so each (card, key,
kernel) sweeps once per machine. A backward (several launches and their allocations) is
timed as CUDA-graph replays, as `make tune` times it. Committed keys never sweep (the
suite's shapes all have entries: tests/test_tuning.py), nor do "once" keys (their tile
and warps come with a forward key's sweep), calls being captured into a CUDA graph, or
calls under the interpreter.

LIK_AUTOTUNE=0 turns the sweep off (keys without entries then launch the heuristic
default); LIK_CACHE_DIR moves the cache file (default ~/.cache/lik).
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
import logging
import os
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from lik.runtime import registry
from lik.runtime.tuning import THIN_ROWS

log = logging.getLogger("lik.autotune")

CACHE_FORMAT = 1
CACHE_FILE = "autotune.json"

_lock = threading.Lock()
_entries: dict[str, dict] | None = None  # cache key -> entry, read from disk on first use
sweeps = 0  # sweeps run in this process (benchmarks check that the suite runs none)


def applies(key, device: torch.device) -> bool:
    """Whether a call's key may take an autotuned entry: a CUDA forward or backward key,
    autotune on."""
    return (device.type == "cuda" and key.kernel in ("fwd", "bwd")
            and os.environ.get("LIK_AUTOTUNE", "1") != "0")  # fmt: skip


def capturing(device: torch.device) -> bool:
    """A call being captured into a CUDA graph cannot sync or time: it takes the default."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def cache_path() -> Path:
    root = os.environ.get("LIK_CACHE_DIR") or os.path.join(Path.home(), ".cache", "lik")
    return Path(root) / CACHE_FILE


def cache_key(key) -> str:
    """A key's cache entry name: the card, the table key and the generated kernel's hash
    (a regenerated kernel tunes again; so does another Triton)."""
    import triton  # only CUDA calls get here, and they run Triton

    kernel = registry.kernels()[registry.entry(key.variant)["kernel"]]["sha256"][:16]
    return f"{key.card}|{key.table_key()}|{kernel}|triton {triton.__version__}"


def _read_file(path: Path) -> dict[str, dict]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:
        log.warning("ignoring unreadable autotune cache %s (%s)", path, error)
        return {}
    if not isinstance(data, dict) or data.get("format") != CACHE_FORMAT:
        log.warning("ignoring autotune cache %s: not format %s", path, CACHE_FORMAT)
        return {}
    entries = data.get("entries", {})
    return entries if isinstance(entries, dict) else {}


def _loaded() -> dict[str, dict]:
    global _entries
    if _entries is None:
        _entries = _read_file(cache_path())
    return _entries


FIELDS = ("block_l", "num_warps", "num_stages", "query_group")


def cached_entry(key) -> dict | None:
    """The autotuned entry of a key on its card (None if it has none yet, or only one
    that is not a config: the key then sweeps again and replaces it)."""
    with _lock:
        entry = _loaded().get(cache_key(key))
    valid = isinstance(entry, dict) and all(
        isinstance(entry.get(field), int) and entry[field] > 0 for field in FIELDS
    )
    return entry if valid else None


def _store(name: str, entry: dict) -> None:
    """Keeps an entry in memory and merges it into the cache file (written whole, then
    renamed: a reader never sees half a file). A file that cannot be written leaves the
    entry in memory only."""
    _loaded()[name] = entry
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        entries = {**_read_file(path), name: entry}
        payload = json.dumps({"format": CACHE_FORMAT, "entries": entries}, indent=1)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False) as tmp:
            tmp.write(payload)
        os.replace(tmp.name, path)
    except OSError as error:
        log.warning("autotune cache %s not written (%s); kept for this process", path, error)


def candidates(base: dict, *, lq: int, max_query_group: int, backward=False,
               warps: tuple[int, ...] | None = None) -> list[dict]:  # fmt: skip
    """The configs a sweep times: the default `base` and its neighbours (half and twice
    its doc tile, two warp counts or `warps` where given, 2 or 3 stages, its query
    stacking and the most the key allows; a backward's 1 to 3 stages). About two dozen
    (9 for a plain lowmem backward, on one warpgroup), so that the one-time stall (each
    candidate compiles) stays in seconds; `make tune`'s grid is wider."""
    tiles = sorted({max(16, base["block_l"] // 2), base["block_l"], min(256, base["block_l"] * 2)})
    if backward:
        # grad_D's tiles are gathered rows: its tuned entries are unpipelined or 2 stages.
        stages = (1, 2, 3)
    elif base["num_stages"] == 1:  # unpipelined variants (residual decoding) stay so
        stages = (1,)
    else:
        stages = (2, 3)
    groups = sorted({base["query_group"], max_query_group})
    found = [base]
    for group in groups:
        # A tile of one short query is too thin for a warpgroup: fewer warps there.
        counts = warps or ((2, 4) if lq * group <= THIN_ROWS else (4, 8))
        for block_l, num_warps, num_stages in itertools.product(tiles, counts, stages):
            entry = {**base, "block_l": block_l, "num_warps": num_warps,
                     "num_stages": num_stages, "query_group": group}  # fmt: skip
            if entry not in found:
                found.append(entry)
    return found


def _time_ms(run, device: torch.device, graph: bool = False) -> float:
    """Median ms of run() as make tune's quick sweep times it (triton's do_bench, L2
    emptied before each launch: timed back to back, small calls' docs stay in L2 and the
    winner can be the slower one once they do not; H100, 4 x 300 docs at Lq 64: a config
    timed 18.9 us hot read 42 under do_bench against the default's 22.5). graph: replays
    of a CUDA graph of run(), whose host work (several launches) would otherwise hide the
    configs' differences. perf_counter off CUDA (tests on the CPU)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        if graph:
            with torch.cuda.device(device):  # the graph's stream on the call's GPU
                return graph_ms(run, rep_ms=40)
        return do_bench(run, warmup=10, rep=40, return_mode="median")
    began = time.perf_counter()
    run()
    return (time.perf_counter() - began) * 1000


def graph_ms(run, *, rep_ms: float, replays: int = 10) -> float:
    """Median ms per call of run(), replayed from a CUDA graph of about rep_ms of calls (as
    triton's do_bench_cudagraph); the sweep's and `make tune`'s timer of backwards.
    Captured thread-locally: a backward sweeps inside the first training step, and a
    global capture would forbid other threads' CUDA calls meanwhile (a data loader
    pinning its next batch)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(side):
        run()  # warm-up off the capturing thread's current stream, as capture wants
        start.record()
        for _ in range(5):
            run()
        end.record()
        torch.cuda.synchronize()
        calls = max(1, int(rep_ms / max(start.elapsed_time(end) / 5, 1e-3)))
        graph = torch.cuda.CUDAGraph()
        # A collection during capture could finalize a compiled kernel, whose unloading
        # is illegal there.
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
                for _ in range(calls):
                    run()
        finally:
            if collecting:
                gc.enable()
        times = []
        for _ in range(replays):
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / calls)
    torch.cuda.current_stream().wait_stream(side)
    return statistics.median(times)


# Threads that compile a sweep's candidates side by side. Compiling is most of a sweep's
# stall, and Triton releases the GIL while it compiles.
COMPILE_THREADS = 8


def compile_side_by_side(entries: list[dict], run, device: torch.device) -> None:
    """Launches every entry once so that their compiles overlap: the first on this thread
    (it sets up the kernels' per-device state), the rest from a pool of threads on this
    thread's CUDA device and stream, so that the launches keep the call's stream order. A
    failing entry is left for the timed loop to report."""
    stream = torch.cuda.current_stream(device) if device.type == "cuda" else None

    def launch(entry):
        try:
            with contextlib.ExitStack() as on_call_stream:
                if stream is not None:
                    on_call_stream.enter_context(torch.cuda.device(device))
                    on_call_stream.enter_context(torch.cuda.stream(stream))
                run(entry)
        except Exception:
            pass

    launch(entries[0])
    workers = min(COMPILE_THREADS, os.cpu_count() or 1, len(entries) - 1)
    if workers > 0:
        with ThreadPoolExecutor(workers, thread_name_prefix="lik-autotune") as pool:
            list(pool.map(launch, entries[1:]))


def _outputs(result) -> tuple[torch.Tensor, ...]:
    """A run's outputs (a tensor, or a backward's gradients), copied."""
    return tuple(t.clone() for t in (result if isinstance(result, tuple) else (result,)))


def agreement(dtype: torch.dtype) -> float:
    """How far two configs' outputs may differ (relative): 1e-3, or two units in the last
    place of a 16-bit output (the dense grad_D sums its rows in tile-sized groups, so
    another BLOCK_L rounds a few elements to the neighbouring bf16 value); see agree."""
    if dtype.is_floating_point:
        return max(1e-3, 2 * torch.finfo(dtype).eps)
    return 1e-3


def agree(outputs, reference, *, tolerance: float | None = None, equal_nan=False) -> bool:
    """Whether a config's outputs match the reference config's: within agreement() of
    each output's dtype and 1e-3 absolute, or `tolerance` for both where given; equal_nan:
    NaN where the reference has NaN (a call-time sweep's inputs may score NaN, a pair
    list's bad index). Call-time sweeps and `make tune` both check configs with it."""
    return all(
        torch.allclose(o.float(), r.float(), rtol=tolerance or agreement(r.dtype),
                       atol=tolerance or 1e-3, equal_nan=equal_nan)  # fmt: skip
        for o, r in zip(outputs, reference, strict=True)
    )


def sweep(key, entries: list[dict], run, device: torch.device, shape: str,
          graph: bool = False) -> dict | None:  # fmt: skip
    """Times run(entry) -> the call's output(s) for each entry, stores the fastest under
    the key and returns it; None (nothing stored) where no entry ran. Every launch writes
    the call's whole output; one that disagrees with the first entry's is left out.
    graph: time CUDA-graph replays (_time_ms)."""
    global sweeps
    began = time.perf_counter()
    if device.type == "cuda":
        compile_side_by_side(entries, run, device)
    compiled = time.perf_counter() - began
    times, reference = [], None
    for entry in entries:
        try:
            outputs = _outputs(run(entry))  # compiled by now: not timed
            if reference is None:
                reference = outputs
            elif not agree(outputs, reference, equal_nan=True):
                log.warning("autotune %s: %s left out, its outputs differ from the first "
                            "config's that ran", key.table_key(), entry)  # fmt: skip
                continue
            times.append((_time_ms(lambda e=entry: run(e), device, graph), entry))
        except Exception as error:  # a config this GPU cannot run (resources, compile)
            log.debug("autotune %s: %s failed: %s", key.table_key(), entry, error)
    if not times:
        return None
    ms, best = min(times, key=lambda pair: pair[0])
    winner = {**best, "ms": round(ms, 4), "shape": shape, "card": key.card}
    with _lock:
        sweeps += 1
        _store(cache_key(key), winner)
    log.info("autotuned %s on %s in %.1f s (%d configs, compiled in %.1f s): block_l=%d "
             "num_warps=%d num_stages=%d query_group=%d, %.4f ms", key.table_key(), key.card,
             time.perf_counter() - began, len(entries), compiled, best["block_l"],
             best["num_warps"], best["num_stages"], best["query_group"], ms)  # fmt: skip
    return winner


def forget() -> None:
    """Drops the in-memory entries (the next lookup reads the file again); for tests."""
    global _entries
    with _lock:
        _entries = None
