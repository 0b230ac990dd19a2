"""Route PyLate's, colpali-engine's and Sentence Transformers' MaxSim scoring through lik.

`lik.integrations.pylate`, `lik.integrations.colpali` and
`lik.integrations.sentence_transformers` each offer `enable()`,
`disable()` and the context manager `enabled()`. Enabling swaps a library's scoring
functions, wherever the library's own modules hold them (module globals, `__init__`
defaults such as a loss's default score function) and on the classes that wrap them,
for routed twins. A twin sends a call to lik when lik has a kernel for it and can take
its arguments, and to the library's original otherwise: a CPU without the Triton
interpreter (lik's reference path is no faster than the library's own torch code, so
the library stays in charge there, as its native kernel backends leave CPU calls to
it), another dtype, device or head dim, an argument value lik does not take (a tensor
`tau`, say), a non-default backend choice, or `LIK_DISABLE=1` (read on every call).
Each adapter reproduces its library's numbers, padding conventions included; the
submodules' docstrings give the formulas. Calls routed to lik warn nothing of lik's own:
the "inputs look unnormalized" check is off inside them (the library's callers cannot
pass `normalize`).

`disable()` puts the originals back, by identity. A twin that stays captured somewhere
(say, a loss built while enabled) calls the original once its integration is off.
Copies taken outside the library before `enable()` (`from pylate.scores import
colbert_scores` in user code) keep the original: enable first, or call through the module.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import sys
from collections.abc import Callable, Iterator
from types import FunctionType, ModuleType

import torch

from lik.runtime import backends, norm_warning
from lik.runtime.keys import MAX_HEAD_DIM, SUPPORTED_DTYPES

# Devices with a lik path that is worth taking (kernels on CUDA, the reference on CPU).
# Elsewhere (MPS) the library's own backends stay in charge.
LIK_DEVICE_TYPES = ("cpu", "cuda")
_TRUE_WORDS = ("1", "true", "yes", "on")

Adapter = Callable[..., object]


def disabled_by_env() -> bool:
    """True when LIK_DISABLE asks for every integration to stand aside."""
    return os.environ.get("LIK_DISABLE", "").strip().lower() in _TRUE_WORDS


def has_kernel(device: torch.device) -> bool:
    """Whether lik runs a generated kernel on this device: Triton on CUDA, or a CPU under
    TRITON_INTERPRET=1. Elsewhere lik would run its reference, and the library's own
    function stays in charge."""
    return (
        device.type in LIK_DEVICE_TYPES
        and backends.device_backend(device) in backends.GENERATED_TRITON
    )


def lik_accepts(*tensors: object) -> bool:
    """Whether lik scores these embeddings: tensors of one supported dtype and device
    that lik has a kernel for, a head dim lik handles, nothing empty. Masks are checked
    by the caller."""
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return False
    first = tensors[0]
    return (
        first.dtype in SUPPORTED_DTYPES
        and has_kernel(first.device)
        and all(t.dtype == first.dtype and t.device == first.device for t in tensors)
        and all(t.dim() > 0 and 0 < t.shape[-1] <= MAX_HEAD_DIM for t in tensors)
        and all(t.numel() > 0 for t in tensors)
    )


def mask_fits(mask: object, shape: tuple[int, ...], device: torch.device) -> bool:
    """None, or a real-valued tensor of exactly `shape` on `device`."""
    if mask is None:
        return True
    return (
        isinstance(mask, torch.Tensor)
        and not mask.dtype.is_complex
        and tuple(mask.shape) == tuple(shape)
        and mask.device == device
    )


def positive_number(value: object) -> bool:
    """A Python number (not a bool or tensor) that fp32 holds as a positive normal
    number: what lik's smooth max takes as tau."""
    fp32 = torch.finfo(torch.float32)
    number = isinstance(value, int | float) and not isinstance(value, bool)
    return number and fp32.tiny <= value <= fp32.max


def call_lik(score: Callable[..., torch.Tensor], *args, **kwargs) -> torch.Tensor | None:
    """score(*args, **kwargs) without lik's norm warning, or None where lik declines the
    call: NotImplementedError for a path it does not offer yet, ValueError or TypeError
    from its input checks. Both are raised before anything is launched, and the library's
    own code still answers the call, so the caller falls back to it."""
    try:
        with norm_warning.quiet():
            return score(*args, **kwargs)
    except (NotImplementedError, ValueError, TypeError):
        return None


