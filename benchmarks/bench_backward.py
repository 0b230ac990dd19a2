"""Training steps on lik's unified and lowmem backwards, and the strategy
backward="auto" picks for each, in one run on one card.

In-batch (dense) steps from small squares to lopsided batches (one query against a
thousand docs, hundreds of queries against a few), and ragged in-batch steps (varlen:
packed queries of 16-32 tokens and docs of 50-300, maxsim_varlen): each step
(bench_train.measure's: scores, a fixed weighting, backward to Q and D) captured in a CUDA
graph and replayed (the GPU's time alone), its peak memory above the inputs, its
gradients against float64. "auto" is lik.runtime.api.choose_backward's pick for the
shape, and whether it was the faster of the two there. Keys take their committed entries
or the heuristic defaults (LIK_AUTOTUNE=0) unless --autotune, where each key sweeps on its
first step.

    python3 benchmarks/bench_backward.py --out DIR [--rounds 2] [--quick] [--autotune]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ragged import packed_tokens, random_lengths  # noqa: E402
from bench_train import (  # noqa: E402
    GRADIENT_TOLERANCE,
    TIMING,
    make_inputs,
    measure,
    reference_gradients,
)
from common import (  # noqa: E402
    environment_info,
    gpu_name,
    gpu_tag,
    markdown_table,
    missing_gpu,
    release_cached_memory,
    write_results,
)

# (name, Nq, Nd, Lq, Ld) of in-batch steps, d 128: squares, then by docs per query.
SHAPES = [
    ("4 x 4", 4, 4, 32, 300),
    ("16 x 16", 16, 16, 32, 300),
    ("31 x 31", 31, 31, 32, 300),
    ("16 x 16, Lq 64", 16, 16, 64, 200),
    ("8 x 8, colpali", 8, 8, 128, 1024),
    ("64 x 64", 64, 64, 32, 300),
    ("256 x 2", 256, 2, 32, 300),
    ("256 x 8", 256, 8, 32, 300),
    ("256 x 16", 256, 16, 32, 300),
    ("16 x 1000", 16, 1000, 32, 300),
    ("8 x 1000", 8, 1000, 32, 300),
    ("1 x 250", 1, 250, 32, 300),
    ("1 x 1000", 1, 1000, 32, 300),
]
# (name, Nq, Nd, (shortest, longest) query, (shortest, longest) doc) of ragged steps, d 128.
RAGGED_SHAPES = [
    ("varlen 16 x 16", 16, 16, (16, 32), (50, 300)),
    ("varlen 32 x 32", 32, 32, (16, 32), (50, 300)),
    ("varlen 64 x 64", 64, 64, (16, 32), (50, 300)),
    ("varlen 128 x 128", 128, 128, (16, 32), (50, 300)),
    ("varlen 256 x 8", 256, 8, (16, 32), (50, 300)),
    ("varlen 1 x 1000", 1, 1000, (16, 32), (50, 300)),
]
STRATEGIES = ("unified", "lowmem")


def ragged_inputs(nq, nd, q_range, d_range, seed):
    """Packed unit-norm tokens, their int32 offsets and longest length per side (each
    sequence's length drawn from its range), and the scores' weights."""
    batch = {}
    for side, count, (low, high) in (("q", nq, q_range), ("d", nd, d_range)):
        lengths = random_lengths(count, low, high, seed)
        batch[side] = (*packed_tokens(lengths, seed + 1), int(lengths.max()))
        seed += 2
    weights = torch.randn(nq, nd, device="cuda", generator=torch.Generator("cuda").manual_seed(7))
    return batch, weights


def ragged_scores(strategy, batch):
    from lik.runtime import maxsim_varlen

    (_, cu_q, max_q), (_, cu_d, max_d) = batch["q"], batch["d"]
    return lambda q, docs: maxsim_varlen(q, docs, cu_q, cu_d, max_q, max_d, backward=strategy)


def ragged_reference(batch, weights):
    from lik.runtime.reference import score_pairs_packed_reference

    (q, cu_q, _), (docs, cu_d, _) = batch["q"], batch["d"]
    q64 = q.detach().double().requires_grad_()
    d64 = docs.detach().double().requires_grad_()
    scores = score_pairs_packed_reference(q64, d64, cu_seqlens_q=cu_q, cu_seqlens_d=cu_d,
                                          layout="varlen")  # fmt: skip
    (scores * weights.double()).sum().backward()
    return q64.grad, d64.grad


def _steps():
    """(name, layout, dims, q, docs, weights, reference, scores per strategy) per step."""
    for name, nq, nd, lq, ld in SHAPES:
        q, docs, weights = make_inputs("dense", nq, nd, lq, ld, 128, seed=11)
        reference = reference_gradients(q, docs, weights, "dense")
        yield name, "dense", [nq, nd, lq, ld, 128], q, docs, weights, reference, {}
    for name, nq, nd, q_range, d_range in RAGGED_SHAPES:
        batch, weights = ragged_inputs(nq, nd, q_range, d_range, seed=11)
        q, docs = batch["q"][0], batch["d"][0]
        reference = ragged_reference(batch, weights)
        scores = {strategy: ragged_scores(strategy, batch) for strategy in STRATEGIES}
        dims = [nq, nd, "-".join(map(str, q_range)), "-".join(map(str, d_range)), 128]
        yield name, "varlen", dims, q, docs, weights, reference, scores


def run(rounds: int, timing: dict, autotune: bool) -> dict:
    from lik.runtime.api import LOPSIDED, choose_backward

    report = {"env": environment_info(), "gpu": gpu_name(), "autotune": autotune,
              "lopsided": LOPSIDED, "shapes": []}  # fmt: skip
    for name, layout, dims, q, docs, weights, reference, scores in _steps():
        q.requires_grad_()
        docs.requires_grad_()
        cells = {strategy: [] for strategy in STRATEGIES}
        for round_ in range(rounds):  # alternated: each round in the other order
            for strategy in STRATEGIES[:: 1 if round_ % 2 == 0 else -1]:
                result = measure(f"lik-{strategy}", layout, q, docs, weights, reference, timing,
                                 scores=scores.get(strategy))  # fmt: skip
                cells[strategy].append(result)
                release_cached_memory()
        nq, nd = dims[:2]
        record = {"name": name, "layout": layout, "dims": dims, "cells": cells,
                  "auto": choose_backward("auto", layout, nq, nd)}  # fmt: skip
        print(f"[{name}] " + "; ".join(f"{s} {_best(cells[s], 'graph_ms')} ms" for s in STRATEGIES)
              + f"; auto takes {record['auto']}", flush=True)  # fmt: skip
        report["shapes"].append(record)
        del q, docs, weights, reference
        release_cached_memory()
    return report


def _best(runs: list[dict], field: str) -> float | None:
    """The smallest of a cell's readings (its runs' field), None where none ran."""
    values = [run[field] for run in runs if run.get(field) is not None]
    return min(values) if values else None


def _cell(runs: list[dict]) -> str:
    ms, peak = _best(runs, "graph_ms"), _best(runs, "peak_mib")
    if ms is None or peak is None:
        failures = (run.get("graph_error") or run.get("error") for run in runs)
        return next((failure for failure in failures if failure), "")[:60]
    return f"{ms:.4f} / {peak:.2f}"


def markdown(report: dict) -> str:
    rows = []
    for shape in report["shapes"]:
        cells = shape["cells"]
        unified, lowmem = _best(cells["unified"], "graph_ms"), _best(cells["lowmem"], "graph_ms")
        speedup = verdict = ""
        if unified and lowmem:
            speedup = f"{unified / lowmem:.2f}x"
            verdict = "yes" if (lowmem < unified) == (shape["auto"] == "lowmem") else "no"
        errors = [run[field] for runs in cells.values() for run in runs
                  for field in ("grad_q_err", "grad_d_err") if field in run]  # fmt: skip
        worst = max(errors, default=None)
        flag = "" if worst is None or worst < GRADIENT_TOLERANCE else " (over 2e-2)"
        nq, nd, lq, ld, d = shape["dims"]
        rows.append([shape["name"], f"{nq}, {nd}, {lq}, {ld}, {d}", _cell(cells["unified"]),
                     _cell(cells["lowmem"]), speedup, shape["auto"], verdict,
                     "" if worst is None else f"{worst:.1e}{flag}"])  # fmt: skip
    headers = ["in-batch step", "Nq, Nd, Lq, Ld, d", "unified ms / MiB", "lowmem ms / MiB",
               "lowmem speedup", "auto takes", "auto's the faster",
               "max gradient error"]  # fmt: skip
    env = report["env"]
    keys = ("each key autotuned on its first step" if report["autotune"]
            else "committed entries or heuristic defaults (LIK_AUTOTUNE=0)")  # fmt: skip
    return (f"# Training steps: unified or lowmem backward, and auto's pick, on "
            f"{report['gpu']}\n\n{env['date']}; commit {env['commit']}; torch {env['torch']}, "
            f"Triton {env['triton']}.\n\nForward, a fixed weighting of the scores and backward "
            "to Q and D, bf16 unit-norm tokens, captured in a CUDA graph and replayed (median "
            "ms of do_bench; the best of the rounds, the strategies alternated); peak MiB "
            f"above the inputs during one step, gradients included; keys: {keys}. auto takes "
            f"unified for in-batch calls whose one side is {report['lopsided']} or more times "
            "the other, else lowmem (lik.runtime.api.choose_backward). varlen rows: packed "
            "sequences of random lengths in the ranges given (maxsim_varlen with both "
            "bounds). Gradient error: relative to float64.\n\n"
            + markdown_table(headers, rows) + "\n")  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--autotune", action="store_true", help="let each key sweep once")
    args = parser.parse_args(argv)
    if missing_gpu("bench_backward"):
        return 2
    if not args.autotune:
        os.environ["LIK_AUTOTUNE"] = "0"  # read per call: set before the first step
    report = run(args.rounds, TIMING["quick" if args.quick else "full"], args.autotune)
    text = markdown(report)
    write_results(args.out, f"backward_strategies_{gpu_tag(report['gpu'])}", report, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
