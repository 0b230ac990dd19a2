"""Host work per call: microseconds a scoring call spends on the CPU, in one run.

The shape is tiny (1 query of 32 tokens against 16 docs of 32 tokens, d 128, bf16): its
kernels take a few microseconds, so calls issued back to back are paced by the host.
Rows: lik.maxsim; the same call with the generated module's launch replaced by a no-op
(lik's own Python path: checks, dispatch, allocation); the generated launcher alone
(its Python plus Triton's launch of the compiled kernel); late-interaction-kernels
0.4.5 and flash-maxsim 0.3.0 on the same inputs. Then the other rerank entries on the
same docs: PLAID residuals (nbits 2, 1024 fp16 centroids; varlen with max_seqlen_d, as
an index that knows its longest doc passes it) and fp8 with per-tensor scales, each
beside late-interaction-kernels 0.4.5's entry of the same name; and the fused head on
hidden states of that shape (d_model 768 -> 128): maxsim_from_hidden, its generated
launcher alone with H as a TMA descriptor and by pointer, and the peer's.

    python3 benchmarks/bench_host.py --out DIR [--calls 2000]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    attempt,
    back_to_back_ms,
    environment_info,
    gpu_name,
    markdown_table,
    missing_gpu,
    normalized_tokens,
    provenance,
    result_stem,
    write_results,
)

SHAPE = {"Nq": 1, "Nd": 16, "Lq": 32, "Ld": 32, "d": 128}
VARIANT = "maxsim_dense_nomask_bf16_triton"
REPEATS = 3


def per_call_us(fn, calls: int) -> float:
    """Best of REPEATS: wall-clock microseconds per call over `calls` calls, one sync."""
    return back_to_back_ms(fn, calls=calls, rounds=REPEATS) * 1e3


@contextlib.contextmanager
def launch_stubbed(name: str):
    """The registry serves a copy of the variant's module whose launch does nothing."""
    from lik.runtime import registry

    bound = registry.load(name)
    stub = copy.copy(bound)
    stub.launch = lambda out, *args, **kwargs: out
    registry._bound[name] = stub
    try:
        yield
    finally:
        registry._bound[name] = bound


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
    table.update(compressed_calls(q, docs))
    table.update(head_calls(q, docs))
    return table


HEAD_D_MODEL = 768


def head_calls(q, docs) -> dict:
    """Label -> call: the fused projection head (bias, normalize) on hidden states of the
    docs' shape, lik's public call, its launcher (TMA descriptor or pointer), the peer's."""
    import dataclasses

    from lik.runtime import head, registry
    from lik.runtime.keys import variant_name

    nd, ld, dim = docs.shape
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(nd, ld, HEAD_D_MODEL, generator=g).to(q.device, q.dtype)
    W = (torch.randn(dim, HEAD_D_MODEL, generator=g) * HEAD_D_MODEL**-0.5).to(q.device, q.dtype)
    b = (torch.randn(dim, generator=g) * 0.03).to(q.device, q.dtype)
    module = registry.load(variant_name("dense", False, False, True, q.dtype, op="head"))
    config = head.head_config(module, q, ld)
    out = torch.empty(q.shape[0], nd, device=q.device)
    pointer = dataclasses.replace(config, tma=False)
    table = {
        "lik head.maxsim_from_hidden": lambda: head.maxsim_from_hidden(q, hidden, W, b),
        "generated head launcher alone, H by TMA descriptor":
            lambda: module.launch(out, q, hidden, W, b=b, config=config),
        "generated head launcher alone, H by pointer":
            lambda: module.launch(out, q, hidden, W, b=b, config=pointer),
    }  # fmt: skip
    peer, error = attempt(lambda: __import__("late_interaction_kernels.fused_head").fused_head)
    table["LIK 0.4.5 fused_head.maxsim_from_hidden"] = (
        (lambda: peer.maxsim_from_hidden(q, hidden, W, b)) if peer else f"error: {error}"
    )
    return table


