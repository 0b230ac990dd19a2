"""Packaging: the dev env's editable install, the console script, and a built wheel.

runtime/ and generated/ sit at the top of the checkout but import as lik.runtime and
lik.generated (package-dir mapping in pyproject.toml); these tests make sure both the
editable install and a wheel honour that mapping and ship the generated kernels.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def _run(args, cwd, extra_env=None, **kw):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(extra_env or {})
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, **kw)


def test_imports():
    import lik
    import lik.runtime
    from lik.runtime import maxsim, maxsim_pairs

    assert lik.maxsim is maxsim and lik.maxsim_pairs is maxsim_pairs
    assert callable(lik.describe_backend)
    assert isinstance(lik.__version__, str)


def test_import_without_prewarm_does_not_load_triton(tmp_path):
    # Triton is optional (the `triton` extra) and slow to import: kernels load on first use.
    code = "import sys, lik; assert 'triton' not in sys.modules, 'import lik imported triton'"
    proc = _run([sys.executable, "-c", code], cwd=tmp_path, extra_env={"LIK_PREWARM": "0"})
    assert proc.returncode == 0, proc.stderr


def test_prewarm_imports_triton_and_keys_its_cache_in_a_background_thread(tmp_path):
    # Two fresh processes on one Triton cache folder: the first hashes Triton's files for
    # its cache key and saves it, the second reads the saved key instead of hashing.
    code = (
        "import threading, lik\n"
        "(thread,) = [t for t in threading.enumerate() if t.name == 'lik-prewarm']\n"
        "assert thread.daemon\n"
        "lik.runtime.prewarm.wait()  # what the first kernel load does\n"
        "assert not thread.is_alive()\n"
        "import triton.runtime.cache as triton_cache\n"
        "from triton.runtime.build import platform_key\n"
        "assert platform_key.cache_info().currsize == 1, 'no platform key'\n"
        "import torch\n"
        "assert torch.cuda.is_initialized() is False, 'the warm-up must not start CUDA'\n"
        "assert lik.runtime.tuning._read_table.cache_info().currsize >= 1, 'no table read'\n"
        "hashed = hasattr(triton_cache.triton_key, 'cache_info')\n"
        "if hashed:\n"
        "    assert triton_cache.triton_key.cache_info().currsize == 1, 'no cache key'\n"
        "print('hashed' if hashed else 'read', triton_cache.triton_key())\n"
    )
    env = {"LIK_PREWARM": "1", "TRITON_CACHE_DIR": str(tmp_path / "cache")}
    first, second = (_run([sys.executable, "-c", code], cwd=tmp_path, extra_env=env) for _ in "12")
    assert first.returncode == 0, first.stderr
    assert second.returncode == 0, second.stderr
    how_first, key_first = first.stdout.split(" ", 1)
    how_second, key_second = second.stdout.split(" ", 1)
    assert (how_first, how_second) == ("hashed", "read")
    assert key_second == key_first and len(key_first) > 1000


def test_a_process_that_exits_at_once_waits_for_the_warm_up(tmp_path):
    # Exiting while the daemon thread still hashes in native code could abort the process;
    # the exit waits for it instead, so the thread also finishes saving Triton's key.
    env = {"LIK_PREWARM": "1", "TRITON_CACHE_DIR": str(tmp_path / "cache")}
    proc = _run([sys.executable, "-c", "import lik"], cwd=tmp_path, extra_env=env)
    assert proc.returncode == 0, proc.stderr
    assert "FATAL" not in proc.stderr
    saved = list((tmp_path / "cache" / "lik_triton_key").glob("*.txt"))
    assert len(saved) == 1 and len(saved[0].read_text()) > 1000


@pytest.mark.gpu
def test_prewarm_looks_up_the_compile_backend_once_cuda_is_up(tmp_path):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    code = (
        "import torch\n"
        "torch.cuda.init()  # the caller's own setup started CUDA before the thread looked\n"
        "import lik\n"
        "lik.runtime.prewarm.wait()\n"
        "from triton.backends.nvidia.compiler import get_ptxas_version\n"
        "assert get_ptxas_version.cache_info().currsize == 1, 'ptxas version not looked up'\n"
    )
    env = {
        "LIK_PREWARM": "1",
        "TRITON_CACHE_DIR": str(tmp_path / "cache"),
        "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
    }  # a GPU copy may import from it
    proc = _run([sys.executable, "-c", code], cwd=tmp_path, extra_env=env)
    assert proc.returncode == 0, proc.stderr


def test_a_saved_triton_key_is_dropped_when_a_file_it_covers_changes(tmp_path):
    from lik.runtime.prewarm import _files_fingerprint

    extension = sysconfig.get_config_var("EXT_SUFFIX").split(".")[-1]
    files = ["runtime/cache.py", f"_C/libtriton.{extension}", "compiler/code_generator.py",
             "backends/nvidia/driver.py", "language/core.py"]  # fmt: skip
    for name in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    cache_module = str(tmp_path / "runtime" / "cache.py")
    before = _files_fingerprint(cache_module)
    assert _files_fingerprint(cache_module) == before
    for name in files:
        path = tmp_path / name
        stat = path.stat()
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))  # an edit in place
        assert _files_fingerprint(cache_module) != before, name
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        assert _files_fingerprint(cache_module) == before
    (tmp_path / "language" / "new_module.py").write_text("")  # a module added
    assert _files_fingerprint(cache_module) != before


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_fork_right_after_import_waits_for_the_warm_up(tmp_path):
    # Forking while the thread imports would hand the child a half-done import (and
    # Python warns about forking a multi-threaded process): the fork waits instead.
    code = (
        "import os, threading, lik\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    import triton.language\n"
        "    os._exit(0 if threading.active_count() == 1 else 3)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "assert os.waitstatus_to_exitcode(status) == 0, status\n"
    )
    proc = _run([sys.executable, "-W", "error::DeprecationWarning", "-c", code], cwd=tmp_path,
                extra_env={"LIK_PREWARM": "1"}, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr


def test_the_exit_s_wait_for_a_stuck_warm_up_is_bounded(monkeypatch):
    # The exit waits for the thread with a timeout: a warm-up stuck in a subprocess must
    # not keep a finished process alive.
    import threading
    import time

    from lik.runtime import prewarm

    release = threading.Event()
    stuck = threading.Thread(target=release.wait, daemon=True)
    stuck.start()
    monkeypatch.setattr(prewarm, "_thread", stuck)
    began = time.perf_counter()
    prewarm.wait(timeout=0.2)
    waited = time.perf_counter() - began
    assert stuck.is_alive(), "the warm-up was to still be stuck"
    release.set()
    stuck.join()
    assert 0.15 < waited < 5, f"waited {waited:.2f} s for a 0.2 s bound"


@pytest.mark.parametrize(
    ("setting", "cuda", "expected"),
    [("0", "12.8", False), ("1", None, True), ("", None, False), ("", "12.8", True)],
)
def test_prewarm_runs_where_a_gpu_launch_can_follow(monkeypatch, setting, cuda, expected):
    from lik.runtime import prewarm

    monkeypatch.setenv(prewarm.ENV, setting)
    monkeypatch.setattr(prewarm.torch.version, "cuda", cuda)
    monkeypatch.setattr(prewarm.torch.version, "hip", None)
    assert prewarm.wanted() is expected  # Triton is installed wherever the tests run


@pytest.mark.parametrize(
    "cmd",
    [[str(BIN / "lik-gen"), "--help"], [sys.executable, "-m", "lik_gen", "--help"]],
    ids=["console-script", "python-m"],
)
def test_cli_help(cmd):
    proc = _run(cmd, cwd=REPO, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "generate" in proc.stdout and "check" in proc.stdout


def test_editable_install_maps_to_checkout(tmp_path):
    # Run from outside the checkout so the current directory cannot stand in for the install.
    code = "import lik.runtime, lik.generated as g; print(lik.runtime.__file__); print(g.__file__)"
    proc = _run([sys.executable, "-c", code], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    runtime_file, generated_file = (Path(p).resolve() for p in proc.stdout.split())
    assert runtime_file.parent == REPO / "runtime"
    assert generated_file.parent == REPO / "generated"


def _copy_source(dst: Path) -> Path:
    """Copy the checkout without venvs, VCS data or old build output (a stale build/ can
    leak deleted modules into a wheel)."""

    def ignore(_dir, names):
        skip = {"build", "dist", "__pycache__"}
        return [n for n in names if n.startswith(".") or n in skip or n.endswith(".egg-info")]

    shutil.copytree(REPO, dst, ignore=ignore)
    return dst


def _manifest_kernel_files(manifest) -> set[str]:
    """Every kernel source path named anywhere in MANIFEST.json, relative to generated/."""
    found: set[str] = set()

    def walk(node):
        if isinstance(node, dict):
            for key, value in node.items():
                walk(key)
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)
        elif isinstance(node, str) and node.endswith((".py", ".metal")):
            found.add(node.removeprefix("generated/"))

    walk(manifest)
    return found


@pytest.mark.slow
def test_wheel_installs_and_imports(tmp_path):
    src = _copy_source(tmp_path / "src")
    dist = tmp_path / "dist"
    build = _run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist)],
        cwd=src,
        timeout=300,
    )
    assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-4000:]
    (wheel,) = dist.glob("lik-*.whl")

    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        manifest = json.loads(zf.read("lik/generated/MANIFEST.json"))
    tops = {n.split("/")[0] for n in names if ".dist-info/" not in n}
    # The mapping must not leak the checkout's folder names (runtime/, generated/) as packages.
    assert tops == {"lik", "lik_gen"}, tops
    # lik-gen's specs and templates ride along as package data (list and explain read them).
    for folder, suffix in (("specs", ".toml"), ("templates", ".j2")):
        source = {p.relative_to(REPO).as_posix() for p in (REPO / folder).rglob(f"*{suffix}")}
        shipped = {n.removeprefix("lik_gen/") for n in names if n.startswith(f"lik_gen/{folder}/")}
        assert source and source <= shipped, sorted(source - shipped)[:5]
    kernels = _manifest_kernel_files(manifest)
    missing = sorted(k for k in kernels if f"lik/generated/{k}" not in names)
    assert not missing, f"listed in MANIFEST.json but not in the wheel: {missing[:10]}"
    modules = sorted(
        "lik.generated." + k.removesuffix(".py").replace("/", ".")
        for k in kernels
        if k.startswith("triton/") and k.endswith(".py")
    )
    assert modules, "MANIFEST.json lists no generated Triton kernels"

    target = tmp_path / "site"
    install = _run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(target), str(wheel)],
        cwd=tmp_path,
        timeout=300,
    )
    assert install.returncode == 0, install.stdout[-4000:] + install.stderr[-4000:]

    # -S: no site-packages and no .pth files, so the dev env's editable hook cannot answer;
    # the venv's site-packages comes last, only for torch and numpy. Runs outside the checkout.
    code = textwrap.dedent(
        """
        import importlib.util, sys
        from pathlib import Path
        target, purelib, modules = Path(sys.argv[1]).resolve(), sys.argv[2], sys.argv[3:]
        sys.path[:] = [str(target)] + [p for p in sys.path if p]
        sys.path.append(purelib)
        import lik, lik.runtime, lik.generated, lik_gen
        for mod in (lik, lik.runtime, lik.generated, lik_gen):
            assert Path(mod.__file__).resolve().is_relative_to(target), mod.__file__
        for name in modules:
            spec = importlib.util.find_spec(name)
            assert spec and Path(spec.origin).resolve().is_relative_to(target), name
        print("ok", len(modules))
        """
    )
    purelib = sysconfig.get_paths()["purelib"]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    args = [sys.executable, "-S", "-c", code, str(target), purelib, *modules]
    proc = _run(args, cwd=elsewhere, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.split() == ["ok", str(len(modules))]

    # Outside any checkout, lik-gen lists from the installed specs; generate refuses.
    gen = textwrap.dedent(
        """
        import sys
        sys.path[:] = [sys.argv[1]] + [p for p in sys.path if p] + [sys.argv[2]]
        from lik_gen.cli import main
        sys.exit(main(sys.argv[3:]))
        """
    )
    listed = _run([sys.executable, "-S", "-c", gen, str(target), purelib, "list", "--filter",
                   "layout=kd"], cwd=elsewhere, timeout=120)  # fmt: skip
    assert listed.returncode == 0, listed.stderr[-4000:]
    assert listed.stdout.split() and all("_kd_" in n for n in listed.stdout.split())
    refused = _run([sys.executable, "-S", "-c", gen, str(target), purelib, "generate"],
                   cwd=elsewhere, timeout=120)  # fmt: skip
    assert refused.returncode == 2 and "no lik checkout" in refused.stderr
    assert list(elsewhere.iterdir()) == []


def _module_attribute_reads(path: Path):
    """(line, module, attribute) for each `name.attr` in path where `name` is one of
    lik's own modules imported by `from lik.runtime import name` (or `from lik import`)."""
    import ast
    import importlib

    tree = ast.parse(path.read_text())
    modules = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in ("lik", "lik.runtime"):
            for alias in node.names:
                try:
                    module = importlib.import_module(f"{node.module}.{alias.name}")
                except ImportError:  # a function or class, not a module
                    continue
                modules[alias.asname or alias.name] = module
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in modules):  # fmt: skip
            yield node.lineno, modules[node.value.id], node.attr


def test_every_attribute_the_package_reads_from_its_own_modules_exists():
    """A name moved between modules must move at every use: such a read fails only when
    it runs, and some run on a GPU only (fp8's check of Triton once read
    dispatch.TRITON_AVAILABLE after it moved to backends)."""
    sources = sorted((REPO / "runtime").rglob("*.py")) + sorted((REPO / "lik").rglob("*.py"))
    missing = [f"{path.relative_to(REPO)}:{line} {module.__name__}.{attribute}"
               for path in sources for line, module, attribute in _module_attribute_reads(path)
               if not hasattr(module, attribute)]  # fmt: skip
    assert not missing, missing
