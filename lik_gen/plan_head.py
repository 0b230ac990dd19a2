"""Variant -> HeadRenderContext for the fused projection head (op = "head").

One generated module per (doc mask, normalize, dtype) holds four forward kernels: with
and without a bias, each with and without the argmax a backward needs, and two reduce
kernels (with and without the argmax) that fold the forward's per-block maxima into
scores. The runtime picks one pair per call, so every kernel takes exactly the arguments
it uses (no placeholder bias or argmax tensor) while the variant name keeps to the
shared axes.
"""

from __future__ import annotations

import dataclasses

import sympy

from lik_gen.ir import Backward, Decompression, DType, Layout, Mask, Op, Target, Variant
from lik_gen.plan import (
    DOT_DTYPE_DEVICE,
    DOT_DTYPE_INTERPRETER,
    INPUT_PRECISION_DEVICE,
    INPUT_PRECISION_INTERPRETER,
    SMEM_OPERAND_BYTES,
    TORCH_DTYPE,
    Formula,
    KernelArg,
    PlanError,
    _formula,
    _strides,
)

MODULE_TEMPLATE = "triton/head.py.j2"
LAUNCH_TEMPLATE = "glue/head_launch.py.j2"

# Sizes the forward kernels read, with the launcher's expressions. They vary call to call:
# never specialized (the launcher passes d_model % BLOCK_M == 0 as the EVEN_M constexpr
# instead). tokens = Nd * Ld, the flat token count, is multiplied on the host: a Python
# int, passed as int64 when it reaches 2**31.
DYNAMIC_SIZES = {"Nq": "Nq", "tokens": "Nd * Ld", "Lq": "Lq", "Ld": "Ld", "d_model": "d_model"}
# Sizes the reduce kernels read.
REDUCE_SIZES = ("Nq", "Lq", "Ld")

Nq, Nd, Lq, Ld = sympy.symbols("Nq Nd Lq Ld", integer=True, positive=True)
BLOCK_Q, BLOCK_L, BLOCK_M, BLOCK_K, QUERY_GROUP, num_stages = sympy.symbols(
    "BLOCK_Q BLOCK_L BLOCK_M BLOCK_K QUERY_GROUP num_stages", integer=True, positive=True
)


@dataclasses.dataclass(frozen=True)
class HeadKernel:
    """One forward kernel of the module: which optional inputs it reads."""

    name: str
    has_bias: bool
    save_argmax: bool
    args: tuple[KernelArg, ...]
    branch: str  # the launcher's test that picks this kernel
    reducer: str  # the reduce kernel that turns its per-block maxima into scores


@dataclasses.dataclass(frozen=True)
class HeadReducer:
    """One reduce kernel: per-block maxima (and winners) -> scores (and the argmax)."""

    name: str
    save_argmax: bool
    args: tuple[KernelArg, ...]


@dataclasses.dataclass(frozen=True)
class HeadRenderContext:
    name: str
    purpose: str
    has_d_mask: bool
    normalize: bool
    elem_torch: str
    dot_dtype_device: str
    dot_dtype_interpreter: str
    input_precision_device: str
    input_precision_interpreter: str
    kernels: tuple[HeadKernel, ...]
    reducers: tuple[HeadReducer, ...]
    dynamic: tuple[str, ...]
    reduce_dynamic: tuple[str, ...]
    launcher_keywords: tuple[str, ...]
    formulas: tuple[Formula, ...]
    module_template: str
    launch_template: str
    # Switches of the shared helpers partial (triton/partials/helpers.py.j2): the
    # inference kernels use _max_keep_nan, and no kernel here has a generated backward.
    save_argmax: bool
    backward: str


def _kernel_args(variant: Variant, has_bias: bool, save_argmax: bool) -> tuple[KernelArg, ...]:
    """Exactly what one forward kernel reads, in order, with the launcher's expressions."""
    # H: the tensor, or a TMA descriptor of it (the launcher's h_operand; see H_TMA).
    tensors = [KernelArg("Q", "Q"), KernelArg("H", "h_operand"), KernelArg("W", "W")]
    strides = (
        _strides("q", "Q", ("b", "s", "k"))
        + _strides("h", "H", ("b", "t", "m"))
        + _strides("w", "W", ("k", "m"))
    )
    if has_bias:
        tensors.append(KernelArg("Bias", "b"))
        strides += _strides("bias", "b", ("k",))
    if variant.mask.has_d:
        tensors.append(KernelArg("d_mask", "d_mask"))
        strides += _strides("dm", "d_mask", ("b", "t"))
    # Partial: each program's max per query token over its block of doc tokens (fp32,
    # [Nd, doc blocks, columns]); PartialIndex (same shape, int32) its winning token.
    tensors.append(KernelArg("Partial", "partial"))
    if save_argmax:
        tensors.append(KernelArg("PartialIndex", "partial_index"))
    strides += _strides("p", "partial", ("b", "n"))
    sizes = [KernelArg(s, expr) for s, expr in (*DYNAMIC_SIZES.items(), ("dim", "dim"))]
    return tuple(tensors + sizes + strides)


