"""Training (forward + backward) MaxSim: lik's unified and lowmem backwards against the
peers and eager PyTorch, time and peak memory, in one run on one card.

Each step scores L2-normalized bf16 inputs, weights the scores with a fixed random
matrix (a stand-in for a loss) and backpropagates to Q and D. Gradients are checked
against a float64 reference before anything is timed.

    python3 benchmarks/bench_train.py --out DIR [--shapes inbatch-256,kd-64x32] [--quick]
    python3 benchmarks/bench_train.py --out DIR --dry-run   # CPU, tiny shapes, lik and eager
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import grid  # noqa: E402
import shapes  # noqa: E402
from common import (  # noqa: E402
    DRY_RUN_TIMER,
    attempt,
    back_to_back_ms,
    bench_ms,
    cpu_wallclock_ms,
    environment_info,
    format_ms,
    format_ratio,
    gpu_name,
    graph_replay,
    markdown_table,
    measure_ceilings,
    missing_gpu,
    normalized_tokens,
    peak_extra_memory_mib,
    percent_of_roofline,
    provenance,
    relative_error,
    release_cached_memory,
    result_stem,
    roofline_floor,
    write_results,
)
from grid import eager_scores  # noqa: E402

SHAPES = shapes.TRAIN
TIMING = {"full": {"warmup_ms": 100, "rep_ms": 500}, "quick": {"warmup_ms": 25, "rep_ms": 100}}
GRADIENT_TOLERANCE = 2e-2  # bf16 gradients, one rounding each, against float64
# Steps back to back: the best of a few rounds, since a host-paced rate moves with the
# machine's other load.
LOOP_STEPS = 100
LOOP_ROUNDS = 3


def make_inputs(layout, nq, nd, lq, ld, d, seed, device="cuda"):
    q = normalized_tokens(nq, lq, d, device=device, seed=seed)
    if layout == "kd":
        docs = normalized_tokens(nq * nd, ld, d, device=device, seed=seed + 1).view(nq, nd, ld, d)
    else:
        docs = normalized_tokens(nd, ld, d, device=device, seed=seed + 1)
    weights = torch.randn(nq, nd, device=device, generator=torch.Generator(device).manual_seed(7))
    return q, docs, weights


def build(key: str, layout: str) -> Callable:
    """scores(q, docs) with autograd, for one implementation."""
    if key.startswith("lik"):
        from lik.runtime import maxsim

        strategy = key.split("-", 1)[1]
        return lambda q, docs: maxsim(q, docs, backward=strategy)
    if key.startswith("LIK"):
        from late_interaction_kernels import maxsim as lik045

        strategy = key.split("-", 1)[1]
        return lambda q, docs: lik045(q, docs, backward=strategy)
    if key == "flash":
        from flash_maxsim import flash_maxsim_batched_train

        shared = layout != "kd"
        return lambda q, docs: flash_maxsim_batched_train(q, docs, shared_docs=shared)
    if key == "eager":
        return eager_scores
    raise KeyError(key)


IMPLEMENTATIONS = ["lik-auto", "lik-unified", "lik-lowmem", "LIK-unified", "LIK-lowmem",
                   "flash", "eager"]  # fmt: skip
PEERS = ["LIK-unified", "LIK-lowmem", "flash"]
# A dry run (CPU, tiny shapes) exercises the script itself: lik through its CPU path and
# eager, timed by wall clock, with no peers, graphs, peak memory or back-to-back loops.
DRY_RUN_IMPLEMENTATIONS = ["lik-auto", "lik-unified", "lik-lowmem", "eager"]


def step(scores: Callable, q, docs, weights):
    """One forward + backward; returns the gradients (so peak memory counts them)."""
    q.grad = docs.grad = None
    (scores(q, docs) * weights).sum().backward()
    return q.grad, docs.grad


def step_graph(scores: Callable, q, docs, weights) -> Callable[[], None]:
    """The step captured in a CUDA graph (common.graph_replay): its time is the GPU's
    alone (small steps are otherwise bound by Python, autograd and launch overhead, which
    varies run to run). step clears the gradients before the capture, so the graph
    allocates them and each replay writes them afresh."""
    return graph_replay(lambda: step(scores, q, docs, weights), warmup_calls=2)


def reference_gradients(q, docs, weights, layout):
    from lik.runtime.reference import maxsim_reference

    q64 = q.detach().double().requires_grad_()
    d64 = docs.detach().double().requires_grad_()
    (maxsim_reference(q64, d64) * weights.double()).sum().backward()
    return q64.grad, d64.grad


def measure(key, layout, q, docs, weights, reference, timing, scores=None, dry_run=False) -> dict:
    """One implementation's step: gradient check, then timings and peak memory. `scores`
    (q, docs) -> scores replaces build(key, layout) where a caller scores another way
    (packed ragged batches)."""
    if scores is None:
        scores, error = attempt(lambda: build(key, layout))
        if error:
            return {"error": error}
    grads, error = attempt(lambda: step(scores, q, docs, weights))
    if error:
        return {"error": error}
    errors = [relative_error(g, r) for g, r in zip(grads, reference, strict=True)]
    result = {"grad_q_err": errors[0], "grad_d_err": errors[1],
              "parity_ok": max(errors) < GRADIENT_TOLERANCE}  # fmt: skip
    if dry_run:
        timed, error = attempt(lambda: cpu_wallclock_ms(lambda: step(scores, q, docs, weights)))
        return {**result, "ms": timed, "error": error}
    timed, error = attempt(lambda: bench_ms(lambda: step(scores, q, docs, weights), **timing))
    if error:
        return {**result, "error": error}
    q.grad = docs.grad = None  # the baseline must not hold the previous step's gradients
    peak, error = attempt(lambda: peak_extra_memory_mib(lambda: step(scores, q, docs, weights)))
    # The graph (and its memory pool) is gone when the call returns.
    graph_ms, graph_error = attempt(
        lambda: bench_ms(step_graph(scores, q, docs, weights), **timing)
    )
    loop_ms, loop_error = attempt(lambda: back_to_back_ms(
        lambda: step(scores, q, docs, weights), calls=LOOP_STEPS, rounds=LOOP_ROUNDS
    ))  # fmt: skip
    q.grad = docs.grad = None
    return {**result, "ms": timed, "peak_mib": peak, "error": error, "graph_ms": graph_ms,
            "graph_error": graph_error, "loop_ms": loop_ms, "loop_error": loop_error}  # fmt: skip


def run(args) -> dict:
    timing = TIMING["quick" if args.quick else "full"]
    wanted = set(args.shapes.split(",")) if args.shapes else None
    device = "cpu" if args.dry_run else "cuda"
    report = {"env": environment_info(["late-interaction-kernels", "flash-maxsim"]),
              "gpu": gpu_name(), "shapes": []}  # fmt: skip
    for name, nq, nd, lq, ld, d, layout in SHAPES:
        if wanted and name not in wanted:
            continue
        if args.dry_run:
            nq, nd, lq, ld = min(nq, 4), min(nd, 4), 8, 16
        print(f"[{name}] {nq}, {nd}, {lq}, {ld}, {d} ({layout})", flush=True)
        q, docs, weights = make_inputs(layout, nq, nd, lq, ld, d, seed=11, device=device)
        q.requires_grad_()
        docs.requires_grad_()
        reference = reference_gradients(q, docs, weights, layout)
        record = {"name": name, "dims": [nq, nd, lq, ld, d], "layout": layout, "results": {}}
        for key in IMPLEMENTATIONS:
            if args.dry_run and key not in DRY_RUN_IMPLEMENTATIONS:
                result = {"error": "skipped in dry run"}
            else:
                result = measure(key, layout, q, docs, weights, reference, timing,
                                 dry_run=args.dry_run)  # fmt: skip
            record["results"][key] = result
            print(f"  {key:12s} {format_ms(result.get('ms'))} ms, "
                  f"{format_ms(result.get('peak_mib'))} MiB, grad err "
                  f"{result.get('grad_q_err', float('nan')):.1e}/"
                  f"{result.get('grad_d_err', float('nan')):.1e} {result.get('error') or ''}",
                  flush=True)  # fmt: skip
            release_cached_memory()
        report["shapes"].append(record)
        del q, docs, weights, reference
        release_cached_memory()
    return report


def _lik_vs_faster_peer(results: dict, field: str) -> str:
    """The faster peer's time over lik's best strategy's, by one timing field."""
    lik_best = min((results[k][field] for k in IMPLEMENTATIONS[:3] if results[k].get(field)),
                   default=None)  # fmt: skip
    peer_best = min((results[k][field] for k in PEERS if results[k].get(field)), default=None)
    return format_ratio(peer_best / lik_best if lik_best and peer_best else None)


