"""PyLate's score functions with doc masks: through lik's integration (the masks passed as
they are, read as zeros by lik's masked-as-zero kernels), through lik with zeroed copies
of the embeddings (the integration's former path), and through PyLate 1.6's own backends
(`backend="torch"`, its reference; "flash": flash-maxsim; "lik": late-interaction-kernels
0.4.5), time and peak memory, in one run on one card.

PyLate's torch path multiplies the similarities by the masks, so a masked doc token
competes with similarity 0. Every implementation's scores (and, for training shapes, its
gradients w.r.t. Q and D) are compared with the float64 form of that formula before
anything is timed, and with the torch path's own bf16 result: lik must match both (bf16
tolerance); the kernel backends may not (they leave masked tokens out of the max, and
flash-maxsim reads a mask as a length), which the table records.

Inputs: L2-normalized bf16 tokens, d 128, queries and docs leaning apart so that many
query tokens' best similarity is below 0 (where the conventions differ, and where lik
reads a doc's mask again); doc masks of random lengths with skiplist-like holes (5%),
one doc fully masked; no query mask (PyLate's query expansion).

    python3 benchmarks/bench_pylate.py --out DIR [--quick] [--shapes rerank,kd-train]
    python3 benchmarks/bench_pylate.py --out DIR --dry-run   # CPU, tiny shapes, no kernels
"""

from __future__ import annotations

import argparse
import contextlib
import functools
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
    peak_extra_memory_mib,
    pick,
    provenance,
    relative_error,
    release_cached_memory,
    result_stem,
    write_results,
)

SHAPES = shapes.PYLATE
# The implementations, in table order; "lik" and "lik-copies" are lik's.
IMPLEMENTATIONS = ("lik", "lik-copies", "pylate-torch", "pylate-flash", "pylate-LIK")
PYLATE_BACKEND = {"pylate-torch": "torch", "pylate-flash": "flash", "pylate-LIK": "lik"}
TIMING = {"full": {"warmup_ms": 100, "rep_ms": 500}, "quick": {"warmup_ms": 25, "rep_ms": 100}}
TOLERANCE = 2e-2  # bf16 inputs: scores and gradients against float64
LEAN = 6.0  # along axis 0 before normalizing, at d 128: about half the maxima below 0
HOLES = 0.05  # masked tokens within a doc's length (PyLate's skiplist)
# A dry run exercises the script: every shape shrunk to (Nq, Nd, Lq, Ld, d) with its Nq
# and Nd capped, lik's reference path, PyLate's torch path, CPU wall clock, no peers.
DRY_RUN_DIMS = (2, 3, 5, 7, 16)


