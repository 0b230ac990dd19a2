"""FP8 (e4m3) rerank: lik's fp8 kernel against lik bf16 and late-interaction-kernels 0.4.5
(its `maxsim_inference_fp8` and its bf16 `maxsim`), all timed in one run on one card.

Each implementation is reported against its own floor, from the same run's measured
ceilings: the longer of its bytes at the copy rate (fp8 bytes = fp8 docs + fp8 query +
their scales + fp32 scores; bf16 bytes = bf16 docs + bf16 query + scores) and its FLOPs
at its dtype's matmul rate (a rerank of one query is memory bound; eight queries against
the same docs are not). Parity against the float64 reference of the (dequantized) inputs
comes before any timing. A small launch-config sweep of lik's fp8 kernel follows, and
prints the tuning-table line of the fastest config.

    python3 benchmarks/bench_fp8.py --out DIR [--shapes a,b] [--quick] [--no-sweep]
    python3 benchmarks/bench_fp8.py --out DIR --grid   # shapes.GRID_FP8, quick, no sweep
    python3 benchmarks/bench_fp8.py --dry-run     # CPU, tiny shapes, reference paths
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import shapes
import torch
from common import (
    DRY_RUN_TIMER,
    MATMUL_CEILING_N,
    Shape,
    attempt,
    bench_ms,
    clean_l2_ms,
    cpu_wallclock_ms,
    environment_info,
    first_call_seconds,
    format_ms,
    format_ratio,
    markdown_table,
    measure_ceilings,
    normalized_tokens,
    percent_of_roofline,
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

SHAPES = shapes.FP8
DEFAULT_SHAPES = (shapes.FP8_RERANK.name,)
PEER_DISTRIBUTIONS = {"late-interaction-kernels": "0.4.5"}
TIMING = {"full": {"warmup_ms": 100, "rep_ms": 500}, "quick": {"warmup_ms": 25, "rep_ms": 100}}
TIMING_ROUNDS = 2
# DESIGN.md: fp8 scores within 5e-2 of the float64 reference of the dequantized inputs;
# bf16 inputs within 1e-2 of theirs.
TOLERANCE = {"fp8": 5e-2, "bf16": 1e-2}
PARITY_DOCS_EACH_END = 32  # first and last docs: offset overflows show at high indices
# Launch configs the sweep tries for lik's fp8 kernel (block_l, num_stages, num_warps): the
# fields a table entry sets. The query tile's rows are the runtime's (fp8.fp8_tiles: 64 on
# Hopper, whose fp8 wgmma takes no fewer), since no entry can choose them.
SWEEP = list(itertools.product((64, 128, 256), (2, 3, 4), (4, 8)))
SWEEP_SCALES = ("tensor", "token")  # the scale granularities each config runs with

# key: (label, storage, scale granularity)
IMPLEMENTATIONS = {
    "lik_fp8_tensor": ("lik fp8 (per-tensor)", "fp8", "tensor"),
    "lik_fp8_token": ("lik fp8 (per-token)", "fp8", "token"),
    "lik_bf16": ("lik bf16", "bf16", None),
    "lik45_fp8_tensor": ("LIK 0.4.5 fp8 (per-tensor)", "fp8", "tensor"),
    "lik45_fp8_token": ("LIK 0.4.5 fp8 (per-token)", "fp8", "token"),
    "lik45_bf16": ("LIK 0.4.5 bf16", "bf16", None),
}
HEADLINE = "lik_fp8_tensor"
GRID_SUITE = "fp8_grid"
BASELINES = ("lik_bf16", "lik45_fp8_tensor", "lik45_bf16")
DRY_RUN_IMPLEMENTATIONS = ("lik_fp8_tensor", "lik_fp8_token", "lik_bf16")


# ---------------------------------------------------------------------------------------
# Inputs and implementations. Imports are lazy: a missing package is a recorded error.


def make_inputs(shape: Shape, device, seed: int) -> dict:
    """bf16 unit-norm tokens, and their fp8 forms with per-tensor and per-token scales
    (lik's quantizers; LIK 0.4.5 uses the same e4m3 convention, scale = amax / 448)."""
    from lik.runtime.fp8 import quantize_fp8_per_tensor, quantize_fp8_per_token

    q = normalized_tokens(shape.nq, shape.lq, shape.d, device=device, seed=seed)
    docs = normalized_tokens(shape.nd, shape.ld, shape.d, device=device, seed=seed + 1)
    inputs = {"bf16": (q, docs)}
    for granularity, quantize in (
        ("tensor", quantize_fp8_per_tensor),
        ("token", quantize_fp8_per_token),
    ):
        q8, scale_q = quantize(q)
        d8, scale_d = quantize(docs)
        inputs[granularity] = (q8, d8, scale_q, scale_d)
    return inputs


def build(key: str) -> Callable[[dict], torch.Tensor]:
    """scores(inputs) -> fp32 [Nq, Nd] for one implementation."""
    _, storage, granularity = IMPLEMENTATIONS[key]
    if key.startswith("lik45"):
        import late_interaction_kernels as peer
        from late_interaction_kernels.fp8 import maxsim_inference_fp8 as peer_fp8

        if storage == "bf16":
            return lambda inputs: peer.maxsim(*inputs["bf16"])
        return lambda inputs: _call_fp8(peer_fp8, inputs[granularity])
    from lik.runtime import maxsim
    from lik.runtime.fp8 import maxsim_inference_fp8

    if storage == "bf16":
        return lambda inputs: maxsim(*inputs["bf16"])
    return lambda inputs: _call_fp8(maxsim_inference_fp8, inputs[granularity])


def _call_fp8(fn, fp8_inputs):
    q8, d8, scale_q, scale_d = fp8_inputs
    return fn(q8, d8, scale_Q=scale_q, scale_D=scale_d)


def fp8_matmul_tflops(device, *, warmup_ms: int, rep_ms: int) -> float | None:
    """e4m3 tensor-core rate of an 8192^3 scaled matmul (fp32 scales, bf16 out); None
    where this PyTorch or card has no fp8 matmul (the floor then counts bytes only)."""
    n = MATMUL_CEILING_N
    a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()  # column-major, as asked
    one = torch.ones((), device=device)
    matmul = lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)  # noqa: E731
    _, error = attempt(matmul)
    if error:
        print(f"  no fp8 matmul rate: {error}", flush=True)
        return None
    return 2 * n**3 / (bench_ms(matmul, warmup_ms=warmup_ms, rep_ms=rep_ms) * 1e-3) / 1e12


