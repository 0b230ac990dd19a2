"""Shared test tools: the float64 comparison, tolerances, poisoned outputs, random inputs,
and the @triton.jit functions of a generated source."""

from __future__ import annotations

import ast
import zlib
from pathlib import Path

import torch

# ||out - ref|| / ||ref|| bounds from DESIGN.md. Under the interpreter every dot is an
# fp32 "ieee" dot, so fp32 is held to the tight bound there.
TOLERANCE = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 1e-2}
INTERPRETER_FP32_TOLERANCE = 1e-5
POISON = float("nan")


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    if ref.numel() == 0:
        return 0.0
    scale = ref.norm().item()
    return (out - ref).norm().item() / (scale if scale > 0 else 1.0)


def assert_close_to_reference(out, ref, dtype, *, interpreter: bool, what: str = "") -> None:
    assert out.dtype == torch.float32, f"{what}: scores must be fp32, got {out.dtype}"
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert not torch.isnan(out).any(), f"{what}: NaN in output (unwritten poison?)"
    bound = (
        INTERPRETER_FP32_TOLERANCE if interpreter and dtype == torch.float32 else TOLERANCE[dtype]
    )
    err = relative_error(out, ref)
    assert err < bound, f"{what}: relative error {err:.3g} >= {bound:g}"


def weighted_gradients(score, Q: torch.Tensor, D: torch.Tensor, weights: torch.Tensor):
    """(grad Q, grad D) of sum(score(Q, D) * weights), on fresh leaf copies of Q and D."""
    Qg, Dg = Q.detach().clone().requires_grad_(), D.detach().clone().requires_grad_()
    (score(Qg, Dg) * weights).sum().backward()
    return Qg.grad, Dg.grad


def random_inputs(shape_q, shape_d, dtype, device="cpu", *, generator=None):
    Q = torch.randn(shape_q, generator=generator).to(device=device, dtype=dtype)
    D = torch.randn(shape_d, generator=generator).to(device=device, dtype=dtype)
    return Q, D


def random_mask(shape, p_valid=0.7, device="cpu", *, generator=None):
    return (torch.rand(shape, generator=generator) < p_valid).to(device)


def poisoned(shape, device="cpu"):
    return torch.full(shape, POISON, dtype=torch.float32, device=device)


PADDED_LAYOUTS = ("_dense_", "_kd_", "_pairs_")
# Variants whose inputs the generic padded tests cannot build (fp8 needs scales:
# tests/test_fp8.py covers them).
OWN_TEST_TOKENS = ("_fp8_",)
# Hooked token scores take weights, tau or k: tests/test_variants.py covers them.
OWN_TEST_TOKENS += ("_weighted", "_smooth", "_topkmean")
# The fused head scores hidden states through W: tests/test_head.py covers it.
OWN_TEST_TOKENS += ("head_",)
# PLAID residual docs are codes + packed residuals: tests/test_plaid.py covers them.
OWN_TEST_TOKENS += ("_res2", "_res4", "_res8")


def padded_variant_names(names):
    """Triton variants of the padded layouts (ragged and Metal ones have their own tests)."""
    return [
        n
        for n in names
        if "_triton" in n
        and any(layout in n for layout in PADDED_LAYOUTS)
        and not any(token in n for token in OWN_TEST_TOKENS)
    ]


def stable_seed(*parts) -> int:
    """A seed from names that is the same in every process (str hashes are not)."""
    return zlib.crc32("/".join(map(str, parts)).encode())


def inference_variant_names(names):
    """The padded variants whose forward dispatch.forward launches as they are named (the
    inference ones): training variants (_unified, _lowmem) and top-k epilogues are
    launched by their own paths and tested there."""
    return [
        n
        for n in padded_variant_names(names)
        if not n.startswith("topk_") and not n.endswith(("_unified", "_lowmem"))
    ]


def jit_functions(path: Path):
    """The @triton.jit functions (ast.FunctionDef) of a Python source file."""
    for node in ast.parse(Path(path).read_text()).body:
        if isinstance(node, ast.FunctionDef) and any(
            ast.unparse(d).startswith("triton.jit") for d in node.decorator_list
        ):
            yield node
