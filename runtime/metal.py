"""Apple GPUs (MPS): the generated Metal kernels, or a fallback outside their envelope.

A generated file, generated/metal/<kernel>.metal, is one structural kernel serving many
variants. Each variant is compiled once per process with torch.mps.compile_shader, under
a lock, from its source: `preamble` (the variant's values from the manifest: mask
presence, normalize and the storage type, as compile-time constants), then the helpers
every kernel shares (generated/metal/common.metal), then its kernel's file, each file
checked against both hashes. A variant that fails to compile is
remembered, reported once (a RuntimeWarning) and served by the fallback from then on. The
file's launch block, written by lik-gen from the plan, lists each kernel's arguments in
order and its simdgroup count, so this module binds tensors, sizes and strides without
knowing any kernel. Every kernel gives one simdgroup (32 threads) one unit of work.

Envelope of the kernels: head dim a multiple of 8 up to lik_gen.ir.METAL_MAX_HEAD_DIM,
docs shorter than 2**15 tokens (the saved argmax is int16), and more than a tiny amount
of work. Outside it, torch.compile of the reference runs (head dims), or the eager
reference (tiny shapes).
LIK_FORCE_MPS_BACKEND=metal|compile|reference pins the path (metal outside its envelope
raises). Metal has one backward strategy, the destination-owned "lowmem" one: a
`backward="unified"` request runs it too.

The hooked token scores of lik.runtime.variants (weighted, smooth, topk_mean) run their
own generated variants (maxsim_scored below) under the same envelope and fallbacks; they
train with the recompute backward, which the forward feeds a saved statistic per query
token instead of an argmax.

Nothing here has been timed on a Mac: no speed is claimed, and TINY_WORK is a guess.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import json
import operator
import os
import re
import threading
import warnings

import torch

from lik.runtime import registry, validate
from lik.runtime.keys import variant_name
from lik.runtime.reference import (
    maxsim_pairs_reference,
    maxsim_reference,
    maxsim_scored_reference,
)
from lik_gen.ir import METAL_MAX_HEAD_DIM, Mask

FORCE_ENV = "LIK_FORCE_MPS_BACKEND"
BACKENDS = ("metal", "compile", "reference")
HEAD_DIM_MULTIPLE = 8  # the kernels read whole 8-wide simdgroup_matrix tiles
MAX_DOC_TOKENS = 2**15 - 1  # argmax is int16 (lik.runtime.autograd saves it so)
# Similarity entries (pairs x Lq x Ld) below which the eager reference runs: a launch,
# let alone a first compile, cannot pay off there. Not measured: no Mac was at hand.
TINY_WORK = 4096
BACKWARD = "lowmem"  # the one Metal backward strategy

_LAUNCH_BLOCK = re.compile(r"/\* launch:\n(.*?)\n\*/", re.DOTALL)


def max_head_dim() -> int:
    """The widest head dim the kernels take (lik_gen.ir.METAL_MAX_HEAD_DIM)."""
    return METAL_MAX_HEAD_DIM


def handles(device: torch.device) -> bool:
    """True for the devices this module serves (MPS)."""
    return device.type == "mps"


def compile_shader(source: str):
    """The compile boundary: Metal source -> a library whose attributes are its kernels,
    each called as kernel(*args, threads=, group_size=)."""
    return torch.mps.compile_shader(source)


@dataclasses.dataclass(frozen=True)
class _Compiled:
    library: object
    launch: dict


_lock = threading.Lock()
_compiled: dict[str, _Compiled] = {}
_failures: dict[str, str] = {}


class MetalCompileError(RuntimeError):
    pass


def describe() -> str:
    forced = _forced()
    if forced:
        return f"{forced} (mps, forced by {FORCE_ENV})"
    return "generated Metal (mps); torch.compile or reference outside the kernels' envelope"


def choose_backend(layout: str, Q: torch.Tensor, D: torch.Tensor) -> str:
    """'metal', 'compile' or 'reference': the path of a call, before compiling anything."""
    forced = _forced()
    reason = _outside_envelope(Q, D)
    if forced == "metal" and reason:
        raise ValueError(f"{FORCE_ENV}=metal, but the Metal kernels cannot run this call: {reason}")
    if forced:
        return forced
    if reason:
        return "compile"
    if _work(layout, Q, D) < TINY_WORK:
        return "reference"
    return "metal"


def maxsim(layout: str, Q, D, q_mask, d_mask, normalize: bool) -> torch.Tensor:
    """Scores of a validated call on an MPS device, by whichever path serves it."""
    backend = choose_backend(layout, Q, D)
    training = torch.is_grad_enabled() and (Q.requires_grad or D.requires_grad)
    strategy = BACKWARD if training else "none"
    name = _name(layout, q_mask is not None, d_mask is not None, normalize, Q.dtype, strategy)
    if backend == "metal" and not _available(name):
        if _forced() == "metal":
            raise MetalCompileError(f"Metal variant {name} did not compile: {_failures[name]}")
        backend = "compile"
    if backend == "metal":
        from lik.runtime import autograd  # not at import: autograd -> dispatch -> metal

        return autograd.score(Q, D, q_mask, d_mask, layout, normalize, strategy)
    reference = _compiled_reference(layout) if backend == "compile" else _reference(layout)
    return reference(Q, D, q_mask, d_mask, normalize=normalize).float()


def forward(layout, Q, D, q_mask, d_mask, normalize, out, *, backward="none", argmax=None):
    """Scores into `out`; with a backward strategy, winners into `argmax` (int16, -1: none)."""
    _check_envelope(Q, D)
    if argmax is not None and argmax.dtype != torch.int16:
        raise ValueError(f"the Metal kernels save an int16 argmax, got {argmax.dtype}")
    strategy = "none" if backward == "none" else BACKWARD
    name = _name(layout, q_mask is not None, d_mask is not None, normalize, Q.dtype, strategy)
    tensors = _inputs(Q, D, q_mask, d_mask)
    _launch(_compile(name), "forward", {**tensors, "out": out, "argmax": argmax})
    return out


def backward(layout, grad_out, argmax, Q, D, has_q_mask, has_d_mask, normalize, strategy):
    """(grad_Q, grad_D) in the inputs' dtype, each element written once by its owner."""
    _check_envelope(Q, D)
    name = _name(layout, has_q_mask, has_d_mask, normalize, Q.dtype, BACKWARD)
    compiled = _compile(name)
    GQ = torch.empty(Q.shape, dtype=Q.dtype, device=Q.device)
    GD = torch.empty(D.shape, dtype=D.dtype, device=D.device)
    tensors = {"Q": Q, "D": D, "grad_out": grad_out, "argmax": argmax, "GQ": GQ, "GD": GD}
    _launch(compiled, "grad_q", tensors)
    _launch(compiled, "grad_d", tensors)
    return GQ, GD


