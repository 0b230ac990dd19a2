"""benchmarks/results/ is a record: one result per suite and card, each named by a doc,
each stamped with its card and the commit it measured (read from git, never typed)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "benchmarks"))
common = pytest.importorskip("common")

# Every suite a script writes: bench_<suite>.py, its grid (<suite>_grid) where it takes
# --grid, and the soak.
SCRIPTS = {p.stem.removeprefix("bench_"): p for p in (ROOT / "benchmarks").glob("bench_*.py")}
SUITES = {*SCRIPTS, "soak"}
SUITES |= {f"{name}_grid" for name, script in SCRIPTS.items() if '"--grid"' in script.read_text()}
CARD = re.compile(r"[A-Z]{1,2}\d{2,4}[A-Za-z]?")
# The CPU suite's cards: vendor and model, then the cores the run had ("AMD_EPYC_2c",
# "Intel_R_Xeon_R_Processor_2c").
CPU_CARD = re.compile(r"[A-Za-z]+(_[A-Za-z0-9]+)*_\d+c")
FILES = sorted(p for p in RESULTS.rglob("*") if p.is_file())
JSONS = [p for p in FILES if p.suffix == ".json"]
DOCS = [
    ROOT / "README.md",
    ROOT / "benchmarks" / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
]


def _docs_text() -> str:
    return "\n".join(doc.read_text() for doc in DOCS if doc.is_file())


def test_there_are_results():
    assert JSONS, "benchmarks/results holds no result"


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(RESULTS)))
def test_every_file_is_a_suite_s_latest_result_for_one_card(path):
    relative = path.relative_to(RESULTS)
    assert len(relative.parts) == 2, f"{relative}: results go to <suite>/<card>.<ext>"
    suite, name = relative.parts
    assert suite in SUITES, f"{relative}: no benchmark writes suite {suite!r}"
    card = CPU_CARD if suite == "cpu" else CARD
    assert card.fullmatch(path.stem), f"{relative}: {path.stem!r} is not a card's short name"
    assert path.suffix in (".json", ".md", ".png"), relative
    assert path.with_suffix(".json").is_file(), f"{relative} has no JSON beside it"


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(RESULTS)))
def test_every_file_is_named_by_a_doc(path):
    name = f"results/{path.relative_to(RESULTS).as_posix()}"
    assert name in _docs_text(), f"no doc names {name} (docs/performance.md lists results)"


@pytest.mark.parametrize("path", JSONS, ids=lambda p: str(p.relative_to(RESULTS)))
def test_every_result_records_its_card_and_commit(path):
    report = json.loads(path.read_text())
    env = report.get("env") or report.get("environment") or {}
    card = report.get("card") or common.gpu_tag(env.get("gpu") or "")
    commit = report.get("commit") or env.get("commit")
    assert card == path.stem, f"{path.name}: measured on {env.get('gpu')!r}"
    assert isinstance(commit, str) and common.COMMIT_PATTERN.fullmatch(
        commit
    ), f"{path.name}: commit {commit!r} is not one git names"


def test_docs_name_no_result_that_is_not_there():
    named = set(re.findall(r"benchmarks/results/([\w./-]+?\.(?:json|md|png))", _docs_text()))
    missing = sorted(name for name in named if not (RESULTS / name).is_file())
    assert not missing, f"docs name results that are not committed: {missing}"


def test_the_writer_stamps_card_and_commit_from_git(tmp_path):
    report = {"env": common.environment_info(), "rows": []}
    stem = common.result_stem("forward", "NVIDIA H200")
    assert stem == "forward/H200"
    assert common.result_stem("forward", "cpu", dry_run=True) == "forward/cpu_dry-run"
    common.write_results(tmp_path, stem, report, "# table\n")
    written = json.loads((tmp_path / "forward" / "H200.json").read_text())
    assert written["card"] == common.gpu_tag(common.gpu_name())
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True)  # fmt: skip
    if head.returncode != 0:
        assert written["commit"] is None  # no git here: no commit, never a typed one
        return
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain"],
                           capture_output=True, text=True).stdout.strip()  # fmt: skip
    assert written["commit"] == head.stdout.strip() + ("+dirty" if dirty else "")
    assert (tmp_path / "forward" / "H200.md").read_text() == "# table\n"
