"""Launching generated kernels with less host work than Triton's JIT dispatch.

`kernel[grid](*args, **meta)` on a Triton JIT function re-derives, on every call, what a
repeated call already knows: the current device and stream, each argument's
specialization, the cache-key string, the launch metadata and hooks, and a small
rerank's kernel runs for less time than that. On an H100 host with Triton 3.6
(commit 6f0883e, same run), a generated launcher took 26.6 us per call
through Triton's dispatch and 15.8 us with this cache; a whole lik.maxsim of 1 query
against 16 docs, 44.3 -> 31.4 us.

Every generated entry kernel is wrapped by `cached_launch`: the first launch of each
specialization goes through Triton (compiling or loading the kernel), later ones call
the compiled kernel directly. A compiled kernel is reused only for arguments that match
everything Triton specializes on: each tensor's dtype and 16-byte alignment; each int's
equality to 1, divisibility by 16 and width (i32, i64, u64); None and bools by value;
floats by type; constexprs and launch options by value. Calls this cannot key (another
argument type, a constexpr passed by position, a parameter left to its default,
a grid given as a function), launches while a profiler's launch hook is set, and the
interpreter keep Triton's own path. Not repeated per launch: Triton's check that a
kernel's global constants have not changed (generated kernels read none that change),
and its reading of the debug and instrumentation settings (a change to them within a
process reaches kernels not launched before it).

Each launch on the fast path is also logged to the thread's launch-plan recording, if
one is open (lik.runtime.launch_plan): later calls of the same launcher signature then
replay it without running the launcher's Python or this dispatch. A launch off the fast
path (a launch hook, an unkeyable call, another GPU than the current one, the
interpreter) marks the recording as one that must not be replayed.

Under the interpreter (TRITON_INTERPRET=1) every launch of a generated kernel holds one
process-wide lock, INTERPRETER_LOCK: the interpreter is not thread-safe (a launch patches
triton.language and keeps the program id in module state for its duration, so two
threads interpreting at once, even two different kernels, raise InterpreterError or
read each other's program ids). Interpreted calls from several threads therefore run one
kernel at a time and give the results they give alone. Compiled launches take no lock.
"""

from __future__ import annotations

import functools
import re
import sys
import threading

import torch

from lik.runtime import launch_plan
from lik.runtime.workspace import raw_stream as _raw_stream

try:
    import triton
    from triton import knobs
    from triton.runtime.jit import JITFunction
except ImportError:  # no Triton, or one without knobs (before 3.4): nothing to wrap
    JITFunction = None
try:
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:
    InterpretedFunction = None
try:  # host-side TMA descriptors (the fused head reads its hidden states through one)
    from triton.tools.tensor_descriptor import TensorDescriptor as _TensorDescriptor
except ImportError:
    _TensorDescriptor = None

# Triton versions whose compiled-kernel launch takes (grid x, y, z, stream, function,
# packed metadata, launch metadata, enter hook, exit hook, *every bound argument):
# checked on 3.6 (GPU) and in 3.9's sources. Others keep Triton's own path.
SUPPORTED_TRITON = ((3, 6), (4, 0))


def _supported(version: str) -> bool:
    found = re.match(r"(\d+)\.(\d+)", version)
    return (
        found is not None
        and SUPPORTED_TRITON[0] <= tuple(map(int, found.groups())) < SUPPORTED_TRITON[1]
    )


_UNKEYABLE = object()  # an argument the key cannot describe
_MISSING = object()
_Tensor = torch.Tensor
# The current device's index without torch.cuda's lazy-init check (kernels launch only
# once CUDA is up).
_current_device = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)


