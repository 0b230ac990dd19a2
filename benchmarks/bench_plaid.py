"""PLAID rerank: lik's fused residual decompression + MaxSim (lik.runtime.plaid) against
late-interaction-kernels 0.4.5 (`plaid.maxsim_residual_varlen`, `plaid.maxsim_residual`),
in one run on one card.

    python3 benchmarks/bench_plaid.py --out DIR [--quick]
    python3 benchmarks/bench_plaid.py --out DIR --dry-run   # CPU interpreter, tiny sizes
    python3 benchmarks/bench_plaid.py --out DIR --sweep --write-table   # retune PLAID keys
    python3 benchmarks/bench_plaid.py --out DIR --sweep --write-table --card   # this card's own

One query (Lq 32, d 128) against 1000 and 4096 candidate docs of 64-300 tokens, nbits 2,
4 and 8 (--nbits picks some), fp16 centroids (65536 of them, as an index of a few
million passages has), int32 codes. Both layouts: the index's packed tokens with
cu_seqlens_d (varlen) and a padded [B, max Ld] batch with doc_lengths (dense). Each
result is checked against the float64 reference on the first docs before it is timed; a
peer that reads another bit order shows a large parity error (its timing still stands).
Floor: the bytes a rerank must read (codes + packed residuals + one centroid row per
token, + Q and the scores) at the measured copy bandwidth; "% floor" = floor / time.
Beside do_bench's median: the GPU time alone (each input set's call in one CUDA graph,
replayed) and a tight loop's rate, which show when a small rerank is paced by its host
work rather than by its kernel.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    attempt,
    back_to_back_ms,
    bench_ms,
    copy_bandwidth_tbps,
    cpu_wallclock_ms,
    environment_info,
    format_ms,
    format_ratio,
    gpu_name,
    graph_ms,
    markdown_table,
    relative_error,
    result_stem,
    rotating,
    write_results,
)

TIMING = {"full": {"warmup_ms": 100, "rep_ms": 500}, "quick": {"warmup_ms": 25, "rep_ms": 100}}
LQ, DIM, N_CENTROIDS = 32, 128, 65536
DOC_TOKENS = (64, 300)
CANDIDATES = (1000, 4096)
NBITS = (2, 4, 8)
PARITY_DOCS = 48
# Input sets cycled through per timed call so that codes and residuals come from HBM,
# not from L2 left warm by the previous call (the centroid table is shared, as in a real
# index, and may stay in L2: the floor still counts its reads at copy bandwidth).
ROTATION_BYTES = 256e6
TUNING_DIR = Path(__file__).resolve().parents[1] / "runtime" / "tuning"
MAX_SETS = 8


def make_index(n_docs: int, nbits: int, device, seed: int, n_centroids: int, dim: int):
    """Random compressed docs: packed (codes [T] int32, residuals [T, dim*nbits/8] uint8,
    cu_seqlens_d) and padded (codes [B, Ld], residuals [B, Ld, bytes], doc_lengths)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(DOC_TOKENS[0], DOC_TOKENS[1] + 1, (n_docs,), generator=g)
    total, width = int(lengths.sum()), dim * nbits // 8
    codes = torch.randint(0, n_centroids, (total,), generator=g, dtype=torch.int32)
    residuals = torch.randint(0, 256, (total, width), generator=g, dtype=torch.uint8)
    cu = torch.zeros(n_docs + 1, dtype=torch.int32)
    cu[1:] = lengths.cumsum(0)
    longest = int(lengths.max())
    index = (cu[:-1, None].long() + torch.arange(longest)).clamp(max=total - 1)
    padded = (codes[index], residuals[index], lengths)
    flat = (codes, residuals, cu)
    return [t.to(device) for t in flat], [t.to(device) for t in padded], longest