@dataclasses.dataclass(frozen=True)
class ScoredCall:
    """A hooked token score call (lik.runtime.variants): which score and its parameters."""

    score: str  # weighted | smooth | topk_mean
    layout: str  # dense | pairs
    normalize: bool
    tau: float = 1.0  # smooth
    k: int = 1  # topk_mean


def maxsim_scored(call: ScoredCall, Q, D, weights, q_mask, d_mask) -> torch.Tensor:
    """Scores of a validated lik.runtime.variants call on an MPS device (Q [Nq, Lq, d]),
    by whichever path serves it: the generated Metal kernels (autograd through the
    recompute backward), torch.compile of the reference, or the eager reference."""
    backend = choose_backend(call.layout, Q, D)
    inputs = (Q, D) if weights is None else (Q, D, weights)
    training = torch.is_grad_enabled() and any(t.requires_grad for t in inputs)
    name = _scored_name(call, Q, q_mask is not None, d_mask is not None, training)
    if backend == "metal" and not _available(name):
        if _forced() == "metal":
            raise MetalCompileError(f"Metal variant {name} did not compile: {_failures[name]}")
        backend = "compile"
    if backend == "metal":
        if training:
            return _Scored.apply(Q, D, weights, q_mask, d_mask, call)
        return scored_forward(call, Q, D, weights, q_mask, d_mask, training=False)[0]
    reference = _compiled_scored_reference() if backend == "compile" else maxsim_scored_reference
    options = {"score": call.score, "weights": weights, "tau": call.tau, "k": call.k,
               "normalize": call.normalize, "pairs": call.layout == "pairs"}  # fmt: skip
    return reference(Q, D, q_mask, d_mask, **options).float()


