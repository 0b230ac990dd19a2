"""The CPU backend (lik.runtime.cpu) against plain PyTorch and maxsim-cpu, in one run on
one CPU.

Cells: rerank (1 query x 1000 docs, 32 x 300 tokens; d 128, 96, 48), in-batch (32 x 32,
32 x 300 tokens, d 128), kd reranks (16 queries, each against its own 64 docs), and doc
masks (prefix lengths uniform in [32, 300], or holes: each token valid with probability
0.7), in fp32 and bf16; inputs are unit-norm tokens (maxsim-cpu expects them). Rows:
lik.runtime.cpu.forward (scores into a fresh fp32 output, as the runtime calls it); the
flat PyTorch composition (one Q.reshape(-1, d) @ D.reshape(-1, d).T, a bmm of each query
against its docs for kd, .view(...).amax(-1).sum over query tokens) and
torch.einsum + amax, each with the doc mask filled in place with -inf on the
similarities they materialize anyway; maxsim-cpu (fp32 only; a prefix mask as its
variable-length list, a query at a time in-batch and kd; holes it cannot express); and lik's
reference (plain PyTorch in fp32) for context. Each is checked against the float64
reference on the same inputs.

Times are wall-clock medians of warm calls, the implementations of a cell interleaved
call by call so that drift in the machine's speed reaches all of them alike. Peak extra
memory is estimated, not measured (tracemalloc does not see torch's allocations): lik's
from the scratch buffers it holds after the call (per-step temporaries of a few hundred
KB left out), the compositions' from the similarity tensor they materialize.

    python benchmarks/bench_cpu.py [--out DIR] [--quick] [--repeats N]
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import re
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    RESULTS,
    attempt,
    environment_info,
    format_ms,
    format_ratio,
    markdown_table,
    normalized_tokens,
    provenance,
    relative_error,
    result_stem,
    write_results,
)

from lik.runtime import cpu  # noqa: E402
from lik.runtime.reference import maxsim_reference  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PEERS = ("torch flat matmul", "torch einsum", "maxsim-cpu", "lik reference")
IMPLEMENTATIONS = ("lik", *PEERS)
# lik's reference is there for context: a few calls are enough to place it.
REFERENCE_REPEATS = 3
# Parity bounds against float64 (DESIGN.md): fp32 (IEEE matmuls here) and bf16.
BOUND = {"fp32": 1e-3, "bf16": 1e-2}


@dataclass(frozen=True)
class Cell:
    name: str
    nq: int
    nd: int
    lq: int
    ld: int
    d: int
    mask: str | None = None  # None, "prefix" or "holes"
    layout: str = "dense"  # or "kd": each of the nq queries against its own nd docs

    @property
    def dims(self) -> str:
        return f"{self.nq} x {self.nd} x {self.lq} x {self.ld}, d {self.d}"


CELLS = [
    Cell("rerank", 1, 1000, 32, 300, 128),
    Cell("rerank d96", 1, 1000, 32, 300, 96),
    Cell("rerank d48", 1, 1000, 32, 300, 48),
    Cell("in-batch", 32, 32, 32, 300, 128),
    Cell("rerank, prefix mask", 1, 1000, 32, 300, 128, "prefix"),
    Cell("rerank, mask with holes", 1, 1000, 32, 300, 128, "holes"),
    Cell("in-batch, prefix mask", 32, 32, 32, 300, 128, "prefix"),
    Cell("kd rerank", 16, 64, 32, 300, 128, layout="kd"),
    Cell("kd rerank, prefix mask", 16, 64, 32, 300, 128, "prefix", layout="kd"),
]
QUICK = {("rerank", "fp32"), ("rerank", "bf16"), ("rerank, prefix mask", "fp32")}


def cpu_card() -> tuple[str, str]:
    """(the CPU's model name as /proc/cpuinfo gives it, a file-name-safe card name: the
    model and the cores this process may use, e.g. 'AMD_EPYC_2c')."""
    model = platform.processor() or platform.machine()
    try:
        text = Path("/proc/cpuinfo").read_text()
        found = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
        model = found.group(1).strip() if found else model
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    safe = re.sub(r"[^A-Za-z0-9]+", "_", model).strip("_") or "cpu"
    return model, f"{safe}_{cores}c"


def make_inputs(cell: Cell, dtype: torch.dtype, seed: int = 0):
    """(Q, D, d_mask or None, doc lengths or None) for a cell: D [Nd, Ld, d], or
    [Nq, Nd, Ld, d] for kd; d_mask and lengths D's shape without d, and without Ld."""
    docs = (cell.nq, cell.nd) if cell.layout == "kd" else (cell.nd,)
    Q = normalized_tokens(cell.nq, cell.lq, cell.d, device="cpu", seed=seed, dtype=dtype)
    D = normalized_tokens(math.prod(docs), cell.ld, cell.d, device="cpu", seed=seed + 1,
                          dtype=dtype).view(*docs, cell.ld, cell.d)  # fmt: skip
    g = torch.Generator().manual_seed(seed + 2)
    if cell.mask is None:
        return Q, D, None, None
    if cell.mask == "prefix":
        lengths = torch.randint(32, cell.ld + 1, docs, generator=g)
        return Q, D, torch.arange(cell.ld) < lengths[..., None], lengths
    mask = torch.rand(*docs, cell.ld, generator=g) < 0.7
    mask[..., 0] = True
    return Q, D, mask, None


