"""Top-k retrieval at corpus scale: lik's retrieve against late_interaction_kernels.retrieve.

corpus-100k (Nq=16, Nd=100k, Lq=32, Ld=128, d=128, bf16): both implementations, each
unchunked and chunked; median time, % of the roofline floor (the FLOPs at the measured
matmul rate, the inputs read once at the measured copy rate) and peak GPU memory above
the inputs, after checking the top-k of sampled queries against a float64 reference.
corpus-1m (Nd=1M: D holds 2^31 x 8 elements, ~34 GB in bf16): lik only, since the peer
crashes past 2^31 elements (and a crash can poison the CUDA context for what follows);
the same figures, the reference computed chunk by chunk. --grid runs shapes.GRID_RETRIEVE
(doc counts 10k-1M, head dims, doc length, query count, top-10 and top-100) into
retrieve_grid/.

    python3 benchmarks/bench_retrieve.py --out DIR [--cases corpus-100k] [--quick]
    python3 benchmarks/bench_retrieve.py --out DIR --grid   # quick
    python3 benchmarks/bench_retrieve.py --dry-run     # CPU, tiny corpora, lik only
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import shapes
import torch
from common import (
    DRY_RUN_TIMER,
    Shape,
    attempt,
    bench_ms,
    cpu_wallclock_ms,
    environment_info,
    first_call_seconds,
    format_ms,
    format_ratio,
    markdown_table,
    measure_ceilings,
    normalized_tokens,
    peak_extra_memory_mib,
    percent_of_roofline,
    pick,
    provenance,
    release_cached_memory,
    result_stem,
    roofline_floor,
    write_results,
)

TOP_K = 100  # but in the grid's top-10 cases
CHUNK_DOCS = 16384  # [16, 16384] fp32 scores per step: 1 MiB, far below the corpus
# Inputs are unit-norm already (as an index stores them), so no implementation normalizes.
NORMALIZE = False
PEER_VERSION = "0.4.5"

# Sampled queries for the top-k check: the first and the last.
CHECK_QUERIES = 2
# float64 reference docs per step: 8192 x 128 x 128 x 8 bytes = 1 GiB of doc copy.
REFERENCE_CHUNK_DOCS = 8192
# Scores within this of each other are a near tie: bf16 inputs scored in fp32 land ~1e-6
# from the float64 reference, so two docs this close may trade places legitimately.
NEAR_TIE = 1e-4
# lik's CPU backend scores bf16 through bf16 matmuls and recomputes each query token's
# winner in fp32: where two similarities round to one bf16 value it may keep the lesser,
# by at most bf16's rounding of a unit-norm similarity (2^-8): a dry run's near ties.
CPU_BF16_NEAR_TIE = 2**-8

TIMING = {"full": {"warmup_ms": 100, "rep_ms": 500}, "quick": {"warmup_ms": 25, "rep_ms": 100}}


# late_interaction_kernels indexes docs with 32-bit offsets: it crashes past this many doc
# elements (and a crash can poison the CUDA context for what follows).
PEER_MAX_DOC_ELEMENTS = 2**31
GRID_SUITE = "retrieve_grid"
# Goals the summary reports against (PERF.md, corpus scale): from this many docs, lik at
# 85% or more of its floor, and chunked calls within 15% of unchunked ones.
GOAL_DOCS = 1_000_000


@dataclass(frozen=True)
class Case:
    shape: Shape
    top_k: int = TOP_K

    @property
    def name(self) -> str:
        return self.shape.name + ("" if self.top_k == TOP_K else f"-top{self.top_k}")

    @property
    def peers(self) -> bool:
        """Whether late_interaction_kernels runs on this corpus."""
        return self.shape.nd * self.shape.ld * self.shape.d < PEER_MAX_DOC_ELEMENTS


CASES = [Case(shape) for shape in shapes.RETRIEVE]
GRID_CASES = [Case(shape, top_k) for shape, top_k in shapes.GRID_RETRIEVE]


# ---------------------------------------------------------------------------------------
# Implementations: each builder returns retrieve(Q, D) -> (scores [Nq, k], indices [Nq, k]).


def build_lik(chunk: int | None, top_k: int) -> Callable:
    from lik.runtime.retrieval import retrieve

    return lambda q, docs: retrieve(q, docs, top_k, normalize=NORMALIZE, chunk=chunk)


def build_late_interaction_kernels(chunk: int | None, top_k: int) -> Callable:
    from late_interaction_kernels import retrieve

    return lambda q, docs: retrieve(q, docs, top_k=top_k, normalize=NORMALIZE, chunk=chunk)


IMPLEMENTATIONS = {"lik": build_lik, "late_interaction_kernels": build_late_interaction_kernels}
LABELS = {"lik": "lik", "late_interaction_kernels": f"LIK {PEER_VERSION}"}


def runs_for(case: Case, keys: list[str], chunk: int) -> list[tuple[str, int | None]]:
    """(implementation, chunk) pairs measured on this case. Chunked runs go first: an
    unchunked run that faults would leave no working CUDA context for them."""
    chosen = [key for key in keys if case.peers or key == "lik"]
    return [(key, size) for key in chosen for size in (chunk, None)]


# ---------------------------------------------------------------------------------------
# Reference top-k and the check


def reference_scores(q: torch.Tensor, docs: torch.Tensor) -> torch.Tensor:
    """float64 scores [nq, Nd], scored REFERENCE_CHUNK_DOCS docs at a time so that no
    float64 copy of the whole corpus is ever made."""
    from lik.runtime.reference import maxsim_reference

    q64 = q.double()
    parts = []
    for start in range(0, docs.shape[0], REFERENCE_CHUNK_DOCS):
        part = docs[start : start + REFERENCE_CHUNK_DOCS].double()
        parts.append(maxsim_reference(q64, part, normalize=NORMALIZE))
        del part
    return torch.cat(parts, dim=1)


def check_queries(nq: int, device) -> torch.Tensor:
    return torch.tensor(sorted({0, nq - 1})[:CHECK_QUERIES], device=device)


def check_top_k(scores, indices, reference: torch.Tensor, queries: torch.Tensor,
                near_tie: float = NEAR_TIE) -> dict:  # fmt: skip
    """Top-k of the sampled queries against the reference: identical indices (in order),
    or differences confined to near ties; scores within near_tie of the reference's."""
    k = indices.shape[1]
    ref = torch.sort(reference, dim=1, descending=True, stable=True)
    ref_ids, ref_values = ref.indices[:, :k], ref.values[:, :k]
    got_ids = indices.index_select(0, queries).to(ref_ids.device)
    got_scores = scores.index_select(0, queries).double().to(ref_ids.device)
    # What the reference says each returned doc scores: near the k-th best, at least.
    got_ref = reference.gather(1, got_ids)
    worst_gap = float((ref_values[:, -1:] - got_ref).clamp_min(0).max())
    score_err = float((got_scores - got_ref).abs().max())
    exact = bool(torch.equal(got_ids, ref_ids))
    return {
        "topk_exact": exact,
        "topk_ok": exact or (worst_gap <= near_tie and score_err <= near_tie),
        "topk_worst_gap": worst_gap,
        "score_max_abs_err": score_err,
    }