def scored_forward(call: ScoredCall, Q, D, weights, q_mask, d_mask, *, training: bool):
    """(scores fp32, saved): with training, `saved` holds what the recompute backward
    reads per query token (the winning doc token or the k kept ones, int16, -1: none; or
    the logsumexp, fp32); else None."""
    _check_envelope(Q, D)
    shape = (Q.shape[0], D.shape[0]) if call.layout == "dense" else (Q.shape[0],)
    out = torch.empty(shape, dtype=torch.float32, device=Q.device)
    saved = _saved(call, shape, Q) if training else None
    if _empty(Q, D):
        if saved is not None:
            saved.fill_(-1 if saved.dtype == torch.int16 else float("-inf"))
        return out.zero_(), saved
    name = _scored_name(call, Q, q_mask is not None, d_mask is not None, training)
    tensors = {**_scored_inputs(Q, D, weights, q_mask, d_mask), "out": out, "saved": saved}
    _launch(_compile(name), "forward", tensors, _scored_params(call))
    return out, saved


def scored_backward(call: ScoredCall, grad_out, saved, Q, D, weights, q_mask, d_mask):
    """(grad_Q, grad_D, grad_W or None), each element written once by its owner simdgroup;
    grad_Q and grad_D in the inputs' dtype, grad_W in the weights' dtype."""
    _check_envelope(Q, D)
    GQ = torch.empty(Q.shape, dtype=Q.dtype, device=Q.device)
    GD = torch.empty(D.shape, dtype=D.dtype, device=D.device)
    # The kernels write grad_W in fp32, like the weights they read.
    GW = None if weights is None else torch.empty(weights.shape, dtype=torch.float32,
                                                  device=Q.device)  # fmt: skip
    if _empty(Q, D):
        grads = (GQ.zero_(), GD.zero_(), None if GW is None else GW.zero_())
    else:
        name = _scored_name(call, Q, q_mask is not None, d_mask is not None, True)
        compiled = _compile(name)
        tensors = {**_scored_inputs(Q, D, weights, q_mask, d_mask), "saved": saved,
                   "grad_out": grad_out.float(), "GQ": GQ, "GD": GD, "GW": GW}  # fmt: skip
        _launch(compiled, "grad_q", tensors, _scored_params(call))
        _launch(compiled, "grad_d", tensors, _scored_params(call))
        grads = (GQ, GD, GW)
    grad_w = None if weights is None else grads[2].to(weights.dtype)
    return grads[0], grads[1], grad_w


class _Scored(torch.autograd.Function):
    @staticmethod
    def forward(ctx, Q, D, weights, q_mask, d_mask, call):
        out, saved = scored_forward(call, Q, D, weights, q_mask, d_mask, training=True)
        ctx.save_for_backward(Q, D, weights, q_mask, d_mask, saved)
        ctx.call = call
        return out

    @staticmethod
    def backward(ctx, grad_out):
        Q, D, weights, q_mask, d_mask, saved = ctx.saved_tensors
        grads = scored_backward(ctx.call, grad_out, saved, Q, D, weights, q_mask, d_mask)
        return (*grads, None, None, None)


def _scored_name(call: ScoredCall, Q, has_q_mask: bool, has_d_mask: bool, training: bool) -> str:
    strategy = BACKWARD if training else "none"
    return _name(call.layout, has_q_mask, has_d_mask, call.normalize, Q.dtype, strategy,
                 call.score)  # fmt: skip


def _inputs(Q, D, q_mask, d_mask) -> dict[str, torch.Tensor]:
    """Q, D and the masks as the kernels bind them. Every kernel of a file takes both
    mask slots; an absent mask's slot takes the tensor whose tokens it would mask (Q or
    D): a valid buffer with valid strides, which the kernel never reads, since its
    variant's HAS_Q_MASK / HAS_D_MASK is false. No placeholder is allocated."""
    return {
        "Q": Q,
        "D": D,
        "q_mask": Q if q_mask is None else validate.byte_mask(q_mask),
        "d_mask": D if d_mask is None else validate.byte_mask(d_mask),
    }