def _timing_rows(report: dict, field: str, error_field: str) -> list[list[str]]:
    """One row per shape: each implementation's `field` in ms, then lik against the faster
    peer."""
    rows = []
    for record in report["shapes"]:
        results = record["results"]
        cells = [f"error: {results[k][error_field][:40]}" if results[k].get(error_field)
                 else format_ms(results[k].get(field)) for k in IMPLEMENTATIONS]  # fmt: skip
        rows.append([record["name"], *cells, _lik_vs_faster_peer(results, field)])
    return rows


def markdown(report: dict) -> str:
    headers = ["shape", *IMPLEMENTATIONS, "lik best vs faster peer"]
    rows = []
    for record in report["shapes"]:
        results = record["results"]
        cells = []
        for key in IMPLEMENTATIONS:
            r = results[key]
            ok = "" if r.get("parity_ok", False) else " (parity FAIL)"
            cells.append(f"{format_ms(r.get('ms'))} / {format_ms(r.get('peak_mib'))}{ok}"
                         if r.get("ms") else f"error: {r.get('error', '')[:60]}")  # fmt: skip
        rows.append([f"{record['name']} {tuple(record['dims'])}", *cells,
                     _lik_vs_faster_peer(results, "ms")])  # fmt: skip
    failed = [f"{record['name']} {key} {max(r['grad_q_err'], r['grad_d_err']):.3f}"
              for record in report["shapes"] for key, r in record["results"].items()
              if r.get("parity_ok") is False]  # fmt: skip
    note = "" if not failed else (
        f"\nparity FAIL: a gradient's relative error against float64 is above"
        f" {GRADIENT_TOLERANCE} ({', '.join(failed)}). Eager's bf16 einsum rounds each"
        " similarity to bf16 before the max, so near-tied doc tokens trade places; the"
        " kernels compare in fp32.\n"
    )  # fmt: skip
    parts = [f"# Training forward + backward on {report['gpu']}", "",
             "Cells: median ms / peak MiB above inputs (gradients included), same run.", "",
             markdown_table(headers, rows)]  # fmt: skip
    if any("graph_ms" in r for record in report["shapes"] for r in record["results"].values()):
        graph_rows = _timing_rows(report, "graph_ms", "graph_error")
        parts += ["", "GPU time alone: the same step captured in a CUDA graph and replayed"
                  " (median ms; no host work between kernels).", "",
                  markdown_table(headers, graph_rows)]  # fmt: skip
    if any("loop_ms" in r for record in report["shapes"] for r in record["results"].values()):
        loop_rows = _timing_rows(report, "loop_ms", "loop_error")
        parts += ["", f"Back to back: ms per step of {LOOP_STEPS} steps issued in a row with one"
                  f" sync at the end, best of {LOOP_ROUNDS} rounds. A training loop's rate"
                  " when nothing else keeps the GPU busy: above the GPU time, the step is"
                  " paced by its host work (Python, autograd, launches).", "",
                  markdown_table(headers, loop_rows)]  # fmt: skip
    return "\n".join(parts) + "\n" + note