def codebook(nbits: int, device, n_centroids: int, dim: int):
    g = torch.Generator().manual_seed(100 + nbits)
    centroids = torch.nn.functional.normalize(torch.randn(n_centroids, dim, generator=g), dim=-1)
    # PLAID's bucket weights: quantiles of the residuals, small and sorted around 0.
    weights = torch.sort(torch.randn(2**nbits, generator=g) * 0.03).values
    return centroids.half().to(device), weights.to(device)


def floor_bytes(tokens: int, n_docs: int, nbits: int, dim: int) -> int:
    per_token = 4 + dim * nbits // 8 + 2 * dim  # int32 code, packed residual, fp16 centroid
    return tokens * per_token + LQ * dim * 4 + n_docs * 4


def implementations(nbits: int, dry_run: bool) -> dict:
    """name -> (layout, callable(Q, flat, padded, longest, centroids, weights)) or error."""
    from lik.runtime import plaid

    calls = {
        "lik varlen": ("varlen", lambda Q, f, p, m, c, w: plaid.maxsim_residual_varlen(
            Q, *f, c, w, nbits, max_seqlen_d=m)),
        "lik dense": ("dense", lambda Q, f, p, m, c, w: plaid.maxsim_residual(Q, *p, c, w, nbits)),
    }  # fmt: skip
    if dry_run:
        return calls
    try:
        from late_interaction_kernels import plaid as lik045
    except ImportError as error:
        calls["LIK 0.4.5 varlen"] = ("varlen", error)
        calls["LIK 0.4.5 dense"] = ("dense", error)
        return calls
    calls["LIK 0.4.5 varlen"] = ("varlen", lambda Q, f, p, m, c, w: lik045.maxsim_residual_varlen(
        Q, *f, c, w, nbits, max_seqlen_d=m))
    calls["LIK 0.4.5 dense"] = ("dense", lambda Q, f, p, m, c, w: lik045.maxsim_residual(
        Q, *p, c, w, nbits))  # fmt: skip
    return calls


