"""The kernel registry: variant name -> generated module, built from generated/MANIFEST.json.

Modules load lazily, once per process, under a lock. A generated file whose body no
longer matches the hash in its header was edited by hand; it is refused at import.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.resources
import json
import re
import threading
from types import ModuleType

from lik.runtime import prewarm

# The header's hash line, in Python (#) or Metal (//) comments.
_HASH_LINE = re.compile(r"^(?:#|//) body-sha256: ([0-9a-f]{64})\n\n", re.MULTILINE)
_lock = threading.Lock()
_modules: dict[str, ModuleType] = {}


class GeneratedFileError(RuntimeError):
    pass


@functools.cache
def manifest() -> dict[str, dict]:
    text = (importlib.resources.files("lik.generated") / "MANIFEST.json").read_text()
    return json.loads(text)["variants"]


def names() -> list[str]:
    return sorted(manifest())


def verify_text(name: str, path: str, text: str) -> None:
    """Raises GeneratedFileError unless the body still hashes to its header's value."""
    match = _HASH_LINE.search(text)
    body = text[match.end() :] if match else ""
    if match is None or hashlib.sha256(body.encode()).hexdigest() != match.group(1):
        raise GeneratedFileError(
            f"generated/{path} (variant {name}) does not match the hash in its header: it was "
            "edited by hand. Generated files are never edited; run `make generate`."
        )


def _verify(name: str, path: str) -> None:
    verify_text(name, path, (importlib.resources.files("lik.generated") / path).read_text())


def load(name: str) -> ModuleType:
    """The generated module of a variant; raises KeyError for a name no spec declares."""
    module = _modules.get(name)
    if module is not None:
        return module
    with _lock:
        if name not in _modules:
            entry = manifest().get(name)
            if entry is None:
                raise KeyError(
                    f"no generated variant named {name!r}: add it to specs/ and run "
                    "`make generate`"
                )
            (path,) = entry["files"]
            prewarm.wait()  # the first kernel of a process: Triton's start-up, done once
            _verify(name, path)
            _modules[name] = importlib.import_module(f"lik.generated.triton.{name}")
        return _modules[name]