# ---------------------------------------------------------------------------------------
# The shape-class grid (--grid): shapes.GRID_TRAIN's training steps, GPU time (the step
# captured in a CUDA graph and replayed) against both peers where they train the cell,
# eager PyTorch and torch.compile of it (benchmarks/grid.py builds the inputs).

GRID_SUITE = "train_grid"
# lik as a call gets it (backward="auto") against every peer strategy.
GRID_IMPLEMENTATIONS = ["lik-auto", "LIK-unified", "LIK-lowmem", "flash", "eager", "compile"]
GRID_DRY_RUN_IMPLEMENTATIONS = ["lik-auto", "eager"]
# Quick timing keeps the grid's ~30 cells to one GPU session's few minutes.
GRID_TIMING = TIMING["quick"]


def grid_not_applicable(key: str, cell: shapes.Cell) -> str | None:
    """Why an implementation cannot train a cell (a grid.NOT_APPLICABLE code), or None."""
    packed = cell.ragged == "packed"
    if key == "flash" and cell.holes:
        return "no holes"
    if key == "flash" and packed:
        return "no packed autograd"
    if key == "LIK-lowmem" and packed:
        return "one varlen backward"
    return None


def takes_packed(key: str, cell: shapes.Cell) -> bool:
    """Whether the implementation gets the cell's docs packed (its varlen entry)."""
    return cell.ragged == "packed" and key.startswith(("lik", "LIK"))