def _routed_twin(original: Callable, adapter: Adapter, routing: Callable[[], bool]) -> Callable:
    """A function that calls adapter while routing, and original when it returns None."""

    @functools.wraps(original)
    def routed(*args, **kwargs):
        if routing():
            result = adapter(*args, **kwargs)
            if result is not None:
                return result
        return original(*args, **kwargs)

    return routed


def _resolve(target: str) -> tuple[object, str]:
    """'package.module:Name' -> (module, 'Name'); 'package.module:Class.attr' -> (Class, 'attr')."""
    module_name, _, path = target.partition(":")
    owner: object = importlib.import_module(module_name)
    *parents, name = path.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    return owner, name


class Integration:
    """The swap bookkeeping for one library: its twins, what was replaced, and how to undo it."""

    def __init__(self, name: str, package: str, extra: str):
        self.name = name  # lik.integrations.<name>
        self.package = package  # the library's import name
        self.extra = extra  # pip install 'lik[<extra>]' installs the library
        self.active = False
        self._twins: dict[Callable, Callable] = {}  # original -> routed twin, made once
        self._class_attributes: list[tuple[type, str, Callable]] = []  # owner, name, original

    def routing(self) -> bool:
        return self.active and not disabled_by_env()

    def twin(self, original: Callable, adapter: Adapter) -> Callable:
        """The routed twin of original; the same object on every enable()."""
        if original not in self._twins:
            self._twins[original] = _routed_twin(original, adapter, self.routing)
        return self._twins[original]

    def enable(self, routes: dict[str, Adapter]) -> None:
        """Swap in a twin for each 'module:name' (a module function, swapped everywhere in
        the library) or 'module:Class.name' (a method, swapped on that class)."""
        if self.active:
            return
        resolved = [(*self._import(target), adapter) for target, adapter in routes.items()]
        function_swaps = {}
        for owner, name, adapter in resolved:
            original = vars(owner)[name]
            if isinstance(owner, ModuleType):
                function_swaps[original] = self.twin(original, adapter)
            else:
                self._class_attributes.append((owner, name, original))
                setattr(owner, name, self.twin(original, adapter))
        self._replace_in_library(function_swaps)
        self.active = True

    def disable(self) -> None:
        if not self.active:
            return
        self._replace_in_library({twin: original for original, twin in self._twins.items()})
        for owner, name, original in reversed(self._class_attributes):
            setattr(owner, name, original)
        self._class_attributes.clear()
        self.active = False

    @contextlib.contextmanager
    def scope(self, enable: Callable[[], None]) -> Iterator[None]:
        """enable() for a with-block; leaves the integration as it found it."""
        was_active = self.active
        enable()
        try:
            yield
        finally:
            if not was_active:
                self.disable()

    def _import(self, target: str) -> tuple[object, str]:
        try:
            return _resolve(target)
        except ImportError as error:
            raise ImportError(
                f"lik.integrations.{self.name} needs {self.package} "
                f"(pip install 'lik[{self.extra}]'): {error}"
            ) from error

    def _library_modules(self) -> list[ModuleType]:
        prefix = self.package + "."
        return [
            module
            for name, module in list(sys.modules.items())
            if isinstance(module, ModuleType) and (name == self.package or name.startswith(prefix))
        ]

    def _replace_in_library(self, swaps: dict[Callable, Callable]) -> None:
        """Replace, by identity, every module global and class __init__ default of the
        library's loaded modules that holds a key of swaps. Modules imported later pick
        up whatever their source module holds at that time."""
        by_id = {id(old): new for old, new in swaps.items()}  # keys stay alive: ids are safe
        for module in self._library_modules():
            for name, value in list(vars(module).items()):
                if id(value) in by_id:
                    setattr(module, name, by_id[id(value)])
                elif isinstance(value, type) and value.__module__ == module.__name__:
                    _replace_in_init_defaults(value, by_id)


def _replace_in_init_defaults(cls: type, by_id: dict[int, Callable]) -> None:
    # A default argument is evaluated once, at import (e.g. PyLate's Distillation takes
    # score_metric=colbert_kd_scores), so it needs its own swap.
    init = vars(cls).get("__init__")
    if not isinstance(init, FunctionType):
        return
    if init.__defaults__ and any(id(v) in by_id for v in init.__defaults__):
        init.__defaults__ = tuple(by_id.get(id(v), v) for v in init.__defaults__)
    if init.__kwdefaults__ and any(id(v) in by_id for v in init.__kwdefaults__.values()):
        init.__kwdefaults__ = {k: by_id.get(id(v), v) for k, v in init.__kwdefaults__.items()}
