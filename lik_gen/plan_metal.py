"""Kernel -> MetalRenderContext: every value the Metal templates need, computed once.

One generated .metal file is one structural kernel (layout, backward, score); it serves
every value of the value axes (mask presence, normalize, input dtype). Those values are
compile-time constants that lik.runtime.metal prepends to the file's text for the variant
it compiles (`preamble`): torch.mps.compile_shader sets no MTLFunctionConstantValues, so
the constants are `constant constexpr` declarations the compiler folds, like function
constants, and the kernels branch on them with plain `if`.

The Metal kernels take the arguments of their Triton counterparts, in the same order
(lik_gen.plan_base's argument plan, for the kernel's widest variant: every input any value
reads), so both targets bind the same tensors, sizes and strides. Each kernel gives one
simdgroup (32 lanes) one unit of work: a (query, doc) pair for the forward, a query token
for grad_Q, a doc token for grad_D. Threadgroups hold SIMDGROUPS_PER_GROUP simdgroups that
never talk to each other, so the kernels use no threadgroup memory and no barriers.

The generated file carries a launch block (JSON in a comment) from which lik.runtime.metal
binds arguments and sizes the grid without knowing any kernel.

The MSL helpers every kernel calls (element loads and stores, 8x8 fragments, head-dim
rows) and the constants they and the kernels read (SIMD_WIDTH, SIMDGROUPS, DIM_TILES,
DIMS_PER_LANE, NORM_EPS) are one generated module, generated/metal/common.metal
(`plan_metal_common`), which lik.runtime.metal compiles between a variant's preamble and
its kernel's file: a change in a helper changes that one file.
"""

from __future__ import annotations

import dataclasses
import json
import re

import sympy

from lik_gen.ir import (
    METAL_MAX_HEAD_DIM,
    Backward,
    Decompression,
    DType,
    Kernel,
    Layout,
    Score,
    Target,
)
from lik_gen.plan_base import LAYOUT_SHAPES, Ld, Lq, PlanError, formula, kernel_args, layout_sizes
from lik_gen.plan_metal_score import (
    EXTRA_ARGS,
    PARAM_DECL,
    RECOMPUTE_TEMPLATE,
    MetalScorePlan,
    score_decl,
    score_plan,
)

SIMD_WIDTH = 32  # lanes of an Apple GPU simdgroup
# Four simdgroups (128 threads) per threadgroup, the split MLX's GEMM kernels use.
SIMDGROUPS_PER_GROUP = 4
FRAGMENT = 8  # simdgroup_matrix tiles are 8 x 8
MAX_HEAD_DIM = METAL_MAX_HEAD_DIM  # lik_gen.ir says why
NORM_EPS = "1e-12f"  # F.normalize's eps, as an MSL float literal

METAL_LAYOUTS = (Layout.DENSE, Layout.KD, Layout.PAIRS)
# One lookup table per spelling: never format a type inline. The MSL type of `Element`
# (Q, D and their gradients in memory) per dtype value; the runtime's preamble reads it
# from the launch block. bf16 travels as raw ushort bits: the bfloat type needs Metal 3.1,
# bits work everywhere.
STORAGE_TYPE = {DType.FP32: "float", DType.FP16: "half", DType.BF16: "ushort"}
ELEMENT_TYPE = "Element"  # the preamble's typedef, as the kernels' arguments spell it
# The autograd glue saves int16 argmax for docs shorter than 2**15 tokens (the Metal
# runtime routes longer docs elsewhere).
INDEX_TYPE = "short"
INDEX_DOC = "int16"
MASK_TYPE = "uchar"  # bool masks arrive as a zero-copy uint8 view
SCALAR_DECL = "constant long&"  # sizes and strides: Python ints bind as int64
MAX_BUFFERS = 31  # buffer arguments a Metal kernel can bind (scalars included)

MODULE_TEMPLATE = "metal/maxsim.metal.j2"
COMMON_TEMPLATE = "metal/common.metal.j2"  # the shared helpers, rendered once
COMMON_NAME = "metal-common"  # the shared module's name in its header
BACKWARD_TEMPLATE = {Backward.LOWMEM: "metal/backward/lowmem.metal.j2"}
NO_TEMPLATE = ""

