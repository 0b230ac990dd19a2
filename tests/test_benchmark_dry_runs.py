"""Every benchmark with a --dry-run runs end to end on the CPU (tiny shapes, lik's
reference paths, or its PLAID kernels under the interpreter; no peers) and reports lik's
results as checked against float64: a GPU run then fails on the GPU, not on a typo in a
report. The kernels themselves are tested elsewhere, so the dry runs take the CPU paths
(without TRITON_INTERPRET, which the suite sets): seconds each instead of minutes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _dry_run(name: str, out: Path, *flags: str, suite: str | None = None) -> tuple[dict, str]:
    script = [sys.executable, str(BENCHMARKS / f"bench_{name}.py"), *flags]
    done = subprocess.run(
        [*script, "--dry-run", "--out", str(out)], capture_output=True, text=True, timeout=600,
        env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (report_path,) = out.glob(f"{suite or name}/*_dry-run.json")  # <suite>/<card>_dry-run.*
    markdown = report_path.with_suffix(".md").read_text()
    return json.loads(report_path.read_text()), markdown


def _lik_results(name: str, report: dict) -> list[dict]:
    """lik's own results in a report, one per shape (and implementation variant)."""
    if name == "plaid":
        return [result for case in report["cases"].values()
                for impl, result in case["impl"].items() if impl.startswith("lik ")]  # fmt: skip
    if name == "retrieve":
        return [result for case in report["cases"] for result in case["results"]
                if result["impl"] == "lik"]  # fmt: skip
    if name == "backward":  # every strategy's run of every step, each round
        return [run for shape in report["shapes"] for runs in shape["cells"].values()
                for run in runs]  # fmt: skip
    if name == "cold_start":  # every child: the empty-cache one, then each mode's
        return [run for shape in report["shapes"]
                for run in [shape["empty_cache"], *(r for runs in shape["warm_cache"].values()
                                                    for r in runs)]]  # fmt: skip
    if name == "ragged":
        return [result for case in report["cases"].values()
                for impl, result in case.items() if impl.startswith("lik")]  # fmt: skip
    return [result for shape in report["shapes"]
            for impl, result in shape["results"].items()
            if impl == "lik" or impl.startswith(("lik_", "lik-"))]  # fmt: skip


DRY_RUNS = ["forward", "train", "head", "fp8", "retrieve", "plaid", "ragged", "variants",
            "backward", "cold_start", "pylate"]  # fmt: skip


def test_every_benchmark_with_a_dry_run_is_run_here():
    offered = {path.stem.removeprefix("bench_") for path in BENCHMARKS.glob("bench_*.py")
               if '"--dry-run"' in path.read_text()}  # fmt: skip
    assert offered == set(DRY_RUNS)


@pytest.mark.parametrize("name", DRY_RUNS)
def test_a_benchmark_s_dry_run_reports_lik_checked_on_every_shape(name, tmp_path):
    report, markdown = _dry_run(name, tmp_path)
    assert markdown.startswith("# ") and "\n| " in markdown
    results = _lik_results(name, report)
    assert results, f"bench_{name} reported no lik result"
    for result in results:
        assert result["error"] is None, result
        if name == "retrieve":
            assert result["topk_ok"], result
        elif name == "plaid":
            assert result["parity_rel_err"] < 1e-3, result
        else:
            assert result["parity_ok"], result
        if "grad_rel_err" in result:  # training rows: every gradient against float64
            assert max(result["grad_rel_err"].values()) < 1e-2, result


# The grids' suites, their cells, and the key of lik as a call gets it.
GRIDS = {"forward": ("GRID_FORWARD", "lik"), "train": ("GRID_TRAIN", "lik-auto")}


