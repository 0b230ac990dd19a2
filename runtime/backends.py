"""The one device ladder: which backend serves a call of an op family, by its device.

Backends:
- "triton": the generated Triton kernels, on CUDA (and ROCm) GPUs;
- "interpreter": the same kernels under the Triton interpreter, on a CPU with
  TRITON_INTERPRET=1 (CI's path: slow, for tests);
- "metal": the generated Metal kernels on Apple GPUs (lik.runtime.metal, which keeps
  calls outside its envelope on the reference);
- "cpu": chunked matrix products on a CPU (lik.runtime.cpu), for maxsim and maxsim_pairs;
- "reference": plain PyTorch (lik.runtime.reference), autograd-aware, everywhere else
  (and the float64 ground truth of the tests).

Each op family names the backends that implement it (FAMILY_BACKENDS); a call of a
family on another backend's device takes the reference. Entries ask `route` once per
call and branch on its answer; none keeps a ladder of its own.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from lik.runtime import metal

# Looked up once at import (not per call), so torch.compile sees a plain constant.
TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None
GENERATED_TRITON = ("triton", "interpreter")
# Which backends implement each op family (lik.runtime.ops): maxsim and maxsim_pairs;
# the other token scores; packed (ragged) batches; the top-k epilogue; fp8; PLAID
# residuals; the fused head.
FAMILY_BACKENDS = {
    "maxsim": (*GENERATED_TRITON, "metal", "cpu"),
    "scored": (*GENERATED_TRITON, "metal"),
    "ragged": GENERATED_TRITON,
    "topk": GENERATED_TRITON,
    "fp8": GENERATED_TRITON,
    "residual": GENERATED_TRITON,
    "head": GENERATED_TRITON,
}


def device_backend(device: torch.device) -> str:
    """The backend a device offers: 'triton', 'interpreter', 'metal', 'cpu' or 'reference'."""
    if device.type == "cuda" and TRITON_AVAILABLE:
        return "triton"
    if metal.handles(device):
        return "metal"
    if device.type == "cpu":
        interpreting = os.environ.get("TRITON_INTERPRET") == "1" and TRITON_AVAILABLE
        return "interpreter" if interpreting else "cpu"
    return "reference"


def of(tensor: torch.Tensor) -> str:
    """device_backend(tensor.device), with the CUDA case first and without building a
    device object: this runs on every call."""
    if tensor.is_cuda and TRITON_AVAILABLE:
        return "triton"
    return device_backend(tensor.device)


def route(family: str, tensor: torch.Tensor) -> str:
    """The backend that serves a call of `family` on tensor's device: the device's own,
    or the reference where that one does not implement the family."""
    backend = of(tensor)
    return backend if backend in FAMILY_BACKENDS[family] else "reference"


def describe_backend(device: torch.device | str) -> str:
    """The path maxsim takes on a device, in words."""
    device = torch.device(device)
    backend = device_backend(device)
    if backend == "metal":
        return metal.describe()
    return {
        "triton": f"generated Triton ({device.type})",
        "interpreter": "generated Triton under the interpreter (cpu)",
        "cpu": "lik's CPU backend (chunked matmuls; other entries: reference PyTorch)",
        "reference": f"reference PyTorch ({device.type})",
    }[backend]