_STRIDE = re.compile(r"^(\w+)\.stride\((\d)\)$")
_SHAPE = re.compile(r"^(\w+)\.shape\[(\d)\]$")


@dataclasses.dataclass(frozen=True)
class MetalArg:
    """One kernel argument: its MSL declaration and what the runtime binds to it."""

    name: str
    decl: str  # MSL type, without the name and the [[buffer(i)]] attribute
    kind: str  # "tensor", "size", "stride", "param" or "strides"
    source: str  # the tensor (runtime name), size or parameter it comes from
    axis: int = -1  # stride axis
    # kind "strides": the stride arguments bound together as one constant array (a kernel
    # with more arguments than Metal binds), unpacked into locals of the same names.
    packed: tuple[MetalArg, ...] = ()


@dataclasses.dataclass(frozen=True)
class MetalKernel:
    role: str  # forward, grad_q or grad_d
    name: str  # the MSL function name, the runtime's handle
    args: tuple[MetalArg, ...]
    simdgroups: str  # Python expression of the sizes: simdgroups to launch
    doc: str
    # Strides bound as one array (see MetalArg.packed), declared as locals in the body.
    packed_strides: tuple[MetalArg, ...] = ()


@dataclasses.dataclass(frozen=True)
class MetalRenderContext:
    name: str  # the structural kernel's name (lik_gen.ir.Kernel.name)
    purpose: str
    layout: str
    backward: str
    save_argmax: bool
    index_type: str
    forward: MetalKernel
    grad_q: MetalKernel | None
    grad_d: MetalKernel | None
    launch_json: str
    module_template: str
    backward_template: str
    output_doc: str
    argmax_doc: str
    # The token-score hook (lik_gen.plan_metal_score); score "max" has no hook.
    score: MetalScorePlan


@dataclasses.dataclass(frozen=True)
class MetalCommonContext:
    """What templates/metal/common.metal.j2 needs: the constants of the shared helpers
    and of every kernel, the same for all of them."""

    name: str  # the module's name in its header (it serves no single kernel)
    simd_width: int
    simdgroups_per_group: int
    max_head_dim: int
    dim_tiles: int  # 8-wide fragments of the largest head dim
    dims_per_lane: int  # head-dim elements each lane holds of a row
    norm_eps: str  # an MSL float literal
    module_template: str


def layout_size_sources(layout: Layout) -> dict[str, tuple[str, int]]:
    """Where each size of a layout comes from, as (tensor, axis): lik_gen.plan_base's
    launcher sizes, which the Metal layouts read from shapes only."""
    out = {}
    for arg in layout_sizes(layout):
        shape = _SHAPE.match(arg.expr)
        if shape is None:
            raise PlanError(f"layout {layout.value}: size {arg.name} = {arg.expr!r} is no shape")
        out[arg.name] = (shape[1], int(shape[2]))
    return out


def _decl(name: str, role: str) -> str:
    """The MSL type of a tensor argument (sizes and strides are SCALAR_DECL)."""
    outputs = {"Out": "device float*", "GQ": f"device {ELEMENT_TYPE}*",
               "GD": f"device {ELEMENT_TYPE}*"}  # fmt: skip
    inputs = {
        "Q": f"device const {ELEMENT_TYPE}*",
        "D": f"device const {ELEMENT_TYPE}*",
        "q_mask": f"device const {MASK_TYPE}*",
        "d_mask": f"device const {MASK_TYPE}*",
        "Grad": "device const float*",
    }
    if name == "Argmax":
        const = "" if role == "forward" else "const "
        return f"device {const}{INDEX_TYPE}*"
    return outputs.get(name) or inputs[name]


