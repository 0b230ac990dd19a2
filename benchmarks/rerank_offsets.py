"""Probe: one memory-bound rerank (lateon-edge by default) timed with its docs at several
base addresses, lik against LIK 0.4.5 in the same process, the order alternating per
address. Tells a kernel that depends on where its docs lie from a process (or machine)
that runs slow as a whole.

    OUT=... python3 benchmarks/rerank_offsets.py SEED [--shape NQ,ND,LQ,LD,D]

Prints one JSON row per offset and writes $OUT/rerank_offsets_<seed>.json.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F

OFFSETS_BYTES = (0, 256, 4096, 65536, 1 << 20, 2 << 20, (3 << 20) | 512)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("seed", type=int)
    parser.add_argument("--shape", default="1,1000,32,1024,48")
    args = parser.parse_args()
    from late_interaction_kernels import maxsim as peer_maxsim  # GPU runs only
    from triton.testing import do_bench

    import lik

    nq, nd, lq, ld, dim = (int(x) for x in args.shape.split(","))
    torch.manual_seed(args.seed)
    Q = F.normalize(torch.randn(nq, lq, dim, device="cuda"), dim=-1).bfloat16()
    rows, buffers = [], []
    for offset in OFFSETS_BYTES:
        skip = offset // 2  # bf16 elements
        buffer = torch.empty(nd * ld * dim + skip, device="cuda", dtype=torch.bfloat16)
        D = buffer[skip:].view(nd, ld, dim)
        D.copy_(F.normalize(torch.randn(nd, ld, dim, device="cuda"), dim=-1))
        buffers.append(buffer)  # kept: every offset gets fresh memory
        row = {"offset_bytes": offset, "address_mod_2MiB": D.data_ptr() % (2 << 20)}
        calls = [("lik", lambda D=D: lik.maxsim(Q, D)), ("LIK", lambda D=D: peer_maxsim(Q, D))]
        for name, call in calls if len(rows) % 2 else calls[::-1]:
            call()
            torch.cuda.synchronize()
            row[name + "_us"] = [round(do_bench(call, warmup=50, rep=200) * 1e3, 1) for _ in "ab"]
        print(json.dumps(row), flush=True)
        rows.append(row)
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rerank_offsets_{args.seed}.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
