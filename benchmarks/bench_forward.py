"""Forward (inference) MaxSim: lik against the peers, eager PyTorch and torch.compile.

For each of PERF.md's inference shapes: check every implementation against a float64
reference, then time it (median), and report it against the roofline floor measured in
the same run. A baseline that is missing or fails is recorded with its error.

    python3 benchmarks/bench_forward.py --out DIR [--shapes a,b] [--quick]
    python3 benchmarks/bench_forward.py --dry-run     # CPU, tiny shapes, no Triton
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import grid
import shapes
import torch
from common import (
    DRY_RUN_TIMER,
    Shape,
    attempt,
    back_to_back_ms,
    bench_ms,
    clean_l2_ms,
    cpu_wallclock_ms,
    environment_info,
    first_call_seconds,
    format_ms,
    format_ratio,
    make_input_sets,
    markdown_table,
    measure_ceilings,
    peak_extra_memory_mib,
    percent_of_roofline,
    pick,
    provenance,
    relative_error,
    release_cached_memory,
    result_stem,
    roofline_floor,
    rotating,
    rotation_count,
    speedup_series,
    write_results,
)
from grid import eager_scores

SHAPES = shapes.FORWARD

PEER_DISTRIBUTIONS = {"late-interaction-kernels": "0.4.5", "flash-maxsim": "0.3.0"}

# bf16 inputs with fp32 accumulation land near 1e-3; a wrong kernel lands far above.
PARITY_TOLERANCE = 1e-2
# Parity compares these queries and docs of the full-shape output with the reference;
# the last docs are included because offset overflows show up at high indices.
PARITY_QUERIES = 2
PARITY_DOCS_EACH_END = 32

TIMING = {"full": {"warmup_ms": 100, "rep_ms": 500}, "quick": {"warmup_ms": 25, "rep_ms": 100}}


# ---------------------------------------------------------------------------------------
# Implementations: each builder returns scores(Q, D) -> fp32 [Nq, Nd]. Imports are lazy
# so a missing package becomes a recorded error, not a crash.


def build_lik() -> Callable:
    from lik.runtime import maxsim

    return lambda q, docs: maxsim(q, docs)


def build_late_interaction_kernels() -> Callable:
    from late_interaction_kernels import maxsim

    # Inputs are already unit-norm, so no implementation normalizes (normalize=False).
    return lambda q, docs: maxsim(q, docs)


def build_flash_maxsim() -> Callable:
    from flash_maxsim import flash_maxsim_batched

    return lambda q, docs: flash_maxsim_batched(q, docs)


def build_eager() -> Callable:
    return eager_scores


def build_torch_compile() -> Callable:
    # A fresh compile per shape: static shapes, and no recompile limit to run into.
    torch._dynamo.reset()
    return torch.compile(eager_scores, dynamic=False)


IMPLEMENTATIONS = {
    "lik": ("lik", build_lik),
    "late_interaction_kernels": ("LIK 0.4.5", build_late_interaction_kernels),
    "flash_maxsim": ("flash 0.3.0", build_flash_maxsim),
    "eager": ("eager", build_eager),
    "torch_compile": ("compile", build_torch_compile),
}
PEERS = ("late_interaction_kernels", "flash_maxsim")
# Timed a second way, with L2 left clean, on the memory-bound shapes (common.clean_l2_ms).
CLEAN_L2_IMPLEMENTATIONS = ("lik", *PEERS)
# Without a GPU only the pure-PyTorch paths (and lik's CPU path, if present) can run.
DRY_RUN_IMPLEMENTATIONS = ("lik", "eager")


# ---------------------------------------------------------------------------------------
# Reference


def reference_scores(q: torch.Tensor, docs: torch.Tensor) -> tuple[torch.Tensor, str]:
    """float64 scores from lik's reference, or from the eager formula where lik is
    not importable (the dry run may precede lik's runtime)."""
    q64, docs64 = q.double(), docs.double()
    try:
        from lik.runtime.reference import maxsim_reference
    except ImportError:
        return eager_scores(q64, docs64).double(), "float64 einsum"
    return maxsim_reference(q64, docs64).double(), "lik.runtime.reference (float64)"


def parity_indices(shape: Shape, device) -> tuple[torch.Tensor, torch.Tensor]:
    queries = torch.arange(min(PARITY_QUERIES, shape.nq), device=device)
    if shape.nd <= 2 * PARITY_DOCS_EACH_END:
        docs = torch.arange(shape.nd, device=device)
    else:
        head = torch.arange(PARITY_DOCS_EACH_END, device=device)
        docs = torch.cat([head, head + shape.nd - PARITY_DOCS_EACH_END])
    return queries, docs


# ---------------------------------------------------------------------------------------
# Measuring one shape


def empty_result(error: str | None) -> dict:
    return {
        "ms": None,
        "back_to_back_ms": None,
        "clean_l2_ms": None,
        "pct_roofline": None,
        "peak_mib": None,
        "first_call_s": None,
        "parity_rel_err": None,
        "parity_ok": None,
        "error": error,
    }


def check_parity(scores: Callable, q, docs, reference, indices) -> dict:
    """Runs the full-shape call once (its first call) and compares a slice."""
    out, seconds = first_call_seconds(lambda: scores(q, docs))
    queries, doc_ids = indices
    error = relative_error(out.index_select(0, queries).index_select(1, doc_ids), reference)
    return {
        "first_call_s": seconds,
        "parity_rel_err": error,
        "parity_ok": error <= PARITY_TOLERANCE,
    }


def time_implementation(scores: Callable, input_sets, args, clean_l2: bool) -> dict:
    if args.dry_run:
        return {"ms": cpu_wallclock_ms(rotating(scores, input_sets)), "peak_mib": None}
    timing = TIMING["quick" if args.quick else "full"]
    ms = bench_ms(rotating(scores, input_sets), **timing)
    loop_ms = back_to_back_ms(rotating(scores, input_sets))
    clean_ms = clean_l2_ms(rotating(scores, input_sets)) if clean_l2 else None
    q, docs = input_sets[0]
    return {"ms": ms, "back_to_back_ms": loop_ms, "clean_l2_ms": clean_ms,
            "peak_mib": peak_extra_memory_mib(lambda: scores(q, docs))}  # fmt: skip


def measure_implementation(
    key: str, input_sets, reference, indices, floor, args, clean_l2: bool
) -> dict:
    if args.dry_run and key not in DRY_RUN_IMPLEMENTATIONS:
        return empty_result("skipped in dry run")
    scores, error = attempt(IMPLEMENTATIONS[key][1])
    if error:
        return empty_result(error)
    q, docs = input_sets[0]
    result = empty_result(None)
    parity, error = attempt(lambda: check_parity(scores, q, docs, reference, indices))
    if error:
        result["error"] = error
        return result
    result.update(parity)
    timing, error = attempt(lambda: time_implementation(scores, input_sets, args, clean_l2))
    if error:
        result["error"] = error
        return result
    result.update(timing)
    result["pct_roofline"] = percent_of_roofline(floor["floor_ms"], result["ms"])
    return result


def time_doc_read(docs, timing: dict, clean_l2: bool, sweep: dict = TIMING["quick"]):
    """(ms, ms with L2 left clean or None, how) of the fastest read of the docs alone
    (benchmarks/read_ceiling.py: a sweep of read kernels and PyTorch's sum, each timed
    with `sweep`, the winner re-timed with `timing`, like the implementations): what a
    memory-bound MaxSim cannot beat at this size. clean_l2: also time it with L2 left
    clean (the memory-bound shapes)."""
    from read_ceiling import fastest_read

    def quick_ms(call):
        return attempt(lambda: bench_ms(call, **sweep))[0]

    found, error = attempt(lambda: fastest_read(docs, quick_ms))
    if found is None:
        return None, None, error
    name, call = found
    ms, _ = attempt(lambda: bench_ms(call, **timing))
    clean_ms = attempt(lambda: clean_l2_ms(call))[0] if clean_l2 else None
    return ms, clean_ms, name


def measure_shape(shape: Shape, keys, ceilings, device, args) -> dict:
    sets_count = 1 if args.dry_run else rotation_count(shape.input_bytes())
    input_sets = make_input_sets(shape, device, sets_count)
    indices = parity_indices(shape, device)
    q, docs = input_sets[0]
    reference, reference_name = reference_scores(
        q.index_select(0, indices[0]), docs.index_select(0, indices[1])
    )
    floor = roofline_floor(shape, ceilings)
    memory_bound = floor["bound"] == "memory"
    read_ms = read_clean_ms = read_by = None
    if not args.dry_run:
        timing = TIMING["quick" if args.quick else "full"]
        read_ms, read_clean_ms, read_by = time_doc_read(docs, timing, memory_bound)
    record = {
        **shape.as_dict(),
        "input_mb": shape.input_bytes() / 1e6,
        "flops": shape.flops,
        "bytes": shape.bytes_moved(),
        "rotation_sets": sets_count,
        "reference": reference_name,
        **floor,
        "read_docs_ms": read_ms,
        "read_docs_clean_l2_ms": read_clean_ms,
        "read_docs_by": read_by,
        "results": {},
    }
    for key in keys:
        print(f"  {IMPLEMENTATIONS[key][0]} ...", flush=True)
        clean_l2 = memory_bound and key in CLEAN_L2_IMPLEMENTATIONS
        result = measure_implementation(key, input_sets, reference, indices, floor, args,
                                        clean_l2)  # fmt: skip
        record["results"][key] = result
        print(f"    {describe_result(result)}", flush=True)
    del input_sets, q, docs, reference
    release_cached_memory()
    return record


def describe_result(result: dict) -> str:
    if result["ms"] is None:
        return f"no timing: {result['error']}"
    parity = "ok" if result["parity_ok"] else "FAILED"
    return f"{format_ms(result['ms'])} ms, parity {parity} ({result['parity_rel_err']:.2e})"


# ---------------------------------------------------------------------------------------
# Reporting


def speedup(record: dict, baseline: str) -> float | None:
    lik_ms = record["results"].get("lik", {}).get("ms")
    other_ms = record["results"].get(baseline, {}).get("ms")
    if not lik_ms or not other_ms:
        return None
    return other_ms / lik_ms


def timing_table(report: dict) -> str:
    keys = report["implementations"]
    headers = [
        "shape (Nq, Nd, Lq, Ld, d)",
        "floor",
        "read D once",
        *(IMPLEMENTATIONS[k][0] for k in keys),
        "lik % roofline",
        "lik % read",
        *(f"lik vs {IMPLEMENTATIONS[p][0]}" for p in PEERS),
    ]
    rows = []
    for record in report["shapes"]:
        results = record["results"]
        lik_pct = results.get("lik", {}).get("pct_roofline")
        # Against the read alone only where the roofline says memory bounds the shape.
        memory_bound = record.get("bound") == "memory"
        read_pct = percent_of_roofline(record.get("read_docs_ms"), results.get("lik", {}).get("ms"))
        read_pct = read_pct if memory_bound else None
        rows.append(
            [
                f"{record['name']} {record['Nq']}, {record['Nd']}, {record['Lq']}, "
                f"{record['Ld']}, {record['d']}",
                format_ms(record["floor_ms"]),
                format_ms(record.get("read_docs_ms")),
                *(format_ms(results.get(k, {}).get("ms")) for k in keys),
                format_ratio(lik_pct, "%"),
                format_ratio(read_pct, "%"),
                *(format_ratio(speedup(record, p)) for p in PEERS),
            ]
        )
    return markdown_table(headers, rows)


def clean_l2_table(report: dict) -> str | None:
    """The memory-bound shapes timed with L2 left clean at each call's start; None when
    the run has none."""
    records = [r for r in report["shapes"] if r.get("bound") == "memory"]
    if not records:
        return None
    keys = [k for k in CLEAN_L2_IMPLEMENTATIONS if k in report["implementations"]]
    headers = [
        "shape",
        "floor",
        "read D once",
        *(IMPLEMENTATIONS[k][0] for k in keys),
        "lik % roofline",
        "lik % read",
        "lik vs faster peer",
    ]
    rows = []
    for record in records:
        ms = {k: record["results"].get(k, {}).get("clean_l2_ms") for k in keys}
        peers = [ms[p] for p in PEERS if ms.get(p)]
        read_ms = record["read_docs_clean_l2_ms"]
        rows.append(
            [
                record["name"],
                format_ms(record["floor_ms"]),
                format_ms(read_ms),
                *(format_ms(ms[k]) for k in keys),
                format_ratio(percent_of_roofline(record["floor_ms"], ms.get("lik")), "%"),
                format_ratio(percent_of_roofline(read_ms, ms.get("lik")), "%"),
                format_ratio(min(peers) / ms["lik"] if peers and ms.get("lik") else None),
            ]
        )
    return markdown_table(headers, rows)


def back_to_back_table(report: dict) -> str:
    keys = report["implementations"]
    headers = ["shape", *(IMPLEMENTATIONS[k][0] for k in keys)]
    rows = [
        [record["name"], *(format_ms(record["results"].get(k, {}).get("back_to_back_ms"))
                           for k in keys)]
        for record in report["shapes"]
    ]  # fmt: skip
    return markdown_table(headers, rows)


def parity_cell(result: dict) -> str:
    if result.get("parity_rel_err") is None:
        return "—"
    mark = "" if result["parity_ok"] else " FAIL"
    return f"{result['parity_rel_err']:.1e}{mark}"


def parity_table(report: dict) -> str:
    keys = report["implementations"]
    headers = ["shape", *(IMPLEMENTATIONS[k][0] for k in keys)]
    rows = [
        [record["name"], *(parity_cell(record["results"].get(k, {})) for k in keys)]
        for record in report["shapes"]
    ]
    return markdown_table(headers, rows)


def error_lines(report: dict) -> list[str]:
    """One line per (implementation, error), naming the shapes it hit."""
    shapes_by_error: dict[tuple[str, str], list[str]] = {}
    for record in report["shapes"]:
        for key, result in record["results"].items():
            if result.get("error"):
                shapes_by_error.setdefault((key, result["error"]), []).append(record["name"])
    return [
        f"- {IMPLEMENTATIONS[key][0]} ({', '.join(names)}): {error}"
        for (key, error), names in shapes_by_error.items()
    ]


def report_header(report: dict, title: str) -> list[str]:
    """A report's title, provenance, peer versions where they differ and ceilings."""
    env, ceilings = report["env"], report["ceilings"]
    parts = [f"# {title} on {env['gpu']}", "", provenance(env), ""]
    mismatched = [
        f"{name} {env['packages'].get(name)} (expected {expected})"
        for name, expected in PEER_DISTRIBUTIONS.items()
        if env["packages"].get(name) not in (None, expected)
    ]
    if mismatched:
        parts += ["Peer versions differ from PERF.md's: " + ", ".join(mismatched) + ".", ""]
    if ceilings:
        parts += [
            f"Measured ceilings: copy {ceilings['copy_tbps']:.2f} TB/s (read + write), "
            f"bf16 matmul {ceilings['matmul_tflops']:.0f} TFLOP/s.",
            "",
        ]
    return parts


def markdown_report(report: dict) -> str:
    timing = report["timing"]
    parts = report_header(report, "Forward MaxSim")
    parts += [
        f"Median ms ({timing['timer']}, warm-up {timing['warmup_ms']} ms, "
        f"rep {timing['rep_ms']} ms); L2-normalized random bf16 inputs, rotated "
        "when they fit in L2. Speedup = baseline ms / lik ms. \"read D once\": the "
        "fastest of PyTorch's sum and a sweep of read kernels over the same "
        "docs (benchmarks/read_ceiling.py), timed the same way: what a memory-bound "
        "MaxSim cannot beat at this size; \"lik % read\" is its time over lik's, for the "
        "memory-bound shapes.",
        "",
        timing_table(report),
        "",
    ]
    clean = clean_l2_table(report)
    if clean:
        parts += [
            "## Memory-bound shapes with L2 left clean (median ms of 300 calls, CUDA events)",
            "",
            "do_bench empties L2 before each call by writing a 256 MB buffer, so the timed "
            "call also writes back the dirty lines that buffer left in L2 while it reads "
            "its docs. Here L2 is emptied by reading the buffer instead (common.clean_l2_ms): "
            "what a call costs after a kernel that only read. Same floors as above.",
            "",
            clean,
            "",
        ]
    parts += [
        "## Back to back (ms per call, 200 calls in a row, one sync at the end; best of 3 rounds)",
        "",
        "A tight loop's rate. Where it exceeds the median above, the call's host work "
        "(checks, dispatch, launches) outlasts its kernels; the median then depends on "
        "how far ahead of the GPU the host got, which varies with the machine's load.",
        "",
        back_to_back_table(report),
        "",
        f"## Parity (relative error vs {PARITY_TOLERANCE:g} tolerance; "
        "first queries, first and last docs; float64 reference)",
        "",
        parity_table(report),
        "",
    ]
    sweeps = report.get("call_time_sweeps")
    if sweeps is not None:
        why = " (every suite key has a committed entry)" if sweeps == 0 else ""
        parts += [f"Call-time autotune sweeps in this run (lik.runtime.autotune): {sweeps}{why}.",
                  ""]  # fmt: skip
    errors = error_lines(report)
    if errors:
        parts += ["## Errors", "", *errors, ""]
    return "\n".join(parts)


def write_report(report: dict, out_dir: Path, stem: str) -> None:
    names = [record["name"] for record in report["shapes"]]
    series = speedup_series(report, PEERS, lambda p: IMPLEMENTATIONS[p][0], speedup)
    title = f"lik forward speedup, {report['env']['gpu']}"
    write_results(out_dir, stem, report, markdown_report(report), (names, series, title))


# ---------------------------------------------------------------------------------------
# The shape-class grid (--grid): shapes.GRID_FORWARD, each cell against both peers where
# they can take it, eager PyTorch and torch.compile, in one run (benchmarks/grid.py builds
# the inputs).

GRID_SUITE = "forward_grid"
# The grid's ~50 cells fit one GPU session's few minutes with the quick timing, and the
# read ceiling's readers swept shorter still (its winner is re-timed like the cells).
GRID_TIMING = TIMING["quick"]
GRID_READ_SWEEP = {"warmup_ms": 5, "rep_ms": 25}


def grid_not_applicable(key: str, cell: shapes.Cell) -> str | None:
    """Why an implementation cannot take a cell (a grid.NOT_APPLICABLE code), or None."""
    if key != "flash_maxsim":
        return None
    if cell.holes:
        return "no holes"
    if cell.ragged == "packed" and cell.shape.nq > 1:
        return "one query packed"
    return None


def build_grid_call(key: str, cell: shapes.Cell) -> Callable[[grid.Inputs], torch.Tensor]:
    """One implementation's call on a cell's inputs, as a client with those inputs makes
    it: masks, lengths (flash-maxsim) or packed docs; scores [Nq, Nd] ([B] for pairs)."""
    packed = cell.ragged == "packed"
    if key in ("lik", "late_interaction_kernels"):
        if key == "lik":
            from lik.runtime import maxsim, maxsim_pairs, maxsim_varlen
        else:
            from late_interaction_kernels import maxsim, maxsim_pairs, maxsim_varlen
        if packed:
            return lambda x: maxsim_varlen(*x.packed.varlen_args)
        entry = maxsim_pairs if cell.layout == "pairs" else maxsim
        return lambda x: entry(x.q, x.docs, x.q_mask, x.d_mask)
    if key == "flash_maxsim":
        import flash_maxsim as flash

        if packed:  # one query (grid_not_applicable)
            return lambda x: flash.flash_maxsim_packed(x.q[0], x.packed.docs, x.packed.cu_d,
                                                       x.packed.max_d)  # fmt: skip
        if cell.layout == "pairs":
            return lambda x: flash.flash_maxsim_pairs_dense(x.q, x.docs, x.q_lengths, x.d_lengths)
        shared = cell.layout == "dense"
        return lambda x: flash.flash_maxsim_batched(x.q, x.docs, doc_lengths=x.d_lengths,
                                                    shared_docs=shared,
                                                    query_lengths=x.q_lengths)  # fmt: skip
    if key == "eager":
        return grid.padded_call(cell, eager_scores)
    if key == "torch_compile":
        torch._dynamo.reset()  # a fresh compile per cell, as per shape above
        return grid.padded_call(cell, torch.compile(eager_scores, dynamic=False))
    raise KeyError(key)


def grid_result(**fields) -> dict:
    return {"ms": None, "parity_rel_err": None, "parity_ok": None, "error": None,
            "not_applicable": None, **fields}  # fmt: skip


def measure_grid_implementation(key, cell, input_sets, reference, indices, dry_run) -> dict:
    """Checked against the float64 slice on its first call, then timed."""
    reason = grid_not_applicable(key, cell)
    if reason:
        return grid_result(not_applicable=reason)
    if dry_run and key not in DRY_RUN_IMPLEMENTATIONS:
        return grid_result(error="skipped in dry run")
    call, error = attempt(lambda: build_grid_call(key, cell))
    if error:
        return grid_result(error=error)
    out, error = attempt(lambda: call(input_sets[0]))
    if error:
        return grid_result(error=error)
    rel_err = relative_error(grid.parity_slice(cell, out, indices), reference)
    result = grid_result(parity_rel_err=rel_err, parity_ok=rel_err <= PARITY_TOLERANCE)
    timed = rotating(call, [(inputs,) for inputs in input_sets])
    if dry_run:
        result["ms"], result["error"] = attempt(lambda: cpu_wallclock_ms(timed))
    else:
        result["ms"], result["error"] = attempt(lambda: bench_ms(timed, **GRID_TIMING))
    return result


def grid_doc_read(docs, cache: dict) -> tuple[float | None, str | None]:
    """(ms, how) of the read-once ceiling over docs: a read of as many bytes takes as long
    whatever they hold, so each size is swept once per run (cache: bytes -> result)."""
    size = docs.numel() * docs.element_size()
    if size not in cache:
        ms, _, how = time_doc_read(docs, GRID_TIMING, False, sweep=GRID_READ_SWEEP)
        cache[size] = (ms, how)
    return cache[size]


def measure_grid_cell(cell: shapes.Cell, keys, ceilings, device, args, read_cache) -> dict:
    sets_count = 1 if args.dry_run else rotation_count(cell.input_bytes())
    input_sets = grid.input_sets(cell, device, sets_count)
    indices = grid.parity_indices(cell, device)
    reference = grid.reference_scores(cell, input_sets[0], indices)
    floor = roofline_floor(cell, ceilings)
    docs = grid.given_docs(input_sets[0])
    record = {**cell.as_dict(), "doc_mb": docs.numel() * docs.element_size() / 1e6,
              "rotation_sets": sets_count, **floor, "read_docs_ms": None, "read_docs_by": None,
              "pct_read": None, "results": {}}  # fmt: skip
    ceiling = grid.ceiling_applies(cell, input_sets[0], floor)
    if ceiling:
        record["read_docs_ms"], record["read_docs_by"] = grid_doc_read(
            grid.read_once_docs(input_sets[0]), read_cache)  # fmt: skip
    for key in keys:
        result = measure_grid_implementation(key, cell, input_sets, reference, indices,
                                             args.dry_run)  # fmt: skip
        result["pct_roofline"] = percent_of_roofline(floor["floor_ms"], result["ms"])
        record["results"][key] = result
        print(f"  {IMPLEMENTATIONS[key][0]}: {describe_grid_result(result)}", flush=True)
    if ceiling:
        lik_ms = record["results"].get("lik", {}).get("ms")
        record["pct_read"] = percent_of_roofline(record["read_docs_ms"], lik_ms)
    del input_sets, docs, reference
    release_cached_memory()
    return record


def describe_grid_result(result: dict) -> str:
    if result["not_applicable"]:
        return f"n/a ({result['not_applicable']})"
    if result["parity_rel_err"] is None:
        return f"no result: {result['error']}"
    parity = "ok" if result["parity_ok"] else "FAILED"
    timing = f"{format_ms(result['ms'])} ms" if result["ms"] is not None else result["error"]
    return f"{timing}, parity {parity} ({result['parity_rel_err']:.2e})"


def grid_ratio(record: dict) -> float | None:
    """The best peer's time over lik's (above 1: lik is faster)."""
    lik_ms = record["results"].get("lik", {}).get("ms")
    _, peer_ms = grid.best_peer(record["results"], PEERS, "ms")
    return peer_ms / lik_ms if lik_ms and peer_ms else None


def grid_summary(report: dict) -> list[str]:
    """Where lik is behind the best peer, below the read ceiling's target, or failed parity."""
    held = {r["name"]: r["pct_read"] for r in report["cells"] if r["pct_read"] is not None}
    below = [f"{name} ({pct:.0f}%)" for name, pct in held.items()
             if pct < grid.CEILING_TARGET_PCT]  # fmt: skip
    ceiling = (f"- memory-bound cells with {grid.CEILING_DOC_BYTES / 1e6:.0f} MB of docs or "
               f"more at {grid.CEILING_TARGET_PCT:.0f}% of the read-once ceiling or above: "
               f"{len(held) - len(below)} of {len(held)}"
               + (f"; below in {', '.join(below)}." if below else "."))  # fmt: skip
    labels = {key: IMPLEMENTATIONS[key][0] for key in report["implementations"]}
    return [grid.ratio_line(report, grid_ratio), ceiling, grid.parity_line(report, labels)]


def grid_table(report: dict) -> str:
    keys = report["implementations"]
    headers = ["cell", "axes", "Nq, Nd, Lq, Ld, d", "docs MB", "floor", "read D once",
               *(IMPLEMENTATIONS[k][0] for k in keys), "lik vs best peer",
               "lik % read"]  # fmt: skip
    rows = []
    for r in report["cells"]:
        cells = [grid.result_cell(r["results"].get(k, {}), "ms", format_ms) for k in keys]
        rows.append([r["name"], ", ".join(r["axes"]), f"{r['Nq']}, {r['Nd']}, {r['Lq']}, "
                     f"{r['Ld']}, {r['d']}", f"{r['doc_mb']:.1f}", format_ms(r["floor_ms"]),
                     format_ms(r["read_docs_ms"]), *cells, format_ratio(grid_ratio(r)),
                     format_ratio(r["pct_read"], "%")])  # fmt: skip
    return markdown_table(headers, rows)


def grid_parity_table(report: dict) -> str:
    keys = report["implementations"]
    headers = ["cell", *(IMPLEMENTATIONS[k][0] for k in keys)]
    rows = [[r["name"], *(parity_cell(r["results"].get(k, {})) for k in keys)]
            for r in report["cells"]]  # fmt: skip
    return markdown_table(headers, rows)


def grid_markdown(report: dict) -> str:
    timing = report["timing"]
    parts = report_header(report, "Forward MaxSim grid")
    parts += [
        f"Median ms ({timing['timer']}, warm-up {timing['warmup_ms']} ms, rep "
        f"{timing['rep_ms']} ms); L2-normalized random inputs in the cell's dtype, rotated "
        "when they fit in L2. Cells (benchmarks/shapes.py, GRID_FORWARD): a star around "
        "base shapes, one class axis moved at a time. Masks as clients build them "
        "(benchmarks/grid.py): prefix = padded queries and docs; skiplist = PyLate's doc "
        "mask, punctuation masked anywhere; multivector = ST's MultiVectorMask, query "
        "padding and doc holes; ragged = doc lengths spread widely, padded with a d_mask or "
        "packed for the varlen entries (eager and compile take them padded). \"lik vs best "
        "peer\": the faster peer's time over lik's, among the peers that took the cell (one "
        "that failed parity counts too, flagged FAIL). \"lik % read\": the read-once "
        "ceiling over lik's time, for memory-bound cells with "
        f"{grid.CEILING_DOC_BYTES / 1e6:.0f} MB of docs or more (the doc tokens a call must "
        "read: packed ones where packed, each masked doc's up to its last valid token).",
        "",
        *grid_summary(report),
        "",
        grid_table(report),
        "",
        *grid.not_applicable_lines(report),
        "",
        f"## Parity (relative error vs {PARITY_TOLERANCE:g} tolerance; first queries, first "
        "and last docs; float64 reference)",
        "",
        grid_parity_table(report),
        "",
    ]
    sweeps = report.get("call_time_sweeps")
    if sweeps is not None:
        parts += [f"Call-time autotune sweeps in this run (lik.runtime.autotune): {sweeps} "
                  "(a cell whose key no table covers sweeps on its first call, before timing).",
                  ""]  # fmt: skip
    errors = error_lines({"shapes": report["cells"]})
    if errors:
        parts += ["## Errors", "", *errors, ""]
    return "\n".join(parts)


def write_grid(report: dict, out_dir: Path, stem: str) -> None:
    title = f"lik forward grid, {report['env']['gpu']}"
    write_results(out_dir, stem, report, grid_markdown(report),
                  grid.ratio_plot(report, grid_ratio, title))  # fmt: skip


def run_grid(args, keys, device, ceilings, timer, out_dir: Path) -> int:
    from lik.runtime import autotune

    cells = grid.pick_cells(shapes.GRID_FORWARD, args.shapes, args.axes)
    env = environment_info(["lik", *PEER_DISTRIBUTIONS])
    stem = result_stem(GRID_SUITE, env["gpu"], args.dry_run)
    timing = {"warmup_ms": 0, "rep_ms": 0} if args.dry_run else GRID_TIMING
    report = {
        "suite": GRID_SUITE,
        "env": env,
        "expected_peer_versions": PEER_DISTRIBUTIONS,
        "ceilings": ceilings,
        "timing": {"timer": timer, **timing, "read_sweep": GRID_READ_SWEEP},
        "parity_tolerance": PARITY_TOLERANCE,
        "implementations": keys,
        "labels": {key: IMPLEMENTATIONS[key][0] for key in keys},
        "not_applicable": grid.NOT_APPLICABLE,
        "cells": [],
    }
    read_cache: dict = {}
    for cell in cells:
        print(f"[{cell.name}] {cell.shape.dims} ({', '.join(cell.axes)})", flush=True)
        measured = grid.tiny(cell) if args.dry_run else cell
        report["cells"].append(measure_grid_cell(measured, keys, ceilings, device, args,
                                                 read_cache))  # fmt: skip
        report["call_time_sweeps"] = autotune.sweeps
        # After every cell, so a cut-off run keeps what it measured.
        write_grid(report, out_dir, stem)
    print("\n" + "\n".join(grid_summary(report)))
    print(f"\nwrote {out_dir / stem}.json, .md", flush=True)
    return 0


# ---------------------------------------------------------------------------------------
# Command line


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="output folder (default: benchmarks/results)")
    parser.add_argument("--shapes", help="comma-separated shape (with --grid: cell) names "
                        "(default: all)")  # fmt: skip
    parser.add_argument("--grid", action="store_true", help="the shape-class grid "
                        f"(shapes.GRID_FORWARD) into {GRID_SUITE}/, timed quick")  # fmt: skip
    parser.add_argument("--axes", help="with --grid: comma-separated axes (default: all)")
    parser.add_argument(
        "--impls",
        help="comma-separated implementations (default: all): " + ",".join(IMPLEMENTATIONS),
    )
    parser.add_argument("--quick", action="store_true", help="shorter warm-up and timing")
    parser.add_argument(
        "--dry-run", action="store_true", help="CPU only, tiny shapes, no Triton, peers or do_bench"
    )
    parser.add_argument("--render", type=Path, help="re-render the Markdown table and plot of "
                        "a saved JSON report (into --out)")  # fmt: skip
    return parser.parse_args(argv)