def _hooked(hook) -> bool:
    """Whether a launch hook is set: None or an empty HookChain (newer Triton) is not."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _specializations(args) -> tuple:
    """What Triton's specialization reads from the runtime arguments (hashable). Plain
    tensors and ints, nearly every argument, are read inline (per-argument calls,
    isinstance checks against torch.Tensor and hashing a tuple per int would cost about
    what this saves); an int's facts pack into one small int: 1 if it equals 1, +2 if
    divisible by 16, +4 * its width."""
    return tuple([
        (arg.dtype, arg.data_ptr() & 15 == 0) if type(arg) is _Tensor
        else (arg == 1) + 2 * (arg & 15 == 0) + (0 if -(2**31) <= arg < 2**31 else _wide(arg))
        if type(arg) is int
        else _other_specialization(arg)
        for arg in args
    ])  # fmt: skip


def _wide(value: int) -> int:
    return 4 if value < 2**63 else 8  # i64, u64 (below 2**31 and above -2**31: i32, 0)


def _other_specialization(arg):
    if isinstance(arg, torch.Tensor):  # a subclass (e.g. nn.Parameter)
        return arg.dtype, arg.data_ptr() & 15 == 0
    if arg is None:
        return None
    if isinstance(arg, bool):  # keyed apart from the ints' codes
        return bool, arg
    if isinstance(arg, int):
        return _specializations((int(arg),))[0]
    if isinstance(arg, float):
        return float
    if _TensorDescriptor is not None and type(arg) is _TensorDescriptor:
        # Triton keys a descriptor by its element type and block shape; keyed here by
        # everything but its base address (padding, rounding, each size's and stride's
        # int facts too), a superset that stays safe whatever a version specializes.
        # The launcher encodes the descriptor itself on every launch, either path.
        sizes = _specializations((*arg.shape, *arg.strides))
        rounding = getattr(arg, "round_f32_to_tf32", False)
        block = tuple(arg.block_shape)
        return _TensorDescriptor, arg.base.dtype, block, arg.padding, rounding, sizes
    return _UNKEYABLE


def hooks_set() -> bool:
    """Whether a Triton launch hook (a profiler's) is set: launches must then go through
    Triton, which calls it."""
    runtime = knobs.runtime
    return _hooked(runtime.launch_enter_hook) or _hooked(runtime.launch_exit_hook)


# Each generated module's entry kernels (module name -> kernel names), as cached_launch
# saw them, and the modules where it left one unwrapped.
_entry_kernels: dict[str, set[str]] = {}
_unwrapped_modules: set[str] = set()


def launches_every_kernel_cached(launcher) -> bool:
    """Whether every entry kernel of a generated launcher's module is a CachedLaunch, so
    that a launch plan's recording sees each of its launches: an unwrapped kernel (a
    Triton outside SUPPORTED_TRITON, a kernel swapped for its JIT function) launches
    unseen."""
    while isinstance(launcher, functools.partial):
        launcher = launcher.func
    name = getattr(launcher, "__module__", "")
    module = sys.modules.get(name)
    kernels = _entry_kernels.get(name)
    if module is None or not kernels or name in _unwrapped_modules:
        return False
    return all(isinstance(getattr(module, kernel, None), CachedLaunch) for kernel in kernels)


class CompiledLaunch:
    """One compiled kernel's launch: `(grid, stream, args)` with grid a 3-tuple and args
    every bound argument, through Triton's compiled launcher. On Triton 3.6, whose
    launcher object only adds scratch buffers before calling its C launch, a kernel that
    needs no scratch is launched by that C function directly (3 us less per launch on an
    H200 host); elsewhere through the launcher object."""

    __slots__ = ("launch", "function", "prefix")

    def __init__(self, compiled):
        launcher = compiled.run
        self.function = compiled.function
        direct = (
            hasattr(launcher, "launch")
            and not hasattr(launcher, "kernel_signature")  # 3.9's C launch takes other arguments
            and getattr(launcher, "global_scratch_size", 1) == 0
            and getattr(launcher, "profile_scratch_size", 1) == 0
        )
        if direct:
            self.launch = launcher.launch
            self.prefix = (launcher.launch_cooperative_grid, launcher.launch_pdl, None, None,
                           compiled.packed_metadata, None, None, None)  # fmt: skip
        else:
            self.launch = launcher
            self.prefix = (compiled.packed_metadata, None, None, None)

    def __call__(self, grid: tuple, stream: int, args) -> None:
        self.launch(grid[0], grid[1], grid[2], stream, self.function, *self.prefix, *args)


class CachedLaunch:
    """A JIT function whose `[grid](*args, **meta)` reuses its compiled kernels (see the
    module docstring). Other attributes are the JIT function's."""

    def __init__(self, kernel):
        self.kernel = kernel
        # (device, argument specializations, meta) -> (compiled kernel, its launch, names
        # of the parameters that meta supplies, in signature order), or None: not cacheable.
        self._compiled: dict[tuple, tuple | None] = {}

    def __getattr__(self, name):
        return getattr(self.kernel, name)

    def __getitem__(self, grid):
        return lambda *args, **meta: self._launch(grid, args, meta)

    def _launch(self, grid, args, meta):
        device = _current_device()
        first = args[0] if args else None
        if type(first) is _Tensor and first.is_cuda and first.get_device() != device:
            # Inputs on another GPU than the current one (a process that never called
            # set_device): launch with their device current, so the stream is their
            # device's current stream, the one PyTorch's own ops on them use.
            launch_plan.refuse()  # a replay would launch without switching
            with torch.cuda.device(first.device):
                return self._launch(grid, args, meta)
        if hooks_set():
            launch_plan.refuse()
            return self.kernel.run(*args, grid=grid, warmup=False, **meta)
        specs = _specializations(args)
        key = (device, specs, tuple(meta.items()))
        entry = self._compiled.get(key, _MISSING)
        if entry is _MISSING:
            compiled = self.kernel.run(*args, grid=grid, warmup=False, **meta)
            entry = self._compiled[key] = self._entry(compiled, grid, args, meta, specs)
            if entry is None:
                launch_plan.refuse()
            else:
                self._record(entry, grid, args, meta)
            return compiled
        if entry is None:
            launch_plan.refuse()
            return self.kernel.run(*args, grid=grid, warmup=False, **meta)
        compiled, launch, meta_params = entry
        grid = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
        bound = (*args, *[meta[name] for name in meta_params])
        launch(grid, _raw_stream(device), bound)
        log = launch_plan.recording()
        if log is not None:
            log.launch(launch, grid, bound)
        return compiled

    @staticmethod
    def _record(entry, grid, args, meta) -> None:
        """Logs a launch that Triton served (a first one) to this thread's recording."""
        log = launch_plan.recording()
        if log is not None:
            _, launch, meta_params = entry
            grid = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
            log.launch(launch, grid, (*args, *[meta[name] for name in meta_params]))

    def _entry(self, compiled, grid, args, meta, specs):
        """The cache entry for a launch Triton just served: None where the fast path
        cannot rebuild its arguments."""
        kernel = self.kernel
        meta_params = kernel.arg_names[len(args) :]
        keyable = (
            _UNKEYABLE not in specs
            and compiled is not None
            and isinstance(grid, tuple)
            and not kernel.pre_run_hooks
            and not any(p.is_constexpr for p in kernel.params[: len(args)])  # keyed by value
            and all(name in meta for name in meta_params)
        )
        return (compiled, CompiledLaunch(compiled), meta_params) if keyable else None


