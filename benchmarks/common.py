"""Measuring and reporting helpers shared by lik's benchmarks.

The method (median timing, input rotation, measured ceilings, roofline floor) is the
one PERF.md lays down; every number a run reports comes from the same process and card.
"""

from __future__ import annotations

import importlib.metadata
import itertools
import json
import math
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

# Inputs under this size can stay resident in L2 (50-60 MB on H100/H200) between calls.
L2_RESIDENT_BYTES = 60e6
# Rotate enough input sets that one full cycle overflows L2 several times over.
ROTATION_FOOTPRINT_BYTES = 256e6
MAX_ROTATION_SETS = 16

COPY_CEILING_BYTES = 1 << 30
MATMUL_CEILING_N = 8192

# Random generation runs in fp32 blocks of at most this many elements (256 MB scratch).
GENERATION_BLOCK_ELEMENTS = 1 << 26


@dataclass(frozen=True)
class Shape:
    """One MaxSim problem: Nq queries of Lq tokens against Nd docs of Ld tokens, dim d."""

    name: str
    nq: int
    nd: int
    lq: int
    ld: int
    d: int

    def __iter__(self):
        """Unpacks as (name, nq, nd, lq, ld, d)."""
        return iter((self.name, self.nq, self.nd, self.lq, self.ld, self.d))

    @property
    def dims(self) -> str:
        return f"{self.nq}, {self.nd}, {self.lq}, {self.ld}, {self.d}"

    @property
    def flops(self) -> int:
        return 2 * self.nq * self.nd * self.lq * self.ld * self.d

    def input_bytes(self, element_size: int = 2) -> int:
        return (self.nq * self.lq + self.nd * self.ld) * self.d * element_size

    def bytes_moved(self, element_size: int = 2) -> int:
        """D and Q read once, fp32 scores written once."""
        return self.input_bytes(element_size) + self.nq * self.nd * 4

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "Nq": self.nq,
            "Nd": self.nd,
            "Lq": self.lq,
            "Ld": self.ld,
            "d": self.d,
        }


# ---------------------------------------------------------------------------------------
# Inputs


def normalized_tokens(
    rows: int, length: int, dim: int, *, device, seed: int, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Random L2-normalized token embeddings [rows, length, dim], generated in blocks
    so a multi-GB corpus never needs a full-size fp32 copy."""
    generator = torch.Generator(device=device).manual_seed(seed)
    out = torch.empty(rows, length, dim, device=device, dtype=dtype)
    rows_per_block = max(1, GENERATION_BLOCK_ELEMENTS // (length * dim))
    for start in range(0, rows, rows_per_block):
        stop = min(rows, start + rows_per_block)
        block = torch.randn(stop - start, length, dim, device=device, generator=generator)
        out[start:stop] = torch.nn.functional.normalize(block, dim=-1)
    return out


def rotation_count(input_bytes: int) -> int:
    """How many distinct input sets a timed loop cycles through."""
    if input_bytes >= L2_RESIDENT_BYTES:
        return 1
    return min(MAX_ROTATION_SETS, math.ceil(ROTATION_FOOTPRINT_BYTES / input_bytes))


def make_input_sets(shape: Shape, device, count: int, *, seed: int = 0):
    """`count` independent (Q, D) pairs for `shape`, bf16 and unit-norm per token."""
    sets = []
    for index in range(count):
        base = seed + 2 * index
        q = normalized_tokens(shape.nq, shape.lq, shape.d, device=device, seed=base)
        docs = normalized_tokens(shape.nd, shape.ld, shape.d, device=device, seed=base + 1)
        sets.append((q, docs))
    return sets


def rotating(call: Callable, input_sets: Sequence[tuple]) -> Callable[[], object]:
    """A no-argument callable that feeds the next input set to `call` each time, so a
    timed loop never re-reads inputs that are still cached from the previous call
    (do_bench also overwrites L2 between timed calls, but not during its warm-up)."""
    cycle = itertools.cycle(input_sets)
    return lambda: call(*next(cycle))


# ---------------------------------------------------------------------------------------
# Timing and ceilings


def bench_ms(fn: Callable[[], object], *, warmup_ms: int, rep_ms: int) -> float:
    """Median milliseconds of `fn` on the GPU."""
    from triton.testing import do_bench  # GPU runs only; a dry run never imports Triton

    # First call outside the timing: JIT compilation and autotuning are not steady state.
    fn()
    torch.cuda.synchronize()
    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def clean_l2_ms(fn: Callable[[], object], *, reps: int = 300) -> float:
    """Median milliseconds of `fn` on the GPU with L2 left clean before each call: do_bench
    empties L2 by writing a 256 MB buffer, whose dirty lines the timed call then writes
    back (H100: ~10 us of a 262 MB rerank, measured in commit 5fc3399); this reads it
    instead, as after a kernel that only read. make tune's timer for its near-ties."""
    from tune import clean_l2_ms as timed  # GPU runs only, lik installed

    return timed(fn, reps=reps)


def back_to_back_ms(fn: Callable[[], object], *, calls: int = 200, rounds: int = 3) -> float:
    """Wall-clock milliseconds per call of `calls` calls issued back to back, one sync at
    the end: the rate of a tight loop, the best of `rounds` (a host-paced rate moves with
    the machine's other load). Above the GPU time, the call is bound by its host work
    (argument checks, dispatch, kernel launches), not by the GPU."""
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) * 1e3 / calls)
    return best


