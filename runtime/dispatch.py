"""Validated call -> device path -> KernelKey -> generated kernel -> launch.

CUDA tensors run the generated Triton kernels; CPU tensors run the reference, or the
generated kernels under the Triton interpreter when TRITON_INTERPRET=1; other devices
run the reference until their target lands.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from lik.runtime import registry
from lik.runtime.keys import (
    LQ_CHUNK,
    KernelKey,
    gpu_family,
    lq_bucket,
    padded_head_dim,
    size_class,
    variant_name,
)
from lik.runtime.tuning import config_for


@functools.cache
def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def backend(device: torch.device) -> str:
    """'triton', 'interpreter' or 'reference': the path a tensor on this device takes."""
    if device.type == "cuda" and _triton_available():
        return "triton"
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1" and _triton_available():
        return "interpreter"
    return "reference"


def describe_backend(device: torch.device | str) -> str:
    device = torch.device(device)
    return {
        "triton": f"generated Triton ({device.type})",
        "interpreter": "generated Triton under the interpreter (cpu)",
        "reference": f"reference PyTorch ({device.type})",
    }[backend(device)]


def _mask_arg(mask: torch.Tensor | None) -> torch.Tensor | None:
    # Bool tensors reach Triton as 1-bit pointers; a zero-copy uint8 view loads as bytes.
    if mask is not None and mask.dtype == torch.bool:
        return mask.view(torch.uint8)
    return mask


def forward(
    layout: str,
    Q: torch.Tensor,
    D: torch.Tensor,
    q_mask,
    d_mask,
    normalize: bool,
    out: torch.Tensor,
) -> torch.Tensor:
    """Scores into `out` (fp32, shaped for the layout) with the generated kernel.

    Queries longer than LQ_CHUNK tokens are scored chunk by chunk and summed: exact, since
    each query token's max is independent of the others.
    """
    lq = Q.shape[1]
    if out.numel() == 0:
        return out
    if lq == 0 or D.shape[-2] == 0:
        return out.zero_()
    name = variant_name(layout, q_mask is not None, d_mask is not None, normalize, Q.dtype)
    module = registry.load(name)
    programs = out.numel()
    masks = {}
    if d_mask is not None:
        masks["d_mask"] = _mask_arg(d_mask)
    for start in range(0, lq, LQ_CHUNK):
        stop = min(lq, start + LQ_CHUNK)
        key = KernelKey(
            name,
            gpu_family(Q.device),
            padded_head_dim(Q.shape[-1]),
            lq_bucket(stop - start),
            size_class(programs),
        )
        config = config_for(key, module.smem_bytes)
        if q_mask is not None:
            masks["q_mask"] = _mask_arg(q_mask[:, start:stop])
        target = out if start == 0 else torch.empty_like(out)
        module.launch(target, Q[:, start:stop], D, config=config, **masks)
        if start > 0:
            out += target
    return out