def fp8_ceilings(device, *, warmup_ms: int, rep_ms: int) -> dict:
    """The copy and bf16 matmul ceilings (common.measure_ceilings) and the fp8 matmul rate."""
    ceilings = measure_ceilings(device, warmup_ms=warmup_ms, rep_ms=rep_ms)
    ceilings["fp8_matmul_tflops"] = fp8_matmul_tflops(device, warmup_ms=warmup_ms, rep_ms=rep_ms)
    torch.cuda.empty_cache()
    return ceilings


def floor_ms(shape: Shape, storage: str, granularity: str | None, ceilings: dict) -> dict:
    """An implementation's floor (common.roofline_floor): its bytes (floor_bytes) at the
    copy rate or its FLOPs at its dtype's matmul rate, whichever is longer; bytes alone
    where the card's fp8 rate was not measured."""
    rate = ceilings["matmul_tflops"] if storage == "bf16" else ceilings.get("fp8_matmul_tflops")
    rated = {**ceilings, "matmul_tflops": rate or float("inf")}
    return roofline_floor(shape, rated, floor_bytes(shape, storage, granularity))


def floor_bytes(shape: Shape, storage: str, granularity: str | None) -> int:
    """Bytes an implementation must move at least: inputs read once, scores written."""
    tokens = shape.nq * shape.lq + shape.nd * shape.ld
    scores = shape.nq * shape.nd * 4
    if storage == "bf16":
        return tokens * shape.d * 2 + scores
    scales = 4 * (tokens if granularity == "token" else 2)
    return tokens * shape.d + scales + scores


# ---------------------------------------------------------------------------------------
# Parity and timing


def parity_docs(shape: Shape, device) -> torch.Tensor:
    if shape.nd <= 2 * PARITY_DOCS_EACH_END:
        return torch.arange(shape.nd, device=device)
    head = torch.arange(PARITY_DOCS_EACH_END, device=device)
    return torch.cat([head, head + shape.nd - PARITY_DOCS_EACH_END])


