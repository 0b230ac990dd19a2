"""Launch plans: a generated launcher's work for one call signature, recorded once and
replayed.

A generated launcher (a variant's `launch` or `backward`) turns shapes, strides, dtypes,
flags and a LaunchConfig into grids, kernel arguments and constexprs, allocates its
outputs and scratch buffers, and launches its kernels. All of it but the tensors'
addresses depends only on that signature, and on a small call it costs more host time
than the kernels take on the GPU. So the first call of each signature runs the launcher
under a Recording, which logs, in order:
- every call of a `recorded` helper (workspace.empty and zeros, zeroed_counters, the
  casts and views workspace.converted, reshaped and head_rows, kernel_lib.valid_tokens):
  its function, its arguments and the tensor it made;
- every kernel launch (launch_cache): the compiled kernel's launch and its arguments.
Tensors in the log are named by slot: the launcher's tensor arguments first, then what
the helpers made. Later calls of the signature replay the log: the helpers run again on
the new tensors, the kernels launch straight through Triton's compiled launcher, and a
scratch slot is dropped after its last use, as the launcher frees it.

A launcher is replayed only where its log describes all of its work: a signature whose
recording met a tensor neither passed in nor made by a helper (a view, a cast), an
argument of another type (a TMA descriptor) or a launch off launch_cache's fast path
(the interpreter, a launch hook) keeps the launcher's own path. Generated launchers make
no other tensors in place (tests/test_launch_plan.py reads their sources for it), so what
the log misses can only be a tensor it does not know, which it refuses.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable

import torch

_Tensor = torch.Tensor
_local = threading.local()  # .recording: the Recording of this thread's launcher, or None
# Argument types a helper call's log keeps as they are (tensors go by slot; anything else
# refuses).
CONSTANT_TYPES = (int, float, bool, str, type(None), torch.dtype, torch.device)


class Slot(int):
    """A tensor in a log: its index among the launcher's tensors."""


class Unreplayable(Exception):
    """The log cannot describe a launcher's work (see the module docstring)."""


def recording() -> Recording | None:
    """This thread's Recording, or None (the common case: a replay, or no plan)."""
    return getattr(_local, "recording", None)


def recorded(fn: Callable) -> Callable:
    """A helper whose calls a Recording logs, so that replays call it again."""

    @functools.wraps(fn)
    def helper(*args, **kwargs):
        result = fn(*args, **kwargs)
        log = getattr(_local, "recording", None)
        if log is not None:
            log.call(fn, args, kwargs, result)
        return result

    return helper


def refuse() -> None:
    """Marks this thread's recording (if any) as one that must not be replayed: a launch
    went a way its log cannot follow."""
    log = getattr(_local, "recording", None)
    if log is not None:
        log.replayable = False


class Recording:
    """The log of one launcher call: its tensors' slots and its steps."""

    def __init__(self, tensors: list):
        self.tensors = list(tensors)  # held, so that no id is reused while recording
        self.slots = {id(t): i for i, t in enumerate(tensors) if t is not None}
        self.inputs = len(tensors)
        self.steps: list[tuple] = []
        # One tensor passed twice (maxsim(Q, Q)): its uses cannot be told apart, and the
        # signature's next call may pass two tensors. Not replayed, and not remembered.
        self.aliased = len(self.slots) < sum(t is not None for t in tensors)
        self.replayable = not self.aliased

    def __enter__(self):
        self.outer = recording()
        _local.recording = self
        return self

    def __exit__(self, *exc):
        _local.recording = self.outer

    def _ref(self, value):
        if type(value) is _Tensor or isinstance(value, _Tensor):
            slot = self.slots.get(id(value))
            if slot is None:
                raise Unreplayable("a tensor the log does not know")
            return Slot(slot)
        if isinstance(value, tuple):
            return tuple(self._ref(v) for v in value)
        if not isinstance(value, CONSTANT_TYPES):
            raise Unreplayable(f"an argument of type {type(value).__name__}")
        return value

    def _new_slot(self, tensor) -> int | None:
        if tensor is None:
            return None
        if not isinstance(tensor, _Tensor):
            raise Unreplayable(f"a helper made a {type(tensor).__name__}")
        self.slots[id(tensor)] = len(self.tensors)
        self.tensors.append(tensor)
        return len(self.tensors) - 1

    def call(self, fn, args, kwargs, result) -> None:
        try:
            template = (self._ref(args), {k: self._ref(v) for k, v in kwargs.items()})
            self.steps.append(("call", fn, template, self._new_slot(result)))
        except Unreplayable:
            self.replayable = False

    def launch(self, launcher, grid: tuple, args: tuple) -> None:
        """Logs a kernel launch. Its arguments besides tensors are constants of any type
        (constexprs are Triton's own types), but for objects that hold a tensor's address
        (a TMA descriptor holds its base's)."""
        try:
            template = []
            for value in args:
                if isinstance(value, _Tensor):
                    template.append(self._ref(value))
                elif isinstance(getattr(value, "base", None), _Tensor):
                    raise Unreplayable(f"a {type(value).__name__} holding a tensor")
                else:
                    template.append(value)
            self.steps.append(("launch", launcher, grid, tuple(template)))
        except Unreplayable:
            self.replayable = False

    def plan(self, result) -> Plan | None:
        """The Plan of what was logged, the launcher having returned `result`; None where
        it cannot be replayed."""
        if not self.replayable:
            return None
        try:
            returned = self._ref(result)
        except Unreplayable:
            return None
        return Plan(len(self.tensors), self.inputs, self.steps, returned)