@pytest.mark.parametrize("name", GRIDS)
def test_a_grid_dry_run_reports_every_cell_checked_and_why_a_peer_cannot_take_one(name, tmp_path):
    sys.path.insert(0, str(BENCHMARKS))
    import grid
    import shapes

    report, markdown = _dry_run(name, tmp_path, "--grid", suite=f"{name}_grid")
    cells, lik = getattr(shapes, GRIDS[name][0]), GRIDS[name][1]
    assert [record["name"] for record in report["cells"]] == [cell.name for cell in cells]
    for cell, record in zip(cells, report["cells"], strict=True):
        assert f"| {cell.name} | {', '.join(cell.axes)} |" in markdown
        assert record["results"][lik]["error"] is None and record["results"][lik]["parity_ok"]
        eager = record["results"]["eager"]  # parity is recorded, and flagged where it fails
        assert eager["parity_ok"] is not None and eager["error"] is None
        flash = record["results"]["flash_maxsim" if name == "forward" else "flash"]
        assert (flash["not_applicable"] == "no holes") == cell.holes, (cell.name, flash)
        # A peer is either skipped here (no GPU) or cannot take the cell, never dropped.
        for result in record["results"].values():
            assert result["not_applicable"] or result["parity_ok"] is not None or (
                result["error"] == "skipped in dry run"), (cell.name, result)  # fmt: skip
    used = {result["not_applicable"] for record in report["cells"]
            for result in record["results"].values() if result["not_applicable"]}  # fmt: skip
    assert "no holes" in used
    for code in used:
        assert f"n/a ({code})" in markdown and grid.NOT_APPLICABLE[code] in markdown
    assert "## Parity" in markdown or "## Gradient check" in markdown
    # --render redraws a saved report: the same Markdown, and its plot where it can.
    (saved,) = tmp_path.glob(f"{name}_grid/*_dry-run.json")
    rendered = tmp_path / "rendered"
    done = subprocess.run([sys.executable, str(BENCHMARKS / f"bench_{name}.py"), "--render",
                           str(saved), "--out", str(rendered)], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (again,) = rendered.glob(f"{name}_grid/*.md")
    assert again.read_text() == markdown


def test_the_fp8_grid_dry_run_checks_lik_on_every_cell(tmp_path):
    sys.path.insert(0, str(BENCHMARKS))
    import shapes

    report, markdown = _dry_run("fp8", tmp_path, "--grid", suite="fp8_grid")
    assert [record["name"] for record in report["shapes"]] == [s.name for s in shapes.GRID_FP8]
    assert len(set(s.name for s in shapes.GRID_FP8)) == len(shapes.GRID_FP8)
    for record in report["shapes"]:
        for key in ("lik_fp8_tensor", "lik_fp8_token", "lik_bf16"):
            assert record["results"][key]["parity_ok"], (record["name"], key)
        assert "sweep" not in record  # the grid runs no config sweep
    assert markdown.startswith("# FP8 rerank grid on ") and "worst" in markdown


def test_the_retrieve_grid_dry_run_checks_lik_on_every_case(tmp_path):
    report, markdown = _dry_run("retrieve", tmp_path, "--grid", suite="retrieve_grid")
    sys.path.insert(0, str(BENCHMARKS))
    import bench_retrieve

    names = [case.name for case in bench_retrieve.GRID_CASES]
    assert [record["name"] for record in report["cases"]] == names and len(set(names)) == len(names)
    assert {record["top_k"] for record in report["cases"]} == {10, 100}
    for record in report["cases"]:
        chunks = [r["chunk"] for r in record["results"] if r["impl"] == "lik"]
        assert len(chunks) == 2 and None in chunks  # chunked and unchunked
        assert all(r["topk_ok"] for r in record["results"]), record["name"]
    # Which corpora the peer can index: below 2^31 doc elements.
    peers = {case.name: case.peers for case in bench_retrieve.GRID_CASES}
    assert peers["corpus-100k"] and not peers["corpus-1m"] and not peers["corpus-100k-ld300"]
    assert "chunked over unchunked: worst" in markdown and "| top k |" in markdown


def test_the_soak_checks_the_kernels_against_the_reference(tmp_path):
    # Under the interpreter, tiny sizes: the same cases a GPU soak draws, scaled down.
    soak = [sys.executable, str(BENCHMARKS / "soak.py"), "--dry-run"]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([*soak, "--seconds", "8", "--workers", "2", "--out", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads((tmp_path / "soak" / "cpu_dry-run.json").read_text())
    assert report["result"]["failures"] == [] and report["result"]["cut_off"] == []
    assert report["result"]["workers"] == {"asked": 2, "reported": 2}
    cases = report["result"]["cases"]
    assert sum(cases.values()) >= 10 and cases.get("maxsim, gradients", 0) >= 1
    assert "| maxsim |" in (tmp_path / "soak" / "cpu_dry-run.md").read_text()
    replayed = subprocess.run([*soak, "--case", "12345"], env=env, capture_output=True,
                              text=True, timeout=120)  # fmt: skip
    assert replayed.returncode == 0 and "case 12345: " in replayed.stdout, replayed.stderr[-2000:]


def test_make_soak_starts_the_soak():
    # make soak runs on a GPU machine only; here its command line must reach the script's
    # argument parsing (it once ran with python3 -P, which left the script's own folder,
    # where its helpers live, off the import path).
    recipe = subprocess.run(["make", "-s", "-n", "soak"], cwd=BENCHMARKS.parent,
                            capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
    assert recipe[0] == "python3" and "benchmarks/soak.py" in recipe
    done = subprocess.run([sys.executable, *recipe[1:], "--help"], cwd=BENCHMARKS.parent,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0 and "--seconds" in done.stdout, done.stderr[-2000:]


def test_the_read_once_ceiling_counts_each_masked_doc_up_to_its_last_valid_token():
    sys.path.insert(0, str(BENCHMARKS))
    import grid
    import torch

    docs = torch.randn(3, 5, 2)
    d_mask = torch.tensor([[1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)
    masked = grid.Inputs(q=torch.randn(1, 2, 2), docs=docs, d_mask=d_mask)
    # The padded ends go, the hole between valid tokens stays, an empty doc reads nothing.
    assert torch.equal(grid.read_once_docs(masked), torch.cat([docs[0, :2], docs[1, :3]]))
    assert grid.given_docs(masked) is docs
    assert grid.read_once_docs(grid.Inputs(q=masked.q, docs=docs)) is docs
