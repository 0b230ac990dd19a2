"""Kernel -> HeadRenderContext for the fused projection head (op = "head").

One generated module serves every variant of the head (doc mask or none, normalize or
not, fp32/fp16/bf16): one forward kernel and one reduce kernel, whose values are
constexprs. Besides the variant's values, the forward takes a bias or none (HAS_BIAS)
and saves the argmax a backward needs or not (SAVE_ARGMAX), and the reduce writes that
argmax or not: the launcher sets each flag from whether the call has the input, and an
input a call lacks is passed as None (its strides as 0), never as a placeholder tensor.
"""

from __future__ import annotations

import dataclasses

import sympy

from lik_gen.ir import Backward, Decompression, Kernel, Layout, Op, Target
from lik_gen.plan_base import Formula, KernelArg, PlanError, formula, strides

MODULE_TEMPLATE = "triton/head.py.j2"
LAUNCH_TEMPLATE = "glue/head_launch.py.j2"

# Sizes the forward kernel reads, with the launcher's expressions. They vary call to call:
# never specialized (the launcher passes d_model % BLOCK_M == 0 as the EVEN_M constexpr
# instead). tokens = Nd * Ld, the flat token count, is multiplied on the host: a Python
# int, passed as int64 when it reaches 2**31.
DYNAMIC_SIZES = {"Nq": "Nq", "tokens": "Nd * Ld", "Lq": "Lq", "Ld": "Ld", "d_model": "d_model"}
# Sizes the reduce kernel reads.
REDUCE_SIZES = ("Nq", "Lq", "Ld")

# The launcher's optional inputs (keywords, None when a call lacks them), each with the
# constexpr its presence sets. The argmax's also sets the forward's per-block winners
# (partial_index), which exist only with it.
OPTIONAL_INPUTS = {"b": "HAS_BIAS", "d_mask": "HAS_D_MASK", "argmax": "SAVE_ARGMAX"}

# Constexprs and launch options of each kernel ("NAME=expr"): tiles from the launch
# config, per-call facts of the inputs, and the values the variant binds (normalize; the
# dot dtype from the inputs' dtype, through kernel_lib.dot_config).
FORWARD_OPTIONS = (
    "BLOCK_Q=config.block_q",
    "BLOCK_L=config.block_l",
    "BLOCK_M=config.block_m",
    "BLOCK_K=config.block_k",
    "QUERY_GROUP=config.query_group",
    "EVEN_M=even_m",
    "H_TMA=h_tma",
    "FLAT_TOKENS=flat",
    *(f"{flag}={name} is not None" for name, flag in OPTIONAL_INPUTS.items()),
    "NORMALIZE=normalize",
    "DOT_DTYPE=dot_dtype",
    "INPUT_PRECISION=input_precision",
    "num_warps=config.num_warps",
    "num_stages=config.num_stages",
)
REDUCE_OPTIONS = (
    "BLOCK_Q=config.block_q",
    "BLOCK_L=config.block_l",
    "QUERY_GROUP=config.query_group",
    "FLAT_TOKENS=flat",
    f"{OPTIONAL_INPUTS['d_mask']}=d_mask is not None",
    f"{OPTIONAL_INPUTS['argmax']}=argmax is not None",
    "num_warps=4",
)

Nq, Nd, Lq, Ld = sympy.symbols("Nq Nd Lq Ld", integer=True, positive=True)
BLOCK_Q, BLOCK_L, BLOCK_M, BLOCK_K, QUERY_GROUP, num_stages = sympy.symbols(
    "BLOCK_Q BLOCK_L BLOCK_M BLOCK_K QUERY_GROUP num_stages", integer=True, positive=True
)
operand_bytes = sympy.Symbol("operand_bytes", integer=True, positive=True)


@dataclasses.dataclass(frozen=True)
class HeadKernel:
    """One kernel of the module: its name, runtime arguments and launch options."""

    name: str
    args: tuple[KernelArg, ...]
    dynamic: tuple[str, ...]  # size arguments Triton must not specialize on
    options: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class HeadRenderContext:
    name: str
    purpose: str
    forward: HeadKernel
    reduce: HeadKernel
    # Launcher keywords a call may leave out (None): their constexpr flags and strides
    # follow from that (glue/macros.py.j2 passes kernel_lib.NO_STRIDES for them).
    optional_inputs: tuple[str, ...]
    formulas: tuple[Formula, ...]
    module_template: str
    launch_template: str