def references(inputs: dict, docs: torch.Tensor) -> dict:
    """float64 scores of the checked docs, per input form."""
    from lik.runtime.reference import maxsim_fp8_reference, maxsim_reference

    q, d = inputs["bf16"]
    out = {"bf16": maxsim_reference(q.double(), d.index_select(0, docs).double())}
    for granularity in ("tensor", "token"):
        q8, d8, scale_q, scale_d = inputs[granularity]
        if scale_d.dim() > 0:
            scale_d = scale_d.index_select(0, docs)
        out[granularity] = maxsim_fp8_reference(
            q8, d8.index_select(0, docs), scale_Q=scale_q, scale_D=scale_d, dtype=torch.float64
        )
    return out


def measure(key, shape, input_sets, refs, docs, ceilings, args) -> dict:
    _, storage, granularity = IMPLEMENTATIONS[key]
    result = {
        "ms": None,
        "pct_floor": None,
        "clean_l2_ms": None,
        "pct_floor_clean_l2": None,
        "parity_rel_err": None,
        "parity_ok": None,
        "first_call_s": None,
        "error": None,
    }
    if args.dry_run and key not in DRY_RUN_IMPLEMENTATIONS:
        result["error"] = "skipped in dry run"
        return result
    scores, error = attempt(lambda: build(key))
    if error:
        result["error"] = error
        return result
    out, error = attempt(lambda: first_call_seconds(lambda: scores(input_sets[0])))
    if error:
        result["error"] = error
        return result
    out, result["first_call_s"] = out
    ref = refs[granularity or "bf16"]
    result["parity_rel_err"] = relative_error(out.index_select(1, docs), ref)
    result["parity_ok"] = result["parity_rel_err"] <= TOLERANCE[storage]
    if not result["parity_ok"]:
        result["error"] = "parity failed: not timed"
        return result
    call = rotating(scores, [(inputs,) for inputs in input_sets])
    if args.dry_run:
        result["ms"] = cpu_wallclock_ms(call)
    else:
        # Each timer in TIMING_ROUNDS rounds, the lowest median kept (all in the record):
        # a round now and then reads 10-30% high on these ~0.08 ms calls (H200 hosts:
        # lik's per-tensor call 0.085-0.096 ms in three of six one-round runs, 0.074-0.076
        # in the others).
        timing = TIMING["quick" if args.quick else "full"]
        result["ms_rounds"], result["clean_l2_ms_rounds"] = [], []
        for _ in range(TIMING_ROUNDS):
            ms, error = attempt(lambda: bench_ms(call, **timing))
            if error:
                result["error"] = error
                break
            result["ms_rounds"].append(ms)
            # and after a flush that leaves L2 clean (common.clean_l2_ms)
            clean = attempt(lambda: clean_l2_ms(call))[0]
            if clean is not None:
                result["clean_l2_ms_rounds"].append(clean)
        result["ms"] = min(result["ms_rounds"], default=None)
        result["clean_l2_ms"] = min(result["clean_l2_ms_rounds"], default=None)
    if ceilings and result["ms"]:
        floor = floor_ms(shape, storage, granularity, ceilings)
        result["floor_ms"], result["bound"] = floor["floor_ms"], floor["bound"]
        result["pct_floor"] = percent_of_roofline(floor["floor_ms"], result["ms"])
        result["pct_floor_clean_l2"] = percent_of_roofline(floor["floor_ms"], result["clean_l2_ms"])
    return result