# ---------------------------------------------------------------------------------------
# Measuring


def empty_result(key: str, chunk: int | None, error: str | None) -> dict:
    return {
        "impl": key,
        "chunk": chunk,
        "ms": None,
        "pct_floor": None,
        "peak_mib": None,
        "first_call_s": None,
        "topk_exact": None,
        "topk_ok": None,
        "topk_worst_gap": None,
        "score_max_abs_err": None,
        "error": error,
    }


def measure(fn: Callable, q, docs, args) -> dict:
    if args.dry_run:
        return {"ms": cpu_wallclock_ms(lambda: fn(q, docs), repeats=3), "peak_mib": None}
    timing = TIMING["quick" if args.quick else "full"]
    return {
        "ms": bench_ms(lambda: fn(q, docs), **timing),
        "peak_mib": peak_extra_memory_mib(lambda: fn(q, docs)),
    }


def measure_run(key, chunk, top_k, q, docs, reference, queries, args) -> dict:
    result = empty_result(key, chunk, None)
    fn, error = attempt(lambda: IMPLEMENTATIONS[key](chunk, top_k))
    if error:
        return empty_result(key, chunk, error)
    first, error = attempt(lambda: first_call_seconds(lambda: fn(q, docs)))
    if error:
        return empty_result(key, chunk, error)
    (scores, indices), result["first_call_s"] = first
    cpu_bf16 = scores.device.type == "cpu" and q.dtype == torch.bfloat16
    near_tie = CPU_BF16_NEAR_TIE if cpu_bf16 else NEAR_TIE
    result.update(check_top_k(scores, indices, reference, queries, near_tie))
    del scores, indices
    timing, error = attempt(lambda: measure(fn, q, docs, args))
    result.update(timing or {"error": error})
    return result


def corpus(shape: Shape, device):
    q = normalized_tokens(shape.nq, shape.lq, shape.d, device=device, seed=0)
    docs = normalized_tokens(shape.nd, shape.ld, shape.d, device=device, seed=1)
    return q, docs