def run_case(n_docs: int, nbits: int, args, timing, copy_tbps) -> dict:
    from lik.runtime.reference import maxsim_residual_reference

    device = "cpu" if args.dry_run else "cuda"
    n_centroids = 64 if args.dry_run else N_CENTROIDS
    centroids, weights = codebook(nbits, device, n_centroids, args.dim)
    flat, padded, longest = make_index(n_docs, nbits, device, 1, n_centroids, args.dim)
    tokens = int(flat[0].shape[0])
    set_bytes = tokens * (4 + args.dim * nbits // 8)
    count = 1 if args.dry_run else max(1, min(MAX_SETS, int(ROTATION_BYTES // set_bytes)))
    sets = [(flat, padded)] + [
        make_index(n_docs, nbits, device, 2 + i, n_centroids, args.dim)[:2]
        for i in range(count - 1)
    ]
    g = torch.Generator().manual_seed(7)
    Q = torch.nn.functional.normalize(torch.randn(LQ, args.dim, generator=g), dim=-1)
    Q = Q.to(device, torch.float16)
    head = min(PARITY_DOCS, n_docs)
    ref = maxsim_residual_reference(
        Q.double().cpu(), padded[0][:head].cpu(), padded[1][:head].cpu(), padded[2][:head].cpu(),
        centroids.double().cpu(), weights.double().cpu(), nbits,
    )  # fmt: skip
    floor_ms = None
    if copy_tbps:
        floor_ms = floor_bytes(tokens, n_docs, nbits, args.dim) / (copy_tbps * 1e12) * 1e3
    results = {"tokens": tokens, "floor_ms": floor_ms, "input_sets": len(sets), "impl": {}}
    for name, (layout, call) in implementations(nbits, args.dry_run).items():
        if isinstance(call, Exception):
            results["impl"][name] = {"error": str(call)}
            continue
        out, error = attempt(lambda call=call: call(Q, flat, padded, longest, centroids, weights))
        if error:
            results["impl"][name] = {"error": error}
            print(f"  {name:20s} error: {error}", flush=True)
            continue
        parity = relative_error(out[:head].cpu(), ref)
        timed = rotating(lambda f, p, call=call: call(Q, f, p, longest, centroids, weights), sets)
        gpu_ms = loop_ms = None
        if args.dry_run:
            ms, error = attempt(lambda timed=timed: cpu_wallclock_ms(timed, repeats=1))
        else:
            ms, error = attempt(lambda timed=timed: bench_ms(timed, **timing))
            # A small rerank's call can be paced by its host work: the GPU's time alone
            # (every input set's call in one CUDA graph) and a tight loop's rate say which.
            gpu_ms, _ = attempt(lambda timed=timed: graph_ms(timed, calls=len(sets), **timing))
            loop_ms, _ = attempt(lambda timed=timed: back_to_back_ms(timed))
        percent = 100 * floor_ms / ms if floor_ms and ms else None
        gpu_percent = 100 * floor_ms / gpu_ms if floor_ms and gpu_ms else None
        results["impl"][name] = {"layout": layout, "ms": ms, "parity_rel_err": parity,
                                 "percent_of_floor": percent, "gpu_ms": gpu_ms,
                                 "gpu_percent_of_floor": gpu_percent, "loop_ms": loop_ms,
                                 "error": error}  # fmt: skip
        print(f"  {name:20s} {format_ms(ms)} ms (GPU alone {format_ms(gpu_ms)}, back to back "
              f"{format_ms(loop_ms)}), parity {parity:.1e}, "
              f"{'—' if percent is None else f'{percent:.0f}'}% of floor", flush=True)  # fmt: skip
    return results


SWEEP = {"block_l": (16, 32, 64), "num_warps": (2, 4, 8), "num_stages": (1, 2)}


def sweep_case(n_docs: int, nbits: int, args) -> dict:
    """Times lik's generated kernels under each launch config of SWEEP (outputs checked
    against the default config's) and reports the fastest per layout as a tuning-table
    line (runtime/tuning/<family>.toml)."""
    from lik.runtime import configs, plaid, registry
    from lik.runtime.keys import gpu_family

    centroids, weights = codebook(nbits, "cuda", N_CENTROIDS, args.dim)
    flat, padded, _ = make_index(n_docs, nbits, "cuda", 1, N_CENTROIDS, args.dim)
    Q = torch.nn.functional.normalize(torch.randn(1, LQ, args.dim, device="cuda"), dim=-1).half()
    cu_q = torch.tensor([0, LQ], dtype=torch.int32, device="cuda")
    # The residuals as calls pass them (their int32 word view where torch can make it).
    dense_res, flat_res = plaid._residual_words(padded[1]), plaid._residual_words(flat[1])
    launches = {
        "dense": lambda m, out, c: m.launch(out, Q, padded[0], dense_res, centroids, weights,
                                            padded[2], config=c),
        "varlen": lambda m, out, c: m.launch(out, Q[0], flat[0], flat_res, centroids, weights,
                                             cu_q, flat[2], max_seqlen_q=LQ, config=c),
    }  # fmt: skip
    found = {}
    for layout, launch in launches.items():
        name = plaid._variant(layout, centroids, nbits)
        module = registry.load(name)
        default = configs.call_config(name, module, Q, LQ, n_docs)
        key = table_key(name, n_docs, args.dim, gpu_family(Q.device))
        found[layout] = _sweep_layout(module, launch, default, n_docs, args.dim, args.quick,
                                      shape=f"plaid-{n_docs}-nbits{nbits}")  # fmt: skip
        found[layout]["table_key"] = key.table_key()
        if found[layout]["best"]:
            print(f'  {layout:6s} default {format_ms(found[layout]["default_ms"])} ms; best '
                  f'{found[layout]["best"][0]:.3f} ms: {key.table_key()}', flush=True)
    return found


def table_key(name: str, n_docs: int, dim: int, family: str):
    """The tuning key a rerank of n_docs docs by one LQ-token query looks up (dispatch's
    call key: one query row, n_docs programs), for variant name on a GPU family."""
    from lik.runtime.keys import KernelKey, lq_bucket, padded_head_dim, size_class

    return KernelKey(name, family, padded_head_dim(dim), lq_bucket(LQ), size_class(n_docs), 1)


def table_entries(sweeps: dict, card: str) -> dict[str, dict]:
    """Tuning-table entries (runtime/tuning/<family>.toml) of each swept case's fastest
    config per layout: {table key: entry}, as `make tune` writes them."""
    results = [result for found in sweeps.values() for result in found.values()]
    return {r["table_key"]: {**r["entry"], "card": card} for r in results if r.get("entry")}


def _sweep_layout(module, launch, default, n_docs: int, dim: int, quick: bool, shape: str):
    """The default config and each SWEEP config through make tune's selection (tune.sweep:
    outputs checked against the default's, the clean-L2 tie-break)."""
    import itertools

    import tune

    from lik.runtime.keys import padded_head_dim
    from lik.runtime.tuning import LaunchConfig

    out = torch.empty(1, n_docs, device="cuda")

    def run(config):
        launch(module, out, config)
        return (out,)

    grid = [LaunchConfig(LQ, block_l, padded_head_dim(dim), warps, stages)
            for block_l, warps, stages in itertools.product(*SWEEP.values())]  # fmt: skip
    # Decoded residuals in another order of sums: looser than make tune's 1e-3.
    found = tune.sweep([run], [default, *grid], quick=quick, tolerance=2e-3)
    timings = sorted((ms[0], c.block_l, c.num_warps, c.num_stages)
                     for c, ms in found.times.items() if ms[0] is not None)  # fmt: skip
    best = found.winner
    return {
        "default_ms": found.times[default][0],
        "default": [default.block_l, default.num_warps, default.num_stages],
        "best": None if best is None
        else (found.times[best][0], best.block_l, best.num_warps, best.num_stages),
        "entry": None if best is None
        else tune.table_entry(best, [round(found.times[best][0], 4)], shape),
        "all": timings,
    }


def write_sweep_table(directory: Path, entries: dict[str, dict], card: bool = False) -> None:
    """Merges entries into this GPU family's table, or with card into this GPU's own
    (keys not swept here are kept), written into directory the way `make tune` writes it."""
    from tune import merge_into_table

    from lik.runtime.keys import gpu_card, gpu_family

    family = gpu_family(torch.device("cuda"))
    name = gpu_card(torch.device("cuda")) if card else ""
    path = merge_into_table(directory, family, name, entries)
    print(f"wrote {len(entries)} entries into {path}", flush=True)


def markdown(report: dict) -> str:
    lines = [
        f"# PLAID rerank on {report['gpu']}",
        "",
        f"One query, Lq {LQ}, d {report['dim']}, docs of {DOC_TOKENS[0]}-{DOC_TOKENS[1]} tokens, "
        f"{N_CENTROIDS} fp16 centroids, int32 codes. Copy ceiling "
        f"{format_ratio(report.get('copy_tbps'), ' TB/s')}. Floor = (codes + residual bytes + "
        "one fp16 centroid row per token + Q + scores) / copy rate.",
        "",
        "ms: `do_bench` median of the call (L2 emptied before each). GPU alone: the call "
        "once per input set, captured in one CUDA graph and replayed, per call. Back to back: "
        "a tight loop's wall time per call, one sync per 200 calls. Where ms and back to back "
        "exceed GPU alone, the call is paced by its host work (checks, dispatch, launch), "
        "which moves with the host's load.",
        "",
    ]
    rows = []
    for case, result in report["cases"].items():
        impl = result["impl"]
        for name, r in impl.items():
            own = "lik " + r.get("layout", "")
            lik_ms = impl.get(own, {}).get("ms")
            ratio = r["ms"] / lik_ms if r.get("ms") and lik_ms else None
            percent = r.get("percent_of_floor")
            parity = r.get("parity_rel_err")
            gpu_percent = r.get("gpu_percent_of_floor")
            rows.append([case, name, format_ms(r.get("ms")), format_ms(result["floor_ms"]),
                         "—" if percent is None else f"{percent:.0f}%",
                         format_ms(r.get("gpu_ms")),
                         "—" if gpu_percent is None else f"{gpu_percent:.0f}%",
                         format_ms(r.get("loop_ms")),
                         "—" if parity is None else f"{parity:.1e}", format_ratio(ratio),
                         r.get("error") or ""])  # fmt: skip
    headers = ["case", "implementation", "ms", "floor ms", "% floor", "GPU alone ms",
               "% floor, GPU alone", "back to back ms", "rel err", "ms / lik (same layout)",
               "error"]  # fmt: skip
    return "\n".join(lines + [markdown_table(headers, rows), ""])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--nbits", type=lambda text: tuple(int(n) for n in text.split(",")),
                        default=NBITS, metavar="N[,N...]",
                        help=f"residual widths to run (default {','.join(map(str, NBITS))})")
    parser.add_argument("--sweep", action="store_true",
                        help="also time lik's kernels under each launch config of SWEEP")
    parser.add_argument("--write-table", type=Path, nargs="?", const=TUNING_DIR, default=None,
                        metavar="DIR",
                        help="with --sweep: merge the fastest configs into this GPU "
                             "family's tuning table, <family>.toml in DIR (default: the "
                             "committed runtime/tuning)")
    parser.add_argument("--card", action="store_true",
                        help="with --write-table: into this GPU's own table instead, "
                             "<family>/<card>.toml in DIR")
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU under the Triton interpreter, tiny sizes, no peers")  # fmt: skip
    args = parser.parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        args.dim, candidates = 16, (3,)
    else:
        if not torch.cuda.is_available():
            print("bench_plaid needs a CUDA GPU (or --dry-run)", file=sys.stderr)
            return 2
        args.dim, candidates = DIM, CANDIDATES
    timing = TIMING["quick" if args.quick else "full"]
    copy_tbps = None if args.dry_run else copy_bandwidth_tbps("cuda", **timing)
    report = {"env": environment_info(["late-interaction-kernels"]), "gpu": gpu_name(),
              "dim": args.dim, "copy_tbps": copy_tbps, "cases": {}}  # fmt: skip
    series: dict[str, list] = {"vs LIK 0.4.5 varlen": [], "vs LIK 0.4.5 dense": []}
    for n_docs in candidates:
        for nbits in args.nbits:
            case = f"{n_docs} docs, nbits {nbits}"
            print(f"[{case}]", flush=True)
            result = run_case(n_docs, nbits, args, timing, copy_tbps)
            report["cases"][case] = result
            for layout in ("varlen", "dense"):
                peer = result["impl"].get(f"LIK 0.4.5 {layout}", {}).get("ms")
                own = result["impl"].get(f"lik {layout}", {}).get("ms")
                series[f"vs LIK 0.4.5 {layout}"].append(peer / own if peer and own else None)
            if args.sweep and not args.dry_run:
                report.setdefault("sweep", {})[case] = sweep_case(n_docs, nbits, args)
    if args.write_table and report.get("sweep"):
        entries = table_entries(report["sweep"], report["gpu"])
        write_sweep_table(args.write_table, entries, card=args.card)
    stem = result_stem("plaid", report["gpu"], args.dry_run)
    text = markdown(report)
    title = f"PLAID rerank on {report['gpu']}: LIK 0.4.5 ms / lik ms"
    write_results(args.out, stem, report, text, (list(report["cases"]), series, title))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