def lik_call(Q, D, d_mask):
    layout = "kd" if D.dim() == 4 else "dense"

    def call():
        out = torch.empty(Q.shape[0], D.shape[-3])
        return cpu.forward(layout, Q, D, None, d_mask, False, out)

    return call


def _finish(sim, d_mask, doc_valid):
    """amax over doc tokens of sim [..., Nd, Ld] (the doc mask filled in place), a doc with
    no valid token scoring 0, then the fp32 sum over query tokens (axis -2 of [Nq, Lq, Nd])."""
    if d_mask is not None:
        sim.masked_fill_(~d_mask, float("-inf"))
    best = sim.amax(-1)
    if doc_valid is not None:
        best = torch.where(doc_valid, best, 0)
    return best.float()


def flat_call(Q, D, d_mask):
    """One matmul of every query token against every doc token (kd: a batched one, each
    query against its own docs)."""
    nq, lq, d = Q.shape
    nd, ld = D.shape[-3], D.shape[-2]
    kd = D.dim() == 4
    doc_valid = None if d_mask is None else d_mask.any(-1)
    if kd and d_mask is not None:  # over the query token axis of [Nq, Lq, Nd, Ld]
        d_mask, doc_valid = d_mask[:, None], doc_valid[:, None]

    def call():
        if kd:
            sim = torch.bmm(Q, D.reshape(nq, nd * ld, d).transpose(1, 2))
        else:
            sim = Q.reshape(-1, d) @ D.reshape(-1, d).T
        return _finish(sim.view(nq, lq, nd, ld), d_mask, doc_valid).sum(1)

    return call


def einsum_call(Q, D, d_mask):
    doc_valid = None if d_mask is None else d_mask.any(-1)
    kd = D.dim() == 4
    # d_mask and doc_valid over the query token axis of the similarities [Nq, Nd, Lq, Ld]
    dm = None if d_mask is None else (d_mask[:, :, None] if kd else d_mask[None, :, None])
    dv = None if doc_valid is None else (doc_valid[..., None] if kd else doc_valid[None, :, None])

    def call():
        sim = torch.einsum("isk,ijtk->ijst" if kd else "isk,jtk->ijst", Q, D)
        return _finish(sim, dm, dv).sum(-1)

    return call