def build_grid_scores(key: str, cell: shapes.Cell) -> Callable[[grid.Inputs], torch.Tensor]:
    """One implementation's differentiable scores of a cell's inputs, as a training loop
    with those inputs calls it: masks, lengths (flash-maxsim) or packed docs."""
    pairs = cell.layout == "pairs"
    if key.startswith(("lik", "LIK")):
        strategy = key.split("-", 1)[1]
        if key.startswith("lik"):
            from lik.runtime import maxsim, maxsim_pairs, maxsim_varlen

            if takes_packed(key, cell):
                return lambda x: maxsim_varlen(*x.packed.varlen_args, backward=strategy)
        else:
            from late_interaction_kernels import maxsim, maxsim_pairs, maxsim_varlen

            if takes_packed(key, cell):  # its one backward (grid_not_applicable)
                return lambda x: maxsim_varlen(*x.packed.varlen_args)
        entry = maxsim_pairs if pairs else maxsim
        return lambda x: entry(x.q, x.docs, x.q_mask, x.d_mask, backward=strategy)
    if key == "flash":
        from flash_maxsim import flash_maxsim_batched_train

        # No pairs entry trains: pairs go as kd with one doc per query.
        shared = cell.layout == "dense"
        return lambda x: flash_maxsim_batched_train(
            x.q, x.docs.unsqueeze(1) if pairs else x.docs, shared_docs=shared,
            doc_lengths=x.d_lengths, query_lengths=x.q_lengths)  # fmt: skip
    if key == "eager":
        return grid.padded_call(cell, eager_scores)
    if key == "compile":
        torch._dynamo.reset()  # a fresh compile per cell: static shapes, no recompile limit
        return grid.padded_call(cell, torch.compile(eager_scores, dynamic=False))
    raise KeyError(key)


def grid_step(scores: Callable, x: grid.Inputs, leaves, weights):
    """One forward + backward of sum(weights * scores); returns the leaves' gradients."""
    for leaf in leaves:
        leaf.grad = None
    (scores(x).reshape(weights.shape) * weights).sum().backward()
    return tuple(leaf.grad for leaf in leaves)


def grid_result(**fields) -> dict:
    return {"ms": None, "grad_q_err": None, "grad_d_err": None, "parity_ok": None,
            "error": None, "not_applicable": None, **fields}  # fmt: skip


def measure_grid_implementation(key, cell, x, weights, reference, dry_run) -> dict:
    """Gradients checked against float64, then the step's GPU time (graph replay)."""
    reason = grid_not_applicable(key, cell)
    if reason:
        return grid_result(not_applicable=reason)
    if dry_run and key not in GRID_DRY_RUN_IMPLEMENTATIONS:
        return grid_result(error="skipped in dry run")
    scores, error = attempt(lambda: build_grid_scores(key, cell))
    if error:
        return grid_result(error=error)
    form = "packed" if takes_packed(key, cell) else "padded"
    leaves = (x.packed.q, x.packed.docs) if form == "packed" else (x.q, x.docs)
    grads, error = attempt(lambda: grid_step(scores, x, leaves, weights))
    if error:
        return grid_result(error=error)
    q_err, d_err = (relative_error(g, r) for g, r in zip(grads, reference[form], strict=True))
    result = grid_result(grad_q_err=q_err, grad_d_err=d_err,
                         parity_ok=max(q_err, d_err) < GRADIENT_TOLERANCE)  # fmt: skip

    def step():
        return grid_step(scores, x, leaves, weights)

    if dry_run:
        result["ms"], result["error"] = attempt(lambda: cpu_wallclock_ms(step))
    else:  # the graph (and its memory pool) is gone when the call returns
        result["ms"], result["error"] = attempt(
            lambda: bench_ms(graph_replay(step, warmup_calls=2), **GRID_TIMING)
        )
    for leaf in leaves:
        leaf.grad = None
    return result


def train_floor(cell: shapes.Cell, ceilings: dict | None) -> dict:
    """A step's floor: its forward's FLOPs at the matmul rate (an argmax backward gathers
    and needs none), its least traffic (Cell.train_bytes_moved) at the copy rate."""
    return roofline_floor(cell, ceilings, cell.train_bytes_moved())