def _slots_in(template) -> set[int]:
    if type(template) is Slot:
        return {int(template)}
    if isinstance(template, tuple):
        return set().union(*map(_slots_in, template)) if template else set()
    if isinstance(template, dict):
        return _slots_in(tuple(template.values()))
    return set()


LAUNCH, CALL, NESTED_CALL = range(3)  # a Plan step's kinds


def _positions(args: tuple) -> tuple[tuple[int, int], ...]:
    """(position, slot) of each top-level tensor of an argument template."""
    return tuple((i, int(a)) for i, a in enumerate(args) if type(a) is Slot)


class Plan:
    """A launcher's log, replayed on a new call of its signature."""

    def __init__(self, slot_count: int, inputs: int, steps: list, returned):
        kept = _slots_in(returned)
        self.slot_count = slot_count
        self.returned = returned
        self.returned_slots = _positions(returned) if isinstance(returned, tuple) else None
        # A scratch slot is dropped after its last use, as the launcher frees it.
        last_use: dict[int, int] = {}
        for index, step in enumerate(steps):
            for slot in _slots_in(step[2] if step[0] == "call" else step[3]):
                last_use[slot] = index
        drops: dict[int, list[int]] = {}
        for slot, index in last_use.items():
            if slot >= inputs and slot not in kept:
                drops.setdefault(index, []).append(slot)
        # Each step as (kind, its callable, its grid (a launch) or keyword arguments (a
        # call), its argument list, the positions of the tensors in it, the slot it makes,
        # the slots to drop after it). Arguments are filled in by position; a call with a
        # tensor inside a tuple or a keyword (none of today's helpers) resolves them all.
        self.steps = []
        for index, step in enumerate(steps):
            dropped = tuple(drops.get(index, ()))
            if step[0] == "launch":
                _, launcher, grid, args = step
                self.steps.append((LAUNCH, launcher, grid, list(args), _positions(args), None,
                                   dropped))  # fmt: skip
                continue
            _, fn, (args, kwargs), made = step
            positions = _positions(args)
            nested = len(_slots_in((args, kwargs))) > len({slot for _, slot in positions})
            kind = NESTED_CALL if nested else CALL
            self.steps.append((kind, fn, kwargs, list(args), positions, made, dropped))

    def replay(self, tensors: list, stream: int):
        """Runs the log on the launcher's tensors (in the recorded order) on `stream`;
        returns what the launcher returned."""
        slots = tensors + [None] * (self.slot_count - len(tensors))
        for kind, fn, extra, args, positions, made, drops in self.steps:
            if positions:
                args = args.copy()
                for position, slot in positions:
                    args[position] = slots[slot]
            if kind == LAUNCH:
                fn(extra, stream, args)
            else:
                if kind == NESTED_CALL:
                    args = _resolve(tuple(args), slots)
                    extra = {name: _resolve(value, slots) for name, value in extra.items()}
                result = fn(*args, **extra)
                if made is not None:
                    slots[made] = result
            for slot in drops:
                slots[slot] = None
        if type(self.returned) is Slot:
            return slots[self.returned]
        if self.returned_slots is not None and len(self.returned_slots) == len(self.returned):
            return tuple(slots[slot] for _, slot in self.returned_slots)
        return _resolve(self.returned, slots)