def _metal_args(kernel: Kernel, args, role: str) -> tuple[MetalArg, ...]:
    """The shared argument plan, typed for MSL and labelled for the runtime's binder."""
    sizes = layout_size_sources(kernel.layout)
    out = []
    for arg in args:
        stride = _STRIDE.match(arg.expr)
        if stride:
            out.append(MetalArg(arg.name, SCALAR_DECL, "stride", stride[1], int(stride[2])))
        elif arg.expr in sizes:
            out.append(MetalArg(arg.name, SCALAR_DECL, "size", arg.expr))
        elif arg.expr in PARAM_DECL:
            out.append(MetalArg(arg.name, PARAM_DECL[arg.expr], "param", arg.expr))
        elif arg.expr.isidentifier():
            decl = score_decl(kernel, arg.name, role) or _decl(arg.name, role)
            out.append(MetalArg(arg.name, decl, "tensor", arg.expr))
        else:
            raise PlanError(f"argument {arg.name} = {arg.expr!r} has no Metal binding")
    return tuple(out)


def _pack_strides(args: tuple[MetalArg, ...]) -> tuple[MetalArg, ...]:
    """The arguments with every stride moved into one trailing constant array."""
    strides = tuple(a for a in args if a.kind == "stride")
    packed = MetalArg("strides", "constant long*", "strides", "", packed=strides)
    return tuple(a for a in args if a.kind != "stride") + (packed,)


def _kernel(kernel: Kernel, role: str, args, units: sympy.Expr, doc: str) -> MetalKernel:
    metal_args = _metal_args(kernel, tuple(args) + EXTRA_ARGS.get(kernel.score, ()), role)
    if len(metal_args) > MAX_BUFFERS:
        # The recompute backward of a weighted score reads 35 arguments.
        metal_args = _pack_strides(metal_args)
    if len(metal_args) > MAX_BUFFERS:
        raise PlanError(
            f"{kernel.name} {role}: {len(metal_args)} arguments with packed strides, "
            f"Metal binds {MAX_BUFFERS}"
        )
    params = tuple(sorted(str(s) for s in units.free_symbols))
    return MetalKernel(
        role=role,
        name=f"{kernel.name}_{role}",
        args=metal_args,
        simdgroups=formula(f"{role}_simdgroups", units, params, doc).expr,
        doc=doc,
        packed_strides=tuple(s for a in metal_args if a.kind == "strides" for s in a.packed),
    )


def _kernels(kernel: Kernel) -> dict[str, MetalKernel]:
    shape = LAYOUT_SHAPES[kernel.layout]
    # Every input any value of the kernel reads: an absent mask's slot is bound all the
    # same (lik.runtime.metal), and the kernel never reads it.
    args = kernel_args(kernel.widest())
    # (role, the shared argument list it takes, its units of work, what a unit is)
    roles = [
        (
            "forward",
            "fwd",
            shape["queries"] * shape["docs"],
            "one simdgroup per scored (query, doc) pair",
        )
    ]
    if kernel.backward is Backward.LOWMEM:
        roles += [
            ("grad_q", "bwd_q", shape["queries"] * Lq,
             "one simdgroup per query token, owning its gradient row"),
            ("grad_d", "bwd_d", shape["doc_count"] * Ld,
             "one simdgroup per doc token, owning its gradient row"),
        ]  # fmt: skip
    return {role: _kernel(kernel, role, args[key], units, doc) for role, key, units, doc in roles}


def _arg_entry(arg: MetalArg) -> list:
    if arg.kind == "strides":
        return [arg.name, arg.kind, [[a.source, a.axis] for a in arg.packed]]
    return [arg.name, arg.kind, arg.source] + ([arg.axis] if arg.kind == "stride" else [])


