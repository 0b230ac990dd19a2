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
    python3 benchmarks/bench_backward.py --out DIR --dry-run   # CPU, tiny shapes, auto too
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import shapes  # noqa: E402
from bench_ragged import packed_tokens, random_lengths  # noqa: E402
from bench_train import (  # noqa: E402
    GRADIENT_TOLERANCE,
    TIMING,
    make_inputs,
    measure,
    reference_gradients,
)
from common import (  # noqa: E402
    DRY_RUN_TIMER,
    environment_info,
    gpu_name,
    markdown_table,
    missing_gpu,
    provenance,
    release_cached_memory,
    result_stem,
    write_results,
)

SHAPES = shapes.BACKWARD
RAGGED_SHAPES = shapes.BACKWARD_RAGGED
STRATEGIES = ("unified", "lowmem")
DIM = 128
# A dry run (CPU, tiny shapes) exercises the script and its report, not the kernels: lik's
# reference path, timed by wall clock, no graphs or peak memory, and backward="auto" run as
# well. Each step is named for the one it stands in for; 1 x 64 is lopsided enough
# (LOPSIDED_DOCS) for auto to take unified, the others take lowmem.
DRY_RUN_SHAPES = [
    ("4 x 4", 4, 4, 5, 7),
    ("256 x 2, as 4 x 2", 4, 2, 5, 7),
    ("1 x 1000, as 1 x 64", 1, 64, 5, 7),
]
DRY_RUN_RAGGED_SHAPES = [("varlen 16 x 16, as 4 x 4", 4, 4, (3, 5), (4, 7))]
DRY_RUN_DIM = 16
DRY_RUN_STRATEGIES = (*STRATEGIES, "auto")


def ragged_inputs(nq, nd, q_range, d_range, seed, device="cuda", dim=DIM):
    """Packed unit-norm tokens, their int32 offsets and longest length per side (each
    sequence's length drawn from its range), and the scores' weights."""
    batch = {}
    for side, count, (low, high) in (("q", nq, q_range), ("d", nd, d_range)):
        lengths = random_lengths(count, low, high, seed, device)
        batch[side] = (*packed_tokens(lengths, seed + 1, device, dim), int(lengths.max()))
        seed += 2
    weights = torch.randn(nq, nd, device=device, generator=torch.Generator(device).manual_seed(7))
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


def _steps(dry_run: bool):
    """(name, layout, dims, q, docs, weights, reference, scores per strategy) per step."""
    device, dim = ("cpu", DRY_RUN_DIM) if dry_run else ("cuda", DIM)
    strategies = DRY_RUN_STRATEGIES if dry_run else STRATEGIES
    for name, nq, nd, lq, ld in DRY_RUN_SHAPES if dry_run else SHAPES:
        q, docs, weights = make_inputs("dense", nq, nd, lq, ld, dim, seed=11, device=device)
        reference = reference_gradients(q, docs, weights, "dense")
        yield name, "dense", [nq, nd, lq, ld, dim], q, docs, weights, reference, {}
    for name, nq, nd, q_range, d_range in DRY_RUN_RAGGED_SHAPES if dry_run else RAGGED_SHAPES:
        batch, weights = ragged_inputs(nq, nd, q_range, d_range, seed=11, device=device, dim=dim)
        q, docs = batch["q"][0], batch["d"][0]
        reference = ragged_reference(batch, weights)
        scores = {strategy: ragged_scores(strategy, batch) for strategy in strategies}
        dims = [nq, nd, "-".join(map(str, q_range)), "-".join(map(str, d_range)), dim]
        yield name, "varlen", dims, q, docs, weights, reference, scores


def run(rounds: int, timing: dict, autotune: bool, dry_run: bool = False) -> dict:
    from lik.runtime.api import AUTO_RULE, choose_backward

    timer = (DRY_RUN_TIMER if dry_run
             else "CUDA graph replayed, do_bench median")  # fmt: skip
    report = {"env": environment_info(), "gpu": gpu_name(), "autotune": autotune,
              "auto_rule": AUTO_RULE, "dry_run": dry_run, "timer": timer,
              "shapes": []}  # fmt: skip
    strategies = DRY_RUN_STRATEGIES if dry_run else STRATEGIES
    field = _time_field(report)
    for name, layout, dims, q, docs, weights, reference, scores in _steps(dry_run):
        q.requires_grad_()
        docs.requires_grad_()
        cells = {strategy: [] for strategy in strategies}
        for round_ in range(rounds):  # alternated: each round in the other order
            for strategy in strategies[:: 1 if round_ % 2 == 0 else -1]:
                result = measure(f"lik-{strategy}", layout, q, docs, weights, reference, timing,
                                 scores=scores.get(strategy), dry_run=dry_run)  # fmt: skip
                if dry_run:  # no CPU counterpart of the GPU's peak memory
                    result["peak_mib"] = None
                cells[strategy].append(result)
                release_cached_memory()
        nq, nd = dims[:2]
        record = {"name": name, "layout": layout, "dims": dims, "cells": cells,
                  "auto": choose_backward("auto", layout, nq, nd)}  # fmt: skip
        print(f"[{name}] " + "; ".join(f"{s} {_best(cells[s], field)} ms" for s in strategies)
              + f"; auto takes {record['auto']}", flush=True)  # fmt: skip
        report["shapes"].append(record)
        del q, docs, weights, reference
        release_cached_memory()
    return report


