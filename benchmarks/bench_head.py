"""Fused projection head: lik's maxsim_from_hidden against late-interaction-kernels'
and against the unfused path (torch linear, then lik maxsim), in one run on one card.

Each implementation's scores are checked against the float64 reference (first and last
docs) before it is timed. The floor is the larger of reading the hidden states (and W,
Q, scores) once at the measured copy rate, and the projection + MaxSim FLOPs at the
measured bf16 matmul rate. Training rows also report the step's GPU time (a CUDA graph
replay: the public call's host work paces the step at this size) and each gradient's
error against float64. --sweep also times a grid of lik launch configs per shape
(the default config is a heuristic; this is how its table entry gets chosen).

    python3 benchmarks/bench_head.py --out DIR [--shapes a,b] [--quick] [--sweep]
    python3 benchmarks/bench_head.py --dry-run     # CPU, tiny shapes, plumbing only
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from common import (
    attempt,
    bench_ms,
    cpu_wallclock_ms,
    environment_info,
    first_call_seconds,
    format_ms,
    format_ratio,
    graph_replay,
    markdown_table,
    measure_ceilings,
    peak_extra_memory_mib,
    percent_of_roofline,
    pick,
    provenance,
    relative_error,
    release_cached_memory,
    result_stem,
    speedup_series,
    write_results,
)


@dataclasses.dataclass(frozen=True)
class HeadShape:
    """Nq queries of Lq projected tokens (dim d) against Nd docs of Ld hidden states
    (dim d_model), projected by W [d, d_model] + b. train: time forward + backward."""

    name: str
    nq: int
    nd: int
    lq: int
    ld: int
    d_model: int
    d: int
    train: bool = False

    @property
    def dims(self) -> str:
        return f"{self.nq}, {self.nd}, {self.lq}, {self.ld}, {self.d_model}->{self.d}"

    @property
    def flops(self) -> int:
        projection = 2 * self.nd * self.ld * self.d_model * self.d
        return projection + 2 * self.nq * self.nd * self.lq * self.ld * self.d

    def bytes_moved(self, element: int = 2) -> int:
        """H, W, b and Q read once, fp32 scores written once."""
        hidden = self.nd * self.ld * self.d_model
        weights = self.d * (self.d_model + 1)
        return (hidden + weights + self.nq * self.lq * self.d) * element + self.nq * self.nd * 4


# The shape (Nd 1024, Ld 2048, 768 -> 128), for one query and for 32 queries
# sharing each projected doc tile; a ColBERT-length rerank; one in-batch training step.
SHAPES = [
    HeadShape("hidden-rerank-1", 1, 1024, 32, 2048, 768, 128),
    HeadShape("hidden-batch-32", 32, 1024, 32, 2048, 768, 128),
    HeadShape("colbert-rerank", 1, 1000, 32, 300, 768, 128),
    HeadShape("train-inbatch-32", 32, 32, 32, 300, 768, 128, train=True),
]
PEER_DISTRIBUTIONS = {"late-interaction-kernels": "0.4.5"}
PARITY_TOLERANCE = 1e-2
PARITY_DOCS_EACH_END = 4
TIMING = {"full": {"warmup_ms": 100, "rep_ms": 500}, "quick": {"warmup_ms": 25, "rep_ms": 100}}


# ---------------------------------------------------------------------------------------
# Inputs and implementations: each takes (Q, H, W, b) and returns fp32 [Nq, Nd].


def make_inputs(shape: HeadShape, device, *, seed: int = 0, requires_grad: bool = False):
    """Unit-norm bf16 queries; hidden states like a transformer's last layer (unit
    variance); W and b as nn.Linear initializes them. Generated in blocks (a 3 GB H)."""
    g = torch.Generator(device=device).manual_seed(seed)
    Q = F.normalize(torch.randn(shape.nq, shape.lq, shape.d, device=device, generator=g), dim=-1)
    H = torch.empty(shape.nd, shape.ld, shape.d_model, device=device, dtype=torch.bfloat16)
    block = max(1, (1 << 26) // (shape.ld * shape.d_model))
    for start in range(0, shape.nd, block):
        stop = min(shape.nd, start + block)
        H[start:stop] = torch.randn(
            stop - start, shape.ld, shape.d_model, device=device, generator=g
        )
    bound = shape.d_model**-0.5
    W = (torch.rand(shape.d, shape.d_model, device=device, generator=g) * 2 - 1) * bound
    b = (torch.rand(shape.d, device=device, generator=g) * 2 - 1) * bound
    tensors = [Q.bfloat16(), H, W.bfloat16(), b.bfloat16()]
    return [t.requires_grad_(requires_grad) for t in tensors]


def build_lik() -> Callable:
    from lik.runtime.head import maxsim_from_hidden

    return lambda Q, H, W, b: maxsim_from_hidden(Q, H, W, b)


def build_late_interaction_kernels() -> Callable:
    from late_interaction_kernels.fused_head import maxsim_from_hidden

    return lambda Q, H, W, b: maxsim_from_hidden(Q, H, W, b)


def build_unfused() -> Callable:
    from lik.runtime import maxsim

    # The queries are unit-norm, so normalizing both sides inside maxsim is the same as
    # normalizing the projected docs only; the projection is materialized in bf16.
    return lambda Q, H, W, b: maxsim(Q, F.linear(H, W, b), normalize=True)


IMPLEMENTATIONS = {
    "lik": ("lik fused", build_lik),
    "late_interaction_kernels": ("LIK 0.4.5", build_late_interaction_kernels),
    "unfused": ("linear + lik maxsim", build_unfused),
}
BASELINES = ("late_interaction_kernels", "unfused")
DRY_RUN_IMPLEMENTATIONS = ("lik", "unfused")


def reference_scores(Q, H, W, b, docs: torch.Tensor) -> torch.Tensor:
    from lik.runtime.reference import maxsim_from_hidden_reference

    H = H.detach().index_select(0, docs)
    f64 = [t.detach().double() for t in (Q, H, W, b)]
    return maxsim_from_hidden_reference(*f64)


def parity_docs(shape: HeadShape, device) -> torch.Tensor:
    if shape.nd <= 2 * PARITY_DOCS_EACH_END:
        return torch.arange(shape.nd, device=device)
    head = torch.arange(PARITY_DOCS_EACH_END, device=device)
    return torch.cat([head, head + shape.nd - PARITY_DOCS_EACH_END])


def training_step(scores: Callable, Q, H, W, b):
    """Forward + backward to every input; returns the gradients (peak memory counts them)."""
    weights = torch.linspace(-1, 1, Q.shape[0] * H.shape[0], device=Q.device, dtype=torch.float64)
    out = scores(Q, H, W, b)
    return torch.autograd.grad((out * weights.view_as(out).to(out.dtype)).sum(), (Q, H, W, b))


def reference_gradients(Q, H, W, b) -> list[torch.Tensor]:
    """The training step's gradients in float64, every doc."""
    from lik.runtime.reference import maxsim_from_hidden_reference

    f64 = [t.detach().double().requires_grad_() for t in (Q, H, W, b)]
    return list(training_step(maxsim_from_hidden_reference, *f64))


