"""Ragged batches: lik's score_pairs_packed / maxsim_varlen against late-interaction-kernels
0.4.5 (score_pairs_packed, maxsim_varlen) and flash-maxsim 0.3.0 (flash_maxsim_varlen on
pack_pairs output), in one run on one card.

    python3 benchmarks/bench_ragged.py --out DIR [--quick]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    attempt,
    bench_ms,
    environment_info,
    format_ms,
    format_ratio,
    gpu_name,
    gpu_tag,
    markdown_table,
    missing_gpu,
    relative_error,
    write_json,
)

TIMING = {"full": {"warmup_ms": 100, "rep_ms": 500}, "quick": {"warmup_ms": 25, "rep_ms": 100}}
DIM = 128


def packed_tokens(lengths: torch.Tensor, seed: int):
    """Unit-norm bf16 tokens packed [sum lengths, DIM] and their int32 offsets."""
    g = torch.Generator("cuda").manual_seed(seed)
    tokens = torch.randn(int(lengths.sum()), DIM, device="cuda", generator=g)
    tokens = torch.nn.functional.normalize(tokens, dim=-1).to(torch.bfloat16)
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device="cuda")
    offsets[1:] = lengths.cumsum(0)
    return tokens, offsets


def random_lengths(n: int, low: int, high: int, seed: int) -> torch.Tensor:
    """n sequence lengths drawn from [low, high]."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high + 1, (n,), generator=g).cuda()


def pairs_case(n_pairs: int):
    """n_pairs (query, doc) pairs, each its own sequences: Lq in 16-32, Ld in 16-300."""
    lq, ld = random_lengths(n_pairs, 16, 32, 1), random_lengths(n_pairs, 16, 300, 2)
    Q, cu_q = packed_tokens(lq, 3)
    D, cu_d = packed_tokens(ld, 4)
    ids = torch.arange(n_pairs, device="cuda")
    return Q, D, cu_q, cu_d, ids, int(lq.max()), int(ld.max())


def run_pairs(args, timing) -> dict:
    from lik.runtime import score_pairs_packed
    from lik.runtime.reference import score_pairs_packed_reference

    Q, D, cu_q, cu_d, ids, mq, md = pairs_case(args.pairs)
    sample = ids[:: max(1, args.pairs // 500)]
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
    return _measure(calls, lambda out: relative_error(out[sample], reference), timing)


def run_varlen(args, timing) -> dict:
    """All pairs of 32 ragged queries against 2000 ragged docs."""
    from lik.runtime import maxsim_varlen
    from lik.runtime.reference import score_pairs_packed_reference

    lq, ld = random_lengths(32, 16, 32, 5), random_lengths(2000, 16, 300, 6)
    Q, cu_q = packed_tokens(lq, 7)
    D, cu_d = packed_tokens(ld, 8)
    mq, md = int(lq.max()), int(ld.max())
    head = 64  # reference on the first docs only
    reference = score_pairs_packed_reference(
        Q.double(), D[: int(cu_d[head])].double(), cu_seqlens_q=cu_q,
        cu_seqlens_d=cu_d[: head + 1], layout="varlen",
    )  # fmt: skip
    calls = {"lik maxsim_varlen": lambda: maxsim_varlen(Q, D, cu_q, cu_d, mq, md)}
    try:
        from late_interaction_kernels import maxsim_varlen as lik045_varlen

        calls["LIK 0.4.5 maxsim_varlen"] = lambda: lik045_varlen(Q, D, cu_q, cu_d, mq, md)
    except ImportError as error:
        calls["LIK 0.4.5 maxsim_varlen"] = error
    return _measure(calls, lambda out: relative_error(out[:, :head], reference), timing)


def _measure(calls: dict, parity, timing) -> dict:
    results = {}
    for name, call in calls.items():
        if isinstance(call, Exception):
            results[name] = {"error": str(call)}
            continue
        out, error = attempt(call)
        if error:
            results[name] = {"error": error}
            continue
        ms, error = attempt(lambda call=call: bench_ms(call, **timing))
        results[name] = {"parity_rel_err": parity(out), "ms": ms, "error": error}
        print(f"  {name:34s} {format_ms(ms)} ms, parity {results[name]['parity_rel_err']:.1e}",
              flush=True)  # fmt: skip
    return results


def markdown(report: dict) -> str:
    lines = [f"# Ragged batches on {report['gpu']}", ""]
    for case, results in report["cases"].items():
        lines += [f"## {case}", ""]
        lik_ms = min((r["ms"] for n, r in results.items() if n.startswith("lik") and r.get("ms")),
                     default=None)  # fmt: skip
        rows = []
        for name, r in results.items():
            ratio = r["ms"] / lik_ms if r.get("ms") and lik_ms else None
            error = f"{r.get('parity_rel_err', float('nan')):.1e}"
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
    parser.add_argument("--pairs", type=int, default=5000)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if missing_gpu("bench_ragged"):
        return 2
    timing = TIMING["quick" if args.quick else "full"]
    report = {"env": environment_info(["late-interaction-kernels", "flash-maxsim"]),
              "gpu": gpu_name(), "cases": {}}  # fmt: skip
    print(f"[{args.pairs} packed pairs, Lq 16-32, Ld 16-300, d {DIM}, bf16]", flush=True)
    report["cases"][f"{args.pairs} pairs (Lq 16-32, Ld 16-300)"] = run_pairs(args, timing)
    print("[varlen all pairs: 32 queries x 2000 docs]", flush=True)
    report["cases"]["varlen 32 x 2000 (Lq 16-32, Ld 16-300)"] = run_varlen(args, timing)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"ragged_{gpu_tag(report['gpu'])}"
    write_json(args.out / f"{stem}.json", report)
    text = markdown(report)
    (args.out / f"{stem}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
