"""The kernel registry: variant name -> generated kernel with its values bound, built from
generated/MANIFEST.json.

A generated file is a structural kernel; a variant is that kernel with constexpr values
(mask presence, normalize, input dtype). `load(name)` returns a BoundVariant: the
kernel's module, whose launchers receive the variant's `normalize`, and whose shared
memory formula receives its element size.

Modules load lazily, once per process, under a lock. A file loads only if its bytes hash
to the manifest's value and its body to its header's: a hand edit is refused at load.
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
from lik_gen.ir import DType, Mask, Variant

# The header's hash line, in Python (#) or Metal (//) comments.
_HASH_LINE = re.compile(r"^(?:#|//) body-sha256: ([0-9a-f]{64})\n\n", re.MULTILINE)
_lock = threading.Lock()
_kernels: dict[str, ModuleType] = {}
_bound: dict[str, BoundVariant] = {}
FIX = "run `make generate`"
# Bytes per element of a tl.dot operand tile in shared memory, by the dtype a variant
# binds: fp32's tf32x3 dots keep a high and a low tf32 part of each operand, twice its
# bytes (H200: a 128-token query tile at head dim 256 with one 16-token doc tile took
# 288 KB, the element model said 144).
SMEM_OPERAND_BYTES = {"fp32": 8, "fp16": 2, "bf16": 2, "fp8e4m3": 1}


class GeneratedFileError(RuntimeError):
    pass


@functools.cache
def _document() -> dict:
    text = (importlib.resources.files("lik.generated") / "MANIFEST.json").read_text()
    return json.loads(text)


def manifest() -> dict[str, dict]:
    """Variant name -> {"family", "kernel", "values"}."""
    return _document()["variants"]


def kernels() -> dict[str, dict]:
    """Kernel name -> {"file", "sha256", "spec", "templates"}."""
    return _document()["kernels"]


def limits() -> dict[str, int]:
    """The limits the generated kernels were built for (lik_gen.ir, through the manifest)."""
    return _document()["limits"]


def names() -> list[str]:
    return sorted(manifest())


def entry(name: str) -> dict:
    """A variant's manifest entry; KeyError naming the fix for a name no spec declares."""
    found = manifest().get(name)
    if found is None:
        raise KeyError(f"no generated variant named {name!r}: add it to specs/ and {FIX}")
    return found


def kernel_file(name: str) -> str:
    """The generated file (relative to generated/) that serves variant `name`."""
    return kernels()[entry(name)["kernel"]]["file"]


def verify_text(name: str, path: str, text: str) -> None:
    """Raises GeneratedFileError unless the file's bytes hash to the manifest's value and
    its body to its header's."""
    kernel = entry(name)["kernel"]
    _verify(path, text, kernels()[kernel]["sha256"], f"kernel {kernel}, variant {name}")


def _verify(path: str, text: str, sha256: str, what: str) -> None:
    match = _HASH_LINE.search(text)
    body = text[match.end() :] if match else ""
    body_ok = match is not None and hashlib.sha256(body.encode()).hexdigest() == match.group(1)
    file_ok = hashlib.sha256(text.encode()).hexdigest() == sha256
    if not (body_ok and file_ok):
        raise GeneratedFileError(
            f"generated/{path} ({what}) does not match the hash in "
            f"{'its header' if not body_ok else 'MANIFEST.json'}: it was edited by hand. "
            f"Generated files are never edited; {FIX}."
        )


def _read(path: str, what: str) -> str:
    try:
        return (importlib.resources.files("lik.generated") / path).read_text()
    except FileNotFoundError:
        raise GeneratedFileError(f"generated/{path} ({what}) is missing; {FIX}") from None


def read_verified(name: str) -> tuple[str, str]:
    """(path, text) of the file serving variant `name`, checked against both hashes."""
    path = kernel_file(name)
    text = _read(path, f"variant {name}")
    verify_text(name, path, text)
    return path, text


def read_shared(module: str) -> tuple[str, str]:
    """(path, text) of a shared generated module, by its key in MANIFEST.json's "shared"
    ("metal": the MSL helpers every Metal kernel is compiled after), checked against both
    hashes like a kernel's file."""
    found = _document()["shared"][module]
    path, what = found["file"], f"shared {module} module"
    text = _read(path, what)
    _verify(path, text, found["sha256"], what)
    return path, text


class BoundVariant:
    """A structural kernel's module with one variant's values bound: `launch` and
    `backward` take the variant's normalize, `launch` whether it reads its doc mask as
    zeros (masked_as_zero, in the kernels that can: Kernel.takes_zero_mask), `smem_bytes`
    its operand size; every other attribute is the module's."""

    def __init__(self, name: str, module: ModuleType, values: dict) -> None:
        self.name = name
        self.module = module
        self.values = values
        self.dtype = DType(values["dtype"])
        normalize = values["normalize"]
        for role in ("launch", "backward"):
            if hasattr(module, role):
                setattr(self, role, functools.partial(getattr(module, role), normalize=normalize))
        if hasattr(module, "launch") and Variant.parse(name).kernel.takes_zero_mask:
            zero = Mask(values["mask"]).as_zero
            self.launch = functools.partial(self.launch, masked_as_zero=zero)
        if hasattr(module, "smem_bytes"):
            operand = SMEM_OPERAND_BYTES[values["dtype"]]
            self.smem_bytes = functools.partial(module.smem_bytes, operand_bytes=operand)

    def __getattr__(self, attribute: str):
        # Only for attributes not set above; a copy that has no module yet finds none.
        module = self.__dict__.get("module")
        if module is None or attribute.startswith("__"):
            raise AttributeError(attribute)
        return getattr(module, attribute)

    def __repr__(self) -> str:
        return f"BoundVariant({self.name!r}, kernel={self.module.__name__.rsplit('.', 1)[-1]!r})"


def _kernel_module(name: str) -> ModuleType:
    kernel = entry(name)["kernel"]
    module = _kernels.get(kernel)
    if module is None:
        prewarm.wait()  # the first kernel of a process: Triton's start-up, done once
        read_verified(name)
        module = importlib.import_module(f"lik.generated.triton.{kernel}")
        _kernels[kernel] = module
    return module


def load(name: str) -> BoundVariant:
    """The generated kernel of a variant with its values bound; raises KeyError for a name
    no spec declares, GeneratedFileError for a missing or hand-edited file."""
    bound = _bound.get(name)
    if bound is not None:
        return bound
    with _lock:
        if name not in _bound:
            _bound[name] = BoundVariant(name, _kernel_module(name), entry(name)["values"])
        return _bound[name]