def measure_grid_cell(cell: shapes.Cell, device, dry_run: bool, ceilings=None) -> dict:
    (x,) = grid.input_sets(cell, device, 1, seed=11)
    for leaf in (x.q, x.docs, *((x.packed.q, x.packed.docs) if x.packed else ())):
        leaf.requires_grad_()
    weights = torch.randn(cell.shape.nq, cell.shape.nd, device=device,
                          generator=torch.Generator(device).manual_seed(7))  # fmt: skip
    reference = grid.reference_gradients(cell, x, weights)
    record = {**cell.as_dict(), **train_floor(cell, ceilings), "results": {}}
    for key in GRID_IMPLEMENTATIONS:
        result = measure_grid_implementation(key, cell, x, weights, reference, dry_run)
        record["results"][key] = result
        if result["not_applicable"]:
            print(f"  {key:12s} n/a ({result['not_applicable']})", flush=True)
        else:
            print(f"  {key:12s} {format_ms(result['ms'])} ms, grad err "
                  f"{result['grad_q_err'] or float('nan'):.1e}/"
                  f"{result['grad_d_err'] or float('nan'):.1e} {result['error'] or ''}",
                  flush=True)  # fmt: skip
        release_cached_memory()
    lik_ms = record["results"]["lik-auto"]["ms"]
    record["pct_floor"] = percent_of_roofline(record["floor_ms"], lik_ms)
    del x, weights, reference
    release_cached_memory()
    return record


def grid_ratio(record: dict) -> float | None:
    """The best peer's GPU time over lik's (above 1: lik is faster)."""
    lik_ms = record["results"]["lik-auto"]["ms"]
    _, peer_ms = grid.best_peer(record["results"], PEERS, "ms")
    return peer_ms / lik_ms if lik_ms and peer_ms else None


def grid_markdown(report: dict) -> str:
    keys = GRID_IMPLEMENTATIONS
    timing = report["timing"]
    headers = ["cell", "axes", "Nq, Nd, Lq, Ld, d", *keys, "lik vs best peer", "floor",
               "lik % floor"]  # fmt: skip
    rows = [[r["name"], ", ".join(r["axes"]), f"{r['Nq']}, {r['Nd']}, {r['Lq']}, {r['Ld']}, "
             f"{r['d']}", *(grid.result_cell(r["results"][k], "ms", format_ms) for k in keys),
             format_ratio(grid_ratio(r)), format_ms(r.get("floor_ms")),
             format_ratio(r.get("pct_floor"), "%")] for r in report["cells"]]  # fmt: skip

    def errors(result):
        if result["grad_q_err"] is None:
            return "—"
        mark = "" if result["parity_ok"] else " FAIL"
        return f"{result['grad_q_err']:.1e} / {result['grad_d_err']:.1e}{mark}"

    parity_rows = [[r["name"], *(errors(r["results"][k]) for k in keys)]
                   for r in report["cells"]]  # fmt: skip
    failures = [f"- {r['name']} {k}: {r['results'][k]['error']}"
                for r in report["cells"] for k in keys
                if r["results"][k]["error"] not in (None, "skipped in dry run")]  # fmt: skip
    parts = [
        f"# Training forward + backward grid on {report['gpu']}",
        "",
        provenance(report["env"]),
        "",
        f"GPU time of one step (forward, backward to Q and D of sum(weights * scores)): the "
        f"step captured in a CUDA graph and replayed, median ms ({timing['timer']}, warm-up "
        f"{timing['warmup_ms']} ms, rep {timing['rep_ms']} ms). Cells (benchmarks/shapes.py, "
        "GRID_TRAIN) and their masks as in the forward grid (benchmarks/grid.py); lik with "
        "backward=\"auto\". \"lik vs best peer\": the fastest peer strategy's time over "
        "lik's, among the peers that train the cell (one that failed the gradient check counts "
        "too, flagged FAIL).",
        "",
        floor_line(report),
        "",
        grid.ratio_line(report, grid_ratio),
        grid.parity_line(report, {k: k for k in keys}),
        "",
        markdown_table(headers, rows),
        "",
        *grid.not_applicable_lines(report),
        "",
        f"## Gradient check (relative error of dQ / dD against float64, tolerance "
        f"{GRADIENT_TOLERANCE:g})",
        "",
        "Eager's bf16 einsum rounds each similarity to bf16 before the max, so near-tied doc "
        "tokens trade places and its gradients can miss the tolerance; the kernels compare in "
        "fp32.",
        "",
        markdown_table(["cell", *keys], parity_rows),
        "",
    ]
    if failures:
        parts += ["## Errors", "", *failures, ""]
    return "\n".join(parts)


