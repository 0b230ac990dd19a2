"""Every Python block of README.md and docs/ runs as written, on its own, on the CPU.

A block runs in a fresh namespace (so it must import what it uses), with lik's norm
warning armed: an example that scores unnormalized tokens without normalize=True fails.
Comment lines right above a block's fence change how it runs:

    <!-- skip: REASON -->              not run here (say why: needs CUDA, a network, ...)
    <!-- needs: MODULE -->             skipped where MODULE is not importable
    <!-- needs: MODULE>=MAJOR -->      the same, and its distribution at release MAJOR or later
    <!-- env: TRITON_INTERPRET=1 -->   run with the generated kernels under the interpreter

A versioned need that this environment does not meet may be met by the Sentence
Transformers 6 folder `make test` sets up (LIK_ST6_PATH, default .venv/st6): such blocks
run with that folder first on PYTHONPATH. The blocks of one page run in one process (per
interpreter setting and path), one after another.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Pages the compiler redesign rewrites; their blocks are signatures, not programs, today.
NOT_COVERED: set[str] = set()
PAGES = [ROOT / "README.md"] + [
    page for page in sorted((ROOT / "docs").glob("*.md")) if page.name not in NOT_COVERED
]
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
MARKER = re.compile(r"<!--\s*(skip|needs|env):\s*(.*?)\s*-->")

RUNNER = r"""
import json, sys, traceback, warnings
blocks, out = json.loads(open(sys.argv[1]).read()), sys.argv[2]
results = []
for block in blocks:
    try:
        from lik.runtime import norm_warning  # re-armed: it warns once per process
        norm_warning._done, norm_warning._pending = False, None
    except ImportError:
        pass
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            exec(compile(block["code"], block["where"], "exec"), {"__name__": "__main__"})
            error = None
        except BaseException:
            error = traceback.format_exc(limit=8)
    lik_warnings = [str(w.message) for w in caught if str(w.message).startswith("lik")]
    results.append({"error": error, "warnings": lik_warnings})
    open(out, "w").write(json.dumps(results))
"""


@dataclasses.dataclass(frozen=True)
class Block:
    page: str
    line: int
    code: str
    skip: str | None
    needs: tuple[str, ...]
    interpret: bool

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def _markers(text: str, start: int) -> list[tuple[str, str]]:
    """The marker comments on the lines right above the fence at `start`."""
    found = []
    for line in reversed(text[:start].rstrip("\n").split("\n")):
        marker = MARKER.fullmatch(line.strip())
        if marker is None:
            break
        found.append((marker.group(1), marker.group(2)))
    return found


def blocks_of(page: Path) -> list[Block]:
    text = page.read_text()
    out = []
    for match in FENCE.finditer(text):
        markers = _markers(text, match.start())
        skip = next((value for kind, value in markers if kind == "skip"), None)
        needs = tuple(value for kind, value in markers if kind == "needs")
        env = [value for kind, value in markers if kind == "env"]
        bad = [value for value in env if value != "TRITON_INTERPRET=1"]
        assert not bad, f"{page.name}: unknown env marker {bad}"
        line = text.count("\n", 0, match.start()) + 2  # the block's first line of code
        name = page.relative_to(ROOT).as_posix()
        out.append(Block(name, line, match.group(1), skip, needs, bool(env)))
    return out


BLOCKS = [block for page in PAGES for block in blocks_of(page)]


ST6_PATH = Path(os.environ.get("LIK_ST6_PATH", ROOT / ".venv" / "st6"))


def _release(module: str, path: Path | None) -> int | None:
    """The major release of MODULE's distribution, here (path None) or in a --target
    folder; None where it is not installed."""
    name = module.replace("_", "-").lower()
    found = (
        importlib.metadata.distributions(path=[str(path)]) if path is not None
        else importlib.metadata.distributions()
    )  # fmt: skip
    for dist in found:
        if (dist.metadata["Name"] or "").replace("_", "-").lower() == name:
            return int(dist.version.split(".")[0])
    return None


def _met(need: str, path: Path | None) -> bool:
    module, _, major = need.partition(">=")
    module = module.strip()
    if path is None and importlib.util.find_spec(module) is None:
        return False
    if not major:
        return True
    release = _release(module, path)
    return release is not None and release >= int(major)


def _path_for(block: Block) -> Path | None | bool:
    """None: runs in this environment; a folder: runs with it on PYTHONPATH; False: its
    needs are met nowhere here."""
    if all(_met(need, None) for need in block.needs):
        return None
    if ST6_PATH.is_dir() and all(
        _met(need, None) or (">=" in need and _met(need, ST6_PATH)) for need in block.needs
    ):
        return ST6_PATH
    return False


def _runnable(block: Block) -> bool:
    return block.skip is None and _path_for(block) is not False


_RESULTS: dict[tuple[str, bool, Path | None], list[dict]] = {}


def _run_group(page: str, interpret: bool, path: Path | None, tmp_dir: Path) -> dict[int, dict]:
    """Runs the runnable blocks of one page in one process; results by line."""
    key = (page, interpret, path)
    group = [
        b for b in BLOCKS
        if (b.page, b.interpret) == (page, interpret) and _runnable(b) and _path_for(b) == path
    ]  # fmt: skip
    if key not in _RESULTS:
        blocks = tmp_dir / "blocks.json"
        blocks.write_text(json.dumps([{"code": b.code, "where": b.where} for b in group]))
        results = tmp_dir / "results.json"
        env = {k: v for k, v in os.environ.items() if k not in ("LIK_SUPPRESS_NORM_WARN",)}
        env.pop("TRITON_INTERPRET", None)
        if interpret:
            env["TRITON_INTERPRET"] = "1"
        if path is not None:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(path), env.get("PYTHONPATH")]))
        done = subprocess.run(
            [sys.executable, "-c", RUNNER, str(blocks), str(results)],
            cwd=tmp_dir, env=env, capture_output=True, text=True, timeout=900,
        )  # fmt: skip
        got = json.loads(results.read_text()) if results.is_file() else []
        if len(got) < len(group):  # the process died inside a block
            got.append({"error": done.stderr[-3000:] or f"exit {done.returncode}",
                        "warnings": []})  # fmt: skip
        _RESULTS[key] = got
    return {b.line: result for b, result in zip(group, _RESULTS[key], strict=False)}


def test_the_pages_have_examples():
    pages = {block.page for block in BLOCKS}
    assert "README.md" in pages and "docs/api.md" in pages, pages


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.where)
def test_the_example_runs_as_written(block, tmp_path_factory):
    if block.skip is not None:
        pytest.skip(block.skip)
    path = _path_for(block)
    if path is False:
        pytest.skip(f"needs {', '.join(block.needs)}")
    tmp_dir = tmp_path_factory.mktemp("doc-examples")
    results = _run_group(block.page, block.interpret, path, tmp_dir)
    result = results.get(block.line)
    assert result is not None, f"{block.where}: an earlier block of the page stopped its process"
    assert result["error"] is None, f"{block.where} failed:\n{result['error']}"
    assert not result["warnings"], f"{block.where} warned: {result['warnings']}"