def compressed_calls(q, docs) -> dict:
    """Label -> call: PLAID (dense and varlen) and fp8 reranks of the same docs, lik's
    and late-interaction-kernels 0.4.5's."""
    from lik.runtime import fp8, plaid

    g = torch.Generator().manual_seed(2)
    nd, ld, dim = docs.shape
    device = q.device
    codes = torch.randint(0, 1024, (nd, ld), generator=g, dtype=torch.int32).to(device)
    residuals = torch.randint(0, 256, (nd, ld, dim * 2 // 8), generator=g, dtype=torch.uint8)
    residuals = residuals.to(device)
    lengths = torch.full((nd,), ld, dtype=torch.int32, device=device)
    cu = torch.arange(nd + 1, dtype=torch.int32, device=device) * ld
    centroids = torch.nn.functional.normalize(torch.randn(1024, dim, generator=g), dim=-1)
    centroids = centroids.half().to(device)
    weights = torch.sort(torch.randn(4, generator=g) * 0.03).values.half().to(device)
    qh = q.half()
    dense = (qh, codes, residuals, lengths, centroids, weights, 2)
    flat = (qh, codes.flatten(), residuals.flatten(0, 1), cu, centroids, weights, 2)
    q8, scale_q = fp8.quantize_fp8_per_tensor(q)
    d8, scale_d = fp8.quantize_fp8_per_tensor(docs)
    table = {
        "lik plaid.maxsim_residual": lambda: plaid.maxsim_residual(*dense),
        "lik plaid.maxsim_residual_varlen": lambda: plaid.maxsim_residual_varlen(
            *flat, max_seqlen_d=ld),
        "lik fp8.maxsim_inference_fp8": lambda: fp8.maxsim_inference_fp8(
            q8, d8, scale_Q=scale_q, scale_D=scale_d),
    }  # fmt: skip
    peer, error = attempt(lambda: __import__("late_interaction_kernels.plaid").plaid)
    peer_fp8, error_fp8 = attempt(lambda: __import__("late_interaction_kernels.fp8").fp8)
    table["LIK 0.4.5 plaid.maxsim_residual"] = (
        (lambda: peer.maxsim_residual(*dense)) if peer else f"error: {error}"
    )
    table["LIK 0.4.5 plaid.maxsim_residual_varlen"] = (
        (lambda: peer.maxsim_residual_varlen(*flat, max_seqlen_d=ld)) if peer
        else f"error: {error}")  # fmt: skip
    table["LIK 0.4.5 fp8.maxsim_inference_fp8"] = (
        (lambda: peer_fp8.maxsim_inference_fp8(q8, d8, scale_Q=scale_q, scale_D=scale_d))
        if peer_fp8 else f"error: {error_fp8}")  # fmt: skip
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
            us, error = attempt(lambda fn=fn: per_call_us(fn, calls_per_repeat))
            if error:
                report["us"][label] = f"error: {error}"
                continue
        report["us"][label] = us
        print(f"{label}: {us:.1f} us", flush=True)
    return report


def markdown(report: dict) -> str:
    rows = [[label, f"{us:.1f}" if isinstance(us, float) else us]
            for label, us in report["us"].items()]  # fmt: skip
    shape = ", ".join(f"{k} {v}" for k, v in report["shape"].items())
    env = report["env"]
    return (f"# Host work per call on {report['gpu']}\n\n{provenance(env, packages=False)}\n\n"
            f"Tiny shape ({shape}; bf16, or PLAID / fp8 docs or {HEAD_D_MODEL}-wide hidden "
            "states of that shape): calls back to "
            "back are paced by the host. "
            f"Microseconds per call, best of {REPEATS} x {report['calls']} calls, one sync "
            "each.\n\n" + markdown_table(["call", "us per call"], rows) + "\n")  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args(argv)
    if missing_gpu("bench_host"):
        return 2
    report = run(args.calls)
    text = markdown(report)
    write_results(args.out, result_stem("host", report["gpu"]), report, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
