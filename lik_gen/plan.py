"""Variant -> RenderContext: every value a template needs, computed once, here.

Templates never compute: type spellings come from the lookup tables below, argument
lists are built per layout, and the launch-grid and shared-memory formulas are sympy
expressions, simplified once and printed as Python.
"""

from __future__ import annotations

import dataclasses

import sympy
from sympy.printing.pycode import PythonCodePrinter

from lik_gen.ir import Decompression, DType, Layout, Target, Variant

# One lookup table per spelling: never format a type inline.
TRITON_DTYPE = {
    DType.FP32: "tl.float32",
    DType.FP16: "tl.float16",
    DType.BF16: "tl.bfloat16",
    DType.FP8E4M3: "tl.float8e4nv",
}
TORCH_DTYPE = {
    DType.FP32: "torch.float32",
    DType.FP16: "torch.float16",
    DType.BF16: "torch.bfloat16",
    DType.FP8E4M3: "torch.float8_e4m3fn",
}
ELEMENT_BYTES = {DType.FP32: 4, DType.FP16: 2, DType.BF16: 2, DType.FP8E4M3: 1}
# Operand dtype of tl.dot on a GPU. fp32 inputs use tf32 tensor cores (error ~3e-4,
# inside the 1e-3 fp32 tolerance).
DOT_DTYPE_DEVICE = {
    DType.FP32: "tl.float32",
    DType.FP16: "tl.float16",
    DType.BF16: "tl.bfloat16",
    DType.FP8E4M3: "tl.float8e4nv",
}
INPUT_PRECISION_DEVICE = {
    DType.FP32: "tf32",
    DType.FP16: "ieee",
    DType.BF16: "ieee",
    DType.FP8E4M3: "ieee",
}
# The Triton interpreter multiplies the raw bit patterns of bf16 dot operands, so under
# it every dot runs in fp32 ("ieee"); tensors stay in their dtype in memory, so loads
# and stores are still exercised.
DOT_DTYPE_INTERPRETER = "tl.float32"
INPUT_PRECISION_INTERPRETER = "ieee"

# The decompression hook: one partial per scheme, all with the same signature.
DOC_TILE_HOOK = {Decompression.NONE: "triton/load_doc_tile/none.py.j2"}

MODULE_TEMPLATE = {Target.TRITON: "triton/maxsim_fwd.py.j2"}
LAUNCH_TEMPLATE = {Target.TRITON: "glue/launch_triton.py.j2"}


@dataclasses.dataclass(frozen=True)
class KernelArg:
    """One runtime argument of a kernel and the launcher expression that supplies it."""

    name: str
    expr: str


@dataclasses.dataclass(frozen=True)
class RenderContext:
    name: str
    layout: str
    has_q_mask: bool
    has_d_mask: bool
    normalize: bool
    elem_triton: str
    elem_torch: str
    dot_dtype_device: str
    dot_dtype_interpreter: str
    input_precision_device: str
    input_precision_interpreter: str
    kernel_name: str
    kernel_args: tuple[KernelArg, ...]
    launcher_args: tuple[str, ...]
    grid_params: tuple[str, ...]
    grid_expr: str
    smem_params: tuple[str, ...]
    smem_expr: str
    doc_tile_hook: str
    module_template: str
    launch_template: str
    output_doc: str


class PlanError(ValueError):
    pass


class _Printer(PythonCodePrinter):
    """Prints integer formulas without the math module: ceil(a/b) as cdiv(a, b)."""

    def _print_ceiling(self, expr):
        num, den = sympy.fraction(sympy.together(expr.args[0]))
        return f"cdiv({self._print(num)}, {self._print(den)})"


def _pycode(expr: sympy.Expr) -> str:
    return _Printer().doprint(sympy.simplify(expr))


# Sizes named as the launcher names them.
Nq, Nd, K, B = sympy.symbols("Nq Nd K B", integer=True, positive=True)
BLOCK_Q, BLOCK_L, BLOCK_K, num_stages = sympy.symbols(
    "BLOCK_Q BLOCK_L BLOCK_K num_stages", integer=True, positive=True
)


