"""`make tune`: sweep launch configs on this GPU and write the committed tuning table.

For each benchmark shape (benchmarks' PERF shapes, bf16, the variant a plain
`maxsim(Q, D)` call uses), every candidate config is checked against the first one's
output, timed with triton.testing.do_bench (median), and the fastest is written to
runtime/tuning/<family>.toml under the shape's KernelKey. The runtime then reads it:
no sweep ever runs at call time.

    python3 -m lik.runtime.tune [--out runtime/tuning] [--shapes name,...] [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

from lik.runtime import dispatch, registry
from lik.runtime.keys import (
    KernelKey,
    gpu_family,
    lq_bucket,
    padded_head_dim,
    query_bucket,
    size_class,
    variant_name,
)
from lik.runtime.tuning import STACKED_ROWS, LaunchConfig, load_table

# (name, Nq, Nd, Lq, Ld, d): the forward shapes of the performance suite.
SHAPES = [
    ("colbert-rerank", 1, 1000, 32, 300, 128),
    ("text-long", 1, 1000, 32, 1024, 128),
    ("colpali-rerank", 1, 1000, 128, 1024, 128),
    ("colpali-compute", 1, 500, 1024, 1024, 128),
    ("lateon-edge", 1, 1000, 32, 1024, 48),
    ("inbatch-256", 256, 256, 32, 300, 128),
    ("longdoc", 16, 32, 32, 8192, 128),
    ("corpus-100k", 16, 100000, 32, 128, 128),
    ("train-colpali-32", 32, 32, 128, 1024, 128),
]
BLOCK_L = (32, 64, 128)
NUM_WARPS = (4, 8)
NUM_STAGES = (2, 3)


def key_for(shape, family: str) -> KernelKey:
    """The KernelKey dispatch builds for a plain bf16 maxsim(Q, D) call of this shape
    (see dispatch._config; queries longer than 512 tokens are keyed by their chunk)."""
    _, nq, nd, lq, _, d = shape
    name = variant_name("dense", False, False, False, torch.bfloat16)
    return KernelKey(name, family, padded_head_dim(d), lq_bucket(min(lq, 512)),
                     size_class(nq * nd), query_bucket(nq))  # fmt: skip


def candidates(key: KernelKey):
    # One query alone is always a candidate; stacking stops at twice a full tile.
    groups = [1] + [g for g in (2, 4, 8) if g <= key.queries and g * key.lq <= 2 * STACKED_ROWS]
    for block_l, warps, stages, group in itertools.product(BLOCK_L, NUM_WARPS, NUM_STAGES, groups):
        yield LaunchConfig(key.lq, block_l, key.head_dim, warps, stages, query_group=group)


def tune_shape(shape, quick: bool) -> tuple[str, dict] | None:
    from triton.testing import do_bench

    name_, nq, nd, lq, ld, d = shape
    g = torch.Generator("cuda").manual_seed(0)
    Q = torch.randn(nq, lq, d, device="cuda", generator=g).to(torch.bfloat16)
    D = torch.randn(nd, ld, d, device="cuda", generator=g).to(torch.bfloat16)
    key = key_for(shape, gpu_family(Q.device))
    module = registry.load(key.variant)
    chunk = min(lq, 512)
    Qc = Q[:, :chunk]
    out = torch.empty(nq, nd, device="cuda")
    best, reference = None, None
    for config in candidates(key):
        if getattr(module, "DOC_STREAM", False):  # doc blocks or token ranges, as dispatch
            config = dispatch.streamed(config, nq, nd, ld)
        try:
            module.launch(out, Qc, D, config=config)
            torch.cuda.synchronize()
        except Exception as error:  # noqa: BLE001 - a config that does not fit is skipped
            print(f"  skip {config}: {type(error).__name__}", flush=True)
            continue
        if reference is None:
            reference = out.clone()
        elif not torch.allclose(out, reference, rtol=1e-3, atol=1e-3):
            print(f"  MISMATCH {config}: results differ from the first config", flush=True)
            continue
        ms = do_bench(lambda c=config: module.launch(out, Qc, D, config=c),
                      warmup=10 if quick else 25, rep=40 if quick else 100,
                      return_mode="median")  # fmt: skip
        if best is None or ms < best[0]:
            best = (ms, config)
    if best is None:
        print(f"[{name_}] {key.table_key()}: no config ran; left to the default", flush=True)
        return None
    ms, config = best
    print(f"[{name_}] {key.table_key()}: {ms:.3f} ms with block_l={config.block_l} "
          f"num_warps={config.num_warps} num_stages={config.num_stages} "
          f"query_group={config.query_group}", flush=True)  # fmt: skip
    entry = {"block_l": config.block_l, "num_warps": config.num_warps,
             "num_stages": config.num_stages, "query_group": config.query_group,
             "block_n": 8, "ms": round(ms, 4), "shape": name_}  # fmt: skip
    return key.table_key(), entry


def write_table(path: Path, family: str, entries: dict[str, dict], device_name: str) -> None:
    lines = [
        f"# Launch configs for the {family} GPU family, written by `make tune` on {device_name}.",
        '# Keys: "variant|padded head dim|Lq bucket|size class|q<query bucket>" '
        "(lik.runtime.keys.KernelKey).",
        "# Keys absent here use lik.runtime.tuning.default_config. ms is the tuned median.",
        "[configs]",
    ]
    for key in sorted(entries):
        fields = ", ".join(
            f'{k} = "{v}"' if isinstance(v, str) else f"{k} = {v}" for k, v in entries[key].items()
        )
        lines.append(f'"{key}" = {{ {fields} }}')
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "tuning")
    parser.add_argument("--shapes", default=None)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or dispatch.backend(torch.device("cuda")) != "triton":
        print("make tune needs a CUDA GPU with Triton", file=sys.stderr)
        return 2
    family = gpu_family(torch.device("cuda"))
    entries = dict(load_table(family))  # keep keys tuned earlier for other shapes
    wanted = set(args.shapes.split(",")) if args.shapes else None
    for shape in SHAPES:
        if wanted and shape[0] not in wanted:
            continue
        result = tune_shape(shape, args.quick)
        if result:
            entries[result[0]] = result[1]
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{family}.toml"
    write_table(path, family, entries, torch.cuda.get_device_name())
    print(f"wrote {path} ({len(entries)} entries)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