def sweep_lik_fp8(shape: Shape, inputs: dict, args) -> dict:
    """Times lik's fp8 kernel under the runtime's default config and each SWEEP config,
    launched directly, with per-tensor and with per-token scales (one table entry serves
    both), through make tune's selection (tune.sweep: every output checked against the
    default's, the winner by the joint slowdown over the two, the clean-L2 tie-break)."""
    import tune

    from lik.runtime import configs, fp8, registry
    from lik.runtime.keys import KernelKey, gpu_family, lq_bucket, padded_head_dim, size_class

    name = "maxsim_dense_nomask_fp8_triton"
    module = registry.load(name)
    q8 = inputs["tensor"][0]
    out = torch.empty(shape.nq, shape.nd, dtype=torch.float32, device=q8.device)
    key = KernelKey(name, gpu_family(q8.device), padded_head_dim(shape.d), lq_bucket(shape.lq),
                    size_class(out.numel()), 1)  # fmt: skip
    # Each config with the fp8 tile minimums, as the runtime launches a table entry's.
    default = fp8.fp8_tiles(configs.call_config(name, module, q8, shape.lq, out.numel()), q8.device)
    grid = [
        fp8.fp8_tiles(
            dataclasses.replace(default, block_l=block_l, num_stages=stages, num_warps=warps),
            q8.device,
        )
        for block_l, stages, warps in SWEEP
    ]

    def runner(granularity):
        q8, d8, scale_q, scale_d = inputs[granularity]
        sq, sd = fp8._per_token(scale_q, q8.shape[:-1]), fp8._per_token(scale_d, d8.shape[:-1])

        def run(config):
            module.launch(out, q8, d8, sq, sd, config=config)
            return (out,)

        return run

    found = tune.sweep([runner(g) for g in SWEEP_SCALES], [default, *grid], quick=args.quick)
    rows = [
        {"block_l": c.block_l, "num_stages": c.num_stages, "num_warps": c.num_warps,
         "block_q": c.block_q, "default": c == default,
         **{f"ms_{g}": t for g, t in zip(SWEEP_SCALES, ms, strict=True)},
         "error": found.failures.get(c)}
        for c, ms in found.times.items()
    ]  # fmt: skip
    line = None
    if found.winner is not None:
        # ms per shape, as make tune writes it: the per-tensor time; the per-token one noted.
        tensor_ms, token_ms = (round(t, 4) for t in found.times[found.winner])
        rows_note = f"block_q padded to {found.winner.block_q}"
        label = f"{shape.name} ({rows_note}; per-token scales {token_ms})"
        entry = tune.table_entry(found.winner, [tensor_ms], label)
        line = tune.table_line(key.table_key(), entry)
    return {"table_key": key.table_key(), "rows": rows, "toml_line": line}


# ---------------------------------------------------------------------------------------
# Reporting


def ratio(record: dict, baseline: str, key: str = HEADLINE) -> float | None:
    mine = record["results"].get(key, {}).get("ms")
    other = record["results"].get(baseline, {}).get("ms")
    return other / mine if mine and other else None


def timing_table(report: dict) -> str:
    keys = report["implementations"]
    headers = [
        "shape (Nq, Nd, Lq, Ld, d)",
        "implementation",
        "ms",
        "% of own floor",
        "ms, L2 clean",
        "% of floor, L2 clean",
        "parity",
        f"{IMPLEMENTATIONS[HEADLINE][0]} speedup",
    ]
    rows = []
    for record in report["shapes"]:
        for key in keys:
            result = record["results"][key]
            parity = (
                "—"
                if result["parity_rel_err"] is None
                else (f"{result['parity_rel_err']:.1e}" + ("" if result["parity_ok"] else " FAIL"))
            )
            speed = "—" if key == HEADLINE else format_ratio(ratio(record, key))
            bound = "*" if result.get("bound") == "compute" else ""
            rows.append(
                [
                    f"{record['name']} {record['dims']}",
                    IMPLEMENTATIONS[key][0],
                    format_ms(result["ms"]),
                    format_ratio(result["pct_floor"], "%") + bound,
                    format_ms(result.get("clean_l2_ms")),
                    format_ratio(result.get("pct_floor_clean_l2"), "%") + bound,
                    parity,
                    speed,
                ]
            )
    return markdown_table(headers, rows)


# PERF.md's fp8 goal: at least 90% of the floor from this many docs.
GOAL_DOCS = 8192


def grid_summary(report: dict) -> str:
    """The grid's worst cells: lik fp8's % of its floor from GOAL_DOCS docs, per scale
    granularity, and its speedup over LIK's fp8 of the same scales, over every shape."""
    lines = []
    for granularity in SWEEP_SCALES:
        mine, peer = f"lik_fp8_{granularity}", f"lik45_fp8_{granularity}"
        pct = [r["results"][mine]["pct_floor"] for r in report["shapes"]
               if r["Nd"] >= GOAL_DOCS and r["results"][mine]["pct_floor"]]  # fmt: skip
        speedups = [x for x in (ratio(r, peer, mine) for r in report["shapes"]) if x]
        worst = f"{min(pct):.0f}%" if pct else "—"
        against = f"{min(speedups):.2f}x" if speedups else "—"
        lines.append(
            f"- {IMPLEMENTATIONS[mine][0]}: worst {worst} of its floor from "
            f"{GOAL_DOCS} docs; worst {against} LIK 0.4.5's speed (same scales)."
        )
    return "\n".join(["Grid (shapes.GRID_FP8: one axis of fp8-rerank moved at a time):", *lines])


