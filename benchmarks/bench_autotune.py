"""The call-time autotune: its one-time stall, and what it buys training steps.

Stall: the first call of keys without a table entry. Each cell is a child process with
an empty Triton cache and an empty autotune cache, so every candidate compiles: the worst
first call a user meets (once per machine and key). Two ways per key, alternated:
candidates compiled one after another by the timed loop (COMPILE_THREADS = 0, as before
side-by-side compiles), and side by side (lik.runtime.autotune.compile_side_by_side).
Each child also reports the winner and its scores' error against float64.

Training: steps (lowmem forward + backward, as bench_train.py's) whose forward and
backward keys have no entry, in a child with LIK_AUTOTUNE=0 (the heuristic defaults),
one that autotunes the forward key alone (as before backward keys were autotuned) and
one that autotunes both on its first step; GPU time of the step replayed from a CUDA
graph (bench_train.step_graph), and the gradients' error against float64.

    python3 benchmarks/bench_autotune.py --out DIR [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import shapes  # noqa: E402
from common import (  # noqa: E402
    environment_info,
    gpu_name,
    markdown_table,
    missing_gpu,
    result_stem,
    write_results,
)

SHAPES = shapes.AUTOTUNE
WAYS = {"one after another": 0, "side by side": None}  # COMPILE_THREADS (None: as shipped)
TRAIN_SHAPES = shapes.AUTOTUNE_TRAIN

CHILD = r"""
import json, sys, time
import torch
from lik.runtime import autotune, maxsim
layout, nq, nd, lq, ld, threads = json.loads(sys.argv[1])
if threads is not None:
    autotune.COMPILE_THREADS = threads
g = torch.Generator(device="cuda").manual_seed(0)
unit = lambda *shape: torch.nn.functional.normalize(
    torch.randn(*shape, 128, device="cuda", generator=g), dim=-1).bfloat16()
Q, D = unit(nq, lq), unit(*((nq, nd, ld) if layout == "kd" else (nd, ld)))
torch.cuda.synchronize()
before = autotune.sweeps
start = time.perf_counter()
out = maxsim(Q, D)
torch.cuda.synchronize()
first = time.perf_counter() - start
pattern = "qik,qdjk->qdij" if layout == "kd" else "qik,djk->qdij"
ref = torch.einsum(pattern, Q.double(), D.double()).amax(-1).sum(-1)
(entry,) = json.loads(autotune.cache_path().read_text())["entries"].values()
print(json.dumps({"first_s": first, "sweeps": autotune.sweeps - before, "entry": entry,
                  "error": ((out.double() - ref).abs().max() / ref.abs().max()).item()}))
"""


TRAIN_CHILD = r"""
import json, os, sys, time
sys.path.insert(0, sys.argv[2])
import torch
from bench_train import step_graph, reference_gradients, step
from common import bench_ms, relative_error
from lik.runtime import autotune, maxsim
layout, nq, nd, lq, ld, kernels = json.loads(sys.argv[1])
if kernels == "fwd":  # the forward key alone
    applies = autotune.applies
    autotune.applies = lambda key, device: key.kernel == "fwd" and applies(key, device)
g = torch.Generator(device="cuda").manual_seed(0)
unit = lambda *shape: torch.nn.functional.normalize(
    torch.randn(*shape, 128, device="cuda", generator=g), dim=-1).bfloat16().requires_grad_()
Q, D = unit(nq, lq), unit(*((nq, nd, ld) if layout == "kd" else (nd, ld)))
weights = torch.randn(nq, nd, device="cuda", generator=g)
scores = lambda q, d: maxsim(q, d, backward="lowmem")
torch.cuda.synchronize()
before = autotune.sweeps
start = time.perf_counter()
grads = step(scores, Q, D, weights)
torch.cuda.synchronize()
first = time.perf_counter() - start
want = reference_gradients(Q, D, weights, layout)
error = max(relative_error(got, ref) for got, ref in zip(grads, want))
step_ms = bench_ms(step_graph(scores, Q, D, weights), warmup_ms=25, rep_ms=200)
path = autotune.cache_path()
entries = json.loads(path.read_text())["entries"] if path.exists() else {}
print(json.dumps({"first_s": first, "sweeps": autotune.sweeps - before, "step_ms": step_ms,
                  "error": error, "entries": entries}))