def measure_case(case: Case, keys: list[str], device, args, ceilings=None) -> dict:
    shape = case.shape
    q, docs = corpus(shape, device)
    queries = check_queries(shape.nq, device)
    print("  float64 reference for the sampled queries ...", flush=True)
    reference = reference_scores(q.index_select(0, queries), docs)
    # The floor: Q and D read once (the top-k written is a few KB), or the FLOPs.
    floor = roofline_floor(shape, ceilings, shape.input_bytes())
    record = {
        **shape.as_dict(),
        "name": case.name,
        **floor,
        "top_k": case.top_k,
        "doc_elements": docs.numel(),
        "input_mb": shape.input_bytes() / 1e6,
        "check_queries": queries.tolist(),
        "results": [],
    }
    chunk = min(CHUNK_DOCS, max(1, shape.nd // 4))
    for key, size in runs_for(case, keys, chunk):
        print(f"  {LABELS[key]}, chunk={size} ...", flush=True)
        result = measure_run(key, size, case.top_k, q, docs, reference, queries, args)
        result["pct_floor"] = percent_of_roofline(floor["floor_ms"], result["ms"])
        record["results"].append(result)
        print(f"    {describe(result)}", flush=True)
        release_cached_memory()
    if not case.peers and "late_interaction_kernels" in keys:
        record["skipped"] = f"{LABELS['late_interaction_kernels']}: crashes past 2^31 elements"
    del q, docs, reference
    release_cached_memory()
    return record


def describe(result: dict) -> str:
    if result["ms"] is None:
        return f"no timing: {result['error']}"
    check = (
        "exact" if result["topk_exact"] else ("near-ties only" if result["topk_ok"] else "WRONG")
    )
    peak = "—" if result["peak_mib"] is None else f"{result['peak_mib']:.0f} MiB"
    return f"{format_ms(result['ms'])} ms, peak {peak}, top-k {check}"


# ---------------------------------------------------------------------------------------
# Reporting


def check_cell(result: dict) -> str:
    if result["topk_ok"] is None:
        return "—"
    if result["topk_exact"]:
        return "exact"
    return "near ties" if result["topk_ok"] else f"WRONG (gap {result['topk_worst_gap']:.1e})"


def results_table(report: dict) -> str:
    headers = ["corpus (Nq, Nd, Lq, Ld, d)", "top k", "impl", "chunk", "ms", "% of floor",
               "chunked / unchunked", "peak MiB", "top-k check"]  # fmt: skip
    rows = []
    for record in report["cases"]:
        dims = f"{record['name']} {record['Nq']}, {record['Nd']}, {record['Lq']}, "
        dims += f"{record['Ld']}, {record['d']}"
        for result in record["results"]:
            peak = result["peak_mib"]
            rows.append(
                [
                    dims,
                    record["top_k"],
                    LABELS[result["impl"]],
                    result["chunk"] or "—",
                    format_ms(result["ms"]),
                    format_ratio(result.get("pct_floor"), "%"),
                    format_ratio(chunked_slowdown(record, result)),
                    "—" if peak is None else f"{peak:.0f}",
                    check_cell(result),
                ]
            )
    return markdown_table(headers, rows)


def chunked_slowdown(record: dict, result: dict) -> float | None:
    """A chunked run's time over the same implementation's unchunked one (None otherwise)."""
    if not result["chunk"] or not result["ms"]:
        return None
    whole = [r["ms"] for r in record["results"] if r["impl"] == result["impl"] and not r["chunk"]]
    return result["ms"] / whole[0] if whole and whole[0] else None


def summary(report: dict) -> str:
    """lik's worst cells: % of floor from GOAL_DOCS docs, chunked over unchunked, top-k
    checks, and its speed against LIK's on the corpora both run."""
    lik = [
        (record, r) for record in report["cases"] for r in record["results"] if r["impl"] == "lik"
    ]
    at_scale = [r["pct_floor"] for record, r in lik
                if record["Nd"] >= GOAL_DOCS and r["pct_floor"]]  # fmt: skip
    slowdowns = [x for x in (chunked_slowdown(record, r) for record, r in lik) if x]
    checked = [r["topk_ok"] for _, r in lik if r["topk_ok"] is not None]
    speedups = []
    for record in report["cases"]:
        for r in record["results"]:
            if r["impl"] == "late_interaction_kernels" and r["ms"]:
                mine = [x["ms"] for x in record["results"]
                        if x["impl"] == "lik" and x["chunk"] == r["chunk"] and x["ms"]]  # fmt: skip
                speedups += [r["ms"] / mine[0]] if mine else []
    return "\n".join([
        f"- lik from {GOAL_DOCS:,} docs: worst "
        f"{format_ratio(min(at_scale) if at_scale else None, '%')} of its floor.",
        f"- lik chunked over unchunked: worst {format_ratio(max(slowdowns, default=None))}.",
        f"- lik's top-k checks: {sum(checked)} of {len(checked)} exact or near ties only.",
        f"- lik against {LABELS['late_interaction_kernels']} (same chunking): worst "
        f"{format_ratio(min(speedups, default=None))}.",
    ])  # fmt: skip


def markdown_report(report: dict) -> str:
    env, timing, ceilings = report["env"], report["timing"], report.get("ceilings")
    grid = report["suite"] == GRID_SUITE
    measured = "no ceilings: no GPU"
    if ceilings:
        measured = (f"copy {ceilings['copy_tbps']:.2f} TB/s (read + write), bf16 matmul "
                    f"{ceilings['matmul_tflops']:.0f} TFLOP/s")  # fmt: skip
    parts = [
        f"# Top-k retrieval{' grid' if grid else ''} on {env['gpu']}",
        "",
        provenance(env),
        "",
        summary(report),
        "",
        f"normalize={NORMALIZE}, L2-normalized random bf16 inputs. Median ms "
        f"({timing['timer']}, warm-up {timing['warmup_ms']} ms, rep {timing['rep_ms']} ms). "
        "Floor: the FLOPs at the bf16 matmul rate or Q and D read once at the copy rate, "
        f"whichever is longer ({measured}). "
        "Peak = torch.cuda.max_memory_allocated during one call, above the inputs. "
        f"Top-k check: queries {report['cases'][0]['check_queries'] if report['cases'] else []} "
        f"against float64 scores; near ties = differs only between docs within {NEAR_TIE:g} "
        f"({CPU_BF16_NEAR_TIE:g} for bf16 on lik's CPU backend).",
        "",
        results_table(report),
        "",
    ]
    notes = [f"- {r['name']}: {r['skipped']}" for r in report["cases"] if r.get("skipped")]
    errors = [
        f"- {r['name']}, {LABELS[x['impl']]}, chunk={x['chunk']}: {x['error']}"
        for r in report["cases"]
        for x in r["results"]
        if x.get("error")
    ]
    if notes:
        parts += ["## Not run", "", *notes, ""]
    if errors:
        parts += ["## Errors", "", *errors, ""]
    return "\n".join(parts)


def write_report(report: dict, out_dir: Path, stem: str) -> None:
    write_results(out_dir, stem, report, markdown_report(report))


# ---------------------------------------------------------------------------------------
# Command line


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="output folder (default: benchmarks/results)")
    parser.add_argument("--cases", help="comma-separated corpus names (default: all)")
    parser.add_argument("--impls", help="comma-separated: " + ",".join(IMPLEMENTATIONS))
    parser.add_argument("--quick", action="store_true", help="shorter warm-up and timing")
    parser.add_argument("--dry-run", action="store_true", help="CPU only, tiny corpora, lik only")
    parser.add_argument(
        "--grid", action="store_true", help=f"shapes.GRID_RETRIEVE into {GRID_SUITE}/, quick"
    )
    return parser.parse_args(argv)


def tiny(case: Case) -> Case:
    """A CPU-sized stand-in with the case's name and embedding dim."""
    shape = case.shape
    return Case(Shape(shape.name, 2, min(shape.nd, 300), 8, 16, shape.d), case.top_k)


def main(argv=None) -> int:
    args = parse_args(argv)
    suite = GRID_SUITE if args.grid else "retrieve"
    args.quick = args.quick or args.grid  # the grid's cases in a few minutes
    by_name = {case.name: case for case in (GRID_CASES if args.grid else CASES)}
    cases = [by_name[name] for name in pick(args.cases, list(by_name), "case")]
    keys = pick(args.impls, list(IMPLEMENTATIONS), "implementation")
    if args.dry_run:
        device, cases, keys = "cpu", [tiny(case) for case in cases], ["lik"]
        out_dir = args.out or Path(tempfile.mkdtemp(prefix="lik-retrieve-"))
        timer, timing, ceilings = DRY_RUN_TIMER, {"warmup_ms": 0, "rep_ms": 0}, None
    else:
        if not torch.cuda.is_available():
            sys.exit("no CUDA device; --dry-run exercises this script on a CPU")
        device = "cuda"
        out_dir = args.out or Path(__file__).resolve().parent / "results"
        timer, timing = "triton do_bench", TIMING["quick" if args.quick else "full"]
        ceilings = measure_ceilings(device, **timing)

    env = environment_info(["lik", "late-interaction-kernels"])
    stem = result_stem(suite, env["gpu"], args.dry_run)
    report = {"suite": suite, "env": env, "timing": {"timer": timer, **timing}}
    report.update({"ceilings": ceilings, "normalize": NORMALIZE, "cases": []})
    for case in cases:
        print(f"[{case.name}] {case.shape.dims}, top {case.top_k}", flush=True)
        report["cases"].append(measure_case(case, keys, device, args, ceilings))
        write_report(report, out_dir, stem)  # after every case, so a cut-off run keeps data

    print()
    print(results_table(report))
    print(f"\nwrote {out_dir / stem}.json, .md", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
