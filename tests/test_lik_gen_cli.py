"""The lik-gen command line: which checkout it acts on, --filter checks, a closed pipe."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lik_gen import cli
from lik_gen.cli import main

ROOT = Path(__file__).resolve().parent.parent
SMALL_SPEC = """
[small]
op = "maxsim"
layout = ["dense", "kd"]
mask = "none"
dtype = "bf16"
target = "triton"
"""


@pytest.fixture
def checkout(tmp_path):
    """Another lik checkout: lik's pyproject name, a small spec, the real templates."""
    root = tmp_path / "other"
    (root / "specs").mkdir(parents=True)
    (root / "specs" / "small.toml").write_text(SMALL_SPEC)
    (root / "pyproject.toml").write_text('[project]\nname = "lik"\n')
    shutil.copytree(ROOT / "templates", root / "templates")
    return root


def _manifest_mtime() -> int:
    return (ROOT / "generated" / "MANIFEST.json").stat().st_mtime_ns


def test_acts_on_the_checkout_of_the_working_directory(checkout, monkeypatch, capsys):
    before = _manifest_mtime()
    monkeypatch.chdir(checkout / "specs")  # a folder inside it: found by walking up
    assert main(["generate"]) == 0
    kernel = checkout / "generated" / "triton" / "maxsim_kd_triton.py"
    assert kernel.is_file()
    assert main(["check"]) == 0
    kernel.write_text(kernel.read_text() + "# a hand edit\n")
    capsys.readouterr()
    assert main(["check"]) == 1  # that checkout's hand edit, not this one's clean tree
    assert "maxsim_kd_triton.py" in capsys.readouterr().err
    assert _manifest_mtime() == before, "wrote into the tree lik-gen was installed from"


def test_root_names_the_checkout(checkout, tmp_path, monkeypatch):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main(["--root", str(checkout), "generate"]) == 0
    assert (checkout / "generated" / "MANIFEST.json").is_file()
    assert main(["--root", str(checkout), "check"]) == 0
    assert list(elsewhere.iterdir()) == []


def test_a_root_that_is_no_checkout_exits_2(tmp_path, capsys):
    assert main(["--root", str(tmp_path), "list"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lik-gen list: error: argument --root: ") and "not a lik checkout" in err


def test_a_pyproject_of_another_project_is_no_checkout(checkout):
    (checkout / "pyproject.toml").write_text('[project]\nname = "other"\n')
    assert cli.find_checkout(checkout / "specs") is None
    assert cli.find_checkout(ROOT / "lik_gen") == ROOT


@pytest.mark.parametrize("command", ["generate", "check"])
def test_outside_a_checkout_generate_and_check_write_nothing(
    tmp_path, monkeypatch, capsys, command
):
    monkeypatch.chdir(tmp_path)
    assert main([command]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"lik-gen {command}: error: no lik checkout at or above ")
    assert "--root" in err and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_outside_a_checkout_list_reads_the_installed_specs(tmp_path, monkeypatch, capsys):
    if cli.packaged("specs") is None or cli.packaged("templates") is None:
        pytest.skip("lik is not installed here (no package data to read)")
    assert (cli.packaged("specs") / "maxsim.toml").is_file()
    monkeypatch.chdir(tmp_path)
    assert main(["list", "--filter", "layout=kd", "--filter", "dtype=bf16"]) == 0
    names = capsys.readouterr().out.split()
    assert names and all("_kd_" in n and "_bf16_" in n for n in names)


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("dtype=fp8", "argument --filter: dtype has no value 'fp8' (allowed: "),
        ("dtipe=fp8", "argument --filter: unknown axis 'dtipe' in 'dtipe=fp8' (axes: op, "),
        ("normalize=yes", "argument --filter: normalize has no value 'yes' (allowed: false, true)"),
    ],
)
def test_filter_rejects_an_unknown_axis_or_value(text, fragment, capsys):
    assert main(["list", "--filter", text]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"lik-gen list: error: {fragment}"), err
    if text.startswith("dtype"):
        assert "fp8e4m3" in err


def test_filter_values_as_a_spec_writes_them(capsys):
    assert main(["list", "--filter", "dtype=fp8e4m3", "--filter", "mask=qd"]) == 0
    assert capsys.readouterr().out.split() == ["maxsim_dense_qdmask_fp8_triton"]
    assert main(["list", "--filter", "normalize=True", "--filter", "layout=kd"]) == 0
    names = capsys.readouterr().out.split()
    assert names and all("_kd_" in n and "_norm" in n for n in names)


def test_a_closed_pipe_stops_quietly():
    done = subprocess.run(
        f"'{sys.executable}' -m lik_gen list | head -n 2",
        shell=True,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert len(done.stdout.splitlines()) == 2
    assert done.stderr == "", done.stderr
