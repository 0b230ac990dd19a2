"""Variant -> MetalRenderContext: every value the Metal templates need, computed once.

The Metal kernels take the arguments of their Triton counterparts, in the same order
(lik_gen.plan's argument plan is shared), so both targets bind the same tensors, sizes
and strides. Each kernel gives one simdgroup (32 lanes) one unit of work: a (query, doc)
pair for the forward, a query token for grad_Q, a doc token for grad_D. Threadgroups hold
SIMDGROUPS_PER_GROUP simdgroups that never talk to each other, so the kernels use no
threadgroup memory and no threadgroup barriers.

The generated file carries a launch block (JSON in a comment) from which lik.runtime.metal
binds arguments and sizes the grid without knowing any variant.
"""

from __future__ import annotations

import dataclasses
import json
import re

import sympy

from lik_gen.ir import Backward, Decompression, DType, Layout, Score, Variant
from lik_gen.plan import _LAYOUT, Ld, Lq, PlanError, _formula, _kernel_args
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
# Head dims up to this, in whole 8-wide tiles: a block of 8 query tokens then fits in
# 16 fragments (32 registers per lane), and grad rows in 4 floats per lane.
MAX_HEAD_DIM = 128

# One lookup table per spelling: never format a type inline.
# bf16 travels as raw ushort bits: the bfloat type needs Metal 3.1, bits work everywhere.
STORAGE_TYPE = {DType.FP32: "float", DType.FP16: "half", DType.BF16: "ushort"}
ELEMENT_HOOK = {
    DType.FP32: "metal/element/fp32.metal.j2",
    DType.FP16: "metal/element/fp16.metal.j2",
    DType.BF16: "metal/element/bf16.metal.j2",
}
# The autograd glue saves int16 argmax for docs shorter than 2**15 tokens (the Metal
# runtime routes longer docs elsewhere).
INDEX_TYPE = "short"
INDEX_DOC = "int16"
MASK_TYPE = "uchar"  # bool masks arrive as a zero-copy uint8 view
SCALAR_DECL = "constant long&"  # sizes and strides: Python ints bind as int64
MAX_BUFFERS = 31  # buffer arguments a Metal kernel can bind (scalars included)

MODULE_TEMPLATE = "metal/maxsim.metal.j2"
ROW_HELPERS = "metal/partials/rows.metal.j2"  # what the backward kernels share
BACKWARD_TEMPLATE = {Backward.LOWMEM: "metal/backward/lowmem.metal.j2"}
NO_TEMPLATE = ""

# Where each size comes from: (tensor, axis). Doc counts and lengths are runtime values.
_SIZES = {
    Layout.DENSE: {"Nq": ("Q", 0), "Nd": ("D", 0), "Lq": ("Q", 1), "Ld": ("D", 1), "dim": ("Q", 2)},
    Layout.KD: {"Nq": ("Q", 0), "K": ("D", 1), "Lq": ("Q", 1), "Ld": ("D", 2), "dim": ("Q", 2)},
    Layout.PAIRS: {"B": ("Q", 0), "Lq": ("Q", 1), "Ld": ("D", 1), "dim": ("Q", 2)},
}  # fmt: skip
_STRIDE = re.compile(r"^(\w+)\.stride\((\d)\)$")


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
    name: str
    purpose: str
    layout: str
    has_q_mask: bool
    has_d_mask: bool
    normalize: bool
    backward: str
    save_argmax: bool
    storage_type: str
    index_type: str
    simd_width: int
    simdgroups_per_group: int
    max_head_dim: int
    dim_tiles: int  # 8-wide fragments of the largest head dim
    dims_per_lane: int  # head-dim elements each lane holds of a row
    forward: MetalKernel
    grad_q: MetalKernel | None
    grad_d: MetalKernel | None
    launch_json: str
    element_hook: str
    row_helpers: str  # empty without a backward, so headers list only what is used
    module_template: str
    backward_template: str
    output_doc: str
    argmax_doc: str
    # The token-score hook (lik_gen.plan_metal_score); score "max" has no hook.
    score: MetalScorePlan