def _layout_shape(layout: Layout) -> tuple[sympy.Expr, tuple[str, ...], str]:
    """Programs launched (one per scored (query, doc) pair), and the output shape."""
    if layout is Layout.DENSE:
        return Nq * Nd, ("Nq", "Nd"), "[Nq, Nd]"
    if layout is Layout.KD:
        return Nq * K, ("Nq", "K"), "[Nq, K]"
    if layout is Layout.PAIRS:
        return B, ("B",), "[B]"
    raise PlanError(f"layout {layout.value!r} has no forward template yet")


def _kernel_args(variant: Variant) -> tuple[KernelArg, ...]:
    """Exactly the arguments the kernel reads, in order, with their launcher expressions."""
    layout, mask = variant.layout, variant.mask
    args = [KernelArg("Q", "Q"), KernelArg("D", "D")]
    if mask.has_q:
        args.append(KernelArg("q_mask", "q_mask"))
    if mask.has_d:
        args.append(KernelArg("d_mask", "d_mask"))
    args.append(KernelArg("Out", "out"))
    sizes = {Layout.DENSE: ["Nq", "Nd"], Layout.KD: ["Nq", "K"], Layout.PAIRS: []}[layout]
    args += [KernelArg(s, s) for s in sizes + ["Lq", "Ld", "dim"]]
    args += _strides("q", "Q", ("b", "s", "k"))
    doc_axes = ("b", "c", "t", "k") if layout is Layout.KD else ("b", "t", "k")
    args += _strides("d", "D", doc_axes)
    if mask.has_q:
        args += _strides("qm", "q_mask", ("b", "s"))
    if mask.has_d:
        args += _strides("dm", "d_mask", doc_axes[:-1])
    out_axes = ("b",) if layout is Layout.PAIRS else ("b", "c")
    args += _strides("o", "out", out_axes)
    return tuple(args)


def _strides(prefix: str, tensor: str, axes: tuple[str, ...]) -> list[KernelArg]:
    return [
        KernelArg(f"stride_{prefix}{axis}", f"{tensor}.stride({i})") for i, axis in enumerate(axes)
    ]


def plan(variant: Variant) -> RenderContext:
    if variant.target not in MODULE_TEMPLATE:
        raise PlanError(f"{variant.name}: target {variant.target.value!r} has no templates yet")
    if variant.decompression not in DOC_TILE_HOOK:
        raise PlanError(
            f"{variant.name}: decompression {variant.decompression.value!r} has no "
            "load_doc_tile hook yet"
        )
    if variant.dtype is DType.FP8E4M3:
        raise PlanError(f"{variant.name}: fp8 inputs have their own entry and template")
    programs, grid_params, output_doc = _layout_shape(variant.layout)
    smem = (num_stages * BLOCK_L + BLOCK_Q) * BLOCK_K * ELEMENT_BYTES[variant.dtype]
    launcher_args = ["Q", "D"]
    if variant.mask.has_q:
        launcher_args.append("q_mask")
    if variant.mask.has_d:
        launcher_args.append("d_mask")
    return RenderContext(
        name=variant.name,
        layout=variant.layout.value,
        has_q_mask=variant.mask.has_q,
        has_d_mask=variant.mask.has_d,
        normalize=variant.normalize,
        elem_triton=TRITON_DTYPE[variant.dtype],
        elem_torch=TORCH_DTYPE[variant.dtype],
        dot_dtype_device=DOT_DTYPE_DEVICE[variant.dtype],
        dot_dtype_interpreter=DOT_DTYPE_INTERPRETER,
        input_precision_device=INPUT_PRECISION_DEVICE[variant.dtype],
        input_precision_interpreter=INPUT_PRECISION_INTERPRETER,
        kernel_name=f"{variant.name}_fwd_kernel",
        kernel_args=_kernel_args(variant),
        launcher_args=tuple(launcher_args),
        grid_params=grid_params,
        grid_expr=_pycode(programs),
        smem_params=("BLOCK_Q", "BLOCK_L", "BLOCK_K", "num_stages"),
        smem_expr=_pycode(smem),
        doc_tile_hook=DOC_TILE_HOOK[variant.decompression],
        module_template=MODULE_TEMPLATE[variant.target],
        launch_template=LAUNCH_TEMPLATE[variant.target],
        output_doc=output_doc,
    )
