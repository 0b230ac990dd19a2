"""maxsim and maxsim_pairs as an op family (lik.runtime.ops): `lik::maxsim_forward` scores
and, when training, saves each query token's winning doc token; `lik::maxsim_backward`
turns that argmax into gradients.
"""

from __future__ import annotations

import dataclasses

import torch

from lik.runtime import dispatch, ops


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


@dataclasses.dataclass(frozen=True)
class _MaxSimCall:
    layout: str  # "dense", "kd" or "pairs"
    normalize: bool
    backward: str  # a strategy when training, else "none"
    masked_as_zero: bool  # d_mask reads as zeros (dispatch.forward)


def _maxsim_forward(inputs, call: _MaxSimCall):
    Q, D, q_mask, d_mask = inputs
    scores, argmax = _forward(Q, D, q_mask, d_mask, call.layout, call.normalize, call.backward,
                              call.masked_as_zero)  # fmt: skip
    return (scores,), (argmax,)


def _maxsim_fake(inputs, call: _MaxSimCall):
    Q, D = inputs[:2]
    shape = _output_shape(call.layout, Q, D)
    argmax = None
    if call.backward != "none":
        argmax = Q.new_empty(shape + (Q.shape[1],), dtype=_argmax_dtype(D))
    return (Q.new_empty(shape, dtype=torch.float32),), (argmax,)


def _maxsim_backward(grads, inputs, saved, call: _MaxSimCall, needs):
    Q, D, q_mask, d_mask = inputs
    return dispatch.backward(call.layout, grads[0], saved[0], Q, D, q_mask is not None,
                             d_mask is not None, call.normalize, call.backward,
                             call.masked_as_zero)  # fmt: skip


MAXSIM = ops.Family("maxsim", _MaxSimCall, _maxsim_forward, _maxsim_fake, _maxsim_backward,
                    slots=2)  # fmt: skip


def score(Q, D, q_mask, d_mask, layout: str, normalize: bool, backward: str,
          masked_as_zero: bool = False) -> torch.Tensor:  # fmt: skip
    """Scores with the generated kernels; `backward` is a strategy when training, else "none";
    masked_as_zero reads d_mask as zeros (dispatch.forward)."""
    call = _MaxSimCall(layout, normalize, backward, masked_as_zero)
    return MAXSIM((Q, D, q_mask, d_mask), call, training=backward != "none")