def markdown_report(report: dict) -> str:
    env, ceilings = report["env"], report["ceilings"]
    grid = report["suite"] == GRID_SUITE
    parts = [
        f"# FP8 rerank{' grid' if grid else ''} on {env['gpu']}",
        "",
        provenance(env),
        "",
    ]
    if grid:
        parts += [grid_summary(report), ""]
    if ceilings:
        fp8_rate = ceilings.get("fp8_matmul_tflops")
        fp8_text = f"fp8 {fp8_rate:.0f}" if fp8_rate else "fp8 not measured (bytes only)"
        copy, bf16 = ceilings["copy_tbps"], ceilings["matmul_tflops"]
        parts += [f"Measured ceilings: copy {copy:.2f} TB/s (read + write); matmul bf16 "
                  f"{bf16:.0f}, {fp8_text} TFLOP/s.", ""]  # fmt: skip
    parts += [
        f"Median ms ({report['timing']['timer']}). Floors: the bytes (fp8 docs + query + scales + "
        "fp32 scores for fp8 rows, bf16 docs + query + scores for bf16 rows) at the copy "
        "ceiling, or the FLOPs at the row's matmul rate where that is longer (marked *). "
        f"Speedup = implementation ms / {IMPLEMENTATIONS[HEADLINE][0]} ms. Parity: relative "
        "error vs the float64 reference of the dequantized inputs (fp8 bound 5e-2, bf16 1e-2). "
        "\"L2 clean\": the same call timed after a flush that reads a 256 MB buffer instead of "
        "do_bench's write of it, so it has no dirty lines to write back (common.clean_l2_ms).",
        "",
        timing_table(report),
        "",
    ]
    for record in report["shapes"]:
        sweep = record.get("sweep")
        if not sweep:
            continue
        parts += [f"## lik fp8 launch configs, {record['name']}", ""]
        if sweep.get("error"):
            parts += [f"The sweep failed: {sweep['error']}", ""]
            continue
        rows = [
            [
                r["block_l"],
                r["num_stages"],
                r["num_warps"],
                r.get("block_q", ""),
                "yes" if r["default"] else "",
                *(format_ms(r.get(f"ms_{g}")) for g in SWEEP_SCALES),
                r["error"] or "",
            ]
            for r in sweep["rows"]
        ]
        headers = ["block_l", "stages", "warps", "block_q", "default",
                   *(f"ms, per-{g} scales" for g in SWEEP_SCALES), "error"]  # fmt: skip
        parts += [markdown_table(headers, rows)]
        if sweep["toml_line"]:
            parts += ["", "Fastest, as a tuning-table line:", "", f"    {sweep['toml_line']}"]
        parts += [""]
    errors = [
        f"- {IMPLEMENTATIONS[k][0]} ({r['name']}): {res['error']}"
        for r in report["shapes"]
        for k, res in r["results"].items()
        if res["error"]
    ]
    if errors:
        parts += ["## Errors", "", *errors, ""]
    return "\n".join(parts)


def write_report(report: dict, out_dir: Path, stem: str) -> None:
    names = [record["name"] for record in report["shapes"]]
    series = speedup_series(report, BASELINES, lambda b: IMPLEMENTATIONS[b][0], ratio)
    title = f"{IMPLEMENTATIONS[HEADLINE][0]} speedup, {report['env']['gpu']}"
    write_results(out_dir, stem, report, markdown_report(report), (names, series, title))


