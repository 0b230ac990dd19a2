"""End-to-end demo: ``python -m lik.demo`` (or ``make demo``).

1. From a source checkout, re-render every kernel from specs/ and check that the
   committed generated/ tree matches (the same check CI runs).
2. Score a small ColBERT-like batch with ``lik.maxsim`` on the best device
   (cuda > mps > cpu) and compare it with the float64 reference.
3. On a CPU machine, run a generated Triton kernel under the Triton interpreter on a
   tiny batch. TRITON_INTERPRET must be set before triton is imported, so that phase
   runs in a child process.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

import lik
from lik.runtime import autotune, describe_backend, maxsim
from lik.runtime.reference import maxsim_reference

# Relative error allowed against the float64 reference (tests/helpers.py's TOLERANCE).
TOLERANCE = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def _source_root() -> Path | None:
    """The checkout root when lik runs from a source tree, None for an installed wheel."""
    root = Path(lik.__file__).resolve().parent.parent
    if (root / "specs").is_dir() and (root / "templates").is_dir():
        return root
    return None


def check_generated() -> bool:
    """Re-render the kernels and compare with generated/; True when up to date or skipped."""
    print("== 1. generated kernels")
    root = _source_root()
    if root is None or importlib.util.find_spec("lik_gen") is None:
        print("skipped: no specs/ or templates/ here (installed package, not a checkout)")
        return True
    from lik_gen.cli import main as lik_gen_main

    cwd = os.getcwd()
    os.chdir(root)  # the compiler works on the checkout it belongs to
    try:
        rc = lik_gen_main(["check"])
    except SystemExit as exit_:
        rc = exit_.code
    except Exception as error:  # e.g. a GPU box without the generator's tools (ruff)
        print(f"skipped: the check could not run ({type(error).__name__}: {error})")
        return True
    finally:
        os.chdir(cwd)
    if rc not in (0, None):
        print("generated/ does not match specs/: run `make generate` and review the diff")
        return False
    return True


def pick_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda")
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def make_batch(nq, lq, nd, ld, dim, device, dtype, seed=0):
    """Random query/doc token embeddings with ragged doc lengths (True = valid token)."""
    g = torch.Generator().manual_seed(seed)
    Q = torch.randn(nq, lq, dim, generator=g)
    D = torch.randn(nd, ld, dim, generator=g)
    lengths = torch.randint(max(1, ld // 4), ld + 1, (nd,), generator=g)
    d_mask = torch.arange(ld)[None, :] < lengths[:, None]
    D = D * d_mask[..., None]  # padding is zeros, as an encoder's padded output would be
    return Q.to(device, dtype), D.to(device, dtype), d_mask.to(device)


def max_rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    return ((out - ref).abs() / ref.abs().clamp_min(1e-12)).max().item()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
    elif device.type == "mps":
        torch.mps.synchronize()


def score_batch(device: torch.device) -> bool:
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    nq, lq, nd, ld, dim = 4, 32, 64, 180, 128
    print(f"\n== 2. score {nq} queries x {lq} tokens against {nd} docs x <={ld} tokens, d={dim}")
    print(f"device: {device}, dtype: {str(dtype).removeprefix('torch.')}")
    print(f"backend: {describe_backend(device)}")
    Q, D, d_mask = make_batch(nq, lq, nd, ld, dim, device, dtype)

    swept = autotune.sweeps
    began = time.perf_counter()
    scores = maxsim(Q, D, d_mask=d_mask, normalize=True)  # first call loads/compiles
    _sync(device)
    if autotune.sweeps > swept:  # a key no committed table covers, on a GPU
        print(f"first call: {time.perf_counter() - began:.1f} s, autotuning its launch config "
              f"once for this GPU (cached in {autotune.cache_path()})")  # fmt: skip
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        maxsim(Q, D, d_mask=d_mask, normalize=True)
        _sync(device)
        times.append(time.perf_counter() - t0)
    ms = sorted(times)[len(times) // 2] * 1e3

    ref = maxsim_reference(Q.double(), D.double(), d_mask=d_mask, normalize=True)
    err = max_rel_error(scores, ref)
    ok = err <= TOLERANCE[dtype]
    print(f"scores: {tuple(scores.shape)} {str(scores.dtype).removeprefix('torch.')}")
    print(
        f"max relative error vs float64 reference: {err:.2e} "
        f"({'ok' if ok else 'FAIL'}, limit {TOLERANCE[dtype]:.0e})"
    )
    print(f"time per call: {ms:.3f} ms (median of {len(times)})")
    top = scores.float().topk(3, dim=1)
    for i in range(nq):
        pairs = zip(top.indices[i].tolist(), top.values[i].tolist(), strict=True)
        docs = ", ".join(f"doc {j} ({s:.3f})" for j, s in pairs)
        print(f"  query {i}: {docs}")
    return ok


def interpreter_phase() -> bool:
    """Runs in the child process, with TRITON_INTERPRET=1 set before triton is imported."""
    device = torch.device("cpu")
    backend = describe_backend(device)
    print(f"backend: {backend}")
    Q, D, d_mask = make_batch(2, 8, 5, 12, 32, device, torch.float32, seed=1)
    out = maxsim(Q, D, d_mask=d_mask, normalize=True)
    ref = maxsim_reference(Q.double(), D.double(), d_mask=d_mask, normalize=True)
    err = max_rel_error(out, ref)
    ok = err <= TOLERANCE[torch.float32] and "interpreter" in backend
    print(f"2 queries x 8 tokens, 5 docs x <=12 tokens, d=32: max relative error {err:.2e}")
    if "interpreter" not in backend:
        print("FAIL: TRITON_INTERPRET=1 did not route CPU tensors to the Triton kernel")
    return ok


def run_interpreter_child() -> bool:
    print("\n== 3. generated Triton kernel under the Triton interpreter (TRITON_INTERPRET=1)")
    if importlib.util.find_spec("triton") is None:
        print("skipped: triton is not installed (pip install 'lik[triton]')")
        return True
    env = dict(os.environ, TRITON_INTERPRET="1")
    child = subprocess.run([sys.executable, "-m", "lik.demo", "--interpreter-phase"], env=env)
    return child.returncode == 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lik.demo", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--interpreter-phase",
        action="store_true",
        help="only run the tiny Triton-interpreter check (the demo starts it in a child process)",
    )
    args = parser.parse_args(argv)
    if args.interpreter_phase:
        return 0 if interpreter_phase() else 1

    t0 = time.perf_counter()
    print(f"lik {lik.__version__}, torch {torch.__version__}")
    results = [check_generated()]
    device = pick_device()
    results.append(score_batch(device))
    if device.type == "cpu":
        results.append(run_interpreter_child())
    ok = all(results)
    print(f"\n{'demo ok' if ok else 'demo FAILED'} in {time.perf_counter() - t0:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
