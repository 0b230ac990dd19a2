"""Ragged batches: lik's score_pairs_packed / maxsim_varlen against late-interaction-kernels
0.4.5 (score_pairs_packed, maxsim_varlen) and flash-maxsim 0.3.0 (flash_maxsim_varlen on
pack_pairs output), in one run on one card.

    python3 benchmarks/bench_ragged.py --out DIR [--quick]
    python3 benchmarks/bench_ragged.py --out DIR --dry-run   # CPU, tiny sizes, no peers
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    DRY_RUN_TIMER,
    attempt,
    bench_ms,
    cpu_wallclock_ms,
    environment_info,
    format_ms,
    format_ratio,
    gpu_name,
    markdown_table,
    missing_gpu,
    relative_error,
    result_stem,
    write_results,
)

TIMING = {"full": {"warmup_ms": 100, "rep_ms": 500}, "quick": {"warmup_ms": 25, "rep_ms": 100}}
DIM = 128
LQ_RANGE, LD_RANGE = (16, 32), (16, 300)
PAIRS = 5000
VARLEN = (32, 2000)  # queries x docs
# A dry run exercises the script on the CPU through lik's reference paths, which loop over
# pairs in Python: a few dozen pairs keep it to seconds.
DRY_RUN_PAIRS = 40
DRY_RUN_VARLEN = (4, 30)
PARITY_DOCS = 64  # the varlen reference covers the first docs only
# bf16 inputs, fp32 accumulation: the bound bench_fp8 uses for its bf16 rows.
PARITY_TOLERANCE = 1e-2
SKIPPED = "skipped in dry run"


def packed_tokens(lengths: torch.Tensor, seed: int, device, dim: int = DIM):
    """Unit-norm bf16 tokens packed [sum lengths, dim] and their int32 offsets."""
    g = torch.Generator(device).manual_seed(seed)
    tokens = torch.randn(int(lengths.sum()), dim, device=device, generator=g)
    tokens = torch.nn.functional.normalize(tokens, dim=-1).to(torch.bfloat16)
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=device)
    offsets[1:] = lengths.cumsum(0)
    return tokens, offsets


def random_lengths(n: int, low: int, high: int, seed: int, device) -> torch.Tensor:
    """n sequence lengths drawn from [low, high] (on the CPU generator: the same on any device)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high + 1, (n,), generator=g).to(device)


def pairs_case(n_pairs: int, device):
    """n_pairs (query, doc) pairs, each its own sequences: Lq in 16-32, Ld in 16-300."""
    lq = random_lengths(n_pairs, *LQ_RANGE, 1, device)
    ld = random_lengths(n_pairs, *LD_RANGE, 2, device)
    Q, cu_q = packed_tokens(lq, 3, device)
    D, cu_d = packed_tokens(ld, 4, device)
    ids = torch.arange(n_pairs, device=device)
    return Q, D, cu_q, cu_d, ids, int(lq.max()), int(ld.max())


