"""Cold start: the first lik call of a fresh Python process, with a warm Triton cache.

For each shape, a child process imports lik, builds inputs and times its first
`lik.maxsim` call (synchronized), then a second one. The first child also fills the
Triton cache (its time is the truly cold compile); the next children start from that
cache, the situation of a restarted server. They run three ways (MODES): as shipped,
where importing lik starts lik.runtime.prewarm (Triton's per-process start cost, paid in
a background thread), calling right after building their inputs or after 2 s more of
start-up; and with LIK_PREWARM=0, where the first call pays all of it. PERF.md's target:
under 50 ms.

A training child also runs a small sum and its backward during setup, standing in for
its model's own first step: otherwise torch's loading of its own reduction and autograd
kernels (23 ms on an H200 host, measured in commit 305b670) would count as lik's.

The children share one Python bytecode cache (PYTHONPYCACHEPREFIX, filled by the first
child), as an installed environment has one: pip compiles bytecode when it installs, and
a machine without it (PYTHONDONTWRITEBYTECODE and no .pyc files) would time compiling
torch's and Triton's sources instead.

After its timed calls, each child checks a corner of its scores against the float64
reference of the same inputs (parity_ok). A dry run builds tiny inputs on the CPU, where
lik takes its reference path: it exercises the children, modes, caches and report, not a
cold start.

    python3 benchmarks/bench_cold_start.py --out DIR [--repeats 3]
    python3 benchmarks/bench_cold_start.py --out DIR --dry-run   # CPU, tiny shapes, 1 repeat
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import shapes  # noqa: E402
from common import (  # noqa: E402
    DRY_RUN_TIMER,
    environment_info,
    format_ms,
    gpu_name,
    markdown_table,
    missing_gpu,
    result_stem,
    write_results,
)

# (name, Nq, Nd, Lq, Ld, d, training): a rerank, an in-batch forward and a training step.
SHAPES = [(s.name, s.nq, s.nd, s.lq, s.ld, s.d, train) for s, train in shapes.COLD_START]
TARGET_MS = 50.0
# A dry run: the same plumbing through lik's CPU reference path, one warm child per mode by
# default. A child takes ~2 s of start-up on the CPU, so it runs one shape, named for the
# one it stands in for: a training step, whose child also runs the forward-only code.
DRY_RUN_SHAPES = [("train-inbatch-64, as 4 x 4", 4, 4, 8, 12, 16, True)]
DRY_RUN_REPEATS = 1
# The corner of the scores checked against float64, small enough to cost nothing on a GPU.
PARITY_QUERIES, PARITY_DOCS = 4, 64
# bf16 inputs, fp32 accumulation: the bound bench_ragged and bench_fp8 use for bf16.
PARITY_TOLERANCE = 1e-2

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
import lik
nq, nd, lq, ld, d, training = json.loads(sys.argv[1])
device = sys.argv[3]
sync = torch.cuda.synchronize if device == "cuda" else lambda: None
q = torch.nn.functional.normalize(torch.randn(nq, lq, d, device=device), dim=-1).bfloat16()
docs = torch.nn.functional.normalize(torch.randn(nd, ld, d, device=device), dim=-1).bfloat16()
q.requires_grad_(training)
docs.requires_grad_(training)
if training:  # the model's own first step: torch loads its sum and autograd kernels
    torch.ones(8, device=device, requires_grad=True).sum().backward()
sync()
imported = time.perf_counter() - t0
time.sleep(float(sys.argv[2]))  # the rest of a server's start-up, e.g. loading a model

def call():
    out = lik.maxsim(q, docs)
    if training:
        out.sum().backward()
    sync()
    return out

times = []
for _ in range(2):
    start = time.perf_counter()
    call()
    times.append(time.perf_counter() - start)

# Untimed, a third call: a corner of its scores against the float64 reference.
from lik.runtime.reference import maxsim_reference

nq_check, nd_check, tolerance = json.loads(sys.argv[4])
scores = call().detach()[:nq_check, :nd_check].double()
ref = maxsim_reference(q[:nq_check].detach().double(), docs[:nd_check].detach().double())
rel_err = float((scores - ref).norm() / ref.norm().clamp_min(1e-300))
print(json.dumps({"import_s": imported, "first_s": times[0], "second_s": times[1],
                  "parity_rel_err": rel_err, "parity_ok": rel_err < tolerance, "error": None}))
"""

