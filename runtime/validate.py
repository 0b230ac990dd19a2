"""Input checks shared by every public entry. Errors name the argument, what was expected
and what was given; nothing is truncated or cast silently."""

from __future__ import annotations

import torch

from lik.runtime.keys import MAX_HEAD_DIM, SUPPORTED_DTYPES

BACKWARD_CHOICES = (None, "auto", "unified", "lowmem")


def describe(t: torch.Tensor) -> str:
    """A tensor as an error message names it."""
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def tensor(name: str, value: object, ranks: tuple[int, ...], layout_doc: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {layout_doc}, got {type(value).__name__}")
    if value.dim() not in ranks:
        raise ValueError(f"{name} must be {layout_doc}, got {value.dim()} dims ({describe(value)})")
    if value.dtype not in SUPPORTED_DTYPES:
        allowed = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise TypeError(f"{name} must have dtype in ({allowed}), got {value.dtype}")
    return value


def same_dtype_and_device(Q: torch.Tensor, D: torch.Tensor) -> None:
    if Q.device != D.device:
        raise ValueError(f"Q and D must be on one device: Q is on {Q.device}, D on {D.device}")
    if Q.dtype != D.dtype:
        raise TypeError(
            f"Q and D must share a dtype: Q is {Q.dtype}, D is {D.dtype} "
            f"(cast one, e.g. Q.to({D.dtype}))"
        )


def head_dims(Q: torch.Tensor, D: torch.Tensor, q_name: str = "Q", d_name: str = "D") -> None:
    """Q and D share a head dim (either one wider is refused), of 1 to MAX_HEAD_DIM; errors
    name the arguments as the caller calls them."""
    if Q.shape[-1] != D.shape[-1]:
        raise ValueError(
            f"{q_name} and {d_name} must share the head dim (last axis): {q_name} has "
            f"{Q.shape[-1]} ({describe(Q)}), {d_name} has {D.shape[-1]} ({describe(D)})"
        )
    if Q.shape[-1] == 0:
        raise ValueError(f"{q_name} and {d_name} must have a head dim (last axis) of at least "
                         f"1, got 0 ({describe(Q)})")  # fmt: skip
    if Q.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"head dim {Q.shape[-1]} exceeds the largest supported, {MAX_HEAD_DIM}")


def mask(
    name: str,
    value: object,
    expected: tuple[int, ...],
    device: torch.device,
    layout_doc: str | None = None,
) -> torch.Tensor | None:
    """A bool mask of exactly the expected shape, or None; an integer mask (nonzero =
    valid, as attention masks come) is returned as bool, which every path reads.
    layout_doc names the axes for error messages (default: the expected sizes)."""
    if value is None:
        return None
    if layout_doc is None:  # formatted only here: masks are None on most calls
        layout_doc = f"{list(expected)}"
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a bool tensor {layout_doc}, got {type(value).__name__}")
    if value.dtype.is_floating_point or value.dtype.is_complex:
        raise TypeError(f"{name} must be bool (True = valid token) {layout_doc}, got {value.dtype}")
    if tuple(value.shape) != expected:
        raise ValueError(
            f"{name} must have shape {expected} {layout_doc}, got {tuple(value.shape)}"
        )
    if value.device != device:
        raise ValueError(f"{name} must be on {device} like Q and D, got {value.device}")
    return value if value.dtype == torch.bool else value != 0


def flag(name: str, value: object) -> bool:
    """A bool argument (Python's or NumPy's): strings, None and numbers are refused, not
    read by their truthiness."""
    kind = type(value)
    numpy_bool = kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_")
    if isinstance(value, bool) or numpy_bool:
        return bool(value)
    raise TypeError(f"{name} must be a bool, got {value!r}")


def backward_choice(backward: object) -> None:
    if backward not in BACKWARD_CHOICES:
        raise ValueError(
            f"backward must be one of None, 'auto', 'unified', 'lowmem', got {backward!r}"
        )


def byte_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """A validated (bool) mask as kernels read it: a zero-copy uint8 view (kernels load
    bytes, not 1-bit pointers)."""
    if mask is not None and mask.dtype == torch.bool:
        return mask.view(torch.uint8)
    return mask
