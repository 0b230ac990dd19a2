"""Hooked token scores (weighted, smooth, top-k mean) against their materialized PyTorch
equivalents (einsum to [Nq, Nd, Lq, Ld], then the reduction): inference and training
(forward + backward) time and peak memory, in one run on one card.

Outputs are checked against a float64 reference before anything is timed.

    python3 benchmarks/bench_variants.py --out DIR [--quick]
    python3 benchmarks/bench_variants.py --out DIR --dry-run   # CPU, tiny shapes, reference path
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import shapes  # noqa: E402
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
    normalized_tokens,
    peak_extra_memory_mib,
    relative_error,
    release_cached_memory,
    result_stem,
    write_results,
)

SHAPES = shapes.VARIANTS
TIMING = {"full": {"warmup_ms": 100, "rep_ms": 500}, "quick": {"warmup_ms": 25, "rep_ms": 100}}
SCORES = {"weighted": {}, "smooth": {"tau": 0.1}, "topk_mean": {"k": 4}}
TOLERANCE = 2e-2  # bf16 inputs against float64
# A dry run (CPU) exercises the script itself: both shapes shrunk to these (Nq, Nd, Lq, Ld, d),
# lik through its reference path and eager, timed by wall clock, with no peak memory.
DRY_RUN_DIMS = (3, 4, 5, 7, 16)


def lik_scores(score: str, params: dict):
    from lik.runtime import variants

    if score == "weighted":
        return lambda q, d, w: variants.maxsim_weighted(q, d, w)
    if score == "smooth":
        return lambda q, d, w: variants.maxsim_smooth(q, d, tau=params["tau"])
    return lambda q, d, w: variants.maxsim_topk_mean(q, d, k=params["k"])


def eager_scores(score: str, params: dict):
    """The materialized PyTorch form of each score, as training code writes it."""

    def scores(q, d, w):
        sim = torch.einsum("qsk,ntk->qnst", q, d)
        if score == "weighted":
            return (sim.amax(dim=-1).float() * w[:, None, :]).sum(dim=-1)
        if score == "smooth":
            tau = params["tau"]
            return (tau * torch.logsumexp(sim.float() / tau, dim=-1)).sum(dim=-1)
        return sim.topk(params["k"], dim=-1).values.float().mean(dim=-1).sum(dim=-1)

    return scores


def reference(score, params, q, d, w, grads: bool):
    from lik.runtime.reference import maxsim_scored_reference

    q64 = q.detach().double().requires_grad_(grads)
    d64 = d.detach().double().requires_grad_(grads)
    w64 = w.detach().double().requires_grad_(grads) if score == "weighted" else None
    out = maxsim_scored_reference(q64, d64, score=score, weights=w64, tau=params.get("tau", 0.1),
                                  k=params.get("k", 1))  # fmt: skip
    if not grads:
        return out, None
    out.backward(LOSS_WEIGHTS[out.shape].double())
    return out, [q64.grad, d64.grad] + ([w64.grad] if w64 is not None else [])


LOSS_WEIGHTS: dict = {}


def training_step(scores, q, d, w, score):
    """One forward + backward with a fixed random loss weighting of the scores."""
    tensors = [q, d] + ([w] if score == "weighted" else [])
    for t in tensors:
        t.grad = None
    out = scores(q, d, w)
    out.backward(LOSS_WEIGHTS[out.shape])
    return [t.grad for t in tensors]


def measure(impl, score, params, q, d, w, ref, ref_grads, timing, dry_run=False) -> dict:
    build = lik_scores if impl == "lik" else eager_scores
    scores = build(score, params)
    result = {"error": None}
    with torch.no_grad():
        out, error = attempt(lambda: scores(q, d, w))
    if error:
        return {"error": error}
    result["fwd_err"] = relative_error(out, ref)
    grads, error = attempt(lambda: training_step(scores, q, d, w, score))
    if error:
        return {**result, "error": error}
    result["grad_err"] = max(relative_error(g, r) for g, r in zip(grads, ref_grads, strict=True))
    result["parity_ok"] = max(result["fwd_err"], result["grad_err"]) < TOLERANCE
    del out, grads

    def forward():
        with torch.no_grad():
            return scores(q, d, w)

    for name, fn in (("fwd", forward), ("train", lambda: training_step(scores, q, d, w, score))):
        if dry_run:
            ms, error = attempt(lambda fn=fn: cpu_wallclock_ms(fn))
            peak, error2 = None, None  # peak GPU memory has no CPU counterpart
        else:
            ms, error = attempt(lambda fn=fn: bench_ms(fn, **timing))
            for t in (q, d, w):
                t.grad = None
            peak, error2 = attempt(lambda fn=fn: peak_extra_memory_mib(fn))
        result[f"{name}_ms"], result[f"{name}_mib"] = ms, peak
        if error or error2:
            result["error"] = error or error2
        release_cached_memory()
    return result


def summary(result: dict) -> str:
    fwd = f"fwd {format_ms(result.get('fwd_ms'))} ms {format_ms(result.get('fwd_mib'))} MiB"
    train = f"train {format_ms(result.get('train_ms'))} ms {format_ms(result.get('train_mib'))} MiB"
    errors = (
        f"err {result.get('fwd_err', float('nan')):.1e}/{result.get('grad_err', float('nan')):.1e}"
    )
    return f"{fwd}, {train}, {errors} {result.get('error') or ''}"


def run(args) -> dict:
    timing = TIMING["quick" if args.quick else "full"]
    device = "cpu" if args.dry_run else "cuda"
    timer = {"timer": DRY_RUN_TIMER} if args.dry_run else {"timer": "triton do_bench", **timing}
    report = {"env": environment_info(), "gpu": gpu_name(), "dry_run": args.dry_run,
              "timing": timer, "shapes": []}  # fmt: skip
    for name, *dims in SHAPES:
        nq, nd, lq, ld, dim = DRY_RUN_DIMS if args.dry_run else dims
        q = normalized_tokens(nq, lq, dim, device=device, seed=21).requires_grad_()
        d = normalized_tokens(nd, ld, dim, device=device, seed=22).requires_grad_()
        g = torch.Generator(device).manual_seed(23)
        w = torch.rand(nq, lq, device=device, generator=g).requires_grad_()
        LOSS_WEIGHTS[torch.Size((nq, nd))] = torch.randn(nq, nd, device=device, generator=g)
        for score, params in SCORES.items():
            ref, ref_grads = reference(score, params, q, d, w, grads=True)
            record = {"shape": name, "dims": [nq, nd, lq, ld, dim], "score": score,
                      "params": params, "results": {}}  # fmt: skip
            for impl in ("lik", "eager"):
                result = measure(impl, score, params, q, d, w, ref, ref_grads, timing,
                                 dry_run=args.dry_run)  # fmt: skip
                record["results"][impl] = result
                print(f"[{name} {score}] {impl}: {summary(result)}", flush=True)
            report["shapes"].append(record)
            release_cached_memory()
        del q, d, w
        release_cached_memory()
    return report


def _ratio(a, b):
    return a / b if a and b else None


def markdown(report: dict) -> str:
    headers = ["shape", "score", "lik fwd ms / MiB", "eager fwd ms / MiB", "fwd speedup",
               "lik train ms / MiB", "eager train ms / MiB", "train speedup", "parity"]  # fmt: skip
    rows = []
    for record in report["shapes"]:
        lik, eager = record["results"]["lik"], record["results"]["eager"]

        def cell(r, kind):
            if r.get(f"{kind}_ms") is None:
                return f"error: {str(r.get('error', ''))[:50]}"
            # Dry runs have no peak memory: format_ms writes None as a dash.
            return f"{format_ms(r[f'{kind}_ms'])} / {format_ms(r.get(f'{kind}_mib'))}"

        parity = "ok" if lik.get("parity_ok") else "FAIL"
        rows.append([f"{record['shape']} {tuple(record['dims'])}", record["score"],
                     cell(lik, "fwd"), cell(eager, "fwd"),
                     format_ratio(_ratio(eager.get("fwd_ms"), lik.get("fwd_ms"))),
                     cell(lik, "train"), cell(eager, "train"),
                     format_ratio(_ratio(eager.get("train_ms"), lik.get("train_ms"))),
                     parity])  # fmt: skip
    dry_run = report.get("dry_run", False)
    note = ("Dry run: CPU wall clock, tiny shapes, lik's reference path; no peak memory on "
            "the CPU (—). Not a measurement.\n\n") if dry_run else ""  # fmt: skip
    return (f"# Token-score variants vs materialized PyTorch on {report['gpu']}\n\n" + note
            + "bf16 inputs, median ms / peak MiB above the inputs (outputs and gradients "
            "included), same run. Train = forward + backward to Q, D (and the weights).\n\n"
            + markdown_table(headers, rows) + "\n")  # fmt: skip


def write_report(report: dict, out: Path, dry_run: bool = False) -> None:
    text = markdown(report)
    labels = [f"{r['shape']} {r['score']}" for r in report["shapes"]]
    series = {
        f"{kind} vs eager": [
            _ratio(r["results"]["eager"].get(f"{kind}_ms"), r["results"]["lik"].get(f"{kind}_ms"))
            for r in report["shapes"]
        ]
        for kind in ("fwd", "train")
    }
    title = f"lik token-score variants vs materialized PyTorch, {report['gpu']}"
    stem = result_stem("variants", report["gpu"], dry_run)
    write_results(out, stem, report, text, (labels, series, title))
    print(text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU, tiny shapes, lik's reference path and eager")  # fmt: skip
    args = parser.parse_args(argv)
    if not args.dry_run and missing_gpu("bench_variants"):
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    write_report(run(args), args.out, dry_run=args.dry_run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