# Warm-cache children: (mode, LIK_PREWARM, seconds of other start-up before the call).
MODES = [
    ("right_after_setup", "1", 0.0),
    ("after_2s_more_startup", "1", 2.0),
    ("no_prewarm", "0", 0.0),
]


def child(dims, cache_dir: str, bytecode_dir: str, prewarm: str = "1", idle_s=0.0,
          device: str = "cuda") -> dict:  # fmt: skip
    env = {**os.environ, "TRITON_CACHE_DIR": cache_dir, "LIK_PREWARM": prewarm,
           "PYTHONPYCACHEPREFIX": bytecode_dir}  # fmt: skip
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    if device == "cpu":  # the reference path, not the generated kernels interpreted
        env.pop("TRITON_INTERPRET", None)
    parity = json.dumps([PARITY_QUERIES, PARITY_DOCS, PARITY_TOLERANCE])
    done = subprocess.run([sys.executable, "-P", "-c", CHILD, json.dumps(dims), str(idle_s),
                           device, parity],
                          env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    if done.returncode != 0:
        error = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "failed"
        return {"error": error, "parity_ok": None}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _median_ms(runs: list[dict], field: str) -> float | None:
    """Median of a timing field over the runs that finished, in ms (None if none did)."""
    values = [r[field] * 1e3 for r in runs if field in r]
    return statistics.median(values) if values else None


def measure_shape(name: str, dims: list, repeats: int, bytecode: str, device: str) -> dict:
    """One shape's cells: a compiling child on an empty Triton cache, then `repeats`
    children per mode on the cache it filled."""
    with tempfile.TemporaryDirectory() as cache:
        compile_run = child(dims, cache, bytecode, device=device)
        runs = {mode: [child(dims, cache, bytecode, prewarm, idle, device)
                       for _ in range(repeats)]
                for mode, prewarm, idle in MODES}  # fmt: skip
    every_run = [r for rs in runs.values() for r in rs]
    setup_ms = _median_ms(every_run, "import_s")
    record = {
        "name": name,
        "dims": dims,
        "empty_cache": compile_run,
        "warm_cache": runs,
        "first_call_ms": {mode: _median_ms(rs, "first_s") for mode, rs in runs.items()},
        "second_call_ms": _median_ms(every_run, "second_s"),
        "setup_s": setup_ms / 1e3 if setup_ms is not None else None,
    }
    cold = compile_run.get("first_s", float("nan"))
    firsts = ", ".join(f"{m} {format_ms(ms)} ms" for m, ms in record["first_call_ms"].items())
    print(f"[{name}] first call: empty cache {cold:.2f} s; warm cache: {firsts}", flush=True)
    return record


def run(repeats: int, dry_run: bool = False) -> dict:
    timer = (DRY_RUN_TIMER if dry_run
             else "wall clock, synchronized (time.perf_counter)")  # fmt: skip
    report = {"env": environment_info(), "gpu": gpu_name(), "target_ms": TARGET_MS,
              "dry_run": dry_run, "timer": timer,
              "parity_tolerance": PARITY_TOLERANCE}  # fmt: skip
    device, picked = ("cpu", DRY_RUN_SHAPES) if dry_run else ("cuda", SHAPES)
    with tempfile.TemporaryDirectory() as bytecode:  # shared by every child: the first fills it
        report["shapes"] = [measure_shape(name, dims, repeats, bytecode, device)
                            for name, *dims in picked]  # fmt: skip
    return report


def child_runs(record: dict) -> list[dict]:
    """Every child's result of a shape: the empty-cache one, then each mode's."""
    return [record["empty_cache"], *(r for runs in record["warm_cache"].values() for r in runs)]


def _under_target(ms) -> str:
    return "yes" if ms is not None and ms < TARGET_MS else "no"


def _worst_parity(record: dict) -> str:
    errors = [r["parity_rel_err"] for r in child_runs(record) if "parity_rel_err" in r]
    return f"{max(errors):.1e}" if errors else "—"


def markdown(report: dict) -> str:
    rows = []
    for r in report["shapes"]:
        empty, first = r["empty_cache"], r["first_call_ms"]
        # Reports from before the parity check hold none: no mark.
        failed = any(run.get("parity_ok") is False for run in child_runs(r))
        rows.append([
            f"{r['name']} {tuple(r['dims'][:5])}" + (" train" if r["dims"][5] else "")
            + (" (parity FAIL)" if failed else ""),
            f"{empty['first_s']:.2f} s" if "first_s" in empty else empty.get("error", "")[:60],
            format_ms(first["right_after_setup"]),
            format_ms(first["after_2s_more_startup"]),
            format_ms(first["no_prewarm"]),
            f"{r['setup_s']:.1f} s" if r.get("setup_s") is not None else "",
            format_ms(r["second_call_ms"]),
            f"{_under_target(first['right_after_setup'])} / "
            f"{_under_target(first['after_2s_more_startup'])}",
        ])  # fmt: skip
        if report.get("dry_run"):
            rows[-1].append(_worst_parity(r))
    headers = ["shape", "first call, empty Triton cache",
               "warm cache: first call right after setup (ms)",
               "same, after 2 s more start-up (ms)", "same, LIK_PREWARM=0 (ms)",
               "setup (import, CUDA, inputs)", "second call (ms)",
               f"under {TARGET_MS:g} ms (right after / after 2 s)"]  # fmt: skip
    if report.get("dry_run"):
        headers.append("parity (worst rel err)")
        return (f"# Cold start, dry run on the CPU\n\nTimer: {report['timer']}. Each child "
                "imports lik, builds tiny inputs on the CPU and calls lik.maxsim, which takes "
                "its reference path: this exercises the script (children, modes, the Triton "
                "and bytecode caches, the report), not a cold start; shapes are named for the "
                "ones they stand in for. Parity: a corner of each child's scores against the "
                f"float64 reference (bound {report['parity_tolerance']:.0e}).\n\n"
                + markdown_table(headers, rows) + "\n")  # fmt: skip
    return (f"# Cold start on {report['gpu']}\n\nFresh process per cell (median of the warm "
            "runs); times include launch and synchronization, not the setup. Importing lik "
            "starts lik.runtime.prewarm, which pays Triton's per-process start cost (importing "
            "Triton, its cache key, saved by an earlier process, and lookups) in a background "
            "thread, beside the setup's own work; a first call that comes before the thread "
            "is done waits for the rest. "
            "The middle column gives the process 2 s more of start-up (standing in for "
            "loading a model) before its first call. LIK_PREWARM=0 leaves all of it to "
            "the first call (and saves nothing). The children share a Python bytecode "
            "cache, as an installed environment has one; a training child runs a small sum "
            "and backward of its own during setup (the model's first step, which loads "
            "torch's own kernels).\n\n"
            + markdown_table(headers, rows) + "\n")  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--repeats",
        type=int,
        help=f"warm children per mode (default 3; {DRY_RUN_REPEATS} in a dry run)",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="CPU, tiny shapes, lik's reference path"
    )
    args = parser.parse_args(argv)
    if not args.dry_run and missing_gpu("bench_cold_start"):
        return 2
    repeats = args.repeats if args.repeats is not None else DRY_RUN_REPEATS if args.dry_run else 3
    report = run(repeats, dry_run=args.dry_run)
    stem = result_stem("cold_start", report["gpu"], args.dry_run)
    text = markdown(report)
    write_results(args.out, stem, report, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
