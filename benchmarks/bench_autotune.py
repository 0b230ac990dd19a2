"""The call-time autotune's one-time stall: the first call of keys without a table entry.

Each cell is a child process with an empty Triton cache and an empty autotune cache, so
every candidate compiles: the worst first call a user meets (once per machine and key).
Two ways per key, alternated: candidates compiled one after another by the timed loop
(COMPILE_THREADS = 0, as before side-by-side compiles), and side by side
(lik.runtime.autotune.compile_side_by_side). Each child also reports the winner and its
scores' error against float64.

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
from common import environment_info, gpu_name, gpu_tag, markdown_table, write_json  # noqa: E402

# (name, layout, Nq, Nd, Lq, Ld): calls whose forward keys have no committed entry.
SHAPES = [
    ("1 x 10000 docs, Ld 300", "dense", 1, 10000, 32, 300),
    ("4 x 1000, Ld 300", "dense", 4, 1000, 32, 300),
    ("4 x 300, Lq 64, Ld 200", "dense", 4, 300, 64, 200),
    ("KD 16 x 32 docs, Ld 300", "kd", 16, 32, 32, 300),
]
WAYS = {"one after another": 0, "side by side": None}  # COMPILE_THREADS (None: as shipped)

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


def child(dims: list) -> dict:
    with tempfile.TemporaryDirectory() as triton_cache, tempfile.TemporaryDirectory() as lik_cache:
        env = {**os.environ, "TRITON_CACHE_DIR": triton_cache, "LIK_CACHE_DIR": lik_cache,
               "LIK_AUTOTUNE": "1"}  # fmt: skip
        done = subprocess.run([sys.executable, "-P", "-c", CHILD, json.dumps(dims)], env=env,
                              capture_output=True, text=True, timeout=600)  # fmt: skip
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr else "failed"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(rounds: int) -> dict:
    # Side-by-side compiles scale with the host's cores (COMPILE_THREADS at most).
    report = {"env": environment_info(), "gpu": gpu_name(), "cpus": os.cpu_count(), "shapes": []}
    for name, *dims in SHAPES:
        cells = {way: [] for way in WAYS}
        for round_ in range(rounds):  # alternated: each round in the other order
            for way in list(WAYS)[:: 1 if round_ % 2 == 0 else -1]:
                cells[way].append(child([*dims, WAYS[way]]))
        seconds = {way: [c["first_s"] for c in runs if "first_s" in c]
                   for way, runs in cells.items()}  # fmt: skip
        print(f"[{name}] " + "; ".join(f"{way} {', '.join(f'{s:.1f}' for s in ss)} s"
                                       for way, ss in seconds.items()), flush=True)  # fmt: skip
        report["shapes"].append({"name": name, "dims": dims, "cells": cells})
    return report


def markdown(report: dict) -> str:
    rows = []
    for shape in report["shapes"]:
        row = [shape["name"]]
        for way in WAYS:
            runs = shape["cells"][way]
            times = [r["first_s"] for r in runs if "first_s" in r]
            row.append(", ".join(f"{t:.1f}" for t in times) or runs[0].get("error", "")[:60])
        both = [r for runs in shape["cells"].values() for r in runs if "entry" in r]
        winners = Counter(f"{r['entry']['block_l']} tokens, {r['entry']['num_warps']} warps, "
                          f"{r['entry']['num_stages']} stages" for r in both)  # fmt: skip
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
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench_autotune needs a CUDA GPU", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    report = run(args.rounds)
    text = markdown(report)
    stem = f"autotune_stall_{gpu_tag(report['gpu'])}"
    write_json(args.out / f"{stem}.json", report)
    (args.out / f"{stem}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