def _forward_args() -> tuple[KernelArg, ...]:
    """What the forward kernel reads, in order, with the launcher's expressions."""
    # H: the tensor, or a TMA descriptor of it (the launcher's h_operand; see H_TMA).
    # Partial: each program's max per query token over its block of doc tokens (fp32,
    # [Nd, doc blocks, columns]); PartialIndex (same shape, int32) its winning token.
    names = (("Q", "Q"), ("H", "h_operand"), ("W", "W"), ("Bias", "b"), ("d_mask", "d_mask"),
             ("Partial", "partial"), ("PartialIndex", "partial_index"))  # fmt: skip
    tensors = [KernelArg(name, expr) for name, expr in names]
    sizes = [KernelArg(s, expr) for s, expr in (*DYNAMIC_SIZES.items(), ("dim", "dim"))]
    tensor_strides = (
        strides("q", "Q", ("b", "s", "k"))
        + strides("h", "H", ("b", "t", "m"))
        + strides("w", "W", ("k", "m"))
        + strides("bias", "b", ("k",))
        + strides("dm", "d_mask", ("b", "t"))
        + strides("p", "partial", ("b", "n"))
    )
    return tuple(tensors + sizes + tensor_strides)


def _reduce_args() -> tuple[KernelArg, ...]:
    """What the reduce kernel reads: the forward's partials, each doc's count of valid
    tokens (kernel_lib.valid_tokens), the outputs, their sizes."""
    names = (("Partial", "partial"), ("PartialIndex", "partial_index"),
             ("d_tokens", "valid_tokens(d_mask)"), ("Out", "out"),
             ("Argmax", "argmax"))  # fmt: skip
    tensors = [KernelArg(name, expr) for name, expr in names]
    sizes = [KernelArg(s, s) for s in REDUCE_SIZES]
    tensor_strides = (
        strides("p", "partial", ("b", "n"))
        + strides("o", "out", ("b", "c"))
        + strides("a", "argmax", ("b", "c", "s"))
    )
    return tuple(tensors + sizes + tensor_strides)


def _formulas() -> tuple[Formula, ...]:
    doc_blocks = sympy.ceiling(Ld / BLOCK_L)
    query_groups = sympy.ceiling(Nq / QUERY_GROUP)
    return (
        formula("forward_grid", sympy.Tuple(Nd * doc_blocks), ("Nd", "Ld", "BLOCK_L"),
                "Programs of the forward: one per (document, block of BLOCK_L doc tokens)."),
        formula("flat_forward_grid", sympy.Tuple(sympy.ceiling(Nd * Ld / BLOCK_L)),
                ("Nd", "Ld", "BLOCK_L"),
                "Programs of the forward over flat tokens: one per BLOCK_L of the Nd * Ld."),
        formula("reduce_grid", sympy.Tuple(Nd * query_groups), ("Nd", "Nq", "QUERY_GROUP"),
                "Programs of the reduce: one per (document, query group)."),
        formula("doc_blocks", doc_blocks, ("Ld", "BLOCK_L"),
                "Blocks of BLOCK_L doc tokens per document: partial maxima per query token."),
        formula("flat_doc_blocks", sympy.ceiling((Ld - 1) / BLOCK_L) + 1, ("Ld", "BLOCK_L"),
                "Flat-token tiles one document can touch (it may start anywhere in a tile)."),
        formula("scratch_columns",
                query_groups * QUERY_GROUP * sympy.ceiling(Lq / BLOCK_Q) * BLOCK_Q,
                ("Nq", "Lq", "QUERY_GROUP", "BLOCK_Q"),
                "Partial-max slots per doc block: every (query group, token chunk) tile."),
        formula("smem_bytes", num_stages * (BLOCK_L + BLOCK_K) * BLOCK_M * operand_bytes,
                ("BLOCK_L", "BLOCK_M", "BLOCK_K", "num_stages", "operand_bytes"),
                "Shared memory of the projection loop: pipelined hidden-state and weight "
                "tiles, operand_bytes per element (the variant's, bound by the registry)."),
    )  # fmt: skip


def plan_head(kernel: Kernel) -> HeadRenderContext:
    if kernel.op is not Op.HEAD:
        raise PlanError(f"{kernel.name}: not a fused-head kernel")
    unsupported = {
        "target": (kernel.target is not Target.TRITON, "triton"),
        "layout": (kernel.layout is not Layout.DENSE, "dense"),
        "dtype": (kernel.scaled, "fp32, fp16 or bf16"),
        "decompression": (kernel.decompression is not Decompression.NONE, "none"),
        # The backward is plain PyTorch (lik.runtime.head); the forward saves the argmax.
        "backward": (kernel.backward is not Backward.NONE, "none"),
    }
    for axis, (bad, allowed) in unsupported.items():
        if bad:
            value = "fp8e4m3" if axis == "dtype" else getattr(kernel, axis).value
            raise PlanError(f"{kernel.name}: the fused head takes {axis} {allowed}, not {value!r}")
    return HeadRenderContext(
        name=kernel.name,
        purpose="projection head + MaxSim forward",
        forward=HeadKernel(
            f"{kernel.name}_fwd_kernel", _forward_args(), tuple(DYNAMIC_SIZES), FORWARD_OPTIONS
        ),
        reduce=HeadKernel(
            f"{kernel.name}_reduce_kernel", _reduce_args(), REDUCE_SIZES, REDUCE_OPTIONS
        ),
        optional_inputs=tuple(OPTIONAL_INPUTS),
        formulas=_formulas(),
        module_template=MODULE_TEMPLATE,
        launch_template=LAUNCH_TEMPLATE,
    )
