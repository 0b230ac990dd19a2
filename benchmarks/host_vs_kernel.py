"""Host time per call against kernel time, at rerank sizes (GPU).

    python3 benchmarks/host_vs_kernel.py --out DIR

For each call: the suite's do_bench median (L2 overwritten before every call), the host's
pace (wall time of 200 calls issued back to back, one sync at the end, per call) and the
profiler's device time per kernel. A call whose host work outlasts do_bench's L2
overwrite (about 85 us on an H100) leaves the GPU waiting, and do_bench times the wait:
this tells a host-paced figure from a kernel-paced one. Calls: lik.maxsim on
colbert-rerank, PLAID residuals (1000 docs, nbits 2; varlen without max_seqlen_d, which
reads the offsets back once per call), fp8 (8192 x 256, per-tensor scales).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_plaid import codebook, make_index  # noqa: E402
from common import environment_info, gpu_name, gpu_tag  # noqa: E402

CALLS = 200


def calls() -> dict:
    """Label -> a no-argument call on fresh random inputs."""
    from lik.runtime import maxsim, plaid
    from lik.runtime.fp8 import maxsim_inference_fp8, quantize_fp8_per_tensor

    g = torch.Generator().manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(1, 32, 128, generator=g), dim=-1).cuda()
    docs = torch.nn.functional.normalize(torch.randn(1000, 300, 128, device="cuda"), dim=-1)
    docs = docs.bfloat16()
    centroids, weights = codebook(2, "cuda", 65536, 128)
    flat, padded, _ = make_index(1000, 2, "cuda", 1, 65536, 128)
    fp8_docs, scale_d = quantize_fp8_per_tensor(
        torch.nn.functional.normalize(torch.randn(8192, 256, 128, device="cuda"), dim=-1))
    q8, scale_q = quantize_fp8_per_tensor(q)
    qb, qh = q.bfloat16(), q.half()
    return {
        "maxsim colbert-rerank": lambda: maxsim(qb, docs),
        "plaid dense 1000 nbits2": lambda: plaid.maxsim_residual(qh, *padded, centroids,
                                                                  weights, 2),
        "plaid varlen 1000 nbits2": lambda: plaid.maxsim_residual_varlen(qh, *flat, centroids,
                                                                         weights, 2),
        "fp8 rerank 8192x256": lambda: maxsim_inference_fp8(q8, fp8_docs, scale_Q=scale_q,
                                                            scale_D=scale_d),
    }  # fmt: skip


def measure(fn) -> dict:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    median = triton.testing.do_bench(fn, warmup=25, rep=200)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(CALLS):
        fn()
    host = (time.perf_counter() - start) / CALLS * 1e3
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
    kernels = [(event.key, event.device_time_total / event.count, event.count)
               for event in prof.key_averages() if event.device_time_total > 0]  # fmt: skip
    return {"do_bench_ms": median, "host_ms_per_call": host, "kernels_us": kernels}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("host_vs_kernel needs a CUDA GPU", file=sys.stderr)
        return 2
    report = {"env": environment_info([]), "gpu": gpu_name(), "calls": {}}
    for label, fn in calls().items():
        report["calls"][label] = measure(fn)
        print(label, report["calls"][label], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"host_vs_kernel_{gpu_tag(report['gpu'])}.json"
    path.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