def _scored_inputs(Q, D, weights, q_mask, d_mask) -> dict[str, torch.Tensor]:
    tensors = _inputs(Q, D, q_mask, d_mask)
    if weights is not None:
        tensors["W"] = weights.float()  # the kernels read fp32 weights, whatever their dtype
    return tensors


def _scored_params(call: ScoredCall) -> dict[str, float | int]:
    """The kernels' scalar parameters: tau binds as a 32-bit float, token_k as int64."""
    return {"tau": float(call.tau), "token_k": int(call.k)}


def _saved(call: ScoredCall, shape: tuple[int, ...], Q: torch.Tensor) -> torch.Tensor:
    shape = shape + (Q.shape[1],)
    if call.score == "smooth":
        return torch.empty(shape, dtype=torch.float32, device=Q.device)
    if call.score == "topk_mean":
        shape += (call.k,)
    return torch.empty(shape, dtype=torch.int16, device=Q.device)  # docs < 2**15 tokens


def _empty(Q: torch.Tensor, D: torch.Tensor) -> bool:
    return min(Q.shape[0], Q.shape[1], D.shape[0], D.shape[1]) == 0


@functools.cache
def _compiled_scored_reference():
    return torch.compile(maxsim_scored_reference, dynamic=True)


def _forced() -> str | None:
    value = os.environ.get(FORCE_ENV) or None
    if value is not None and value not in BACKENDS:
        raise ValueError(f"{FORCE_ENV} must be one of {', '.join(BACKENDS)}, got {value!r}")
    return value


def _outside_envelope(Q: torch.Tensor, D: torch.Tensor) -> str | None:
    """Why the Metal kernels cannot take these inputs, or None when they can."""
    dim, limit = Q.shape[-1], max_head_dim()
    if dim % HEAD_DIM_MULTIPLE or dim > limit:
        return f"head dim {dim} is not a multiple of {HEAD_DIM_MULTIPLE} up to {limit}"
    if D.shape[-2] > MAX_DOC_TOKENS:
        return f"docs of {D.shape[-2]} tokens (the int16 argmax stops at {MAX_DOC_TOKENS})"
    return None


def _check_envelope(Q: torch.Tensor, D: torch.Tensor) -> None:
    reason = _outside_envelope(Q, D)
    if reason:
        raise ValueError(f"the Metal kernels cannot run this call: {reason}")


def _work(layout: str, Q: torch.Tensor, D: torch.Tensor) -> int:
    pairs = Q.shape[0] * (D.shape[0] if layout == "dense" else D.shape[1] if layout == "kd" else 1)
    return pairs * Q.shape[1] * D.shape[-2]


def _name(layout, has_q_mask, has_d_mask, normalize, dtype, strategy, score="max") -> str:
    """The Metal variant of a call (lik_gen.ir.Variant, through keys.variant_name)."""
    return variant_name(layout, has_q_mask, has_d_mask, normalize, dtype, target="metal",
                        backward=strategy, score=score)  # fmt: skip


def _reference(layout: str):
    return maxsim_pairs_reference if layout == "pairs" else maxsim_reference


@functools.cache
def _compiled_reference(layout: str):
    return torch.compile(_reference(layout), dynamic=True)


def _available(name: str) -> bool:
    """Compiles the variant if needed; False (reported once, at the failure) if it fails."""
    try:
        _compile(name)
    except MetalCompileError:
        return False
    return True


def _compile(name: str) -> _Compiled:
    """The compiled variant, compiled on first use; raises MetalCompileError if it fails."""
    compiled = _compiled.get(name)
    if compiled is not None:
        return compiled
    with _lock:
        if name not in _compiled and name not in _failures:
            text = source(name)
            launch = launch_block(text)
            try:
                _compiled[name] = _Compiled(compile_shader(text), launch)
            except Exception as error:  # the Metal compiler reports through RuntimeError
                _failures[name] = f"{type(error).__name__}: {error}"
                warnings.warn(
                    f"lik: Metal variant {name} did not compile ({_failures[name]}); calls "
                    "that need it fall back to torch.compile",
                    RuntimeWarning,
                    stacklevel=2,
                )
        if name in _failures:
            raise MetalCompileError(f"Metal variant {name} did not compile: {_failures[name]}")
        return _compiled[name]


