"""`make tune`: sweep launch configs on this GPU and write the committed tuning table.

For each benchmark shape (benchmarks' PERF shapes, bf16, the variant a plain
`maxsim(Q, D)` call uses; and the training steps' forward and backward kernels, keyed
apart), every candidate config is checked against the first one's output and timed
with triton.testing.do_bench (median; backward kernels as CUDA-graph replays, so their
host work does not hide the differences). Shapes that share a KernelKey
(rerank sizes that differ only in Ld, which no key holds) are tuned together: the
config whose times are the smallest multiple of each shape's own best (geometric mean)
wins. Forward candidates within NEAR_TIE of the winner are timed again with L2 left
clean (clean_l2_ms), and one CLEAN_WIN faster there takes the key. A shape whose docs
load once (heuristics.streamed: a small rerank's unpipelined, evict-first loads) tunes
their tile and warps under its "once" key instead. Winners go
to runtime/tuning/<family>.toml under their keys, or with --card to this GPU's own
table, runtime/tuning/<family>/<card>.toml, which calls on that card read first (for
keys whose best config differs between cards of a family: an H200 reads memory 1.4x as
fast as an H100, and its small reranks want other doc tiles). The runtime then reads
them, and keys they cover never sweep at call time (others do, once per machine:
lik.runtime.autotune).

    python3 -P benchmarks/tune.py [--out runtime/tuning] [--shapes name,...] [--quick] [--card]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import math
import statistics
import sys
from pathlib import Path

import shapes
import torch

from lik.runtime import autotune, backends, heuristics, registry
from lik.runtime.explain import key_for, once_key
from lik.runtime.keys import (
    KernelKey,
    gpu_card,
    gpu_family,
    lq_bucket,
    padded_head_dim,
    query_bucket,
    size_class,
    variant_name,
)
from lik.runtime.tuning import (
    STACKED_ROWS,
    THIN_ROWS,
    LaunchConfig,
    config_for,
    default_query_group,
    load_table,
    table_file,
)

# The forward and training suites' shapes, and the forward keys only tuning sweeps.
SHAPES = [tuple(s) for s in (*shapes.FORWARD, *shapes.TUNED_ONLY)]  # (name, Nq, Nd, Lq, Ld, d)
# A training shape's entries are named step-<name> in the tables.
TRAIN_SHAPES = [(f"step-{name}", *rest) for name, *rest in shapes.TRAIN]
TRAIN_STRATEGY = "lowmem"
BLOCK_L = (32, 64, 128)
NUM_WARPS = (4, 8)
NUM_STAGES = (2, 3, 4)
# Query tiles of at most THIN_ROWS rows (tuning.THIN_ROWS) take fewer warps too.
THIN_WARPS = (1, 2)
# Docs loaded once sit in registers, one tile per warp in flight: wide tiles on few warps
# or narrow ones on more (H100, lateon-edge: 128 tokens on 2 warps 44.2 us, 64 on 1-2 warps
# 44.9, 32 on one 47.7; commit ee7ed93).
ONCE_BLOCK_L = (32, 64, 128)
ONCE_WARPS = (1, 2, 4, 8)
# The dense grad_D multiplies a one-hot [BLOCK_L, rows] tile per step, so its work
# grows with BLOCK_L: smaller tiles are worth trying there.
BACKWARD_BLOCK_L = (16, 32, 64, 128)
# The dense grad_D's loop gathers its rows, which pipeline poorly: one stage can win
# (in-batch 256 on an H200: 1, 2, 3 stages 0.20, 0.22, 0.21 ms).
BACKWARD_STAGES = (1, 2, 3)
# do_bench empties L2 before each call by writing a 256 MB buffer, whose dirty lines the
# timed call then writes back while it reads its docs; the configs of a memory-bound
# rerank can tie under that and differ after a kernel that only read (H100, lateon-edge's
# docs-once tiles: 44.3 and 44.6 us under do_bench, 42.7 and 41.6 with L2 left clean;
# commit 2801089). Candidates within NEAR_TIE of do_bench's
# winner are timed again with L2 clean, and one that runs in at most CLEAN_WIN of the
# winner's time there takes the key: one timing each, and a single sweep's clean times
# spread wider than an alternated A/B's (7% there against 2.5%).
NEAR_TIE = 1.01
CLEAN_WIN = 0.97
L2_FLUSH_BYTES = 256 * 2**20


def tuned_key(shape, family: str, card: str = "") -> KernelKey:
    """The key a plain forward of this shape tunes: its "once" key, else its forward key."""
    return once_key(shape, family, card) or key_for(shape, family, card=card)


def train_keys(shape, family: str, card: str = "") -> tuple[KernelKey, KernelKey]:
    """The forward and backward KernelKeys of a bf16 training step of this shape."""
    _, nq, nd, lq, _, d, layout = shape
    name = variant_name(layout, False, False, False, torch.bfloat16, backward=TRAIN_STRATEGY)
    queries = query_bucket(nq) if layout == "dense" else 1
    bucket = (name, family, padded_head_dim(d), lq_bucket(lq), size_class(nq * nd), queries)
    return KernelKey(*bucket, card=card), KernelKey(*bucket, kernel="bwd", card=card)


def candidates(key: KernelKey):
    if key.kernel == "bwd":  # grad_D's doc-token blocks; no queries stack there
        for block_l, warps, stages in itertools.product(
            BACKWARD_BLOCK_L, NUM_WARPS, BACKWARD_STAGES
        ):
            yield LaunchConfig(key.lq, block_l, key.head_dim, warps, stages)
        return
    if key.kernel == "once":  # unpipelined tiles; every query in the one tile
        for block_l, warps in itertools.product(ONCE_BLOCK_L, ONCE_WARPS):
            yield LaunchConfig(key.lq, block_l, key.head_dim, warps, 1,
                               query_group=default_query_group(key))  # fmt: skip
        return
    # One query alone is always a candidate; stacking stops at twice a full tile.
    groups = [1] + [g for g in (2, 4, 8) if g <= key.queries and g * key.lq <= 2 * STACKED_ROWS]
    # The dense training forward keeps its argmax per row or per tile column.
    column = (False, True) if registry.load(key.variant).COLUMN_ARGMAX_OPTION else (False,)
    for group in groups:
        warps = NUM_WARPS if group * key.lq > THIN_ROWS else THIN_WARPS + NUM_WARPS
        for block_l, num_warps, stages, by_column in itertools.product(
            BLOCK_L, warps, NUM_STAGES, column
        ):
            yield LaunchConfig(key.lq, block_l, key.head_dim, num_warps, stages,
                               query_group=group, column_argmax=by_column)  # fmt: skip


def _generator():
    return torch.Generator("cuda").manual_seed(0)


def forward_run(module, shape, key: KernelKey):
    """run(config) -> (scores,) of a plain forward of this shape (its first 512 query
    tokens where longer, as keyed), launched as a call would launch it were `config` the
    key's committed entry (heuristics.stream_config: doc blocks, token ranges and, for a
    "once" key, the tile and warps of its docs-once loads)."""
    _, nq, nd, lq, ld, d = shape
    g = _generator()
    Q = torch.randn(nq, min(lq, 512), d, device="cuda", generator=g).to(torch.bfloat16)
    D = torch.randn(nd, ld, d, device="cuda", generator=g).to(torch.bfloat16)
    out = torch.empty(nq, nd, device="cuda")
    dense_bytes = D.numel() * D.element_size()
    committed = {kernel: config_for(dataclasses.replace(key, kernel=kernel), module.smem_bytes)
                 for kernel in ("fwd", "once")}  # fmt: skip

    def run(config):
        if getattr(module, "DOC_STREAM", False):  # shaped as a call with `config` committed
            swept = {**committed, key.kernel: config}
            config = heuristics.stream_config(module, swept["fwd"], lambda: swept["once"], nq, nd,
                                            ld, dense_bytes, D.device)  # fmt: skip
        module.launch(out, Q, D, config=config)
        return (out,)

    return run


def train_runs(module, shape):
    """(forward run, backward run) of a training step of this shape: the forward saves
    the argmax the backward reads; each returns its outputs."""
    _, nq, nd, lq, ld, d, layout = shape
    g = _generator()
    Q = torch.randn(nq, lq, d, device="cuda", generator=g).to(torch.bfloat16)
    docs = (nq, nd) if layout == "kd" else (nd,)
    D = torch.randn(*docs, ld, d, device="cuda", generator=g).to(torch.bfloat16)
    out = torch.empty(nq, nd, device="cuda")
    saved = torch.empty(nq, nd, lq, dtype=torch.int16, device="cuda")
    grad_out = torch.randn(nq, nd, device="cuda", generator=g)
    # The backward reads fixed winners, whichever forward config ran last.
    spec = "qsd,qntd->qnst" if layout == "kd" else "qsd,ntd->qnst"
    argmax = torch.einsum(spec, Q.float(), D.float()).argmax(-1).to(torch.int16)

    def forward(config):
        module.launch(out, Q, D, argmax=saved, config=config)
        return out, saved

    def backward(config):
        return module.backward(grad_out, argmax, Q, D, config=config)

    return forward, backward


def time_config(run, config, reference, quick: bool, graph: bool = False,
                tolerance: float | None = None):  # fmt: skip
    """(median ms, outputs, None) of run(config), or (None, None, why) when it does not
    launch or its outputs disagree with `reference` (the first config's) beyond tolerance
    (default: autotune.agreement of each output's dtype, 1e-3 absolute). graph: time replays of a
    CUDA graph of the run (GPU time alone), for runs of several launches whose host work
    would otherwise hide the differences between configs."""
    from triton.testing import do_bench

    try:
        outputs = [t.clone() for t in run(config)]
        torch.cuda.synchronize()
    except Exception as error:  # noqa: BLE001 - a config that does not fit is skipped
        return None, None, f"does not launch: {type(error).__name__}"
    if reference is not None and not autotune.agree(outputs, reference, tolerance=tolerance):
        return None, None, "results differ from the first config's"
    if graph:
        ms = autotune.graph_ms(lambda: run(config), rep_ms=40 if quick else 100)
    else:
        ms = do_bench(lambda: run(config), warmup=10 if quick else 25, rep=40 if quick else 100,
                      return_mode="median")  # fmt: skip
    return ms, outputs, None


@functools.cache
def _flush_buffer(device: int) -> torch.Tensor:
    return torch.ones(L2_FLUSH_BYTES // 4, device=torch.device("cuda", device))


def clean_l2_ms(fn, *, reps: int = 300) -> float:
    """Median ms of fn on the GPU, each call timed with CUDA events after a read of a
    256 MB buffer: L2 evicted and left clean (see NEAR_TIE)."""
    flush = _flush_buffer(torch.cuda.current_device())
    for _ in range(3):  # compilation, first-touch allocations
        fn()
    events = []
    for _ in range(reps):
        flush.sum()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def slowdowns(times: dict) -> dict:
    """candidate -> geometric mean over shapes of its time over that shape's best, for
    the candidates that ran every shape. times: candidate -> [ms per shape, or None]."""
    complete = {c: t for c, t in times.items() if None not in t}
    if not complete:
        return {}
    bests = [min(column) for column in zip(*complete.values(), strict=True)]
    return {
        c: math.prod(ms / best for ms, best in zip(t, bests, strict=True)) ** (1 / len(bests))
        for c, t in complete.items()
    }


def best_joint(times: dict) -> tuple | None:
    """The candidate whose times are the smallest multiple of each shape's best
    (geometric mean over shapes); candidates missing a shape's time are out."""
    ratios = slowdowns(times)
    return min(ratios, key=ratios.get) if ratios else None


def clean_l2_tie_break(times: dict, clean_times) -> tuple | None:
    """best_joint(times), or the near-tie (NEAR_TIE) fastest with L2 left clean where it
    runs in at most CLEAN_WIN of the winner's clean time. clean_times(candidate) -> [ms per
    shape] with L2 clean; called only where there are near-ties."""
    ratios = slowdowns(times)
    if not ratios:
        return None
    best = min(ratios, key=ratios.get)
    ties = [c for c, r in ratios.items() if r <= ratios[best] * NEAR_TIE]
    if len(ties) < 2:
        return best
    clean = {c: clean_times(c) for c in ties}
    challenger = best_joint(clean)
    gain = math.prod(a / b for a, b in zip(clean[challenger], clean[best], strict=True))
    return challenger if gain ** (1 / len(clean[best])) <= CLEAN_WIN else best


@dataclasses.dataclass
class Sweep:
    """What a sweep of launch configs found. times: config -> [ms per run, None where it
    did not launch or disagreed with the first config]; failures: config -> why; winner:
    the config that takes the key (None if none ran every run)."""

    times: dict
    failures: dict
    winner: object | None


def sweep(runs, configs, *, quick: bool, graph: bool = False,
          tolerance: float | None = None) -> Sweep:  # fmt: skip
    """Times each launch config on each run (run(config) -> its outputs; one run per shape
    sharing a key), checking every output against the first config's that ran, and picks
    the winner: best_joint, and for single launches (not graph: CUDA-graph replays have no
    L2 flush to tie under) the clean-L2 tie-break. The one selection make tune, the fp8,
    fused-head and PLAID benchmarks' sweeps share."""
    configs = list(dict.fromkeys(configs))  # a default that is also in a grid runs once
    label = labeller(configs)
    references = [None] * len(runs)
    times, failures = {}, {}
    for config in configs:
        times[config] = []
        for i, run in enumerate(runs):
            ms, outputs, failure = time_config(run, config, references[i], quick, graph,
                                               tolerance)  # fmt: skip
            if references[i] is None:
                references[i] = outputs
            if failure:
                failures.setdefault(config, failure)
            times[config].append(ms)
        shown = ", ".join("-" if ms is None else f"{ms:.4f}" for ms in times[config])
        why = f" ({failures[config]})" if config in failures else ""
        print(f"  {label(config)}: {shown} ms{why}", flush=True)
    if graph:
        return Sweep(times, failures, best_joint(times))
    winner = clean_l2_tie_break(
        times, lambda c: [clean_l2_ms(functools.partial(run, c)) for run in runs]
    )
    if winner != best_joint(times):
        print(f"  near-tie faster with L2 left clean: {label(winner)}", flush=True)
    return Sweep(times, failures, winner)


def labeller(configs):
    """label(config): the fields in which the configs differ, as name=value."""
    rows = [dataclasses.asdict(c) for c in configs]
    varying = [f for f in (rows[0] if rows else {}) if len({r[f] for r in rows}) > 1]

    def label(config) -> str:
        fields = dataclasses.asdict(config)
        return " ".join(f"{f}={fields[f]}" for f in varying) or "the one config"

    return label


def table_entry(config, ms, shape: str) -> dict:
    """A tuning-table entry for config, tuned at ms (one per shape sharing its key) on
    the named shape(s)."""
    entry = {"block_l": config.block_l, "num_warps": config.num_warps,
             "num_stages": config.num_stages, "query_group": config.query_group,
             "block_n": 8, "ms": ms[0] if len(ms) == 1 else ms, "shape": shape}  # fmt: skip
    if getattr(config, "column_argmax", False):
        entry["column_argmax"] = True
    return entry


def tune_key(key: KernelKey, runs, names: str, quick: bool) -> tuple[str, dict] | None:
    """Tunes one KernelKey over the runs (one per shape sharing it); returns (table key,
    entry)."""
    # A backward is up to three launches: host-timed, colpali 32's candidates all read
    # 0.11-0.16 ms on an H200, where their replays take 0.038-0.085.
    found = sweep(runs, candidates(key), quick=quick, graph=key.kernel == "bwd")
    config = found.winner
    if config is None:
        print(f"[{names}] {key.table_key()}: no config ran; left to the default", flush=True)
        return None
    ms = [round(t, 4) for t in found.times[config]]
    print(f"[{names}] {key.table_key()}: {ms} ms with {describe(config)}", flush=True)
    return key.table_key(), table_entry(config, ms, names)


def describe(config: LaunchConfig) -> str:
    column = " column_argmax" if config.column_argmax else ""
    return (f"block_l={config.block_l} num_warps={config.num_warps} "
            f"num_stages={config.num_stages} query_group={config.query_group}{column}")  # fmt: skip


def tune_forward(shapes, family: str, card: str, quick: bool):
    """(table key, entry) per key of the plain forward shapes, shapes sharing a key
    tuned together."""
    for group in shapes_by_key(shapes, family, card).values():
        key = tuned_key(group[0], family, card)
        module = registry.load(key.variant)
        runs = [forward_run(module, shape, key) for shape in group]
        yield tune_key(key, runs, ", ".join(shape[0] for shape in group), quick)


def tune_training(shapes, family: str, card: str, quick: bool):
    """(table key, entry) for the forward and the backward key of each training shape."""
    for shape in shapes:
        keys = train_keys(shape, family, card)
        runs = train_runs(registry.load(keys[0].variant), shape)
        for key, run in zip(keys, runs, strict=True):
            yield tune_key(key, [run], shape[0], quick)


def shapes_by_key(shapes, family: str, card: str = "") -> dict[str, list]:
    """Table key -> the shapes that resolve to it, in SHAPES order."""
    groups: dict[str, list] = {}
    for shape in shapes:
        groups.setdefault(tuned_key(shape, family, card).table_key(), []).append(shape)
    return groups


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return str(value)


def table_line(key: str, entry: dict) -> str:
    """One table entry as its TOML line."""
    fields = ", ".join(f"{k} = {_toml_value(v)}" for k, v in entry.items())
    return f'"{key}" = {{ {fields} }}'


def write_table(path: Path, family: str, entries: dict[str, dict], card: str = "") -> None:
    """Writes a family's table, or with card, that card's own (keys absent from it fall
    back to the family's)."""
    if card:
        title = f"# Launch configs of {card} cards, written by `make tune TUNE_ARGS=--card`."
        absent = f"# Keys absent here use {table_file(family)}, their family's table."
    else:
        title = f"# Launch configs for the {family} GPU family, written by `make tune`."
        absent = "# Keys absent here use lik.runtime.tuning.default_config."
    lines = [
        title,
        '# Keys: "variant|padded head dim|Lq bucket|size class|q<query bucket>", then "|bwd" '
        "for a",
        "# training variant's backward kernels or \"|once\" for a small rerank's docs-once loads",
        "# (lik.runtime.keys.KernelKey).",
        absent + " ms is the tuned median",
        "# (one per shape, in order, where shapes share a key) on the entry's card.",
        "[configs]",
    ]
    lines += [table_line(key, entries[key]) for key in sorted(entries)]
    path.write_text("\n".join(lines) + "\n")


def merge_into_table(directory: Path, family: str, card: str, entries: dict[str, dict]) -> Path:
    """Writes the family's committed table (or with card, that card's) with `entries` in
    place of, or beside, its own (keys tuned earlier for other shapes are kept) into
    directory; returns the file written."""
    path = directory / table_file(family, card)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_table(path, family, {**load_table(family, card), **entries}, card)
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "tuning")
    parser.add_argument("--shapes", default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--card", action="store_true", help="write this GPU's own table, not its family's"
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or backends.device_backend(torch.device("cuda")) != "triton":
        print("make tune needs a CUDA GPU with Triton", file=sys.stderr)
        return 2
    family = gpu_family(torch.device("cuda"))
    card = gpu_card(torch.device("cuda")) if args.card else ""
    wanted = set(args.shapes.split(",")) if args.shapes else None
    shapes = [s for s in SHAPES if not wanted or s[0] in wanted]
    train_shapes = [s for s in TRAIN_SHAPES if not wanted or s[0] in wanted]
    results = itertools.chain(tune_forward(shapes, family, card, args.quick),
                              tune_training(train_shapes, family, card, args.quick))  # fmt: skip
    tuned_on = torch.cuda.get_device_name()  # per entry: a rerun for some shapes keeps the rest
    entries = {key: {**entry, "card": tuned_on} for key, entry in filter(None, results)}
    path = merge_into_table(args.out, family, card, entries)
    print(f"wrote {len(entries)} entries into {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