def _tokens(rows, length, dim, lean, *, device, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(rows, length, dim, device=device, generator=g)
    x[..., 0] += lean
    return torch.nn.functional.normalize(x, dim=-1)


def make_inputs(function, nq, nd, lq, ld, d, *, device, dtype, seed=0):
    """Q [nq, lq, d]; D [nd, ld, d] (colbert_scores) or [nq, nd, ld, d] (kd); a bool doc
    mask of random lengths with holes, its last doc fully masked."""
    kd = function == "colbert_kd_scores"
    docs = nq * nd if kd else nd
    lean = LEAN * (d / 128) ** 0.5
    Q = _tokens(nq, lq, d, lean, device=device, seed=seed).to(dtype)
    D = _tokens(docs, ld, d, -lean, device=device, seed=seed + 1).to(dtype)
    g = torch.Generator(device=device).manual_seed(seed + 2)
    lengths = torch.randint(max(1, ld // 4), ld + 1, (docs, 1), device=device, generator=g)
    holes = torch.rand(docs, ld, device=device, generator=g) < HOLES
    d_mask = (torch.arange(ld, device=device) < lengths) & ~holes
    d_mask[-1] = False
    if kd:
        D, d_mask = D.view(nq, nd, ld, d), d_mask.view(nq, nd, ld)
    return Q, D, d_mask


def reference(function, Q, D, d_mask, weights):
    """PyLate's formula in float64 (lik's reference with the doc mask read as zeros, which
    tests/test_masked_as_zero.py checks against the formula), and its gradients when
    weights are given."""
    from lik.runtime.reference import maxsim_reference

    grads = weights is not None
    q, d = Q.detach().double().requires_grad_(grads), D.detach().double().requires_grad_(grads)
    out = maxsim_reference(q, d, None, d_mask, masked_as_zero=True)
    if not grads:
        return out, None
    out.backward(weights.double())
    return out.detach(), {"Q": q.grad, "D": d.grad}


def scorer(impl, function):
    """impl's score call (Q, D, d_mask) -> scores, as PyLate's users make it."""
    from pylate.scores import colbert

    from lik import runtime

    if impl == "lik-copies":  # the integration before masks reached the kernels

        def copies(Q, D, d_mask):
            zeroed = D * d_mask.to(D.dtype).unsqueeze(-1)
            return runtime.maxsim(Q, zeroed).to(Q.dtype)

        return copies
    backend = PYLATE_BACKEND.get(impl)  # lik: PyLate's default, "auto", routed to lik
    return lambda Q, D, d_mask: getattr(colbert, function)(Q, D, documents_mask=d_mask,
                                                           backend=backend)  # fmt: skip


def _routed_through_lik(call) -> bool:
    """Whether call() reached lik's masked-as-zero entry (the integration took it)."""
    from lik.runtime import api

    real, hits = api.maxsim_masked_as_zero, []

    def counting(*args, **kwargs):
        hits.append(1)
        return real(*args, **kwargs)

    api.maxsim_masked_as_zero = counting
    try:
        call()
    finally:
        api.maxsim_masked_as_zero = real
    return bool(hits)


def _step(score, Q, D, d_mask, weights):
    """One training step's scoring: forward, then backward to Q and D."""
    Q.grad = D.grad = None
    out = score(Q, D, d_mask)
    out.float().backward(weights)
    return Q.grad, D.grad


def measure(impl, function, Q, D, d_mask, ref, ref_grads, torch_out, weights, timing,
            dry_run) -> dict:  # fmt: skip
    from lik.integrations import pylate as lik_pylate

    result = {"error": None}
    score = scorer(impl, function)
    training = weights is not None
    scope = lik_pylate.enabled() if impl == "lik" else contextlib.nullcontext()
    with scope:
        if impl == "lik":
            with torch.no_grad():
                routed, error = attempt(lambda: _routed_through_lik(lambda: score(Q, D, d_mask)))
            if error or not routed:
                return {"error": error or "the integration did not route the call to lik"}
        with torch.no_grad():
            out, error = attempt(lambda: score(Q, D, d_mask))
        if error:
            return {"error": error}
        result["err"] = relative_error(out, ref)
        if torch_out is not None:
            result["vs_torch"] = relative_error(out, torch_out)
        ok = result["err"] < TOLERANCE
        if training:
            grads, error = attempt(lambda: _step(score, Q, D, d_mask, weights))
            if error:
                return {**result, "error": error}
            result["grad_rel_err"] = {name: relative_error(grad, ref_grads[name])
                                      for name, grad in zip("QD", grads, strict=True)}  # fmt: skip
            ok = ok and max(result["grad_rel_err"].values()) < TOLERANCE
        result["parity_ok"] = ok
        del out

        def call():
            if training:
                return _step(score, Q, D, d_mask, weights)
            with torch.no_grad():
                return score(Q, D, d_mask)

        if dry_run:
            result["ms"], error = attempt(lambda: cpu_wallclock_ms(call))
            result["mib"] = None  # no peak GPU memory on a CPU
        else:
            result["ms"], error = attempt(lambda: bench_ms(call, **timing))
            Q.grad = D.grad = None
            result["mib"], error2 = attempt(lambda: peak_extra_memory_mib(call))
            error = error or error2
        result["error"] = error
    Q.grad = D.grad = None
    release_cached_memory()
    return result


def _dry_run_dims(nq, nd):
    dq, dd, lq, ld, d = DRY_RUN_DIMS
    return min(nq, dq), min(nd, dd), lq, ld, d


def run(args) -> dict:
    from lik import integrations

    timing = TIMING["quick" if args.quick else "full"]
    device = "cpu" if args.dry_run else "cuda"
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    if args.dry_run:
        # lik's reference path stands in for its kernels (a CPU without the interpreter
        # is otherwise left to PyLate), as in tests/test_integration_pylate.py.
        integrations.has_kernel = lambda device: device.type in ("cpu", "cuda")
    timer = {"timer": DRY_RUN_TIMER} if args.dry_run else {"timer": "triton do_bench", **timing}
    env = environment_info(("pylate", "late-interaction-kernels", "flash-maxsim"))
    report = {"env": env, "gpu": gpu_name(), "dry_run": args.dry_run, "timing": timer,
              "dtype": str(dtype).removeprefix("torch."), "shapes": []}  # fmt: skip
    wanted = pick(args.shapes, [shape[0] for shape in SHAPES], "shape")
    impls = ("lik", "lik-copies", "pylate-torch") if args.dry_run else IMPLEMENTATIONS
    for name, function, nq, nd, lq, ld, d, training in SHAPES:
        if name not in wanted:
            continue
        if args.dry_run:
            nq, nd, lq, ld, d = _dry_run_dims(nq, nd)
        Q, D, d_mask = make_inputs(function, nq, nd, lq, ld, d, device=device, dtype=dtype)
        weights = None
        if training:
            g = torch.Generator(device=device).manual_seed(9)
            weights = torch.randn(nq, d_mask.shape[-2] if function == "colbert_kd_scores"
                                  else d_mask.shape[0], device=device, generator=g)  # fmt: skip
            Q.requires_grad_()
            D.requires_grad_()
        ref, ref_grads = reference(function, Q, D, d_mask, weights)
        torch_out, _ = attempt(functools.partial(_torch_path, function, Q, D, d_mask))
        record = {"shape": name, "function": function, "dims": [nq, nd, lq, ld, d],
                  "training": training, "zero_wins": _zero_wins(Q, D, d_mask, ref),
                  "results": {}}  # fmt: skip
        for impl in impls:
            result = measure(impl, function, Q, D, d_mask, ref, ref_grads, torch_out, weights,
                             timing, args.dry_run)  # fmt: skip
            record["results"][impl] = result
            print(f"[{name}] {impl}: {summary(result)}", flush=True)
        report["shapes"].append(record)
        del Q, D, d_mask, torch_out
        release_cached_memory()
    return report


def _torch_path(function, Q, D, d_mask):
    """PyLate's torch path's scores (no gradients)."""
    with torch.no_grad():
        return scorer("pylate-torch", function)(Q, D, d_mask)


def _zero_wins(Q, D, d_mask, ref) -> float:
    """How much the masked tokens' 0 moves the scores: relative difference of PyLate's
    float64 scores from those that leave masked tokens out (lik.maxsim's convention)."""
    from lik.runtime.reference import maxsim_reference

    own = maxsim_reference(Q.detach().double(), D.detach().double(), None, d_mask)
    return relative_error(own, ref)


def summary(result: dict) -> str:
    if result.get("ms") is None:
        return f"error: {result.get('error')}"
    grads = result.get("grad_rel_err")
    grad = f" grad err {max(grads.values()):.1e}" if grads else ""
    vs_torch = result.get("vs_torch")
    versus = f" vs torch {vs_torch:.1e}" if vs_torch is not None else ""
    return (f"{format_ms(result['ms'])} ms, {format_ms(result.get('mib'))} MiB, err "
            f"{result['err']:.1e}{grad}{versus} {result.get('error') or ''}")  # fmt: skip


def markdown(report: dict) -> str:
    headers = ["shape", "implementation", "ms", "peak MiB", "lik speedup", "err (fp64)",
               "grad err", "vs torch path", "PyLate's numbers"]  # fmt: skip
    rows = []
    for record in report["shapes"]:
        lik_ms = record["results"].get("lik", {}).get("ms")
        kind = "fwd + bwd" if record["training"] else "forward"
        label = (f"{record['shape']} {record['function']} {tuple(record['dims'])}, {kind}; "
                 f"masked 0s move the scores {record['zero_wins']:.0%}")  # fmt: skip
        for impl, result in record["results"].items():
            if result.get("ms") is None:
                rows.append([label, impl, f"error: {str(result.get('error'))[:60]}"] + [""] * 6)
                continue
            grads = result.get("grad_rel_err")
            vs_torch = result.get("vs_torch")
            rows.append([label, impl, format_ms(result["ms"]), format_ms(result.get("mib")),
                         format_ratio(result["ms"] / lik_ms if lik_ms else None),
                         f"{result['err']:.1e}",
                         f"{max(grads.values()):.1e}" if grads else "—",
                         "—" if vs_torch is None else f"{vs_torch:.1e}",
                         "yes" if result.get("parity_ok") else "no"])  # fmt: skip
    note = ("Dry run: CPU wall clock, tiny shapes, fp32, lik's reference path and PyLate's "
            "torch path; no peers, no peak memory (—). Not a measurement.\n\n"
            if report.get("dry_run") else "")  # fmt: skip
    return (f"# PyLate score functions with doc masks on {report['gpu']}\n\n" + note
            + f"{report['dtype']} inputs, median ms (do_bench) and peak MiB above the inputs, "
            "same run. err: relative error of the scores to PyLate's formula in float64 "
            f"(gradients w.r.t. Q and D: grad err); PyLate's numbers: both within "
            f"{TOLERANCE:g}. lik speedup: the implementation's time over lik's (the "
            "integration's masked-as-zero path); lik-copies is the integration's former "
            "path (zeroed copies of D). \"masked 0s move the scores\": how far PyLate's "
            "scores are from those that leave masked tokens out.\n\n"
            + markdown_table(headers, rows) + "\n\n"
            + provenance(report["env"]) + "\n")  # fmt: skip


def write_report(report: dict, out: Path, dry_run: bool = False) -> None:
    text = markdown(report)
    stem = result_stem("pylate", report["gpu"], dry_run)
    write_results(out, stem, report, text)
    print(text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--shapes", default=None,
                        help="comma-separated: " + ", ".join(s[0] for s in SHAPES))  # fmt: skip
    dry_run_help = "CPU, tiny shapes: lik's reference path, PyLate's torch path"
    parser.add_argument("--dry-run", action="store_true", help=dry_run_help)
    args = parser.parse_args(argv)
    if not args.dry_run and missing_gpu("bench_pylate"):
        return 2
    try:
        import pylate.scores.colbert  # noqa: F401
    except ImportError as error:  # make bench runs every suite: this one says why it did not
        print(f"bench_pylate skipped: it needs pylate 1.6 (pip install '.[pylate]'): {error}",
              file=sys.stderr)  # fmt: skip
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    write_report(run(args), args.out, dry_run=args.dry_run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