def floor_line(report: dict) -> str:
    """What the floor column counts, the ceilings it used, and the KD cells' worst %."""
    ceilings = report.get("ceilings")
    line = ("Floor: the step's forward FLOPs at the measured bf16 matmul rate or its least "
            "traffic at the measured copy rate, whichever is longer: Q and D read once, their "
            "gradients written once, the fp32 scores written and their gradient read (an "
            "argmax backward gathers winners and needs no matmul).")  # fmt: skip
    if not ceilings:
        return line + " No ceilings in this run (no GPU): no floor."
    line += (f" Ceilings: copy {ceilings['copy_tbps']:.2f} TB/s (read + write), matmul "
             f"{ceilings['matmul_tflops']:.0f} TFLOP/s.")  # fmt: skip
    kd = [r["pct_floor"] for r in report["cells"] if r["layout"] == "kd" and r.get("pct_floor")]
    if kd:
        line += f" KD cells: lik at {min(kd):.0f}-{max(kd):.0f}% of their floor."
    return line


def write_grid(report: dict, out: Path, stem: str) -> None:
    title = f"lik training grid (GPU time per step), {report['gpu']}"
    write_results(out, stem, report, grid_markdown(report),
                  grid.ratio_plot(report, grid_ratio, title))  # fmt: skip


def run_grid(args) -> int:
    cells = grid.pick_cells(shapes.GRID_TRAIN, args.shapes, args.axes)
    device = "cpu" if args.dry_run else "cuda"
    timer = DRY_RUN_TIMER if args.dry_run else "triton do_bench of the graph's replay"
    timing = {"warmup_ms": 0, "rep_ms": 0} if args.dry_run else GRID_TIMING
    report = {"suite": GRID_SUITE, "env": environment_info(["lik", "late-interaction-kernels",
                                                            "flash-maxsim"]),
              "gpu": gpu_name(), "timing": {"timer": timer, **timing},
              "ceilings": None if args.dry_run else measure_ceilings(device, **timing),
              "gradient_tolerance": GRADIENT_TOLERANCE, "implementations": GRID_IMPLEMENTATIONS,
              "not_applicable": grid.NOT_APPLICABLE, "cells": []}  # fmt: skip
    stem = result_stem(GRID_SUITE, report["gpu"], args.dry_run)
    for cell in cells:
        print(f"[{cell.name}] {cell.shape.dims} ({', '.join(cell.axes)})", flush=True)
        measured = grid.tiny(cell) if args.dry_run else cell
        report["cells"].append(measure_grid_cell(measured, device, args.dry_run,
                                                 report["ceilings"]))  # fmt: skip
        # After every cell, so a cut-off run keeps what it measured.
        write_grid(report, args.out, stem)
    print(grid_markdown(report))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--shapes",
        default=None,
        help="comma-separated shape (with --grid: cell) names (default: all)",
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="CPU, tiny shapes, lik and eager only: exercises the script",
    )
    parser.add_argument(
        "--grid",
        action="store_true",
        help=f"the shape-class grid (shapes.GRID_TRAIN) into {GRID_SUITE}/, timed quick",
    )
    parser.add_argument("--axes", help="with --grid: comma-separated axes (default: all)")
    parser.add_argument(
        "--render",
        type=Path,
        default=None,
        help="re-render the Markdown table and plot of a saved JSON report",
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.render:
        report = json.loads(args.render.read_text())
        if report.get("suite") == GRID_SUITE:
            write_grid(report, args.out, result_stem(GRID_SUITE, report["gpu"]))
        else:
            write_report(report, args.out)
        return 0
    if not args.dry_run and missing_gpu("bench_train"):
        return 2
    if args.grid:
        return run_grid(args)
    write_report(run(args), args.out, dry_run=args.dry_run)
    return 0


def write_report(report: dict, out: Path, dry_run: bool = False) -> None:
    def speedup(record, peer):
        lik, other = (record["results"][name].get("ms") for name in ("lik-auto", peer))
        return other / lik if lik and other else None

    text = markdown(report)
    names = [r["name"] for r in report["shapes"]]
    series = {f"vs {p}": [speedup(r, p) for r in report["shapes"]] for p in [*PEERS, "eager"]}
    title = f"lik training speedup (auto backward), {report['gpu']}"
    stem = result_stem("train", report["gpu"], dry_run)
    write_results(out, stem, report, text, (names, series, title))
    print(text)


if __name__ == "__main__":
    sys.exit(main())