def maxsim_cpu_call(Q, D, d_mask, lengths, dtype_name):
    """maxsim-cpu's call for the cell, or the reason it has none."""
    if dtype_name != "fp32":
        return "n/a (fp32 only)"
    if d_mask is not None and lengths is None:
        return "n/a (no token mask: lengths only)"
    module, error = attempt(lambda: __import__("maxsim_cpu"))
    if module is None:
        return f"n/a (not installed: {error})"
    queries = [q.numpy() for q in Q]
    score = module.maxsim_scores if lengths is None else module.maxsim_scores_variable

    def docs_of(D, lengths):  # its variable-length form: a list of each doc's valid tokens
        if lengths is None:
            return D.numpy()
        return [D[j, :length].numpy() for j, length in enumerate(lengths.tolist())]

    if D.dim() == 4:  # kd: each query against its own docs
        docs = [docs_of(D[i], None if lengths is None else lengths[i]) for i in range(len(D))]

        def call():
            pairs = zip(queries, docs, strict=True)
            return torch.stack([torch.from_numpy(score(q, d)) for q, d in pairs])
    else:
        docs = docs_of(D, lengths)

        def call():
            return torch.stack([torch.from_numpy(score(q, docs)) for q in queries])

    return call


def reference_call(Q, D, d_mask):
    return lambda: maxsim_reference(Q, D, None, d_mask).float()


def scratch_mib() -> float:
    """MiB of the scratch buffers lik.runtime.cpu holds on this thread."""
    buffers = getattr(cpu._local, "buffers", {})
    return sum(b.numel() * b.element_size() for b in buffers.values()) / 2**20


