"""Host work per call: microseconds a scoring call or a training step spends on the CPU.

Each call is issued back to back behind a long GPU spin (torch.cuda._sleep), so the GPU
never catches up and the host is the only clock: the figure is the host's cost per call
whatever the kernels take. Best of ROUNDS rounds of `--calls` calls, one sync per round;
a round that outlasts its spin is run again with half the calls behind a spin twice as
long: an entry of many small kernels may fill CUDA's launch queue (about a thousand
launches), where the host would wait for the GPU however long the spin.

Rows, on a small batch (8 queries of 32 tokens, 8 docs of 64, d 128, bf16):
- the core entries, a forward call (no grad) and a training step (forward, then
  torch.autograd.grad of the scores' sum for every input), for lik, late-interaction-
  kernels 0.4.5 and flash-maxsim 0.3.0 where they have the entry: maxsim in-batch, kd
  (4 docs per query) and pairs; score_pairs_packed (16 listed pairs; flash-maxsim's
  paired varlen scores query i against doc i); maxsim_varlen; PLAID's
  maxsim_residual_varlen (nbits 2, inference only);
- the other entries' forward calls: maxsim_padded, retrieve (top 4), MaxSimScorer, a
  weighted token score, fp8 (per-tensor scales), PLAID's padded maxsim_residual and the
  fused head (hidden states of 768 -> 128);
- PyTorch's own floors: an autograd.Function whose forward and backward only allocate
  (the least any custom op's step costs), and a step of two plain torch ops, measured
  before the rows and after them (how far the host drifted); lik's core entries are
  then given above the lower of the allocating Function's two figures, which moves
  less between hosts than microseconds do.

PERF.md's targets: a training step at most 150 us, a forward call at most 25 us, both
below every peer's.

    python3 benchmarks/bench_host.py --out DIR [--calls 50]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    attempt,
    environment_info,
    gpu_name,
    markdown_table,
    missing_gpu,
    normalized_tokens,
    provenance,
    result_stem,
    write_results,
)

SHAPE = {"Nq": 8, "Nd": 8, "Lq": 32, "Ld": 64, "d": 128, "K": 4, "pairs": 16}
ROUNDS = 5
# GPU cycles the spin starts at (about 0.2 s on an H200); a round whose calls outlast it
# (the GPU caught up, so the GPU may have paced them) runs again on a spin twice as long.
SPIN_CYCLES = 4 * 10**8
# Retries before a cell gives up: calls that outlast a 6 s spin, a few at a time, wait on
# the GPU (a host sync), so no spin can keep them host-bound.
MAX_DOUBLINGS = 5
MIN_CALLS = 5
FORWARD_TARGET_US = 25
STEP_TARGET_US = 150
PEERS = ("lik", "LIK 0.4.5", "flash-maxsim 0.3.0")
DEVICE = "cuda"  # tests smoke-run the rows on the CPU


def host_us(fn, calls: int) -> float:
    """Best of ROUNDS: host microseconds per call of `calls` calls issued behind a spin."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    best, spin, rounds, doublings = float("inf"), SPIN_CYCLES, 0, 0
    while rounds < ROUNDS:
        torch.cuda._sleep(spin)
        spun = torch.cuda.Event()
        spun.record()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        elapsed = time.perf_counter() - start
        caught_up = spun.query()
        torch.cuda.synchronize()
        if caught_up:
            doublings += 1
            if doublings > MAX_DOUBLINGS:
                raise RuntimeError(f"{calls} calls outlasted a spin of {spin:.1e} cycles: "
                                   "they wait on the GPU")  # fmt: skip
            spin, calls = spin * 2, max(MIN_CALLS, calls // 2)
            continue
        best, rounds = min(best, elapsed * 1e6 / calls), rounds + 1
    return best


def step(score, *inputs):
    """A training step of score(*inputs): its forward and the gradients of its sum."""

    def run():
        torch.autograd.grad(score(*inputs).sum(), inputs)

    return run


class Inputs:
    """The rows' tensors, made once: padded, kd and packed forms of one batch."""

    def __init__(self, device):
        s = SHAPE
        self.Q = normalized_tokens(s["Nq"], s["Lq"], s["d"], device=device, seed=0)
        self.D = normalized_tokens(s["Nd"], s["Ld"], s["d"], device=device, seed=1)
        self.Dk = normalized_tokens(s["Nq"] * s["K"], s["Ld"], s["d"], device=device, seed=2)
        self.Dk = self.Dk.view(s["Nq"], s["K"], s["Ld"], s["d"])
        self.cu_q = torch.arange(s["Nq"] + 1, device=device, dtype=torch.int32) * s["Lq"]
        self.cu_d = torch.arange(s["Nd"] + 1, device=device, dtype=torch.int32) * s["Ld"]
        self.Qp, self.Dp = self.Q.reshape(-1, s["d"]), self.D.reshape(-1, s["d"])
        pairs = torch.arange(s["pairs"], device=device)
        self.pair_q, self.pair_d = pairs % s["Nq"], (pairs * 3) % s["Nd"]
        self.diagonal = torch.arange(s["Nq"], device=device)

    def trainable(self, *names):
        return tuple(getattr(self, n).detach().clone().requires_grad_(True) for n in names)


def core_rows(x: Inputs) -> dict:
    """(entry, peer) -> (forward call, training step call or None); peers' missing
    entries are left out."""
    import lik

    s = SHAPE
    packed = {"max_seqlen_q": s["Lq"], "max_seqlen_d": s["Ld"]}

    def packed_pairs(q, d):
        return lik.score_pairs_packed(q, d, x.cu_q, x.cu_d, x.pair_q, x.pair_d, **packed)

    def varlen(q, d):
        return lik.maxsim_varlen(q, d, x.cu_q, x.cu_d, s["Lq"], s["Ld"])

    rows = {
        ("maxsim in-batch", "lik"): (lambda: lik.maxsim(x.Q, x.D),
                                     step(lik.maxsim, *x.trainable("Q", "D"))),
        ("maxsim kd", "lik"): (lambda: lik.maxsim(x.Q, x.Dk),
                               step(lik.maxsim, *x.trainable("Q", "Dk"))),
        ("maxsim_pairs", "lik"): (lambda: lik.maxsim_pairs(x.Q, x.D),
                                  step(lik.maxsim_pairs, *x.trainable("Q", "D"))),
        ("score_pairs_packed", "lik"): (lambda: packed_pairs(x.Qp, x.Dp),
                                        step(packed_pairs, *x.trainable("Qp", "Dp"))),
        ("maxsim_varlen", "lik"): (lambda: varlen(x.Qp, x.Dp),
                                   step(varlen, *x.trainable("Qp", "Dp"))),
    }  # fmt: skip
    rows[("maxsim_residual_varlen", "lik")] = (plaid_call(x, "lik"), None)
    rows.update(peer_rows(x))
    return rows


def peer_rows(x: Inputs) -> dict:
    s = SHAPE
    rows = {}
    lik045, _ = attempt(lambda: __import__("late_interaction_kernels"))
    if lik045 is not None:
        peer = "LIK 0.4.5"

        def packed_pairs(q, d):
            bounds = {"max_seqlen_q": s["Lq"], "max_seqlen_d": s["Ld"]}
            packed = __import__("late_interaction_kernels.score_pairs").score_pairs
            return packed.score_pairs_packed(q, d, x.cu_q, x.cu_d, x.pair_q, x.pair_d, **bounds)

        def varlen(q, d):
            return lik045.maxsim_varlen(q, d, x.cu_q, x.cu_d, s["Lq"], s["Ld"])

        rows.update({
            ("maxsim in-batch", peer): (lambda: lik045.maxsim(x.Q, x.D),
                                        step(lik045.maxsim, *x.trainable("Q", "D"))),
            ("maxsim kd", peer): (lambda: lik045.maxsim(x.Q, x.Dk),
                                  step(lik045.maxsim, *x.trainable("Q", "Dk"))),
            ("maxsim_pairs", peer): (lambda: lik045.maxsim_pairs(x.Q, x.D),
                                     step(lik045.maxsim_pairs, *x.trainable("Q", "D"))),
            ("score_pairs_packed", peer): (lambda: packed_pairs(x.Qp, x.Dp),
                                           step(packed_pairs, *x.trainable("Qp", "Dp"))),
            ("maxsim_varlen", peer): (lambda: varlen(x.Qp, x.Dp),
                                      step(varlen, *x.trainable("Qp", "Dp"))),
            ("maxsim_residual_varlen", peer): (plaid_call(x, peer), None),
        })  # fmt: skip
    flash, _ = attempt(lambda: __import__("flash_maxsim"))
    if flash is not None:
        peer = "flash-maxsim 0.3.0"

        def train(q, d):
            return flash.flash_maxsim_batched_train(q, d, shared_docs=True)

        def paired(q, d):
            return flash.flash_maxsim_varlen(q, d, x.cu_q, x.cu_d, s["Lq"], s["Ld"])

        rows.update({
            ("maxsim in-batch", peer): (lambda: flash.flash_maxsim_batched(x.Q, x.D),
                                        step(train, *x.trainable("Q", "D"))),
            ("maxsim_pairs", peer): (lambda: flash.flash_maxsim_pairs(x.Q, x.D), None),
            ("score_pairs_packed", peer): (lambda: paired(x.Qp, x.Dp), None),
        })  # fmt: skip
    return rows


def plaid_call(x: Inputs, peer: str):
    """A PLAID rerank of the batch's docs (nbits 2, 1024 fp16 centroids), varlen."""
    s = SHAPE
    g = torch.Generator().manual_seed(2)
    nd, ld, dim = s["Nd"], s["Ld"], s["d"]
    codes = torch.randint(0, 1024, (nd * ld,), generator=g, dtype=torch.int32).to(DEVICE)
    residuals = torch.randint(0, 256, (nd * ld, dim * 2 // 8), generator=g, dtype=torch.uint8)
    residuals = residuals.to(DEVICE)
    centroids = torch.nn.functional.normalize(torch.randn(1024, dim, generator=g), dim=-1)
    centroids = centroids.half().to(DEVICE)
    weights = torch.sort(torch.randn(4, generator=g) * 0.03).values.half().to(DEVICE)
    args = (x.Q[:1].half(), codes, residuals, x.cu_d, centroids, weights, 2)
    if peer == "lik":
        from lik.runtime import plaid
    else:
        plaid = __import__("late_interaction_kernels.plaid").plaid
    return lambda: plaid.maxsim_residual_varlen(*args, max_seqlen_d=ld)


def other_rows(x: Inputs) -> dict:
    """entry -> lik's forward call, for the entries outside the core table."""
    import lik
    from lik.runtime import fp8, head, plaid, variants

    s = SHAPE
    lengths_q = torch.full((s["Nq"],), s["Lq"], device=DEVICE)
    lengths_d = torch.full((s["Nq"], 1), s["Ld"], device=DEVICE)
    padded_docs = x.D[: s["Nq"]].unsqueeze(1)
    scorer = lik.MaxSimScorer(normalize=False)
    weights = torch.rand(s["Nq"], s["Lq"], device=DEVICE)
    q8, scale_q = fp8.quantize_fp8_per_tensor(x.Q)
    d8, scale_d = fp8.quantize_fp8_per_tensor(x.D)
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(s["Nd"], s["Ld"], 768, generator=g).to(DEVICE, x.Q.dtype)
    W = (torch.randn(s["d"], 768, generator=g) / 768**0.5).to(DEVICE, x.Q.dtype)
    nd, ld, dim = s["Nd"], s["Ld"], s["d"]
    codes = torch.randint(0, 1024, (nd, ld), generator=g, dtype=torch.int32).to(DEVICE)
    residuals = torch.randint(0, 256, (nd, ld, dim // 4), generator=g, dtype=torch.uint8).to(DEVICE)
    doc_lengths = torch.full((nd,), ld, dtype=torch.int32, device=DEVICE)
    centroids = torch.nn.functional.normalize(torch.randn(1024, dim, generator=g), dim=-1)
    centroids, bucket_weights = (
        centroids.half().to(DEVICE),
        torch.linspace(-0.05, 0.05, 4).half().to(DEVICE),
    )
    qh = x.Q[:1].half()
    return {
        "maxsim_padded": lambda: lik.maxsim_padded(x.Q, padded_docs, lengths_q, lengths_d),
        "retrieve (top 4)": lambda: lik.retrieve(x.Q, x.D, 4),
        "MaxSimScorer.score": lambda: scorer.score(x.Q, x.D),
        "weighted token score": lambda: variants.maxsim_weighted(x.Q, x.D, weights),
        "fp8 maxsim_inference_fp8": lambda: fp8.maxsim_inference_fp8(
            q8, d8, scale_Q=scale_q, scale_D=scale_d),
        "PLAID maxsim_residual": lambda: plaid.maxsim_residual(
            qh, codes, residuals, doc_lengths, centroids, bucket_weights, 2),
        "fused head maxsim_from_hidden": lambda: head.maxsim_from_hidden(x.Q, hidden, W),
    }  # fmt: skip


class _Allocating(torch.autograd.Function):
    """The least a custom op's training step does: its outputs and gradients allocated."""

    @staticmethod
    def forward(ctx, q, d):
        ctx.save_for_backward(q, d)
        return torch.empty(q.shape[0], d.shape[0], device=q.device)

    @staticmethod
    def backward(ctx, grad):
        q, d = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(d)


FLOOR = "autograd.Function that only allocates"


def floor_rows(x: Inputs) -> dict:
    q, d = x.trainable("Q", "D")

    def plain(q, d):
        return q[:, :1, :1] * d[:, :1, :1].mT

    return {
        FLOOR: (lambda: _Allocating.apply(x.Q, x.D), step(_Allocating.apply, q, d)),
        "two plain torch ops (a product, its sum)": (lambda: plain(x.Q, x.D), step(plain, q, d)),
    }  # fmt: skip


def measure(fn, calls: int):
    if fn is None:
        return None
    us, error = attempt(lambda: host_us(fn, calls))
    return f"error: {error}" if error else us


def measure_floors(x: Inputs, calls: int) -> dict:
    floors = {}
    for label, (forward, training) in floor_rows(x).items():
        floors[label] = {"forward": measure(forward, calls), "step": measure(training, calls)}
        print(label, floors[label], flush=True)
    return floors


def run(calls: int) -> dict:
    x = Inputs(DEVICE)
    report = {"env": environment_info(["late-interaction-kernels", "flash-maxsim"]),
              "gpu": gpu_name(), "shape": SHAPE, "calls": calls, "rounds": ROUNDS,
              "core": {}, "other": {}, "floors": {}}  # fmt: skip
    # The floors before and after the rows: how far the host drifted while they ran.
    report["floors_first"] = measure_floors(x, calls)
    for (entry, peer), (forward, training) in core_rows(x).items():
        cell = {"forward": measure(forward, calls), "step": measure(training, calls)}
        report["core"].setdefault(entry, {})[peer] = cell
        print(entry, peer, cell, flush=True)
    for entry, forward in other_rows(x).items():
        report["other"][entry] = measure(forward, calls)
        print(entry, report["other"][entry], flush=True)
    report["floors"] = measure_floors(x, calls)
    return report


def _us(value) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if isinstance(value, float) else str(value)


def _peer_best(cells: dict, what: str):
    times = [c[what] for peer, c in cells.items() if peer != "lik" and isinstance(c[what], float)]
    return min(times) if times else None


def above_floor(report: dict) -> list[list[str]]:
    """Each core entry's lik forward and step over the allocation-only Function's, the
    least any custom op costs on this host: a figure that moves less between hosts than
    the microseconds do. The floor is the lower of its two measurements."""
    measured = [r[FLOOR] for r in (report.get("floors_first"), report["floors"]) if r]
    rows = []
    for entry, cells in report["core"].items():
        row = [entry]
        for what in ("forward", "step"):
            mine = cells.get("lik", {}).get(what)
            floors = [m[what] for m in measured if isinstance(m[what], float)]
            if not isinstance(mine, float) or not floors:
                row += ["-", "-"]
                continue
            floor = min(floors)
            row += [f"{mine - floor:.1f}", f"{mine / floor:.2f}x"]
        rows.append(row)
    return rows


def floor_table(report: dict) -> str:
    first = report.get("floors_first") or {}
    rows = []
    for label, c in report["floors"].items():
        before = first.get(label, {})
        rows.append([label, _us(before.get("forward")), _us(c["forward"]),
                     _us(before.get("step")), _us(c["step"])])  # fmt: skip
    headers = ["call", "forward: first", "forward: last", "step: first", "step: last"]
    return markdown_table(headers, rows)


def markdown(report: dict) -> str:
    rows = []
    for entry, cells in report["core"].items():
        row = [entry]
        for what in ("forward", "step"):
            row += [_us(cells.get(peer, {}).get(what)) for peer in PEERS]
            mine, best = cells.get("lik", {}).get(what), _peer_best(cells, what)
            ratio = best / mine if isinstance(mine, float) and best else None
            row.append(f"{ratio:.2f}x" if ratio else "-")
        rows.append(row)
    headers = ["entry"] + [f"{what}: {peer}" for what in ("forward", "step")
                           for peer in (*PEERS, "best peer / lik")]  # fmt: skip
    other = [[entry, _us(us)] for entry, us in report["other"].items()]
    shape = ", ".join(f"{k} {v}" for k, v in report["shape"].items())
    return (
        f"# Host work per call on {report['gpu']}\n\n{provenance(report['env'])}\n\n"
        f"Microseconds of host time per call, issued back to back behind a GPU spin so that "
        f"the host is the only clock: best of {report['rounds']} rounds of {report['calls']} "
        f"calls. Batch: {shape}, bf16. A step is the forward and the gradients of the "
        f"scores' sum. Targets: forward at most {FORWARD_TARGET_US} us, step at most "
        f"{STEP_TARGET_US} us, below every peer (a peer's '-': it has no such entry).\n\n"
        + markdown_table(headers, rows)
        + "\n\nOther entries, lik's forward call (us):\n\n"
        + markdown_table(["entry", "us per call"], other)
        + "\n\nPyTorch's own floors on this host (us), measured before the rows and after "
        "them:\n\n"
        + floor_table(report)
        + f"\n\nlik's core entries above the floor ({FLOOR}): us more, and the ratio:\n\n"
        + markdown_table(
            ["entry", "forward: us above", "forward: ratio", "step: us above", "step: ratio"],
            above_floor(report),
        )
        + "\n"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--calls", type=int, default=50)
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
