"""The read-alone ceiling's kernels (benchmarks/read_ceiling.py) read every element: a
reader that skipped some would report a ceiling faster than any real read."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
read_ceiling = pytest.importorskip("read_ceiling")

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="interpreter check; on a GPU the benchmark runs it"
)


@pytest.mark.parametrize("evict_first", [False, True])
@pytest.mark.parametrize("n", [1, 4095, 4096 * 3 + 17])
def test_read_kernels_sum_every_element(n, evict_first):
    x = torch.rand(n, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)
    expected = x.double().sum().item()
    block = 4096
    partial = torch.zeros(8)
    read_ceiling._stream_sum[(3,)](x, partial, n, BLOCK=block, EVICT_FIRST=evict_first)
    assert partial.double().sum().item() == pytest.approx(expected, rel=1e-5)
    blocks = -(-n // block)
    partial = torch.zeros(blocks + 2)
    read_ceiling._block_sum[(blocks,)](x, partial, n, BLOCK=block, EVICT_FIRST=evict_first)
    assert partial[blocks:].abs().sum().item() == 0  # one partial per block, no more
    assert partial.double().sum().item() == pytest.approx(expected, rel=1e-5)


def test_plaid_sweep_winners_become_table_entries(tmp_path):
    """bench_plaid --sweep --write-table: each case's fastest config per layout becomes
    the entry `make tune` would write, and the table reads back through tomllib."""
    import tomllib

    bench_plaid = pytest.importorskip("bench_plaid")
    from tune import table_entry, write_table

    from lik.runtime.tuning import LaunchConfig

    winner = LaunchConfig(32, 64, 128, num_warps=4, num_stages=1)
    sweeps = {
        "1000 docs, nbits 2": {
            "dense": {"entry": table_entry(winner, [0.0525], "plaid-1000-nbits2"),
                      "table_key": "a_res2|128|32|s|q1"},
            "varlen": {"entry": None, "table_key": "b_res2|128|32|s|q1"},
        },
    }  # fmt: skip
    entries = bench_plaid.table_entries(sweeps, "NVIDIA H100 80GB HBM3")
    assert entries == {"a_res2|128|32|s|q1": {
        "block_l": 64, "num_warps": 4, "num_stages": 1, "query_group": 1, "block_n": 8,
        "ms": 0.0525, "shape": "plaid-1000-nbits2", "card": "NVIDIA H100 80GB HBM3"}}  # fmt: skip
    kept = {"other|128|32|m|q1": {"block_l": 32, "num_warps": 8, "num_stages": 3}}
    write_table(tmp_path / "hopper.toml", "hopper", {**kept, **entries})
    table = tomllib.loads((tmp_path / "hopper.toml").read_text())["configs"]
    assert table == {**kept, **entries}


def test_plaid_sweep_winners_can_go_to_the_card_s_own_table(tmp_path, monkeypatch):
    import tomllib

    import lik.runtime.keys

    bench_plaid = pytest.importorskip("bench_plaid")
    monkeypatch.setattr(lik.runtime.keys, "gpu_family", lambda device: "hopper")
    monkeypatch.setattr(lik.runtime.keys, "gpu_card", lambda device: "NVIDIA H200")
    entries = {"a_res2|128|32|s|q1": {"block_l": 64, "num_warps": 4, "num_stages": 1,
                                      "card": "NVIDIA H200"}}  # fmt: skip
    bench_plaid.write_sweep_table(tmp_path, entries, card=True)
    text = (tmp_path / "hopper" / "NVIDIA_H200.toml").read_text()
    assert text.startswith("# Launch configs of NVIDIA H200 cards")
    table = tomllib.loads(text)["configs"]
    # The committed H200 entries are kept, the swept one added.
    assert table["a_res2|128|32|s|q1"] == entries["a_res2|128|32|s|q1"]
    assert "maxsim_dense_nomask_bf16_triton|128|128|s|q1" in table
    assert not (tmp_path / "hopper.toml").exists()


def test_forward_report_has_the_clean_l2_table_for_memory_bound_shapes():
    """The clean-L2 table lists the memory-bound shapes timed that way, with lik against
    the faster peer, and is left out of a run that has none."""
    bench_forward = pytest.importorskip("bench_forward")

    def result(ms, clean):
        return {**bench_forward.empty_result(None), "ms": ms, "clean_l2_ms": clean}

    memory = {
        "name": "text-long", "Nq": 1, "Nd": 1000, "Lq": 32, "Ld": 1024, "d": 128,
        "floor_ms": 0.087, "bound": "memory", "read_docs_ms": 0.093,
        "read_docs_clean_l2_ms": 0.086,
        "results": {"lik": result(0.100, 0.091), "late_interaction_kernels": result(0.102, 0.095),
                    "flash_maxsim": result(0.105, 0.093)},
    }  # fmt: skip
    # The bound alone decides the rows: a compute-bound record stays out even with clean
    # times in it.
    compute = {**memory, "name": "longdoc", "bound": "compute"}
    report = {"implementations": list(bench_forward.IMPLEMENTATIONS), "shapes": [memory, compute]}
    table = bench_forward.clean_l2_table(report)
    rows = [line for line in table.splitlines() if line.startswith("| text-long")]
    assert len(rows) == 1 and "longdoc" not in table
    cells = [cell.strip() for cell in rows[0].strip("|").split("|")]
    assert cells[3:6] == ["0.091", "0.095", "0.093"]  # lik, LIK, flash with L2 clean
    assert cells[6] == "95.60%" and cells[8] == "1.02x"  # 0.087 / 0.091; 0.093 / 0.091
    assert bench_forward.clean_l2_table({**report, "shapes": [compute]}) is None



def test_bench_backward_report_names_auto_s_pick_and_whether_it_was_the_faster():
    bench_backward = pytest.importorskip("bench_backward")
    env = {"date": "today", "commit": "abc", "torch": "2.11", "triton": "3.6"}

    def shape(name, dims, auto, unified, lowmem):
        return {"name": name, "dims": dims, "auto": auto,
                "cells": {"unified": unified, "lowmem": lowmem}}  # fmt: skip

    fast = {"graph_ms": 0.02, "peak_mib": 1.3, "grad_q_err": 4e-3, "grad_d_err": 1e-3,
            "error": None, "graph_error": None}  # fmt: skip
    slow = {**fast, "graph_ms": 0.05, "peak_mib": 3.9, "grad_d_err": 5e-3}
    dims = [32, 300, 128]
    faster = {**fast, "graph_ms": 0.03}
    report = {"env": env, "gpu": "GPU", "autotune": False, "lopsided": 64, "shapes": [
        shape("16 x 16", [16, 16, *dims], "lowmem", [slow, slow], [fast, faster]),
        shape("256 x 8", [256, 8, *dims], "lowmem", [fast], [{**slow, "grad_q_err": 0.1}]),
        shape("1 x 1000", [1, 1000, *dims], "unified", [fast], [{"error": "OutOfMemory"}]),
        shape("varlen 8 x 8", [8, 8, "16-32", "50-300", 128], "lowmem", [slow], [fast]),
    ]}  # fmt: skip
    lines = bench_backward.markdown(report).splitlines()
    rows = {line.split("|")[1].strip(): [cell.strip() for cell in line.strip("|").split("|")]
            for line in lines if line.startswith("| ")}  # fmt: skip
    assert rows["16 x 16"][1:] == ["16, 16, 32, 300, 128", "0.0500 / 3.90", "0.0200 / 1.30",
                                   "2.50x", "lowmem", "yes", "5.0e-03"]  # fmt: skip
    assert rows["256 x 8"][4:7] == ["0.40x", "lowmem", "no"]
    assert rows["256 x 8"][7] == "1.0e-01 (over 2e-2)"
    assert rows["1 x 1000"][3:7] == ["OutOfMemory", "", "unified", ""]
    assert rows["varlen 8 x 8"][1:5] == ["8, 8, 16-32, 50-300, 128", "0.0500 / 3.90",
                                         "0.0200 / 1.30", "2.50x"]  # fmt: skip
    assert "(LIK_AUTOTUNE=0)" in bench_backward.markdown(report)


def test_autotune_report_names_each_way_s_first_calls_and_the_winners():
    bench_autotune = pytest.importorskip("bench_autotune")
    entry = {"block_l": 64, "num_warps": 2, "num_stages": 3, "ms": 0.18}
    stall = {"first_s": 5.5, "sweeps": 1, "entry": entry, "error": 2e-7}
    tuned = {"first_s": 3.0, "sweeps": 2, "step_ms": 0.11, "error": 4e-3,
             "entries": {"x|bwd|h": {**entry, "num_stages": 1}, "x|h": entry}}  # fmt: skip
    report = {
        "env": {"date": "today", "commit": "abc", "torch": "2.11", "triton": "3.6"}, "cpus": 16,
        "gpu": "GPU",
        "shapes": [{"name": "1 x 10000", "cells": {"one after another": [stall],
                                                   "side by side": [{**stall, "first_s": 2.9}]}}],
        "training": [{"name": "kd", "cells": {
            "defaults (LIK_AUTOTUNE=0)": [{"failed": "OutOfResources"}],
            "forward autotuned": [{**tuned, "step_ms": 0.15}], "autotuned": [tuned]}}],
    }  # fmt: skip
    text = bench_autotune.markdown(report)
    assert "| 1 x 10000 | 5.5 | 2.9 | 64 tokens, 2 warps, stages 3 (2 of 2)" in text
    assert "16 CPU cores" in text
    training = bench_autotune.training_markdown(report)
    row = next(line for line in training.splitlines() if line.startswith("| kd"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[1:5] == ["OutOfResources", "0.1500", "0.1100", "3.0 s (2 sweeps)"]
    assert "backward 64 tokens, 2 warps, stages 1 (1 of 1)" in row and "4.0e-03" in row


def test_make_bench_and_the_gpu_session_run_every_benchmark():
    import re

    root = Path(__file__).resolve().parents[1]
    scripts = (root / "benchmarks").glob("bench_*.py")
    # bench_cpu is the CPU suite (make bench-cpu), not a GPU session's.
    benches = {path.stem.removeprefix("bench_") for path in scripts} - {"cpu"}
    make = re.search(r"^BENCHES := (.*)$", (root / "Makefile").read_text(), re.M).group(1)
    assert set(make.split()) == benches
    session = (root / "benchmarks" / "gpu_session.sh").read_text()
    extras = re.search(r"^for extra in (.*); do$", session, re.M).group(1).split()
    assert {"forward", "train", *extras} == benches  # forward and train run by default
    assert all(f"RUN_{name.upper()}" in session for name in extras)


@pytest.mark.parametrize("layout", ["dense", "kd"])
@pytest.mark.parametrize("mask", [None, "prefix", "holes"])
def test_bench_cpu_checks_every_implementation_of_a_cell_against_float64(layout, mask):
    bench_cpu = pytest.importorskip("bench_cpu")
    cell = bench_cpu.Cell("tiny", 2, 3, 4, 40, 8, mask, layout)  # prefix lengths from 32
    for dtype in bench_cpu.DTYPES:
        record = bench_cpu.run_cell(cell, dtype, repeats=1)
        for name, result in record["results"].items():
            if name == "maxsim-cpu" and result["error"]:  # fp32 and lengths only; optional
                continue
            assert result["error"] is None and result["parity_ok"], (name, dtype, result)
        assert record["speedup_of_lik"]


def test_the_training_floor_counts_a_steps_least_traffic_and_its_forward_flops():
    bench_train = pytest.importorskip("bench_train")
    import shapes
    from common import Shape

    cell = shapes.Cell(Shape("kd", 4, 3, 8, 20, 16), axes=("layout",), layout="kd")
    ceilings = {"copy_tbps": 2.0, "matmul_tflops": 1e-6}  # a slow matmul: compute binds
    # Q 4 x 8 and 4 x 3 docs of 20 tokens, d 16, bf16, read once and their gradients
    # written once; 12 fp32 scores written and their gradient read.
    moved = 2 * (4 * 8 + 12 * 20) * 16 * 2 + 2 * 12 * 4
    assert cell.train_bytes_moved() == moved
    flops = 2 * 12 * 8 * 20 * 16
    compute = bench_train.train_floor(cell, ceilings)
    assert compute == {"floor_ms": pytest.approx(flops / 1e6 * 1e3), "bound": "compute"}
    memory = bench_train.train_floor(cell, {**ceilings, "matmul_tflops": 1e3})
    assert memory == {"floor_ms": pytest.approx(moved / 2e12 * 1e3), "bound": "memory"}
    assert bench_train.train_floor(cell, None)["floor_ms"] is None
    report = {"ceilings": ceilings, "cells": [{"layout": "kd", "pct_floor": 61.0},
                                              {"layout": "kd", "pct_floor": 87.0},
                                              {"layout": "dense", "pct_floor": 20.0}]}  # fmt: skip
    assert "KD cells: lik at 61-87% of their floor." in bench_train.floor_line(report)


def test_the_fp8_floor_is_the_longer_of_bytes_at_the_copy_rate_and_flops_at_the_dtypes_rate():
    bench_fp8 = pytest.importorskip("bench_fp8")
    from common import Shape

    shape = Shape("fp8", 8, 100, 32, 64, 128)
    # fp8 rows: one byte per element, and scales (two per-tensor ones, or one per token).
    tokens = 8 * 32 + 100 * 64
    fp8_bytes = tokens * 128 + 4 * 2 + 8 * 100 * 4
    assert bench_fp8.floor_bytes(shape, "fp8", "tensor") == fp8_bytes
    assert bench_fp8.floor_bytes(shape, "fp8", "token") == fp8_bytes - 8 + 4 * tokens
    flops = 2 * 8 * 100 * 32 * 64 * 128
    fast = {"copy_tbps": 1.0, "matmul_tflops": 1e6, "fp8_matmul_tflops": 1e6}
    assert bench_fp8.floor_ms(shape, "fp8", "tensor", fast) == {
        "floor_ms": pytest.approx(fp8_bytes / 1e12 * 1e3), "bound": "memory"}  # fmt: skip
    # A slow fp8 matmul binds the fp8 rows, and only them: bf16 rows use the bf16 rate.
    slow_fp8 = {**fast, "fp8_matmul_tflops": 1e-6}
    assert bench_fp8.floor_ms(shape, "fp8", "token", slow_fp8) == {
        "floor_ms": pytest.approx(flops / 1e6 * 1e3), "bound": "compute"}  # fmt: skip
    assert bench_fp8.floor_ms(shape, "bf16", None, slow_fp8)["bound"] == "memory"
    # No fp8 matmul on the card: the fp8 floor counts bytes alone.
    unmeasured = {**slow_fp8, "fp8_matmul_tflops": None}
    assert bench_fp8.floor_ms(shape, "fp8", "tensor", unmeasured)["bound"] == "memory"