def _busy_seconds() -> tuple[float, float] | None:
    """(CPU seconds every process has run, CPU seconds this one has), or None where
    /proc/stat cannot be read."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
    total = (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return total, usage.ru_utime + usage.ru_stime


def other_load(start, stop, seconds: float) -> float | None:
    """Cores other processes kept busy between two _busy_seconds readings: a cell timed
    beside other work is slowed by more than its share (lik's many short parallel steps
    most: each waits for a thread the other work holds)."""
    if start is None or stop is None or seconds <= 0:
        return None
    return max(0.0, (stop[0] - start[0]) - (stop[1] - start[1])) / seconds


def interleaved_ms(calls: dict, repeats: int) -> dict:
    """Median ms per call of each callable, warm (two calls first), called in turn."""
    for call in calls.values():
        call()
        call()
    samples = {name: [] for name in calls}
    for round_ in range(repeats):
        for name, call in calls.items():
            if name == "lik reference" and round_ >= REFERENCE_REPEATS:
                continue
            start = time.perf_counter()
            call()
            samples[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(values) for name, values in samples.items()}


def run_cell(cell: Cell, dtype_name: str, repeats: int) -> dict:
    dtype = DTYPES[dtype_name]
    cpu._local.buffers = {}  # this cell's scratch only
    Q, D, d_mask, lengths = make_inputs(cell, dtype)
    ref = maxsim_reference(Q.double(), D.double(), None, d_mask)
    builders = {
        "lik": lik_call(Q, D, d_mask),
        "torch flat matmul": flat_call(Q, D, d_mask),
        "torch einsum": einsum_call(Q, D, d_mask),
        "maxsim-cpu": maxsim_cpu_call(Q, D, d_mask, lengths, dtype_name),
        "lik reference": reference_call(Q, D, d_mask),
    }
    results = {name: {"ms": None, "rel_err": None, "parity_ok": None, "error": None}
               for name in builders}  # fmt: skip
    calls = {}
    for name, call in builders.items():
        if isinstance(call, str):
            results[name]["error"] = call
            continue
        out, error = attempt(call)
        if error:
            results[name]["error"] = error
            continue
        err = relative_error(out, ref)
        results[name].update(rel_err=err, parity_ok=err < BOUND[dtype_name])
        calls[name] = call
    before, started = _busy_seconds(), time.perf_counter()
    for name, ms in interleaved_ms(calls, repeats).items():
        results[name]["ms"] = ms
    load = other_load(before, _busy_seconds(), time.perf_counter() - started)
    sims = cell.nq * cell.lq * cell.nd * cell.ld * torch.finfo(dtype).bits // 8
    memory = {"lik": scratch_mib(), "torch flat matmul": sims / 2**20,
              "torch einsum": sims / 2**20}  # fmt: skip
    lik_ms = results["lik"]["ms"]
    speedup = {peer: results[peer]["ms"] / lik_ms
               for peer in PEERS if lik_ms and results[peer]["ms"]}  # fmt: skip
    return {"cell": cell.name, "dims": cell.dims, "mask": cell.mask, "dtype": dtype_name,
            "results": results, "speedup_of_lik": speedup, "other_load_cores": load,
            "estimated_peak_extra_mib": memory}  # fmt: skip


def markdown(report: dict) -> str:
    env = report["env"]
    headers = ["cell", "dtype", *(f"{name} ms" for name in IMPLEMENTATIONS),
               *(f"lik vs {peer}" for peer in PEERS), "other load"]  # fmt: skip
    rows = []
    for record in report["cells"]:
        cells = [f"{record['cell']} ({record['dims']})", record["dtype"]]
        for name in IMPLEMENTATIONS:
            result = record["results"][name]
            if result["ms"] is None:
                cells.append(result["error"] or "—")
            else:
                flag = "" if result["parity_ok"] else f" (rel err {result['rel_err']:.1e}!)"
                cells.append(format_ms(result["ms"]) + flag)
        cells += [format_ratio(record["speedup_of_lik"].get(peer)) if peer in
                  record["speedup_of_lik"] else "n/a" for peer in PEERS]  # fmt: skip
        load = record["other_load_cores"]
        cells.append("—" if load is None else f"{load:.2f}")
        rows.append(cells)
    memory_rows = [[f"{r['cell']} ({r['dims']})", r["dtype"],
                    *(f"{r['estimated_peak_extra_mib'][k]:.1f}"
                      for k in ("lik", "torch flat matmul", "torch einsum"))]
                   for r in report["cells"]]  # fmt: skip
    return (
        f"# lik's CPU backend on {report['cpu']} ({report['threads']} threads)\n\n"
        f"{provenance(env)}\n\n"
        f"Median ms of warm calls ({report['repeats']} each, {REFERENCE_REPEATS} for lik's "
        "reference), implementations interleaved call by call; \"lik vs X\" is X's time "
        "over lik's (above 1: lik is faster). Unit-norm inputs; every output checked "
        "against float64 (fp32 < 1e-3, bf16 < 1e-2; a failing one is flagged). \"other "
        "load\": cores other processes kept busy while the cell ran (/proc/stat less this "
        "process); a cell timed beside other work is no measure of either.\n\n"
        + markdown_table(headers, rows)
        + "\n\nEstimated peak extra memory (MiB): lik's scratch buffers after the call; the "
        "compositions' materialized similarities (maxsim-cpu's is not known here).\n\n"
        + markdown_table(
            ["cell", "dtype", "lik", "torch flat matmul", "torch einsum"], memory_rows
        )  # fmt: skip
        + "\n"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--quick", action="store_true", help="three cells, 5 calls each")
    parser.add_argument("--repeats", type=int, default=None, help="calls per implementation")
    args = parser.parse_args(argv)
    repeats = args.repeats or (5 if args.quick else 11)
    model, card = cpu_card()
    env = environment_info(["maxsim-cpu", "numpy"])
    env["gpu"] = card  # the card results are stamped with (common.stamped)
    report = {"env": env, "cpu": model, "threads": torch.get_num_threads(),
              "repeats": repeats, "cells": []}  # fmt: skip
    for cell in CELLS:
        for dtype_name in DTYPES:
            if args.quick and (cell.name, dtype_name) not in QUICK:
                continue
            record = run_cell(cell, dtype_name, repeats)
            report["cells"].append(record)
            times = ", ".join(f"{name} {format_ms(r['ms'])}" for name, r in
                              record["results"].items() if r["ms"] is not None)  # fmt: skip
            print(f"{cell.name} {dtype_name}: {times}; other load "
                  f"{record['other_load_cores']}", flush=True)  # fmt: skip
    text = markdown(report)
    categories = [f"{r['cell']} {r['dtype']}" for r in report["cells"]]
    series = {f"vs {peer}": [r["speedup_of_lik"].get(peer) for r in report["cells"]]
              for peer in PEERS}  # fmt: skip
    title = f"lik.runtime.cpu on {model} ({report['threads']} threads)"
    write_results(args.out, result_stem("cpu", card), report, text, (categories, series, title))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