def _resolve(template, slots):
    if type(template) is Slot:
        return slots[template]
    if isinstance(template, tuple):
        return tuple(_resolve(t, slots) for t in template)
    if isinstance(template, dict):
        return {name: _resolve(value, slots) for name, value in template.items()}
    return template


# Each launcher signature's Plan (None: recorded, not replayable). Cleared when full, so
# a stream of distinct shapes cannot grow it without bound.
_plans: dict[tuple, Plan | None] = {}
PLAN_CACHE_SIZE = 4096
NOT_PLANNED = object()  # lookup's answer for a signature not recorded yet


def tensor_key(t: _Tensor | None):
    """What a launch's work depends on of one tensor: shape, strides, dtype, device and
    16-byte alignment, which Triton specializes on; None for an absent tensor."""
    if t is None:
        return None
    return (t.shape, t.stride(), t.dtype, t.get_device(), t.data_ptr() & 15 == 0)


def signature(launch: Callable, config, args: tuple, kwargs: dict):
    """(key, tensors) of a launcher call: the key holds everything the launcher's work
    depends on (each tensor's tensor_key, every other argument by value), tensors the
    call's tensor arguments in slot order (None for the others). (None, None) off CUDA or
    where an argument is of a type the key cannot hold."""
    key = [launch, config, *kwargs]
    tensors = []
    device = None
    for value in (*args, *kwargs.values()):
        if isinstance(value, _Tensor):
            entry = tensor_key(value)
            index = entry[3]
            if index < 0 or (device is not None and index != device):
                return None, None
            device = index
            key.append(entry)
            tensors.append(value)
        elif isinstance(value, CONSTANT_TYPES):
            key.append(value)
            tensors.append(None)
        else:
            return None, None
    if device is None:
        return None, None
    key.append(device)
    return tuple(key), tensors


def lookup(key: tuple):
    """The Plan recorded for a signature, None where it cannot be replayed, or
    NOT_PLANNED."""
    return _plans.get(key, NOT_PLANNED)


def remember(key: tuple, plan: Plan | None) -> None:
    if len(_plans) >= PLAN_CACHE_SIZE:
        _plans.clear()
    _plans[key] = plan


def clear() -> None:
    """Forgets every plan (for tests that swap a launcher's kernels)."""
    _plans.clear()
    _calls.clear()


# Calls that made one replayable launch (dispatch.replayed_call's: the padded and ragged
# forwards and backwards, the residual varlen forward): each call signature's (Plan, the
# call tensor that fills each of the launcher's slots, device index), so that a repeat
# replays the plan without looking up its variant, config and launcher signature again.
# False: a signature that does not.
_calls: dict[tuple, tuple | bool] = {}


def call_plan(key: tuple):
    """A call signature's (plan, sources, device), False where it made no single
    replayable launch, or None where it was not seen."""
    return _calls.get(key)


def remember_call(key: tuple, launches: list, call_tensors: tuple) -> None:
    """Remembers a call from the launches it made ((plan or None, launcher tensors) each):
    one replayable launch whose every tensor is one of call_tensors (by identity, as the
    call passed them) gives its plan; anything else gives False. A call that passes one
    tensor twice is not remembered (see Recording.aliased)."""
    present = [id(t) for t in call_tensors if t is not None]
    if len(set(present)) < len(present):  # aliased: as Recording.aliased, not remembered
        return
    if len(_calls) >= PLAN_CACHE_SIZE:
        _calls.clear()
    entry = False
    if len(launches) == 1 and launches[0][0] is not None:
        plan, tensors = launches[0]
        ids = [id(t) for t in call_tensors]
        try:
            sources = tuple(None if t is None else ids.index(id(t)) for t in tensors)
        except ValueError:  # a tensor the call did not pass as it is (a copy)
            sources = None
        if sources is not None:
            entry = (plan, sources, next(t for t in tensors if t is not None).get_device())
    _calls[key] = entry