# ---------------------------------------------------------------------------------------
# Measuring


def measure(key: str, shape: HeadShape, inputs, reference, docs, floor_ms, args,
            reference_grads=None) -> dict:  # fmt: skip
    result = {"ms": None, "peak_mib": None, "parity_rel_err": None, "first_call_s": None}
    if args.dry_run and key not in DRY_RUN_IMPLEMENTATIONS:
        return {**result, "error": "skipped in dry run"}
    scores, error = attempt(IMPLEMENTATIONS[key][1])
    if error:
        return {**result, "error": error}

    def check():
        with torch.no_grad():
            out, seconds = first_call_seconds(lambda: scores(*inputs))
        return relative_error(out.index_select(1, docs), reference), seconds

    parity, error = attempt(check)
    if error:
        return {**result, "error": error}
    result["parity_rel_err"], result["first_call_s"] = parity
    result["parity_ok"] = parity[0] <= PARITY_TOLERANCE
    if reference_grads is not None:
        grads, error = attempt(lambda: training_step(scores, *inputs))
        result["grad_rel_err"] = error or {
            name: relative_error(got, want)
            for name, got, want in zip("QHWb", grads, reference_grads, strict=True)
        }

    def call():
        if shape.train:
            return training_step(scores, *inputs)
        with torch.no_grad():
            return scores(*inputs)

    def time_it():
        if args.dry_run:
            return cpu_wallclock_ms(call), None
        ms = bench_ms(call, **TIMING["quick" if args.quick else "full"])
        return ms, peak_extra_memory_mib(call)

    timed, error = attempt(time_it)
    if error:
        return {**result, "error": error}
    result["ms"], result["peak_mib"] = timed
    if shape.train and not args.dry_run:  # the step's host work outlasts its kernels
        timing = TIMING["quick" if args.quick else "full"]
        result["gpu_ms"], result["gpu_error"] = attempt(
            lambda: bench_ms(graph_replay(call, warmup_calls=2), **timing)
        )
    result["pct_floor"] = percent_of_roofline(floor_ms, result["ms"])
    result["error"] = None
    return result


