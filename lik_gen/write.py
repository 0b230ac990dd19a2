"""Rendered files -> generated/: sync (write, delete orphans) and check (report, change nothing)."""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import re
from pathlib import Path

from lik_gen.render import RenderedFile

FIX_COMMAND = "make generate  (or: lik-gen generate)"
_HASH_LINE = re.compile(r"^(?:#|//) body-sha256: ([0-9a-f]{64})\n", re.MULTILINE)
# Never part of the committed output, never reported as orphans.
IGNORED_PARTS = {"__pycache__"}


@dataclasses.dataclass
class CheckReport:
    missing: list[str] = dataclasses.field(default_factory=list)
    stale: dict[str, str] = dataclasses.field(default_factory=dict)  # path -> unified diff
    orphan: list[str] = dataclasses.field(default_factory=list)
    hand_edited: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.stale or self.orphan or self.hand_edited)

    def render(self) -> str:
        if self.ok:
            return "generated/ is up to date"
        lines = []
        for path in self.missing:
            lines.append(f"missing: {path}")
        for path in self.hand_edited:
            lines.append(f"hand-edited: {path} (its body no longer matches its header hash)")
        for path in self.orphan:
            lines.append(f"orphan: {path} (no spec declares it)")
        for path, diff in self.stale.items():
            lines.append(f"stale: {path}")
            lines.append(diff)
        lines.append(f"fix: {FIX_COMMAND}")
        return "\n".join(lines)


def body_matches_header(text: str) -> bool:
    """True when a generated file's body still hashes to the value its header records.

    Files without a body hash (MANIFEST.json) are checked by comparison instead.
    """
    match = _HASH_LINE.search(text)
    if match is None:
        return True
    header_end = text.find("\n\n", match.end() - 1)
    body = text[header_end + 2 :]
    return hashlib.sha256(body.encode()).hexdigest() == match.group(1)


def existing_files(out_dir: Path) -> dict[str, str]:
    if not out_dir.exists():
        return {}
    files = {}
    for path in sorted(out_dir.rglob("*")):
        if path.is_file() and not IGNORED_PARTS & set(path.relative_to(out_dir).parts):
            files[path.relative_to(out_dir).as_posix()] = path.read_text()
    return files


def check(rendered: list[RenderedFile], out_dir: Path) -> CheckReport:
    want = {f.path: f.text for f in rendered}
    have = existing_files(out_dir)
    report = CheckReport()
    for path, text in want.items():
        if path not in have:
            report.missing.append(path)
        elif not body_matches_header(have[path]):
            report.hand_edited.append(path)
        elif have[path] != text:
            diff = difflib.unified_diff(
                have[path].splitlines(keepends=True),
                text.splitlines(keepends=True),
                fromfile=f"generated/{path} (on disk)",
                tofile=f"generated/{path} (from specs + templates)",
            )
            report.stale[path] = "".join(diff)
    report.orphan = sorted(set(have) - set(want))
    return report


def sync(rendered: list[RenderedFile], out_dir: Path) -> tuple[list[str], list[str]]:
    """Writes changed files and deletes orphans. Returns (written, deleted)."""
    have = existing_files(out_dir)
    written, deleted = [], []
    for f in rendered:
        if have.get(f.path) != f.text:
            target = out_dir / f.path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(f.text)
            written.append(f.path)
    wanted = {f.path for f in rendered}
    for path in sorted(set(have) - wanted):
        (out_dir / path).unlink()
        deleted.append(path)
    for directory in sorted(out_dir.rglob("*"), reverse=True):
        if (
            directory.is_dir()
            and directory.name not in IGNORED_PARTS
            and not any(directory.iterdir())
        ):
            directory.rmdir()
    return written, deleted