def _decl(name: str, role: str, storage: str) -> str:
    """The MSL type of a tensor argument (sizes and strides are SCALAR_DECL)."""
    outputs = {"Out": "device float*", "GQ": f"device {storage}*", "GD": f"device {storage}*"}
    inputs = {
        "Q": f"device const {storage}*",
        "D": f"device const {storage}*",
        "q_mask": f"device const {MASK_TYPE}*",
        "d_mask": f"device const {MASK_TYPE}*",
        "Grad": "device const float*",
    }
    if name == "Argmax":
        const = "" if role == "forward" else "const "
        return f"device {const}{INDEX_TYPE}*"
    return outputs.get(name) or inputs[name]


def _metal_args(args, role: str, variant: Variant, storage: str) -> tuple[MetalArg, ...]:
    """The shared argument plan, typed for MSL and labelled for the runtime's binder."""
    out = []
    for arg in args:
        stride = _STRIDE.match(arg.expr)
        if stride:
            out.append(MetalArg(arg.name, SCALAR_DECL, "stride", stride[1], int(stride[2])))
        elif arg.expr in _SIZES[variant.layout]:
            out.append(MetalArg(arg.name, SCALAR_DECL, "size", arg.expr))
        elif arg.expr in PARAM_DECL:
            out.append(MetalArg(arg.name, PARAM_DECL[arg.expr], "param", arg.expr))
        elif arg.expr.isidentifier():
            decl = score_decl(variant, arg.name, role) or _decl(arg.name, role, storage)
            out.append(MetalArg(arg.name, decl, "tensor", arg.expr))
        else:
            raise PlanError(f"argument {arg.name} = {arg.expr!r} has no Metal binding")
    return tuple(out)


def _pack_strides(args: tuple[MetalArg, ...]) -> tuple[MetalArg, ...]:
    """The arguments with every stride moved into one trailing constant array."""
    strides = tuple(a for a in args if a.kind == "stride")
    packed = MetalArg("strides", "constant long*", "strides", "", packed=strides)
    return tuple(a for a in args if a.kind != "stride") + (packed,)


def _kernel(variant: Variant, role: str, args, units: sympy.Expr, doc: str) -> MetalKernel:
    storage = STORAGE_TYPE[variant.dtype]
    metal_args = _metal_args(tuple(args) + EXTRA_ARGS.get(variant.score, ()), role, variant,
                             storage)  # fmt: skip
    if len(metal_args) > MAX_BUFFERS:
        # The recompute backward of a weighted, masked variant reads 35 arguments.
        metal_args = _pack_strides(metal_args)
    if len(metal_args) > MAX_BUFFERS:
        raise PlanError(
            f"{variant.name} {role}: {len(metal_args)} arguments with packed strides, "
            f"Metal binds {MAX_BUFFERS}"
        )
    params = tuple(sorted(str(s) for s in units.free_symbols))
    formula = _formula(f"{role}_simdgroups", units, params, doc)
    return MetalKernel(
        role=role,
        name=f"{variant.name}_{role}",
        args=metal_args,
        simdgroups=formula.expr,
        doc=doc,
        packed_strides=tuple(s for a in metal_args if a.kind == "strides" for s in a.packed),
    )


def _kernels(variant: Variant) -> dict[str, MetalKernel]:
    shape = _LAYOUT[variant.layout]
    args = _kernel_args(variant)
    # (role, the shared argument list it takes, its units of work, what a unit is)
    roles = [
        (
            "forward",
            "fwd",
            shape["queries"] * shape["docs"],
            "one simdgroup per scored (query, doc) pair",
        )
    ]
    if variant.backward is Backward.LOWMEM:
        roles += [
            ("grad_q", "bwd_q", shape["queries"] * Lq,
             "one simdgroup per query token, owning its gradient row"),
            ("grad_d", "bwd_d", shape["doc_count"] * Ld,
             "one simdgroup per doc token, owning its gradient row"),
        ]  # fmt: skip
    return {role: _kernel(variant, role, args[key], units, doc) for role, key, units, doc in roles}