def _launch_json(kernel: Kernel, kernels: dict[str, MetalKernel]) -> str:
    """The launch block the runtime reads (JSON, one argument per line): the MSL type of
    Element per dtype value (for the preamble), where each size comes from, and per kernel
    its name, simdgroup count and arguments in order, each as
    [name, "tensor", tensor] | [name, "size", size] | [name, "stride", tensor, axis] |
    [name, "param", parameter] | [name, "strides", [[tensor, axis], ...]] (one array)."""
    sizes = {name: list(where) for name, where in layout_size_sources(kernel.layout).items()}
    elements = {dtype.value: spelling for dtype, spelling in STORAGE_TYPE.items()}
    lines = [
        "{",
        f' "simd_width": {SIMD_WIDTH},',
        f' "threads_per_group": {SIMD_WIDTH * SIMDGROUPS_PER_GROUP},',
        f' "element_types": {json.dumps(elements)},',
        f' "sizes": {json.dumps(sizes)},',
        ' "kernels": {',
    ]
    for i, (role, k) in enumerate(kernels.items()):
        args = [_arg_entry(a) for a in k.args]
        lines += [f'  "{role}": {{"name": "{k.name}", "simdgroups": "{k.simdgroups}", "args": [']
        lines += [f"   {json.dumps(a)}," for a in args[:-1]] + [f"   {json.dumps(args[-1])}"]
        lines += ["  ]}" + ("," if i < len(kernels) - 1 else "")]
    lines += [" }", "}"]
    text = "\n".join(lines)
    json.loads(text)  # the runtime parses it: fail here, at generate time, if malformed
    return text


def _check(kernel: Kernel) -> None:
    if kernel.target is not Target.METAL:
        raise PlanError(f"{kernel.name}: plan_metal plans Metal kernels only")
    if kernel.layout not in METAL_LAYOUTS:
        raise PlanError(f"{kernel.name}: layout {kernel.layout.value!r} has no Metal template")
    if kernel.scaled:
        raise PlanError(f"{kernel.name}: Metal kernels read fp32, fp16 or bf16 inputs, not fp8")
    if kernel.decompression is not Decompression.NONE:
        raise PlanError(f"{kernel.name}: Metal kernels read uncompressed documents only")
    if kernel.backward not in (Backward.NONE, *BACKWARD_TEMPLATE):
        raise PlanError(
            f"{kernel.name}: Metal has one backward strategy, lowmem (destination-owned)"
        )
    if kernel.score is not Score.MAX and kernel.layout not in (Layout.DENSE, Layout.PAIRS):
        layout = kernel.layout.value
        raise PlanError(f"{kernel.name}: the Metal score hook has no {layout} template")


def plan_metal(kernel: Kernel) -> MetalRenderContext:
    _check(kernel)
    kernels = _kernels(kernel)
    backward = kernel.backward
    shape = LAYOUT_SHAPES[kernel.layout]
    score = score_plan(kernel)
    backward_template = BACKWARD_TEMPLATE.get(backward, NO_TEMPLATE)
    strategy = backward.value
    if score.hook and backward is not Backward.NONE:
        backward_template, strategy = RECOMPUTE_TEMPLATE, "recompute"
    return MetalRenderContext(
        name=kernel.name,
        purpose="forward" if backward is Backward.NONE else f"training ({strategy} backward)",
        layout=kernel.layout.value,
        backward=backward.value,
        save_argmax=backward is not Backward.NONE and not score.hook,
        index_type=INDEX_TYPE,
        forward=kernels["forward"],
        grad_q=kernels.get("grad_q"),
        grad_d=kernels.get("grad_d"),
        launch_json=_launch_json(kernel, kernels),
        module_template=MODULE_TEMPLATE,
        backward_template=backward_template,
        output_doc=shape["output"],
        argmax_doc=f"{shape['argmax']} {INDEX_DOC}",
        score=score,
    )


def plan_metal_common() -> MetalCommonContext:
    """The context of generated/metal/common.metal, the MSL helpers every Metal kernel is
    compiled after (lik.runtime.metal.source)."""
    return MetalCommonContext(
        name=COMMON_NAME,
        simd_width=SIMD_WIDTH,
        simdgroups_per_group=SIMDGROUPS_PER_GROUP,
        max_head_dim=MAX_HEAD_DIM,
        dim_tiles=MAX_HEAD_DIM // FRAGMENT,
        dims_per_lane=MAX_HEAD_DIM // SIMD_WIDTH,
        norm_eps=NORM_EPS,
        module_template=COMMON_TEMPLATE,
    )