# The default sweep: matmul-shaped tiles (doc tokens per program, d_model step), warps,
# pipeline depth; query_group is the default and half of it. --sweep-grid overrides any.
SWEEP_GRID = {
    "block_l": (64, 128),
    "block_m": (32, 64, 128),
    "num_warps": (4, 8),
    "num_stages": (3, 4),
}
# Config fields --sweep-grid may also set (default: the default config's).
SWEEP_SWITCHES = ("query_group", "tma", "flat_tokens")


def parse_sweep_grid(text: str | None) -> dict:
    """'block_m=32/64,num_stages=3/4/5' -> SWEEP_GRID with those axes replaced."""
    grid = dict(SWEEP_GRID)
    for item in filter(None, (text or "").split(",")):
        key, _, values = item.partition("=")
        if key not in (*SWEEP_GRID, *SWEEP_SWITCHES) or not values:
            sys.exit(f"--sweep-grid: expected KEY=V1/V2 with KEY in {sorted(SWEEP_GRID)} "
                     f"or {', '.join(SWEEP_SWITCHES)}, got {item!r}")  # fmt: skip
        grid[key] = tuple(int(v) for v in values.split("/"))
    return grid


def sweep_configs(shape: HeadShape, inputs, args) -> list[dict]:
    """Times lik's forward (normalize, bias, no mask) over a grid of launch configs
    through make tune's selection (tune.sweep: outputs checked against the first
    config's); rows fastest first."""
    import tune

    from lik.runtime import head, registry
    from lik.runtime.keys import variant_name

    Q, H, W, b = (t.detach() for t in inputs)
    module = registry.load(variant_name("dense", False, False, True, Q.dtype, op="head"))
    default = head.head_config(module, Q, H.shape[1], H.numel() * H.element_size())
    grid = parse_sweep_grid(args.sweep_grid)
    if "query_group" not in grid:
        grid["query_group"] = tuple(sorted({default.query_group, max(1, default.query_group // 2)}))
    configs = [dataclasses.replace(default, **dict(zip(grid, values, strict=True)))
               for values in itertools.product(*grid.values())]  # fmt: skip
    out = torch.empty(Q.shape[0], H.shape[0], dtype=torch.float32, device=Q.device)

    def run(config):
        # The module's launcher directly: a config that does not fit fails here instead of
        # being shrunk into another one.
        module.launch(out, Q, H, W, b=b, config=config)
        return (out,)

    # The projection is rounded to bf16 before its dot with Q, and another d_model step
    # sums it in another order: a looser agreement than make tune's.
    found = tune.sweep([run], configs, quick=args.quick, tolerance=1e-2)
    rows = [{**dataclasses.asdict(c), "ms": ms[0], "error": found.failures.get(c)}
            for c, ms in found.times.items()]  # fmt: skip
    return sorted(rows, key=lambda r: r["ms"] if r["ms"] is not None else float("inf"))


def measure_shape(shape: HeadShape, keys, ceilings, device, args) -> dict:
    inputs = make_inputs(shape, device, requires_grad=shape.train)
    docs = parity_docs(shape, device)
    reference = reference_scores(*inputs, docs)
    reference_grads = reference_gradients(*inputs) if shape.train else None
    memory_ms = compute_ms = None
    if ceilings:
        memory_ms = shape.bytes_moved() / (ceilings["copy_tbps"] * 1e12) * 1e3
        compute_ms = shape.flops / (ceilings["matmul_tflops"] * 1e12) * 1e3
    floor_ms = max(memory_ms, compute_ms) if ceilings and not shape.train else None
    record = {
        **dataclasses.asdict(shape),
        "dims": shape.dims,
        "hidden_mb": shape.nd * shape.ld * shape.d_model * 2 / 1e6,
        "flops": shape.flops,
        "bytes": shape.bytes_moved(),
        "memory_floor_ms": memory_ms,
        "compute_floor_ms": compute_ms,
        "floor_ms": floor_ms,
        "results": {},
    }
    for key in keys:
        print(f"  {IMPLEMENTATIONS[key][0]} ...", flush=True)
        result = measure(key, shape, inputs, reference, docs, floor_ms, args, reference_grads)
        record["results"][key] = result
        if result["ms"] is None:
            print(f"    no timing: {result['error']}", flush=True)
        else:
            print(
                f"    {format_ms(result['ms'])} ms, parity {result['parity_rel_err']:.1e}, "
                f"peak {format_ms(result['peak_mib'])} MiB",
                flush=True,
            )
    if args.sweep and not args.dry_run and not shape.train:
        print("  sweeping lik launch configs ...", flush=True)
        record["sweep"] = sweep_configs(shape, inputs, args)
    del inputs, reference, reference_grads
    release_cached_memory()
    return record


# ---------------------------------------------------------------------------------------
# Reporting


def speedup(record: dict, baseline: str) -> float | None:
    lik_ms = record["results"].get("lik", {}).get("ms")
    other_ms = record["results"].get(baseline, {}).get("ms")
    return other_ms / lik_ms if lik_ms and other_ms else None


def markdown_report(report: dict) -> str:
    env, ceilings, keys = report["env"], report["ceilings"], report["implementations"]
    lines = [
        f"# Fused projection head on {env['gpu']}",
        "",
        provenance(env),
        "",
    ]
    if ceilings:
        lines += [
            f"Measured ceilings: copy {ceilings['copy_tbps']:.2f} TB/s (read + write), "
            f"bf16 matmul {ceilings['matmul_tflops']:.0f} TFLOP/s. Floor = max(H, W, Q read "
            "and scores written once at the copy rate, projection + MaxSim FLOPs at the "
            "matmul rate); training rows time forward + backward and have no floor.",
            "",
        ]
    headers = ["shape (Nq, Nd, Lq, Ld, d_model->d)", "floor (mem / flops)"]
    headers += [f"{IMPLEMENTATIONS[k][0]} ms / MiB" for k in keys]
    headers += ["lik % floor", *(f"lik vs {IMPLEMENTATIONS[k][0]}" for k in BASELINES)]
    rows = []
    for r in report["shapes"]:
        res = r["results"]
        floors = f"{format_ms(r['memory_floor_ms'])} / {format_ms(r['compute_floor_ms'])}"
        cells = []
        for k in keys:
            one = res.get(k, {})
            bad = "" if one.get("parity_ok", True) else " PARITY FAIL"
            cells.append(f"{format_ms(one.get('ms'))} / {format_ms(one.get('peak_mib'))}{bad}")
        pct = res.get("lik", {}).get("pct_floor")
        rows.append(
            [
                f"{r['name']} {r['dims']}",
                floors,
                *cells,
                format_ratio(pct, "%"),
                *(format_ratio(speedup(r, k)) for k in BASELINES),
            ]
        )
    lines += [markdown_table(headers, rows), ""]

    def parity_cell(result: dict) -> str:
        error = result.get("parity_rel_err")
        if error is None:
            return "—"
        return f"{error:.1e}" + ("" if result.get("parity_ok") else " FAIL")

    parity = [
        [r["name"], *(parity_cell(r["results"].get(k, {})) for k in keys)] for r in report["shapes"]
    ]
    lines += [
        "## Parity (relative error vs float64, first and last docs)",
        "",
        markdown_table(["shape", *(IMPLEMENTATIONS[k][0] for k in keys)], parity),
        "",
    ]
    training = [r for r in report["shapes"] if r["train"]]
    if training:
        lines += [
            "## Training steps: GPU time and gradients",
            "",
            "GPU time: the step (forward + backward to Q, H, W and b) captured in a CUDA "
            "graph and replayed, median ms (the rows above include the host's work). "
            "Gradient error: relative to float64, for Q and the largest of H, W and b. "
            "linear + lik maxsim normalizes Q as well: for unit queries its scores are the "
            "same, its gradient to Q is another function's.",
            "",
            markdown_table(
                ["shape", *(f"{IMPLEMENTATIONS[k][0]} GPU ms / grad err Q, HWb" for k in keys)],
                [[r["name"], *(training_cell(r["results"].get(k, {})) for k in keys)]
                 for r in training],
            ),  # fmt: skip
            "",
        ]
    for r in report["shapes"]:
        if r.get("sweep"):
            best = r["sweep"][:5]
            cols = ["block_l", "block_m", "num_warps", "num_stages", *SWEEP_SWITCHES, "ms"]
            lines += [
                f"## Fastest lik configs, {r['name']}",
                "",
                markdown_table(
                    cols,
                    [[str(c[k]) if k != "ms" else format_ms(c[k]) for k in cols] for c in best],
                ),
                "",
            ]
    errors = {
        (k, res["error"])
        for r in report["shapes"]
        for k, res in r["results"].items()
        if res.get("error")
    }
    if errors:
        lines += ["## Errors", "", *(f"- {IMPLEMENTATIONS[k][0]}: {e}" for k, e in errors), ""]
    return "\n".join(lines)


def training_cell(result: dict) -> str:
    errors = result.get("grad_rel_err")
    if not isinstance(errors, dict):
        return f"{format_ms(result.get('gpu_ms'))} / —"
    largest = max(errors[name] for name in "HWb")
    return f"{format_ms(result.get('gpu_ms'))} / {errors['Q']:.1e}, {largest:.1e}"


def write_report(report: dict, out_dir: Path, stem: str) -> None:
    names = [r["name"] for r in report["shapes"]]
    series = speedup_series(report, BASELINES, lambda k: IMPLEMENTATIONS[k][0], speedup)
    title = f"lik fused head speedup, {report['env']['gpu']}"
    write_results(out_dir, stem, report, markdown_report(report), (names, series, title))


def tiny(shape: HeadShape) -> HeadShape:
    return dataclasses.replace(
        shape,
        nq=min(shape.nq, 2),
        nd=min(shape.nd, 12),
        lq=min(shape.lq, 8),
        ld=min(shape.ld, 16),
        d_model=48,
        d=16,
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="output folder (default: benchmarks/results)")
    parser.add_argument("--shapes", help="comma-separated shape names (default: all)")
    parser.add_argument("--quick", action="store_true", help="shorter warm-up and timing")
    parser.add_argument("--sweep", action="store_true", help="also time a grid of lik configs")
    parser.add_argument(
        "--sweep-grid", help="sweep axes to replace, e.g. block_m=32/64,num_stages=3/4/5"
    )
    parser.add_argument("--dry-run", action="store_true", help="CPU only, tiny shapes")
    args = parser.parse_args(argv)
    by_name = {s.name: s for s in SHAPES}
    names = pick(args.shapes, list(by_name), "shapes")
    shapes = [by_name[n] for n in names]
    keys = list(IMPLEMENTATIONS)
    if args.dry_run:
        device, ceilings, shapes = "cpu", None, [tiny(s) for s in shapes]
        out_dir = args.out or Path(tempfile.mkdtemp(prefix="lik-head-"))
    else:
        if not torch.cuda.is_available():
            sys.exit("no CUDA device; --dry-run exercises this script on a CPU")
        device = "cuda"
        out_dir = args.out or Path(__file__).resolve().parent / "results"
        ceilings = measure_ceilings(device, **TIMING["quick" if args.quick else "full"])
    env = environment_info(["lik", *PEER_DISTRIBUTIONS])
    stem = result_stem("head", env["gpu"], args.dry_run)
    report = {
        "suite": "head",
        "env": env,
        "ceilings": ceilings,
        "implementations": keys,
        "timing": "CPU wall clock (dry run)" if args.dry_run else "triton do_bench median",
        "shapes": [],
    }
    for shape in shapes:
        print(
            f"[{shape.name}] {shape.dims}{' (forward + backward)' if shape.train else ''}",
            flush=True,
        )
        report["shapes"].append(measure_shape(shape, keys, ceilings, device, args))
        write_report(report, out_dir, stem)  # after every shape: a cut-off run keeps data
    print()
    print(markdown_report(report))
    print(f"wrote {out_dir / stem}.json, .md, .png", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