def _arg_entry(arg: MetalArg) -> list:
    if arg.kind == "strides":
        return [arg.name, arg.kind, [[a.source, a.axis] for a in arg.packed]]
    return [arg.name, arg.kind, arg.source] + ([arg.axis] if arg.kind == "stride" else [])


def _launch_json(variant: Variant, kernels: dict[str, MetalKernel]) -> str:
    """The launch block the runtime reads (JSON, one argument per line): where each size
    comes from, and per kernel its name, simdgroup count and arguments in order, each as
    [name, "tensor", tensor] | [name, "size", size] | [name, "stride", tensor, axis] |
    [name, "param", parameter] | [name, "strides", [[tensor, axis], ...]] (one array)."""
    sizes = {name: list(where) for name, where in _SIZES[variant.layout].items()}
    lines = [
        "{",
        f' "simd_width": {SIMD_WIDTH},',
        f' "threads_per_group": {SIMD_WIDTH * SIMDGROUPS_PER_GROUP},',
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


def _check(variant: Variant) -> None:
    if variant.layout not in _SIZES:
        raise PlanError(f"{variant.name}: layout {variant.layout.value!r} has no Metal template")
    if variant.dtype not in STORAGE_TYPE:
        raise PlanError(f"{variant.name}: dtype {variant.dtype.value!r} has no Metal template")
    if variant.decompression is not Decompression.NONE:
        raise PlanError(f"{variant.name}: Metal kernels read uncompressed documents only")
    if variant.backward not in (Backward.NONE, *BACKWARD_TEMPLATE):
        raise PlanError(
            f"{variant.name}: Metal has one backward strategy, lowmem (destination-owned)"
        )
    if variant.score is not Score.MAX and variant.layout not in (Layout.DENSE, Layout.PAIRS):
        layout = variant.layout.value
        raise PlanError(f"{variant.name}: the Metal score hook has no {layout} template")


def plan_metal(variant: Variant) -> MetalRenderContext:
    _check(variant)
    kernels = _kernels(variant)
    backward = variant.backward
    shape = _LAYOUT[variant.layout]
    score = score_plan(variant)
    backward_template = BACKWARD_TEMPLATE.get(backward, NO_TEMPLATE)
    strategy = backward.value
    if score.hook and backward is not Backward.NONE:
        backward_template, strategy = RECOMPUTE_TEMPLATE, "recompute"
    return MetalRenderContext(
        name=variant.name,
        purpose="forward" if backward is Backward.NONE else f"training ({strategy} backward)",
        layout=variant.layout.value,
        has_q_mask=variant.mask.has_q,
        has_d_mask=variant.mask.has_d,
        normalize=variant.normalize,
        backward=backward.value,
        save_argmax=backward is not Backward.NONE and not score.hook,
        storage_type=STORAGE_TYPE[variant.dtype],
        index_type=INDEX_TYPE,
        simd_width=SIMD_WIDTH,
        simdgroups_per_group=SIMDGROUPS_PER_GROUP,
        max_head_dim=MAX_HEAD_DIM,
        dim_tiles=MAX_HEAD_DIM // FRAGMENT,
        dims_per_lane=MAX_HEAD_DIM // SIMD_WIDTH,
        forward=kernels["forward"],
        grad_q=kernels.get("grad_q"),
        grad_d=kernels.get("grad_d"),
        launch_json=_launch_json(variant, kernels),
        element_hook=ELEMENT_HOOK[variant.dtype],
        row_helpers=ROW_HELPERS if backward is not Backward.NONE else NO_TEMPLATE,
        module_template=MODULE_TEMPLATE,
        backward_template=backward_template,
        output_doc=shape["output"],
        argmax_doc=f"{shape['argmax']} {INDEX_DOC}",
        score=score,
    )