def run_pairs(n_pairs: int, device, timer, dry_run: bool) -> dict:
    from lik.runtime import score_pairs_packed
    from lik.runtime.reference import score_pairs_packed_reference

    Q, D, cu_q, cu_d, ids, mq, md = pairs_case(n_pairs, device)
    sample = ids[:: max(1, n_pairs // 500)]
    reference = score_pairs_packed_reference(
        Q.double(), D.double(), cu_seqlens_q=cu_q, cu_seqlens_d=cu_d, pair_q_idx=sample,
        pair_d_idx=sample,
    )  # fmt: skip
    calls = {
        "lik (bounds given)": lambda: score_pairs_packed(
            Q, D, cu_q, cu_d, ids, ids, max_seqlen_q=mq, max_seqlen_d=md
        ),
        "lik (bounds computed)": lambda: score_pairs_packed(Q, D, cu_q, cu_d, ids, ids),
    }
    if dry_run:
        calls["LIK 0.4.5 score_pairs_packed"] = calls["flash 0.3.0 flash_maxsim_varlen"] = SKIPPED
        return _measure(calls, lambda out: relative_error(out[sample], reference), timer)
    try:
        from late_interaction_kernels.score_pairs import score_pairs_packed as lik045_pairs

        calls["LIK 0.4.5 score_pairs_packed"] = lambda: lik045_pairs(
            Q, D, cu_q, cu_d, ids, ids, max_seqlen_q=mq, max_seqlen_d=md
        )
    except ImportError as error:
        calls["LIK 0.4.5 score_pairs_packed"] = error
    try:
        from flash_maxsim import flash_maxsim_varlen

        calls["flash 0.3.0 flash_maxsim_varlen"] = lambda: flash_maxsim_varlen(
            Q, D, cu_q, cu_d, mq, md
        )
    except ImportError as error:
        calls["flash 0.3.0 flash_maxsim_varlen"] = error
    return _measure(calls, lambda out: relative_error(out[sample], reference), timer)


def run_varlen(queries: int, docs: int, device, timer, dry_run: bool) -> dict:
    """All pairs of `queries` ragged queries against `docs` ragged docs."""
    from lik.runtime import maxsim_varlen
    from lik.runtime.reference import score_pairs_packed_reference

    lq = random_lengths(queries, *LQ_RANGE, 5, device)
    ld = random_lengths(docs, *LD_RANGE, 6, device)
    Q, cu_q = packed_tokens(lq, 7, device)
    D, cu_d = packed_tokens(ld, 8, device)
    mq, md = int(lq.max()), int(ld.max())
    head = min(PARITY_DOCS, docs)
    reference = score_pairs_packed_reference(
        Q.double(), D[: int(cu_d[head])].double(), cu_seqlens_q=cu_q,
        cu_seqlens_d=cu_d[: head + 1], layout="varlen",
    )  # fmt: skip
    calls = {"lik maxsim_varlen": lambda: maxsim_varlen(Q, D, cu_q, cu_d, mq, md)}
    if dry_run:
        calls["LIK 0.4.5 maxsim_varlen"] = SKIPPED
    else:
        try:
            from late_interaction_kernels import maxsim_varlen as lik045_varlen

            calls["LIK 0.4.5 maxsim_varlen"] = lambda: lik045_varlen(Q, D, cu_q, cu_d, mq, md)
        except ImportError as error:
            calls["LIK 0.4.5 maxsim_varlen"] = error
    return _measure(calls, lambda out: relative_error(out[:, :head], reference), timer)


def _measure(calls: dict, parity, timer) -> dict:
    """Each call's parity, then its time by `timer` (fn -> ms). A call given as an
    exception or a string is recorded as that error, untimed."""
    results = {}
    for name, call in calls.items():
        if isinstance(call, Exception | str):
            results[name] = {"error": str(call)}
            continue
        out, error = attempt(call)
        if error:
            results[name] = {"error": error}
            continue
        ms, error = attempt(lambda call=call: timer(call))
        rel_err = parity(out)
        results[name] = {"parity_rel_err": rel_err, "parity_ok": rel_err < PARITY_TOLERANCE,
                         "ms": ms, "error": error}  # fmt: skip
        print(f"  {name:34s} {format_ms(ms)} ms, parity {rel_err:.1e}", flush=True)
    return results


def markdown(report: dict) -> str:
    lines = [f"# Ragged batches on {report['gpu']}", ""]
    lines += [f"Median ms ({report['timing']['timer']}). Rel err: against the float64 "
              f"reference of the same bf16 inputs (bound {report['parity_tolerance']:.0e}).",
              ""]  # fmt: skip
    for case, results in report["cases"].items():
        lines += [f"## {case}", ""]
        lik_ms = min((r["ms"] for n, r in results.items() if n.startswith("lik") and r.get("ms")),
                     default=None)  # fmt: skip
        rows = []
        for name, r in results.items():
            ratio = r["ms"] / lik_ms if r.get("ms") and lik_ms else None
            error = f"{r.get('parity_rel_err', float('nan')):.1e}"
            if r.get("parity_ok") is False:
                error += " FAIL"
            rows.append([name, format_ms(r.get("ms")), error, format_ratio(ratio),
                         r.get("error") or ""])  # fmt: skip
        lines += [
            markdown_table(["implementation", "ms", "rel err", "ms / lik best", "error"], rows),
            "",
        ]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--pairs", type=int, help=f"packed pairs (default {PAIRS}; {DRY_RUN_PAIRS} in a dry run)"
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU, tiny sizes, lik's reference paths, no peers")  # fmt: skip
    args = parser.parse_args(argv)
    if args.dry_run:
        device, (queries, docs) = "cpu", DRY_RUN_VARLEN
        pairs = DRY_RUN_PAIRS if args.pairs is None else args.pairs
        timing = {"timer": DRY_RUN_TIMER}
        timer = cpu_wallclock_ms
    else:
        if missing_gpu("bench_ragged"):
            return 2
        device, (queries, docs) = "cuda", VARLEN
        pairs = PAIRS if args.pairs is None else args.pairs
        timing = TIMING["quick" if args.quick else "full"]
        timer = functools.partial(bench_ms, **timing)
        timing = {"timer": "triton do_bench", **timing}
    report = {"env": environment_info(["late-interaction-kernels", "flash-maxsim"]),
              "gpu": gpu_name(), "timing": timing, "parity_tolerance": PARITY_TOLERANCE,
              "cases": {}}  # fmt: skip
    lengths = f"Lq {LQ_RANGE[0]}-{LQ_RANGE[1]}, Ld {LD_RANGE[0]}-{LD_RANGE[1]}"
    print(f"[{pairs} packed pairs, {lengths}, d {DIM}, bf16]", flush=True)
    report["cases"][f"{pairs} pairs ({lengths})"] = run_pairs(pairs, device, timer, args.dry_run)
    print(f"[varlen all pairs: {queries} queries x {docs} docs]", flush=True)
    report["cases"][f"varlen {queries} x {docs} ({lengths})"] = run_varlen(
        queries, docs, device, timer, args.dry_run
    )
    stem = result_stem("ragged", report["gpu"], args.dry_run)
    text = markdown(report)
    write_results(args.out, stem, report, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
