"""Autograd for the generated kernels, as torch.library custom ops.

Two ops carry every layout and variant (the variant is picked from their arguments):
`lik::maxsim_forward` scores and, when training, saves each query token's winning doc
token; `lik::maxsim_backward` turns that argmax into gradients. Being custom ops,
torch.compile treats them as opaque nodes with known output shapes: no graph breaks.
"""

from __future__ import annotations

import torch

from lik.runtime import dispatch


def _output_shape(layout: str, Q: torch.Tensor, D: torch.Tensor) -> tuple[int, ...]:
    if layout == "dense":
        return (Q.shape[0], D.shape[0])
    if layout == "kd":
        return (Q.shape[0], D.shape[1])
    return (Q.shape[0],)


@torch.library.custom_op("lik::maxsim_forward", mutates_args=())
def maxsim_forward(
    Q: torch.Tensor,
    D: torch.Tensor,
    q_mask: torch.Tensor | None,
    d_mask: torch.Tensor | None,
    layout: str,
    normalize: bool,
    backward: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores fp32, argmax int32). argmax is empty unless `backward` names a strategy."""
    shape = _output_shape(layout, Q, D)
    out = torch.empty(shape, dtype=torch.float32, device=Q.device)
    if backward == "none":
        argmax = torch.empty((0,), dtype=torch.int32, device=Q.device)
    else:
        argmax = torch.empty(shape + (Q.shape[1],), dtype=torch.int32, device=Q.device)
    dispatch.forward(
        layout,
        Q,
        D,
        q_mask,
        d_mask,
        normalize,
        out,
        backward=backward,
        argmax=argmax if backward != "none" else None,
    )
    return out, argmax


@maxsim_forward.register_fake
def _(Q, D, q_mask, d_mask, layout, normalize, backward):
    shape = _output_shape(layout, Q, D)
    argmax_shape = (0,) if backward == "none" else shape + (Q.shape[1],)
    return Q.new_empty(shape, dtype=torch.float32), Q.new_empty(argmax_shape, dtype=torch.int32)


@torch.library.custom_op("lik::maxsim_backward", mutates_args=())
def maxsim_backward(
    grad_out: torch.Tensor,
    argmax: torch.Tensor,
    Q: torch.Tensor,
    D: torch.Tensor,
    layout: str,
    has_q_mask: bool,
    has_d_mask: bool,
    normalize: bool,
    backward: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    return dispatch.backward(
        layout, grad_out, argmax, Q, D, has_q_mask, has_d_mask, normalize, backward
    )


@maxsim_backward.register_fake
def _(grad_out, argmax, Q, D, layout, has_q_mask, has_d_mask, normalize, backward):
    return torch.empty_like(Q), torch.empty_like(D)


def _setup_context(ctx, inputs, output):
    Q, D, q_mask, d_mask, layout, normalize, backward = inputs
    _, argmax = output
    ctx.save_for_backward(Q, D, argmax)
    ctx.layout, ctx.normalize, ctx.backward = layout, normalize, backward
    ctx.has_q_mask, ctx.has_d_mask = q_mask is not None, d_mask is not None


def _backward(ctx, grad_scores, _grad_argmax):
    Q, D, argmax = ctx.saved_tensors
    if ctx.backward == "none":
        raise RuntimeError(
            "lik: this maxsim call ran without a backward strategy (no input required grad "
            "at call time), so it saved no argmax to differentiate"
        )
    grad_q, grad_d = maxsim_backward(
        grad_scores,
        argmax,
        Q,
        D,
        ctx.layout,
        ctx.has_q_mask,
        ctx.has_d_mask,
        ctx.normalize,
        ctx.backward,
    )
    return grad_q, grad_d, None, None, None, None, None


maxsim_forward.register_autograd(_backward, setup_context=_setup_context)