def graph_replay(fn: Callable[[], object], *, calls: int = 1, warmup_calls: int = 1):
    """The replay of `calls` calls of `fn` captured in one CUDA graph: it runs the same
    kernels with no host work between them. The warm-up calls (compile, allocate) run on
    a side stream first, as capture wants."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup_calls):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph.replay


def graph_ms(fn: Callable[[], object], *, calls: int, warmup_ms: int, rep_ms: int) -> float:
    """Milliseconds per call of `fn` on the GPU alone: `calls` calls (with a rotating `fn`,
    one per input set, so L2 holds none of the next call's inputs) captured in one CUDA
    graph and replayed. Where this is below bench_ms, the call's host work outlasts its
    kernels."""
    replay = graph_replay(fn, calls=calls, warmup_calls=calls)
    return bench_ms(replay, warmup_ms=warmup_ms, rep_ms=rep_ms) / calls


# How every benchmark's --dry-run report names its timer (cpu_wallclock_ms).
DRY_RUN_TIMER = "CPU wall clock, dry run"


def cpu_wallclock_ms(fn: Callable[[], object], *, repeats: int = 5) -> float:
    """Median wall-clock milliseconds; only for exercising the plumbing without a GPU."""
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def first_call_seconds(fn: Callable[[], object]):
    """Runs `fn` once and returns (result, seconds), synchronizing when on a GPU."""
    start = time.perf_counter()
    result = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return result, time.perf_counter() - start


def copy_bandwidth_tbps(device, *, warmup_ms: int, rep_ms: int) -> float:
    """Device-to-device copy rate of a 1 GiB buffer, counting bytes read plus written."""
    src = torch.empty(COPY_CEILING_BYTES, dtype=torch.uint8, device=device).random_(0, 256)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), warmup_ms=warmup_ms, rep_ms=rep_ms)
    return 2 * COPY_CEILING_BYTES / (ms * 1e-3) / 1e12


def matmul_tflops(device, *, warmup_ms: int, rep_ms: int) -> float:
    """bf16 tensor-core rate of an 8192^3 matmul on random data."""
    n = MATMUL_CEILING_N
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    c = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    ms = bench_ms(lambda: torch.mm(a, b, out=c), warmup_ms=warmup_ms, rep_ms=rep_ms)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def measure_ceilings(device, *, warmup_ms: int, rep_ms: int) -> dict:
    """The card's copy bandwidth and bf16 matmul rate, measured (and printed) once per run."""
    print("measuring ceilings ...", flush=True)
    ceilings = {
        "copy_tbps": copy_bandwidth_tbps(device, warmup_ms=warmup_ms, rep_ms=rep_ms),
        "matmul_tflops": matmul_tflops(device, warmup_ms=warmup_ms, rep_ms=rep_ms),
    }
    torch.cuda.empty_cache()
    print(f"  copy {ceilings['copy_tbps']:.2f} TB/s, matmul {ceilings['matmul_tflops']:.0f} "
          "TFLOP/s", flush=True)  # fmt: skip
    return ceilings


def roofline_floor(shape: Shape, ceilings: dict | None, moved_bytes: int | None = None) -> dict:
    """Lower bound on time from the measured ceilings, and which one binds: the shape's
    FLOPs at the matmul rate, its bytes (shape.bytes_moved() unless given) at the copy
    rate."""
    if not ceilings:
        return {"floor_ms": None, "bound": None}
    moved = shape.bytes_moved() if moved_bytes is None else moved_bytes
    compute_ms = shape.flops / (ceilings["matmul_tflops"] * 1e12) * 1e3
    memory_ms = moved / (ceilings["copy_tbps"] * 1e12) * 1e3
    bound = "compute" if compute_ms >= memory_ms else "memory"
    return {"floor_ms": max(compute_ms, memory_ms), "bound": bound}


def percent_of_roofline(floor_ms: float | None, ms: float | None) -> float | None:
    if floor_ms is None or not ms:
        return None
    return 100.0 * floor_ms / ms


def peak_extra_memory_mib(fn: Callable[[], object]) -> float:
    """Peak GPU memory allocated while `fn` runs, above what was allocated before
    (the inputs), output included."""
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - baseline
    del result
    return peak / 2**20


# ---------------------------------------------------------------------------------------
# Correctness and failures


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||, computed in float64."""
    ref = ref.double()
    diff = out.double().to(ref.device) - ref
    return float(diff.norm() / ref.norm().clamp_min(1e-300))


def describe_error(exc: BaseException, limit: int = 400) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    first_lines = " | ".join(text.splitlines()[:4])
    return first_lines[:limit]


def attempt(fn: Callable[[], object]):
    """Runs `fn`, returning (value, None) or (None, error string), so that one failing
    implementation is recorded instead of ending the run."""
    try:
        return fn(), None
    except Exception as exc:  # noqa: BLE001 - any failure of a baseline is data
        release_cached_memory()
        return None, describe_error(exc)


def missing_gpu(benchmark: str) -> bool:
    """True (and says so on stderr) where no CUDA GPU is here: main() then exits with 2."""
    if torch.cuda.is_available():
        return False
    print(f"{benchmark} needs a CUDA GPU", file=sys.stderr)
    return True


def release_cached_memory() -> None:
    if not torch.cuda.is_available():
        return
    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001 - a broken context reports itself on the next call
        pass


# ---------------------------------------------------------------------------------------
# Environment


def gpu_name() -> str:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def gpu_tag(name: str) -> str:
    """Short card name for file names: 'NVIDIA H100 80GB HBM3' -> 'H100'."""
    match = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Za-z]?)\b", name)
    if match:
        return match.group(1)
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "unknown"


def package_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


# The checkout these scripts belong to: git is asked about it, wherever they run from.
REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
# A commit as results record it: git's short hash, "+dirty" when the tree differed.
COMMIT_PATTERN = re.compile(r"[0-9a-f]{7,40}(\+dirty)?")


def _git(*args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=10, check=True
    )
    return done.stdout.strip()


def git_commit() -> str | None:
    """The commit a run measures, read from git: `git rev-parse --short HEAD`, plus
    '+dirty' when `git status --porcelain` lists anything. None where git cannot tell (a
    copy of the tree without its .git): such a run's results are no record to commit."""
    try:
        commit = _git("rev-parse", "--short", "HEAD")
        return commit + ("+dirty" if _git("status", "--porcelain") else "")
    except (OSError, subprocess.SubprocessError):
        return None


def environment_info(distributions: Sequence[str] = ()) -> dict:
    info = {
        "gpu": gpu_name(),
        "commit": git_commit(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": package_version("triton"),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    info["packages"] = {name: package_version(name) for name in distributions}
    return info


# ---------------------------------------------------------------------------------------
# Writers


def _finite_or_none(value):
    """JSON has no NaN/inf; write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite_or_none(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite_or_none(item) for item in value]
    return value


def provenance(env: dict, *, packages: bool = True) -> str:
    """A report's line of where its numbers come from: date, commit, torch and Triton, and
    the versions of environment_info's distributions."""
    line = (f"{env['date']}; commit {env['commit'] or 'unknown'}; torch {env['torch']}, "
            f"triton {env['triton']}")  # fmt: skip
    if packages:
        line += "; " + ", ".join(f"{n} {v or 'not installed'}" for n, v in env["packages"].items())
    return line + "."


def write_json(path: Path, payload: dict) -> None:
    text = json.dumps(_finite_or_none(payload), indent=2, default=str)
    path.write_text(text + "\n")


def format_ms(ms: float | None) -> str:
    if ms is None:
        return "—"
    return f"{ms:.2f}" if ms >= 10 else f"{ms:.3f}"


def format_ratio(ratio: float | None, suffix: str = "x") -> str:
    return "—" if ratio is None else f"{ratio:.2f}{suffix}"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


# Plots of more categories than this (the grids' cells) get 0.4 inch per bar, in at most
# GRID_PLOT_INCHES of width.
MANY_CATEGORIES = 16
GRID_PLOT_INCHES = 20.0


def write_speedup_plot(
    path: Path, categories: Sequence[str], series: dict[str, Sequence[float | None]], title: str
) -> bool:
    """Grouped bars of lik's speedup over each baseline per shape, on a linear axis with
    a line at 1.0 (above it lik is faster). Returns False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on benchmark machines
        import matplotlib.pyplot as plt
    except ImportError:
        return False

    width = 0.8 / max(1, len(series))
    many = len(categories) > MANY_CATEGORIES  # a grid's cells: narrower, labels upright
    bars = len(categories) * max(1, len(series))
    inches = min(GRID_PLOT_INCHES, 0.4 * bars) if many else 1.3 * len(categories)
    fig, ax = plt.subplots(figsize=(max(6.0, inches), 6.5 if many else 4.5))
    for index, (label, values) in enumerate(series.items()):
        positions = [i + (index - (len(series) - 1) / 2) * width for i in range(len(categories))]
        heights = [math.nan if v is None else v for v in values]
        bars = ax.bar(positions, heights, width, label=label)
        ax.bar_label(
            bars, labels=["" if v is None else f"{v:.2f}" for v in values], fontsize=7, padding=2
        )
    ax.axhline(1.0, color="black", linewidth=1, linestyle="--")
    ax.set_xticks(range(len(categories)))
    if many:
        ax.set_xticklabels(categories, rotation=90, fontsize=7)
    else:
        ax.set_xticklabels(categories, rotation=30, ha="right")
    ax.set_ylabel("speedup of lik (baseline ms / lik ms)")
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    if not any(v is not None for values in series.values() for v in values):
        ax.text(
            0.5, 0.5, "no lik timings in this run", transform=ax.transAxes, ha="center", va="center"
        )
    if series:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def pick(names: str | None, available: list[str], what: str) -> list[str]:
    """The comma-separated names a user asked for (all when none), or exit naming the
    unknown ones and the choices."""
    if not names:
        return available
    chosen = [name.strip() for name in names.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in available]
    if unknown:
        choices = ", ".join(available)
        raise SystemExit(f"unknown {what}: {', '.join(unknown)}; choose from {choices}")
    return chosen


def speedup_series(report: dict, baselines, label, ratio) -> dict[str, list]:
    """A speedup plot's series: "vs <label(baseline)>" -> ratio(record, baseline) for each
    shape, for each baseline the run measured (report["implementations"])."""
    return {
        f"vs {label(b)}": [ratio(record, b) for record in report["shapes"]]
        for b in baselines
        if b in report["implementations"]
    }


def result_stem(suite: str, gpu: str, dry_run: bool = False) -> str:
    """Where a suite's result goes under an output folder: <suite>/<card> (one file per
    card, the latest run; benchmarks/results keeps them), <suite>/<card>_dry-run for a
    CPU dry run."""
    return f"{suite}/{gpu_tag(gpu)}" + ("_dry-run" if dry_run else "")


def stamped(report: dict) -> dict:
    """The report with its card and measured commit first, from its environment_info."""
    env = report.get("env") or report.get("environment") or {}
    return {"card": gpu_tag(env.get("gpu") or gpu_name()), "commit": env.get("commit"), **report}


def write_results(out_dir: Path, stem: str, report: dict, markdown: str, plot=None) -> None:
    """<stem>.json (stamped with card and commit), <stem>.md and, given plot =
    (categories, series, title), <stem>.png, under out_dir; stem is result_stem's."""
    base = out_dir / stem
    base.parent.mkdir(parents=True, exist_ok=True)
    report = stamped(report)
    if report["commit"] is None:
        print("git cannot tell the commit of this tree: the results name none", flush=True)
    write_json(Path(f"{base}.json"), report)
    Path(f"{base}.md").write_text(markdown)
    if plot is not None and not write_speedup_plot(Path(f"{base}.png"), *plot):
        print("matplotlib is not installed: no plot written", flush=True)