def source(name: str) -> str:
    """The Metal source of a variant: the preamble of its values, the shared helpers
    (generated/metal/common.metal), then its kernel's generated file, both files checked
    against their header hash and the manifest's. A `#line 1 "<file>"` before each file
    makes compiler messages name that file and its own lines."""
    path, text = registry.read_verified(name)
    common_path, common = registry.read_shared("metal")
    element_types = launch_block(text)["element_types"]
    values = registry.entry(name)["values"]
    return preamble(name, values, element_types) + _line(common_path) + common + _line(path) + text


def _line(path: str) -> str:
    return f'#line 1 "{path}"\n'


def preamble(name: str, values: dict, element_types: dict[str, str]) -> str:
    """What the shared helpers and a kernel's file are compiled after for variant `name`:
    its values (a manifest entry's "values": mask, normalize, dtype) as the constants the
    kernels branch on, HAS_Q_MASK, HAS_D_MASK and NORMALIZE, and the storage type of Q, D
    and their gradients as Element, spelled as the file's launch block says
    (element_types).

    torch.mps.compile_shader sets no MTLFunctionConstantValues, so these are `constant
    constexpr` declarations: the compiler folds every `if (NORMALIZE)` as it would a
    function constant's."""
    mask = Mask(values["mask"])
    flags = {"HAS_Q_MASK": mask.has_q, "HAS_D_MASK": mask.has_d, "NORMALIZE": values["normalize"]}
    lines = [f"// variant: {name}"]
    lines += [f"constant constexpr bool {flag} = {str(bool(on)).lower()};"
              for flag, on in flags.items()]  # fmt: skip
    lines += [f"typedef {element_types[values['dtype']]} Element;  // {values['dtype']}"]
    return "\n".join(lines) + "\n"


def launch_block(text: str) -> dict:
    """The launch block of a generated Metal file (or of a source that contains one)."""
    return json.loads(_LAUNCH_BLOCK.search(text).group(1))


def _launch(compiled: _Compiled, role: str, tensors: dict[str, torch.Tensor],
            params: dict[str, float | int] | None = None) -> None:  # fmt: skip
    """Binds a kernel's arguments in the order of its launch block and dispatches one
    simdgroup per unit of work, in threadgroups of threads_per_group threads."""
    launch = compiled.launch
    spec = launch["kernels"][role]
    sizes = {name: tensors[t].shape[axis] for name, (t, axis) in launch["sizes"].items()}
    args = [_argument(entry, tensors, sizes, params or {}) for entry in spec["args"]]
    threads = _evaluate(spec["simdgroups"], sizes) * launch["simd_width"]
    if threads == 0:
        return
    kernel = getattr(compiled.library, spec["name"])
    kernel(*args, threads=threads, group_size=min(threads, launch["threads_per_group"]))


def _argument(entry: list, tensors: dict[str, torch.Tensor], sizes: dict[str, int],
              params: dict[str, float | int]):  # fmt: skip
    _, kind, source_name, *axis = entry
    if kind == "tensor":
        return tensors[source_name]
    if kind == "size":
        return sizes[source_name]
    if kind == "param":
        return params[source_name]
    if kind == "strides":  # one constant array (a list of ints binds as int64 values)
        return [tensors[name].stride(i) for name, i in source_name]
    return tensors[source_name].stride(axis[0])


_OPERATORS = {ast.Mult: operator.mul, ast.Add: operator.add, ast.FloorDiv: operator.floordiv}


@functools.cache
def _formula(expr: str) -> ast.expr:
    return ast.parse(expr, mode="eval").body


def _evaluate(expr: str, sizes: dict[str, int]) -> int:
    """A launch formula of the plan (sums and products of sizes) at the given sizes."""

    def value(node: ast.expr) -> int:
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.Name):
            return sizes[node.id]
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        raise ValueError(f"launch formula {expr!r}: unsupported {ast.dump(node)}")

    return value(_formula(expr))