def _reduce_args(save_argmax: bool) -> tuple[KernelArg, ...]:
    """What one reduce kernel reads: the forward's partials, the outputs, their sizes."""
    tensors = [KernelArg("Partial", "partial")]
    if save_argmax:
        tensors.append(KernelArg("PartialIndex", "partial_index"))
    tensors.append(KernelArg("Out", "out"))
    strides = _strides("p", "partial", ("b", "n")) + _strides("o", "out", ("b", "c"))
    if save_argmax:
        tensors.append(KernelArg("Argmax", "argmax"))
        strides += _strides("a", "argmax", ("b", "c", "s"))
    sizes = [KernelArg(s, s) for s in REDUCE_SIZES]
    return tuple(tensors + sizes + strides)


def _formulas(variant: Variant) -> tuple[Formula, ...]:
    operand = SMEM_OPERAND_BYTES[variant.dtype]
    doc_blocks = sympy.ceiling(Ld / BLOCK_L)
    query_groups = sympy.ceiling(Nq / QUERY_GROUP)
    return (
        _formula("forward_grid", sympy.Tuple(Nd * doc_blocks), ("Nd", "Ld", "BLOCK_L"),
                 "Programs of the forward: one per (document, block of BLOCK_L doc tokens)."),
        _formula("flat_forward_grid", sympy.Tuple(sympy.ceiling(Nd * Ld / BLOCK_L)),
                 ("Nd", "Ld", "BLOCK_L"),
                 "Programs of the forward over flat tokens: one per BLOCK_L of the Nd * Ld."),
        _formula("reduce_grid", sympy.Tuple(Nd * query_groups), ("Nd", "Nq", "QUERY_GROUP"),
                 "Programs of the reduce: one per (document, query group)."),
        _formula("doc_blocks", doc_blocks, ("Ld", "BLOCK_L"),
                 "Blocks of BLOCK_L doc tokens per document: partial maxima per query token."),
        _formula("flat_doc_blocks", sympy.ceiling((Ld - 1) / BLOCK_L) + 1, ("Ld", "BLOCK_L"),
                 "Flat-token tiles one document can touch (it may start anywhere in a tile)."),
        _formula("scratch_columns",
                 query_groups * QUERY_GROUP * sympy.ceiling(Lq / BLOCK_Q) * BLOCK_Q,
                 ("Nq", "Lq", "QUERY_GROUP", "BLOCK_Q"),
                 "Partial-max slots per doc block: every (query group, token chunk) tile."),
        _formula("smem_bytes", num_stages * (BLOCK_L + BLOCK_K) * BLOCK_M * operand,
                 ("BLOCK_L", "BLOCK_M", "BLOCK_K", "num_stages"),
                 "Shared memory of the projection loop: pipelined hidden-state and weight tiles."),
    )  # fmt: skip


def plan_head(variant: Variant) -> HeadRenderContext:
    if variant.op is not Op.HEAD:
        raise PlanError(f"{variant.name}: not a fused-head variant")
    unsupported = {
        "target": (variant.target is not Target.TRITON, "triton"),
        "layout": (variant.layout is not Layout.DENSE, "dense"),
        "mask": (variant.mask not in (Mask.NONE, Mask.D), "none or d"),
        "dtype": (variant.dtype is DType.FP8E4M3, "fp32, fp16 or bf16"),
        "decompression": (variant.decompression is not Decompression.NONE, "none"),
        # The backward is plain PyTorch (lik.runtime.head); the forward saves the argmax.
        "backward": (variant.backward is not Backward.NONE, "none"),
    }
    for axis, (bad, allowed) in unsupported.items():
        if bad:
            value = getattr(variant, axis).value
            raise PlanError(f"{variant.name}: the fused head takes {axis} {allowed}, not {value!r}")
    reducers = tuple(
        HeadReducer(
            f"{variant.name}_reduce" + ("_argmax" if save else ""), save, _reduce_args(save)
        )
        for save in (False, True)
    )
    kernels = []
    branches = iter(("if b is None and argmax is None:", "elif b is None:",
                     "elif argmax is None:", "else:"))  # fmt: skip
    for has_bias in (False, True):
        for save_argmax in (False, True):
            suffix = ("_bias" if has_bias else "") + ("_argmax" if save_argmax else "")
            kernels.append(
                HeadKernel(
                    name=f"{variant.name}_fwd{suffix}_kernel",
                    has_bias=has_bias,
                    save_argmax=save_argmax,
                    args=_kernel_args(variant, has_bias, save_argmax),
                    branch=next(branches),
                    reducer=reducers[save_argmax].name,
                )
            )
    return HeadRenderContext(
        name=variant.name,
        purpose="projection head + MaxSim forward",
        has_d_mask=variant.mask.has_d,
        normalize=variant.normalize,
        elem_torch=TORCH_DTYPE[variant.dtype],
        dot_dtype_device=DOT_DTYPE_DEVICE[variant.dtype],
        dot_dtype_interpreter=DOT_DTYPE_INTERPRETER,
        input_precision_device=INPUT_PRECISION_DEVICE[variant.dtype],
        input_precision_interpreter=INPUT_PRECISION_INTERPRETER,
        kernels=tuple(kernels),
        reducers=reducers,
        dynamic=tuple(DYNAMIC_SIZES),
        reduce_dynamic=REDUCE_SIZES,
        launcher_keywords=("d_mask",) if variant.mask.has_d else (),
        formulas=_formulas(variant),
        module_template=MODULE_TEMPLATE,
        launch_template=LAUNCH_TEMPLATE,
        save_argmax=False,
        backward="none",
    )