"""
# mode: (LIK_AUTOTUNE, keys autotuned)
TRAIN_MODES = {
    "defaults (LIK_AUTOTUNE=0)": ("0", "none"),
    "forward autotuned": ("1", "fwd"),
    "autotuned": ("1", "all"),
}


def child(dims: list, script: str = CHILD, autotune: str = "1") -> dict:
    with tempfile.TemporaryDirectory() as triton_cache, tempfile.TemporaryDirectory() as lik_cache:
        env = {**os.environ, "TRITON_CACHE_DIR": triton_cache, "LIK_CACHE_DIR": lik_cache,
               "LIK_AUTOTUNE": autotune}  # fmt: skip
        here = str(Path(__file__).resolve().parent)
        done = subprocess.run([sys.executable, "-P", "-c", script, json.dumps(dims), here],
                              env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    if done.returncode != 0:
        return {"failed": done.stderr.strip().splitlines()[-1] if done.stderr else "failed"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(rounds: int, parts: list[str]) -> dict:
    # Side-by-side compiles scale with the host's cores (COMPILE_THREADS at most).
    report = {"env": environment_info(), "gpu": gpu_name(), "cpus": os.cpu_count(), "shapes": []}
    for name, *dims in SHAPES if "stall" in parts else []:
        cells = {way: [] for way in WAYS}
        for round_ in range(rounds):  # alternated: each round in the other order
            for way in list(WAYS)[:: 1 if round_ % 2 == 0 else -1]:
                cells[way].append(child([*dims, WAYS[way]]))
        seconds = {way: [c["first_s"] for c in runs if "first_s" in c]
                   for way, runs in cells.items()}  # fmt: skip
        print(f"[{name}] " + "; ".join(f"{way} {', '.join(f'{s:.1f}' for s in ss)} s"
                                       for way, ss in seconds.items()), flush=True)  # fmt: skip
        report["shapes"].append({"name": name, "dims": dims, "cells": cells})
    report["training"] = []
    for name, *dims in TRAIN_SHAPES if "training" in parts else []:
        cells = {mode: [] for mode in TRAIN_MODES}
        for round_ in range(rounds):
            for mode in list(TRAIN_MODES)[:: 1 if round_ % 2 == 0 else -1]:
                setting, kernels = TRAIN_MODES[mode]
                cells[mode].append(child([*dims, kernels], TRAIN_CHILD, setting))
        print(f"[{name}] " + "; ".join(f"{mode} {_step_times(runs)} ms"
                                       for mode, runs in cells.items()), flush=True)  # fmt: skip
        report["training"].append({"name": name, "dims": dims, "cells": cells})
    return report


def _step_times(runs: list[dict]) -> str:
    return ", ".join(f"{r['step_ms']:.4f}" for r in runs if "step_ms" in r)


def _entries_text(runs: list[dict]) -> str:
    """The autotuned forward and backward configs of a training shape's runs."""
    found = Counter()
    for run in runs:
        for name, entry in run.get("entries", {}).items():
            kind = "backward" if "|bwd|" in name else "forward"
            found[f"{kind} {entry['block_l']} tokens, {entry['num_warps']} warps, "
                  f"stages {entry['num_stages']}"] += 1  # fmt: skip
    return "; ".join(f"{text} ({count} of {len(runs)})" for text, count in sorted(found.items()))


def training_markdown(report: dict) -> str:
    rows = []
    for shape in report.get("training", []):
        row = [shape["name"]]
        for mode in TRAIN_MODES:  # a mode a report lacks (an older run's) stays empty
            runs = shape["cells"].get(mode) or [{}]
            row.append(_step_times(runs) or runs[0].get("failed", "")[:60])
        tuned = [r for r in shape["cells"]["autotuned"] if "first_s" in r]
        row.append(", ".join(f"{r['first_s']:.1f} s ({r['sweeps']} sweeps)" for r in tuned))
        row.append(_entries_text(tuned))
        every = [r for runs in shape["cells"].values() for r in runs if "error" in r]
        row.append(f"{max(r['error'] for r in every):.1e}" if every else "")
        rows.append(row)
    headers = ["training step (lowmem)", *(f"GPU ms, {mode}" for mode in TRAIN_MODES),
               "first step, autotuned", "autotuned configs", "max gradient error"]  # fmt: skip
    return ("\n## Training steps whose keys have no entry\n\nForward + backward "
            "(lowmem), bf16 unit-norm tokens, d 128, the step captured in a CUDA graph and "
            "replayed (median ms of do_bench, warm-up 25 ms, rep 200 ms); one child process "
            "per cell, empty caches, the modes alternated. Gradient error: relative to "
            "float64.\n\n" + markdown_table(headers, rows) + "\n")  # fmt: skip


def markdown(report: dict) -> str:
    rows = []
    for shape in report["shapes"]:
        row = [shape["name"]]
        for way in WAYS:
            runs = shape["cells"][way]
            times = [r["first_s"] for r in runs if "first_s" in r]
            row.append(", ".join(f"{t:.1f}" for t in times) or runs[0].get("failed", "")[:60])
        both = [r for runs in shape["cells"].values() for r in runs if "entry" in r]
        winners = Counter(f"{r['entry']['block_l']} tokens, {r['entry']['num_warps']} warps, "
                          f"stages {r['entry']['num_stages']}" for r in both)  # fmt: skip
        sweep_ms = [r["entry"]["ms"] for r in both]
        row.append("; ".join(f"{config} ({count} of {len(both)})"
                             for config, count in winners.most_common())
                   + (f"; {min(sweep_ms):.4f}-{max(sweep_ms):.4f} ms" if both else ""))  # fmt: skip
        row.append(f"{max(r['error'] for r in both):.1e}" if both else "")
        rows.append(row)
    headers = ["call", *(f"first call, s: {way}" for way in WAYS),
               "winners (of the cells); the sweeps' ms", "max error vs float64"]  # fmt: skip
    env = report["env"]
    return (f"# Call-time autotune stall on {report['gpu']}\n\n{env['date']}; commit "
            f"{env['commit']}; torch {env['torch']}, Triton {env['triton']}; "
            f"{report['cpus']} CPU cores.\n\nFirst call of a key with no "
            "committed entry, in a fresh process with empty Triton and autotune caches "
            "(every candidate compiles), seconds from the call to its synchronized "
            "result; bf16 unit-norm tokens, d 128. Rounds alternate the two ways.\n\n"
            + markdown_table(headers, rows) + "\n")  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--parts", default="stall,training", help="stall, training or both")
    args = parser.parse_args(argv)
    if missing_gpu("bench_autotune"):
        return 2
    report = run(args.rounds, args.parts.split(","))
    text = markdown(report) + training_markdown(report)
    write_results(args.out, result_stem("autotune", report["gpu"]), report, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