# Held by every interpreted launch of a generated kernel (see the module docstring).
# Reentrant, so a launch that launches (none does today) cannot deadlock itself.
INTERPRETER_LOCK = threading.RLock()


class SerializedInterpretedLaunch:
    """An interpreted kernel (TRITON_INTERPRET=1) whose launches, `[grid](*args, **meta)`
    or `run(...)`, hold INTERPRETER_LOCK. Other attributes are the kernel's."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getattr__(self, name):
        return getattr(self.kernel, name)

    def __getitem__(self, grid):
        return lambda *args, **meta: self.run(*args, grid=grid, warmup=False, **meta)

    def run(self, *args, **kwargs):
        launch_plan.refuse()
        with INTERPRETER_LOCK:
            return self.kernel.run(*args, **kwargs)


def cached_launch(kernel):
    """Wraps a compiled-mode Triton JIT function; an interpreted one gets the interpreter
    lock instead; anything else (no Triton, a Triton outside SUPPORTED_TRITON) is returned
    as it is."""
    fn = getattr(kernel, "fn", None)
    module = getattr(fn, "__module__", None)
    if module is not None:
        _entry_kernels.setdefault(module, set()).add(fn.__name__)
    if InterpretedFunction is not None and isinstance(kernel, InterpretedFunction):
        return SerializedInterpretedLaunch(kernel)
    if (
        JITFunction is None
        or not isinstance(kernel, JITFunction)
        or not _supported(triton.__version__)
    ):
        _unwrapped_modules.add(module)
        return kernel
    return CachedLaunch(kernel)
