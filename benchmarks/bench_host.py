"""Host work per call: microseconds a scoring call spends on the CPU, in one run.

The shape is tiny (1 query of 32 tokens against 16 docs of 32 tokens, d 128, bf16): its
kernels take a few microseconds, so calls issued back to back are paced by the host.
Rows: lik.maxsim; the same call with the generated module's launch replaced by a no-op
(lik's own Python path: checks, dispatch, allocation); the generated launcher alone
(its Python plus Triton's launch of the compiled kernel); late-interaction-kernels
0.4.5 and flash-maxsim 0.3.0 on the same inputs.

    python3 benchmarks/bench_host.py --out DIR [--calls 2000]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    attempt,
    environment_info,
    gpu_name,
    gpu_tag,
    markdown_table,
    normalized_tokens,
    write_results,
)

SHAPE = {"Nq": 1, "Nd": 16, "Lq": 32, "Ld": 32, "d": 128}
VARIANT = "maxsim_dense_nomask_bf16_triton"
REPEATS = 3


def per_call_us(fn, calls: int) -> float:
    """Best of REPEATS: wall-clock microseconds per call over `calls` calls, one sync."""
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) * 1e6 / calls)
    return best


@contextlib.contextmanager
def launch_stubbed(name: str):
    """The registry serves a copy of the variant's module whose launch does nothing."""
    from lik.runtime import registry

    module = registry.load(name)
    stub = types.SimpleNamespace(**vars(module))
    stub.launch = lambda out, *args, **kwargs: out
    registry._modules[name] = stub
    try:
        yield
    finally:
        registry._modules[name] = module


def calls(q, docs) -> dict:
    """Label -> a no-argument call."""
    import lik
    from lik.runtime import dispatch, registry

    module = registry.load(VARIANT)
    out = torch.empty(q.shape[0], docs.shape[0], device=q.device)
    config = dispatch._config(VARIANT, module, q, q.shape[1], out.numel(),
                              docs=docs.shape[0], doc_tokens=docs.shape[1])  # fmt: skip
    table = {
        "lik.maxsim": lambda: lik.maxsim(q, docs),
        "lik.maxsim, launch stubbed (lik's Python path)": "stub",
        "generated launcher alone (its Python + Triton's launch)":
            lambda: module.launch(out, q, docs, config=config),
    }  # fmt: skip
    peers = {
        "LIK 0.4.5 maxsim": ("late_interaction_kernels", "maxsim"),
        "flash-maxsim 0.3.0 flash_maxsim_batched": ("flash_maxsim", "flash_maxsim_batched"),
    }
    for label, (package, function) in peers.items():
        fn, error = attempt(lambda p=package, f=function: getattr(__import__(p), f))
        table[label] = (lambda fn=fn: fn(q, docs)) if fn else f"error: {error}"
    return table


def run(calls_per_repeat: int) -> dict:
    q = normalized_tokens(SHAPE["Nq"], SHAPE["Lq"], SHAPE["d"], device="cuda", seed=0)
    docs = normalized_tokens(SHAPE["Nd"], SHAPE["Ld"], SHAPE["d"], device="cuda", seed=1)
    report = {"env": environment_info(["late-interaction-kernels", "flash-maxsim"]),
              "gpu": gpu_name(), "shape": SHAPE, "calls": calls_per_repeat, "us": {}}  # fmt: skip
    import lik

    for label, fn in calls(q, docs).items():
        if fn == "stub":
            with launch_stubbed(VARIANT):
                us = per_call_us(lambda: lik.maxsim(q, docs), calls_per_repeat)
        elif isinstance(fn, str):
            report["us"][label] = fn
            continue
        else:
            us = per_call_us(fn, calls_per_repeat)
        report["us"][label] = us
        print(f"{label}: {us:.1f} us", flush=True)
    return report


def markdown(report: dict) -> str:
    rows = [[label, f"{us:.1f}" if isinstance(us, float) else us]
            for label, us in report["us"].items()]  # fmt: skip
    shape = ", ".join(f"{k} {v}" for k, v in report["shape"].items())
    env = report["env"]
    return (f"# Host work per call on {report['gpu']}\n\n{env['date']}; commit "
            f"{env['commit'] or 'unknown'}; torch {env['torch']}, triton {env['triton']}.\n\n"
            f"Tiny shape ({shape}, bf16): calls back to back are paced by the host. "
            f"Microseconds per call, best of {REPEATS} x {report['calls']} calls, one sync "
            "each.\n\n" + markdown_table(["call", "us per call"], rows) + "\n")  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_host needs a CUDA GPU", file=sys.stderr)
        return 2
    report = run(args.calls)
    text = markdown(report)
    write_results(args.out, f"host_{gpu_tag(report['gpu'])}", report, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