def tiny(shape: Shape) -> Shape:
    """A CPU-sized stand-in that keeps the shape's name and embedding dim."""
    return Shape(
        shape.name,
        min(shape.nq, 2),
        min(shape.nd, 80),
        min(shape.lq, 8),
        min(shape.ld, 16),
        shape.d,
    )


def main(argv=None) -> int:
    from lik.runtime import autotune

    args = parse_args(argv)
    if args.render:
        report = json.loads(args.render.read_text())
        out_dir = args.out or Path(__file__).resolve().parent / "results"
        stem = result_stem(report["suite"], report["env"]["gpu"])
        if report["suite"] == GRID_SUITE:
            write_grid(report, out_dir, stem)
        else:
            write_report(report, out_dir, stem)
        return 0
    by_name = {shape.name: shape for shape in SHAPES}
    shapes = [] if args.grid else [by_name[n] for n in pick(args.shapes, list(by_name), "shape")]
    keys = pick(args.impls, list(IMPLEMENTATIONS), "implementation")
    if args.dry_run:
        device, shapes, ceilings = "cpu", [tiny(shape) for shape in shapes], None
        out_dir = args.out or Path(tempfile.mkdtemp(prefix="lik-forward-"))
        timer, timing = DRY_RUN_TIMER, {"warmup_ms": 0, "rep_ms": 0}
    else:
        if not torch.cuda.is_available():
            sys.exit("no CUDA device; --dry-run exercises this script on a CPU")
        device = "cuda"
        out_dir = args.out or Path(__file__).resolve().parent / "results"
        timer, timing = "triton do_bench", TIMING["quick" if args.quick else "full"]
        ceilings = measure_ceilings(device, **timing)
    if args.grid:
        return run_grid(args, keys, device, ceilings, timer, out_dir)

    env = environment_info(["lik", *PEER_DISTRIBUTIONS])
    stem = result_stem("forward", env["gpu"], args.dry_run)
    report = {
        "suite": "forward",
        "env": env,
        "expected_peer_versions": PEER_DISTRIBUTIONS,
        "ceilings": ceilings,
        "timing": {"timer": timer, **timing},
        "parity_tolerance": PARITY_TOLERANCE,
        "implementations": keys,
        "labels": {key: IMPLEMENTATIONS[key][0] for key in keys},
        "shapes": [],
    }
    for shape in shapes:
        print(f"[{shape.name}] {shape.dims}", flush=True)
        report["shapes"].append(measure_shape(shape, keys, ceilings, device, args))
        # The suite's keys all have entries: a sweep here would mean one went missing.
        report["call_time_sweeps"] = autotune.sweeps
        write_report(report, out_dir, stem)  # after every shape, so a cut-off run keeps data

    print()
    print(timing_table(report))
    print(f"\nwrote {out_dir / stem}.json, .md, .png", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