def _time_field(report: dict) -> str:
    """The run field a report's times come from: a dry run has no graph replays."""
    return "ms" if report.get("dry_run") else "graph_ms"


def _best(runs: list[dict], field: str) -> float | None:
    """The smallest of a cell's readings (its runs' field), None where none ran."""
    values = [run[field] for run in runs if run.get(field) is not None]
    return min(values) if values else None


def _cell(runs: list[dict], field: str) -> str:
    ms, peak = _best(runs, field), _best(runs, "peak_mib")
    failures = (run.get("graph_error") or run.get("error") for run in runs)
    failure = next((failure for failure in failures if failure), "")
    # A missing peak is a failure on the GPU; a dry run records none.
    if ms is None or (peak is None and failure):
        return failure[:60]
    return f"{ms:.4f} / " + ("-" if peak is None else f"{peak:.2f}")


def markdown(report: dict) -> str:
    field = _time_field(report)
    rows = []
    for shape in report["shapes"]:
        cells = shape["cells"]
        unified, lowmem = _best(cells["unified"], field), _best(cells["lowmem"], field)
        speedup = verdict = ""
        if unified and lowmem:
            speedup = f"{unified / lowmem:.2f}x"
            verdict = "yes" if (lowmem < unified) == (shape["auto"] == "lowmem") else "no"
        errors = [run[field] for runs in cells.values() for run in runs
                  for field in ("grad_q_err", "grad_d_err") if field in run]  # fmt: skip
        worst = max(errors, default=None)
        flag = "" if worst is None or worst < GRADIENT_TOLERANCE else " (over 2e-2)"
        nq, nd, lq, ld, d = shape["dims"]
        ran_auto = [_cell(cells["auto"], field)] if "auto" in cells else []
        rows.append([shape["name"], f"{nq}, {nd}, {lq}, {ld}, {d}", _cell(cells["unified"], field),
                     _cell(cells["lowmem"], field), *ran_auto, speedup, shape["auto"], verdict,
                     "" if worst is None else f"{worst:.1e}{flag}"])  # fmt: skip
    headers = ["in-batch step", "Nq, Nd, Lq, Ld, d", "unified ms / MiB", "lowmem ms / MiB",
               "lowmem speedup", "auto takes", "auto's the faster",
               "max gradient error"]  # fmt: skip
    # Reports before the rule told queries from docs hold one threshold ("lopsided").
    rule = report.get("auto_rule") or (f"unified for in-batch calls whose one side is "
                                       f"{report['lopsided']} or more times the other, else lowmem")
    if report.get("dry_run"):
        headers.insert(4, "auto ms / MiB")
        return (f"# Training steps: unified or lowmem backward, and auto's pick, dry run on "
                f"the CPU\n\n{provenance(report['env'], packages=False)}\n\n"
                f"Timer: {report['timer']} (median ms, the best of the rounds): lik's reference "
                "path on tiny shapes, standing in for the steps named, which exercises this "
                f"script, not the kernels; no peak memory on the CPU (-). auto: {rule}. "
                "Gradient error: relative to float64.\n\n"
                + markdown_table(headers, rows) + "\n")  # fmt: skip
    env = report["env"]
    keys = ("each key autotuned on its first step" if report["autotune"]
            else "committed entries or heuristic defaults (LIK_AUTOTUNE=0)")  # fmt: skip
    return (f"# Training steps: unified or lowmem backward, and auto's pick, on "
            f"{report['gpu']}\n\n{env['date']}; commit {env['commit']}; torch {env['torch']}, "
            f"Triton {env['triton']}.\n\nForward, a fixed weighting of the scores and backward "
            "to Q and D, bf16 unit-norm tokens, captured in a CUDA graph and replayed (median "
            "ms of do_bench; the best of the rounds, the strategies alternated); peak MiB "
            f"above the inputs during one step, gradients included; keys: {keys}. auto: "
            f"{rule} (lik.runtime.api.choose_backward). varlen rows: packed "
            "sequences of random lengths in the ranges given (maxsim_varlen with both "
            "bounds). Gradient error: relative to float64.\n\n"
            + markdown_table(headers, rows) + "\n")  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--autotune", action="store_true", help="let each key sweep once")
    parser.add_argument(
        "--dry-run", action="store_true", help="CPU, tiny shapes, wall clock: exercises the script"
    )
    args = parser.parse_args(argv)
    if not args.dry_run and missing_gpu("bench_backward"):
        return 2
    if not args.autotune:
        os.environ["LIK_AUTOTUNE"] = "0"  # read per call: set before the first step
    timing = TIMING["quick" if args.quick else "full"]
    report = run(args.rounds, timing, args.autotune, dry_run=args.dry_run)
    text = markdown(report)
    stem = result_stem("backward", report["gpu"], args.dry_run)
    write_results(args.out, stem, report, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
