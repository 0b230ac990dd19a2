"""Autograd for the generated kernels.

Eager calls go through a plain torch.autograd.Function: a custom op costs ~150 us of
dispatch per call on the host (measured), more than a whole rerank kernel. Under
torch.compile the same work goes through two torch.library custom ops, which the
compiler treats as opaque nodes with known output shapes, so there is no graph break:
`lik::maxsim_forward` scores and, when training, saves each query token's winning doc
token; `lik::maxsim_backward` turns that argmax into gradients.
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


def _argmax_dtype(D: torch.Tensor) -> torch.dtype:
    # Doc token indices fit int16 for any document shorter than 32768 tokens: half the
    # memory the saved argmax would take as int32.
    return torch.int16 if D.shape[-2] < 2**15 else torch.int32


def _forward(Q, D, q_mask, d_mask, layout, normalize, backward, masked_as_zero=False):
    out = torch.empty(_output_shape(layout, Q, D), dtype=torch.float32, device=Q.device)
    argmax = None
    if backward != "none":
        argmax = torch.empty(out.shape + (Q.shape[1],), dtype=_argmax_dtype(D), device=Q.device)
    dispatch.forward(layout, Q, D, q_mask, d_mask, normalize, out, backward=backward,
                     argmax=argmax, masked_as_zero=masked_as_zero)  # fmt: skip
    return out, argmax


class _MaxSim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, Q, D, q_mask, d_mask, layout, normalize, backward, masked_as_zero):
        scores, argmax = _forward(Q, D, q_mask, d_mask, layout, normalize, backward,
                                  masked_as_zero)  # fmt: skip
        ctx.save_for_backward(Q, D, argmax)
        ctx.args = (layout, q_mask is not None, d_mask is not None, normalize, backward,
                    masked_as_zero)  # fmt: skip
        return scores

    @staticmethod
    def backward(ctx, grad_scores):
        Q, D, argmax = ctx.saved_tensors
        layout, has_q_mask, has_d_mask, normalize, backward, masked_as_zero = ctx.args
        grad_q, grad_d = dispatch.backward(
            layout, grad_scores, argmax, Q, D, has_q_mask, has_d_mask, normalize, backward,
            masked_as_zero,
        )  # fmt: skip
        return grad_q, grad_d, None, None, None, None, None, None


def score(Q, D, q_mask, d_mask, layout: str, normalize: bool, backward: str,
          masked_as_zero: bool = False) -> torch.Tensor:  # fmt: skip
    """Scores with the generated kernels; `backward` is a strategy when training, else "none";
    masked_as_zero reads d_mask as zeros (dispatch.forward)."""
    if torch.compiler.is_compiling():
        return maxsim_forward(Q, D, q_mask, d_mask, layout, normalize, backward,
                              masked_as_zero)[0]  # fmt: skip
    if backward == "none":
        return _forward(Q, D, q_mask, d_mask, layout, normalize, backward, masked_as_zero)[0]
    return _MaxSim.apply(Q, D, q_mask, d_mask, layout, normalize, backward, masked_as_zero)


@torch.library.custom_op("lik::maxsim_forward", mutates_args=())
def maxsim_forward(
    Q: torch.Tensor,
    D: torch.Tensor,
    q_mask: torch.Tensor | None,
    d_mask: torch.Tensor | None,
    layout: str,
    normalize: bool,
    backward: str,
    masked_as_zero: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores fp32, argmax). argmax is empty unless `backward` names a strategy."""
    scores, argmax = _forward(Q, D, q_mask, d_mask, layout, normalize, backward, masked_as_zero)
    if argmax is None:
        argmax = torch.empty((0,), dtype=torch.int16, device=Q.device)
    return scores, argmax


@maxsim_forward.register_fake
def _(Q, D, q_mask, d_mask, layout, normalize, backward, masked_as_zero=False):
    shape = _output_shape(layout, Q, D)
    if backward == "none":
        argmax = Q.new_empty((0,), dtype=torch.int16)
    else:
        argmax = Q.new_empty(shape + (Q.shape[1],), dtype=_argmax_dtype(D))
    return Q.new_empty(shape, dtype=torch.float32), argmax


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
    masked_as_zero: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    return dispatch.backward(layout, grad_out, argmax, Q, D, has_q_mask, has_d_mask, normalize,
                             backward, masked_as_zero)  # fmt: skip


@maxsim_backward.register_fake
def _(grad_out, argmax, Q, D, layout, has_q_mask, has_d_mask, normalize, backward,
      masked_as_zero=False):  # fmt: skip
    return torch.empty_like(Q), torch.empty_like(D)


def _setup_context(ctx, inputs, output):
    Q, D, q_mask, d_mask, layout, normalize, backward, masked_as_zero = inputs
    ctx.save_for_backward(Q, D, output[1])
    ctx.args = (layout, q_mask is not None, d_mask is not None, normalize, backward,
                masked_as_zero)  # fmt: skip


def _custom_op_backward(ctx, grad_scores, _grad_argmax):
    Q, D, argmax = ctx.saved_tensors
    grad_q, grad_d = maxsim_backward(grad_scores, argmax, Q, D, *ctx.args)
    return grad_q, grad_d, None, None, None, None, None, None


maxsim_forward.register_autograd(_custom_op_backward, setup_context=_setup_context)
