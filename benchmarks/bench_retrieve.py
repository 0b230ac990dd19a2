"""Top-k retrieval at corpus scale: lik's retrieve against late_interaction_kernels.retrieve.

corpus-100k (Nq=16, Nd=100k, Lq=32, Ld=128, d=128, bf16): both implementations, each
unchunked and chunked; median time and peak GPU memory above the inputs, after checking
the top-k of sampled queries against a float64 reference.
corpus-1m (Nd=1M: D holds 2^31 x 8 elements, ~34 GB in bf16): lik only, since the peer
crashes past 2^31 elements (and a crash can poison the CUDA context for what follows);
time, peak memory, and the exact top-k of sampled queries against a float64 reference
computed chunk by chunk.

    python3 benchmarks/bench_retrieve.py --out DIR [--cases corpus-100k] [--quick]
    python3 benchmarks/bench_retrieve.py --dry-run     # CPU, tiny corpora, lik only
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

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
    markdown_table,
    normalized_tokens,
    peak_extra_memory_mib,
    pick,
    provenance,
    release_cached_memory,
    result_stem,
    write_results,
)

TOP_K = 100
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


@dataclass(frozen=True)
class Case:
    shape: Shape
    peers: bool  # whether late_interaction_kernels runs on this corpus


CASES = [
    Case(Shape("corpus-100k", 16, 100_000, 32, 128, 128), peers=True),
    Case(Shape("corpus-1m", 16, 1_000_000, 32, 128, 128), peers=False),
]


# ---------------------------------------------------------------------------------------
# Implementations: each builder returns retrieve(Q, D) -> (scores [Nq, k], indices [Nq, k]).


def build_lik(chunk: int | None) -> Callable:
    from lik.runtime.retrieval import retrieve

    return lambda q, docs: retrieve(q, docs, TOP_K, normalize=NORMALIZE, chunk=chunk)


def build_late_interaction_kernels(chunk: int | None) -> Callable:
    from late_interaction_kernels import retrieve

    return lambda q, docs: retrieve(q, docs, top_k=TOP_K, normalize=NORMALIZE, chunk=chunk)


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


def measure_run(key, chunk, q, docs, reference, queries, args) -> dict:
    result = empty_result(key, chunk, None)
    fn, error = attempt(lambda: IMPLEMENTATIONS[key](chunk))
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


def measure_case(case: Case, keys: list[str], device, args) -> dict:
    shape = case.shape
    q, docs = corpus(shape, device)
    queries = check_queries(shape.nq, device)
    print("  float64 reference for the sampled queries ...", flush=True)
    reference = reference_scores(q.index_select(0, queries), docs)
    record = {
        **shape.as_dict(),
        "top_k": TOP_K,
        "doc_elements": docs.numel(),
        "input_mb": shape.input_bytes() / 1e6,
        "check_queries": queries.tolist(),
        "results": [],
    }
    chunk = min(CHUNK_DOCS, max(1, shape.nd // 4))
    for key, size in runs_for(case, keys, chunk):
        print(f"  {LABELS[key]}, chunk={size} ...", flush=True)
        result = measure_run(key, size, q, docs, reference, queries, args)
        record["results"].append(result)
        print(f"    {describe(result)}", flush=True)
        release_cached_memory()
    if not case.peers:
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
    headers = ["corpus (Nq, Nd, Lq, Ld, d)", "impl", "chunk", "ms", "peak MiB", "top-k check"]
    rows = []
    for record in report["cases"]:
        dims = f"{record['name']} {record['Nq']}, {record['Nd']}, {record['Lq']}, "
        dims += f"{record['Ld']}, {record['d']}"
        for result in record["results"]:
            peak = result["peak_mib"]
            rows.append(
                [
                    dims,
                    LABELS[result["impl"]],
                    result["chunk"] or "—",
                    format_ms(result["ms"]),
                    "—" if peak is None else f"{peak:.0f}",
                    check_cell(result),
                ]
            )
    return markdown_table(headers, rows)


def markdown_report(report: dict) -> str:
    env, timing = report["env"], report["timing"]
    parts = [
        f"# Top-k retrieval on {env['gpu']}",
        "",
        provenance(env),
        "",
        f"top_k={TOP_K}, normalize={NORMALIZE}, L2-normalized random bf16 inputs. Median ms "
        f"({timing['timer']}, warm-up {timing['warmup_ms']} ms, rep {timing['rep_ms']} ms); "
        "peak = torch.cuda.max_memory_allocated during one call, above the inputs. "
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
    return parser.parse_args(argv)


def tiny(case: Case) -> Case:
    """A CPU-sized stand-in with the case's name and embedding dim."""
    shape = case.shape
    return Case(Shape(shape.name, 2, min(shape.nd, 300), 8, 16, shape.d), peers=case.peers)


def main(argv=None) -> int:
    args = parse_args(argv)
    by_name = {case.shape.name: case for case in CASES}
    cases = [by_name[name] for name in pick(args.cases, list(by_name), "case")]
    keys = pick(args.impls, list(IMPLEMENTATIONS), "implementation")
    if args.dry_run:
        device, cases, keys = "cpu", [tiny(case) for case in cases], ["lik"]
        out_dir = args.out or Path(tempfile.mkdtemp(prefix="lik-retrieve-"))
        timer, timing = DRY_RUN_TIMER, {"warmup_ms": 0, "rep_ms": 0}
    else:
        if not torch.cuda.is_available():
            sys.exit("no CUDA device; --dry-run exercises this script on a CPU")
        device = "cuda"
        out_dir = args.out or Path(__file__).resolve().parent / "results"
        timer, timing = "triton do_bench", TIMING["quick" if args.quick else "full"]

    env = environment_info(["lik", "late-interaction-kernels"])
    stem = result_stem("retrieve", env["gpu"], args.dry_run)
    report = {"suite": "retrieve", "env": env, "timing": {"timer": timer, **timing}}
    report.update({"top_k": TOP_K, "normalize": NORMALIZE, "cases": []})
    for case in cases:
        print(f"[{case.shape.name}] {case.shape.dims}", flush=True)
        report["cases"].append(measure_case(case, keys, device, args))
        write_report(report, out_dir, stem)  # after every case, so a cut-off run keeps data

    print()
    print(results_table(report))
    print(f"\nwrote {out_dir / stem}.json, .md", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