# ---------------------------------------------------------------------------------------
# Command line


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="output folder (default: benchmarks/results)")
    parser.add_argument(
        "--shapes",
        help="comma-separated shape names (default: fp8-rerank): "
        + ",".join(s.name for s in SHAPES),
    )
    parser.add_argument("--quick", action="store_true", help="shorter warm-up and timing")
    parser.add_argument("--no-sweep", action="store_true", help="skip the launch-config sweep")
    parser.add_argument(
        "--grid",
        action="store_true",
        help=f"the shape-class grid (shapes.GRID_FP8) into {GRID_SUITE}/: quick, no sweep",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="CPU only, tiny shapes, lik's reference paths, no peers",
    )
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    suite = GRID_SUITE if args.grid else "fp8"
    if args.grid:
        args.quick = args.no_sweep = True  # the grid's ~10 shapes in a few minutes
    by_name = {shape.name: shape for shape in (shapes.GRID_FP8 if args.grid else SHAPES)}
    default = list(by_name) if args.grid else list(DEFAULT_SHAPES)
    names = [n.strip() for n in args.shapes.split(",")] if args.shapes else default
    unknown = [n for n in names if n not in by_name]
    if unknown:
        sys.exit(f"unknown shapes: {', '.join(unknown)}; choose from {', '.join(by_name)}")
    picked = [by_name[n] for n in names]
    if args.dry_run:
        device, ceilings = "cpu", None
        picked = [Shape(s.name, s.nq, 64, 8, 16, s.d) for s in picked]
        out_dir = args.out or Path(tempfile.mkdtemp(prefix="lik-fp8-"))
        timer = DRY_RUN_TIMER
    else:
        if not torch.cuda.is_available():
            sys.exit("no CUDA device; --dry-run exercises this script on a CPU")
        device = "cuda"
        out_dir = args.out or Path(__file__).resolve().parent / "results"
        timing = TIMING["quick" if args.quick else "full"]
        timer = (f"triton do_bench, warm-up {timing['warmup_ms']} ms, rep {timing['rep_ms']} ms; "
                 f"the lowest of {TIMING_ROUNDS} rounds' medians, as for L2 clean")  # fmt: skip
        ceilings = fp8_ceilings(device, **timing)

    env = environment_info(["lik", *PEER_DISTRIBUTIONS])
    stem = result_stem(suite, env["gpu"], args.dry_run)
    keys = list(IMPLEMENTATIONS)
    report = {
        "suite": suite,
        "env": env,
        "ceilings": ceilings,
        "timing": {"timer": timer},
        "tolerance": TOLERANCE,
        "implementations": keys,
        "shapes": [],
    }
    if device == "cuda":
        from lik.runtime.fp8 import fp8_path

        report["lik_fp8_path"] = fp8_path(torch.device(device))
        print(f"lik fp8 path on this card: {report['lik_fp8_path']}", flush=True)
    for shape in picked:
        print(f"[{shape.name}] {shape.dims}", flush=True)
        # The fp8 size decides the rotation (bf16 forms, twice as large, then rotate too).
        sets = 1 if args.dry_run else rotation_count(shape.input_bytes(1))
        input_sets = [make_inputs(shape, device, seed=2 * i) for i in range(sets)]
        docs = parity_docs(shape, device)
        refs = references(input_sets[0], docs)
        record = {**shape.as_dict(), "dims": shape.dims, "rotation_sets": sets, "results": {}}
        for key in keys:
            print(f"  {IMPLEMENTATIONS[key][0]} ...", flush=True)
            result = measure(key, shape, input_sets, refs, docs, ceilings, args)
            record["results"][key] = result
            print(
                f"    {format_ms(result['ms'])} ms, floor {format_ratio(result['pct_floor'], '%')}"
                f", parity {result['parity_rel_err']}"
                f"{'' if result['error'] is None else ', ' + result['error']}",
                flush=True,
            )
        if device == "cuda" and not args.no_sweep:
            print("  lik fp8 config sweep ...", flush=True)
            sweep, error = attempt(lambda s=shape, i=input_sets[0]: sweep_lik_fp8(s, i, args))
            record["sweep"] = (
                sweep if error is None else {"error": error, "rows": [], "toml_line": None}
            )
            if sweep and sweep["toml_line"]:
                print(f"  fastest: {sweep['toml_line']}", flush=True)
        report["shapes"].append(record)
        del input_sets, refs
        release_cached_memory()
        write_report(report, out_dir, stem)  # after every shape: a cut-off run keeps data

    print()
    print(timing_table(report))
    print(f"\nwrote {out_dir / stem}.json, .md, .png", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
