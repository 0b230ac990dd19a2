"""Triton's once-per-process start cost, paid in the background while the caller sets up.

A fresh process with a warm Triton cache spent ~0.5 s of host time in its first kernel
launch (H200 host, Triton 3.6, profiled): 0.37 s in triton.runtime.cache.triton_key,
which hashes Triton's own sources and its ~400 MB shared library to key the cache, and
0.1 s importing modules Triton loads on first launch; of a 54 ms first call that came
after that work (H100 host), 11 ms ran `file` for a platform key. None of it touches
the GPU, so a daemon thread started when lik is imported does it all; the hashing
releases the GIL, so the caller's own start-up (loading a model, building inputs) goes
on beside it, and its first call then finds the work done instead of doing it. A first
kernel load that comes while the thread still runs waits for it rather than redoing its
work beside it, and so does a fork (a child must not inherit an import half done by a
thread it does not have).

It runs where a kernel launch can follow: Triton installed and torch built for CUDA or
ROCm. LIK_PREWARM=0 turns it off; LIK_PREWARM=1 forces it (e.g. on a CPU build).
"""

from __future__ import annotations

import importlib.util
import os
import threading

import torch

ENV = "LIK_PREWARM"


def wanted() -> bool:
    """Whether importing lik starts the warm-up (see the module docstring)."""
    setting = os.environ.get(ENV, "")
    if setting in ("0", "1"):
        return setting == "1"
    has_gpu_build = torch.version.cuda is not None or torch.version.hip is not None
    return has_gpu_build and importlib.util.find_spec("triton") is not None


_thread: threading.Thread | None = None


def warm() -> None:
    """Imports Triton and computes its cache key: the first launch's host-only work (and
    reads the variant manifest, the first kernel load's)."""
    import triton  # noqa: F401
    from triton.runtime.cache import triton_key

    from lik.runtime import registry

    registry.manifest()
    triton_key()  # lru-cached for the process: the first launch reuses it
    try:  # loaded by Triton 3.6's argument specialization on the first launch
        import triton.experimental.gluon  # noqa: F401
    except ImportError:
        pass
    _host_lookups()


def _host_lookups() -> None:
    """Two more of the first launch's host-only lookups, each cached for the process: the
    platform key of Triton's compiled helpers (Python's platform.architecture runs `file`
    on the interpreter) and, on CUDA, where libcuda lies (`ldconfig -p`). Neither
    initializes CUDA: the process may still fork."""
    try:
        from triton.runtime.build import platform_key

        platform_key()
    except (ImportError, AttributeError):
        pass
    if torch.version.cuda is not None:
        try:
            from triton.backends.nvidia.driver import libcuda_dirs

            libcuda_dirs()
        except (ImportError, AttributeError):
            pass


def _warm_quietly() -> None:
    try:
        warm()
    except Exception:  # noqa: BLE001 - an optimization only: the first call redoes the work
        pass  # and raises there if Triton is really broken


def start() -> threading.Thread | None:
    """Starts the warm-up thread when wanted(); returns it (None when not started)."""
    global _thread
    if not wanted():
        return None
    _thread = threading.Thread(target=_warm_quietly, name="lik-prewarm", daemon=True)
    _thread.start()
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(before=wait)
    return _thread


def wait() -> None:
    """Returns once the warm-up is done (at once when none runs): Triton's cache key is
    not computed under a lock, so a launch beside the thread would compute it twice."""
    thread = _thread
    if thread is not None and thread.is_alive() and thread is not threading.current_thread():
        thread.join()
