"""The fused head's H read through a TMA descriptor or by pointer, per batch size (GPU).

    python3 benchmarks/head_tma.py --out DIR

One query of 32 tokens against Nd docs of 300 hidden states (768 -> 128, bf16, bias,
normalize), Nd from 4 to 1000. Per path: the pace of calls issued back to back (best of
3 x 200 calls, one sync each; input sets rotated so H is never read from L2) and the
do_bench median. A descriptor costs host time on every call, so the pointer path wins
while the host paces the calls; this sets head.TMA_MIN_HIDDEN_BYTES.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    back_to_back_ms,
    bench_ms,
    environment_info,
    gpu_name,
    markdown_table,
    missing_gpu,
    provenance,
    result_stem,
    write_results,
)

DOCS = (4, 16, 64, 128, 256, 512, 1000)
LD, D_MODEL, DIM = 300, 768, 128
ROTATION_BYTES = 256e6  # at least this much H across the rotated sets (L2 is 50-60 MB)


def run() -> dict:
    from lik.runtime import head, registry
    from lik.runtime.keys import variant_name

    g = torch.Generator(device="cuda").manual_seed(0)
    Q = F.normalize(torch.randn(1, 32, DIM, device="cuda", generator=g), dim=-1).bfloat16()
    W = (torch.randn(DIM, D_MODEL, device="cuda", generator=g) * D_MODEL**-0.5).bfloat16()
    b = (torch.randn(DIM, device="cuda", generator=g) * 0.03).bfloat16()
    module = registry.load(variant_name("dense", False, False, True, Q.dtype, op="head"))
    rows = []
    for nd in DOCS:
        hidden_bytes = nd * LD * D_MODEL * 2
        sets = min(64, max(2, math.ceil(ROTATION_BYTES / hidden_bytes)))
        Hs = [torch.randn(nd, LD, D_MODEL, device="cuda", generator=g).bfloat16()
              for _ in range(sets)]  # fmt: skip
        config = head.head_config(module, Q, LD)
        for tma in (True, False):
            path = dataclasses.replace(config, tma=tma)
            turn = iter(range(10**9))

            def call(path=path, Hs=Hs, turn=turn, sets=sets):
                H = Hs[next(turn) % sets]
                return head._forward(Q, H, W, b, None, True, False, path)

            with torch.no_grad():
                paced = back_to_back_ms(call) * 1e3
                median = bench_ms(call, warmup_ms=25, rep_ms=200) * 1e3
            rows.append({"nd": nd, "hidden_mb": hidden_bytes / 1e6, "tma": tma,
                         "back_to_back_us": paced, "do_bench_us": median})  # fmt: skip
            print(f"Nd {nd}, H {hidden_bytes / 1e6:.1f} MB, tma {tma}: back to back "
                  f"{paced:.1f} us, do_bench {median:.1f} us", flush=True)  # fmt: skip
        del Hs
    return {"env": environment_info([]), "gpu": gpu_name(), "rows": rows}


def markdown(report: dict) -> str:
    by_nd = {}
    for r in report["rows"]:
        by_nd.setdefault(r["nd"], {})[r["tma"]] = r
    rows = [[str(nd), f"{pair[True]['hidden_mb']:.1f}",
             *(f"{pair[tma]['back_to_back_us']:.1f}" for tma in (True, False)),
             *(f"{pair[tma]['do_bench_us']:.1f}" for tma in (True, False))]
            for nd, pair in by_nd.items()]  # fmt: skip
    env = report["env"]
    headers = ["Nd", "H MB", "back to back, TMA", "back to back, pointer",
               "do_bench, TMA", "do_bench, pointer"]  # fmt: skip
    return (f"# Fused head: H by TMA descriptor or by pointer, {report['gpu']}\n\n"
            f"{provenance(env, packages=False)} Nq 1, Lq 32, Ld {LD}, {D_MODEL} -> {DIM}, bf16; "
            "microseconds per call.\n\n" + markdown_table(headers, rows) + "\n")  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if missing_gpu("head_tma"):
        return 2
    report = run()
    text = markdown(report)
    write_results(args.out, result_stem("head_tma", report["gpu"]), report, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
