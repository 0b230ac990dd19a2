"""Triton's once-per-process start cost, paid in the background while the caller sets up.

A fresh process with a warm Triton cache spent ~0.5 s of host time in its first kernel
launch (H200 host, Triton 3.6, profiled): 0.37 s in triton.runtime.cache.triton_key,
which hashes Triton's own sources and its ~400 MB shared library to key the cache, and
0.1 s importing modules Triton loads on first launch; of a 54 ms first call that came
after that work (H100 host), 11 ms ran `file` for a platform key; 5 ms ran `ptxas
--version` for the backend's part of the key and 4 ms read the tuning table (H200;
commit 305b670). Only
that ptxas lookup needs CUDA started, which the caller's setup does while Triton imports,
so a daemon thread started when lik is imported does it all; the hashing releases the
GIL, so the caller's own start-up (loading a model, building inputs) goes on beside it,
and its first call then finds the work done instead of doing it. A first kernel load
that comes while the thread still runs waits for it rather than redoing its work beside
it, and so does a fork (a child must not inherit an import half done by a thread it does
not have), and so does the process's exit (a thread killed inside native code at
finalization can abort the process).

Triton's cache key is also remembered across processes (`remembered_triton_key`): in a
fresh process the thread, which otherwise spent 0.31-0.37 s of its ~0.9 s hashing, reads
the key a previous process saved and hands it to Triton (the way Triton hands it to its
own worker processes) whenever the files Triton hashes are unchanged (same paths, sizes
and modification times); otherwise it hashes them as Triton would and saves the key.

It runs where a kernel launch can follow: Triton installed and torch built for CUDA or
ROCm. LIK_PREWARM=0 turns it off; LIK_PREWARM=1 forces it (e.g. on a CPU build).
"""

from __future__ import annotations

import atexit
import hashlib
import importlib.util
import os
import sysconfig
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
EXIT_WAIT_SECONDS = 60  # the warm-up takes about a second


def warm() -> None:
    """Imports Triton, keys its cache and does the first launch's lookups (and reads the
    variant manifest and the tuning tables, the first kernel load's)."""
    import triton  # noqa: F401

    from lik.runtime import registry, tuning

    registry.manifest()
    tuning.load_tables()
    remembered_triton_key()  # kept for the process: the first launch reuses it
    try:  # loaded by Triton 3.6's argument specialization on the first launch
        import triton.experimental.gluon  # noqa: F401
    except ImportError:
        pass
    _host_lookups()
    _backend_lookups()


KEY_FOLDER = "lik_triton_key"  # inside Triton's cache folder, beside the kernels it keys


def remembered_triton_key() -> str:
    """Triton's cache key for this process (triton.runtime.cache.triton_key: a digest of
    Triton's sources and its shared library), read from the cache folder when a previous
    process saved it for the same files, else computed by Triton and saved there. A read
    key replaces triton_key in its module, where Triton's compile path looks it up."""
    import triton.runtime.cache as triton_cache

    try:
        saved = os.path.join(_key_folder(), _files_fingerprint(triton_cache.__file__) + ".txt")
    except (AttributeError, OSError):  # a Triton without knobs, or files that moved
        return triton_cache.triton_key()
    try:
        with open(saved, encoding="utf-8") as file:
            key = file.read()
    except OSError:
        key = ""
    if not key:
        key = triton_cache.triton_key()
        _write_atomically(saved, key)
    else:
        triton_cache.triton_key = lambda: key
    return key


def _key_folder() -> str:
    from triton import knobs

    return os.path.join(knobs.cache.dir, KEY_FOLDER)


def _files_fingerprint(cache_module: str) -> str:
    """A digest of the path, size and modification time of every file triton_key reads
    (its own module, the compiler, backend and language packages, libtriton) plus
    Triton's version: any reinstall or edit of those files changes it."""
    import triton

    root = os.path.dirname(os.path.dirname(os.path.abspath(cache_module)))
    extension = sysconfig.get_config_var("EXT_SUFFIX").split(".")[-1]
    files = [os.path.abspath(cache_module), os.path.join(root, "_C", f"libtriton.{extension}")]
    for package in ("compiler", "backends", "language"):
        for folder, subfolders, names in os.walk(os.path.join(root, package)):
            subfolders.sort()
            files += [os.path.join(folder, n) for n in sorted(names) if n.endswith((".py", ".so"))]
    digest = hashlib.sha256(triton.__version__.encode())
    for path in files:
        stat = os.stat(path)
        digest.update(f"\n{path} {stat.st_size} {stat.st_mtime_ns}".encode())
    return digest.hexdigest()


def _write_atomically(path: str, text: str) -> None:
    """Writes beside the target, then renames: a process reading it sees all or none."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        partial = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(partial, "w", encoding="utf-8") as file:
            file.write(text)
        os.replace(partial, path)
    except OSError:  # a read-only cache folder: the next process hashes again
        pass


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


def _backend_lookups() -> None:
    """The first compile's lookups that need the GPU: its target and the ptxas version
    that keys Triton's cache (a subprocess, cached for the process). Done only once the
    caller has started CUDA (building inputs usually does, while this thread imports
    Triton), since starting it here would keep the process from forking."""
    if torch.version.cuda is None or not torch.cuda.is_initialized():
        return
    try:
        from triton.compiler.compiler import make_backend
        from triton.runtime.driver import driver

        make_backend(driver.active.get_current_target()).hash()
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
    # A daemon thread still hashing in native code when the interpreter finalizes is
    # killed there, which can abort the process ("FATAL: exception not rethrown"). The
    # wait is bounded: a warm-up stuck in a subprocess must not keep the process alive.
    atexit.register(wait, timeout=EXIT_WAIT_SECONDS)
    return _thread


def wait(timeout: float | None = None) -> None:
    """Returns once the warm-up is done (at once when none runs; after `timeout` seconds
    at most): Triton's cache key is not computed under a lock, so a launch beside the
    thread would compute it twice."""
    thread = _thread
    if thread is not None and thread.is_alive() and thread is not threading.current_thread():
        thread.join(timeout)
