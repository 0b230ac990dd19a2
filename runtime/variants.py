"""MaxSim with another token score, generated from the score hook (templates/triton/score/).

    maxsim_weighted   sum_s w[s] * max_t sim[s, t]          (IDF-style or learned weights)
    maxsim_smooth     sum_s tau * logsumexp_t(sim[s, t] / tau)   (colpali-engine's smooth max)
    maxsim_topk_mean  sum_s mean of the k largest sim[s, t]  (XTR-style token aggregation)

Layouts: in-batch (Q [Nq, Lq, d] or [Lq, d] against D [Nd, Ld, d] -> [Nq, Nd]) or
diagonal pairs with pairs=True (maxsim_pairs' layout); no KD ([Nq, K, Ld, d]) or single
[Ld, d] doc, and no `backward` choice. Masks and normalize as in maxsim. Autograd to Q,
D (and the weights) through the generated recompute backward, which owns every gradient
element in one program: no atomics, gradients in the input dtype, bitwise reproducible.
CUDA runs the generated Triton kernels, as does a CPU under TRITON_INTERPRET=1; a plain
CPU runs the reference; MPS runs the generated Metal kernels
(lik.runtime.metal.maxsim_scored) within their envelope, outside it torch.compile of the
reference or the eager reference (lik.runtime.metal).
"""

from __future__ import annotations

import dataclasses

import torch

from lik.runtime import (
    backends,
    configs,
    dispatch,
    heuristics,
    metal,
    norm_warning,
    ops,
    registry,
    validate,
)
from lik.runtime.keys import next_power_of_two, variant_name
from lik.runtime.reference import maxsim_scored_reference
from lik_gen.ir import MAX_TOKEN_K


@dataclasses.dataclass(frozen=True)
class _Call:
    score: str
    layout: str  # "dense" or "pairs"
    normalize: bool
    tau: float
    k: int


def _name(call: _Call, Q, has_q_mask: bool, has_d_mask: bool, backward: str) -> str:
    return variant_name(call.layout, has_q_mask, has_d_mask, call.normalize, Q.dtype,
                        backward=backward, score=call.score)  # fmt: skip


def _score_keywords(call: _Call) -> dict:
    if call.score == "smooth":
        return {"tau": call.tau}
    if call.score == "topk_mean":
        return {"token_k": call.k, "token_slots": next_power_of_two(call.k)}
    return {}


def _saved(call: _Call, out: torch.Tensor, Q: torch.Tensor, D: torch.Tensor) -> torch.Tensor:
    """What the forward keeps for the backward: the logsumexp (smooth, fp32) or winning
    doc tokens (int16 below 2**15 doc tokens, like the argmax), k of them for topk_mean."""
    shape = out.shape + (Q.shape[1],)
    if call.score == "smooth":
        return torch.empty(shape, dtype=torch.float32, device=Q.device)
    dtype = torch.int16 if D.shape[1] < 2**15 else torch.int32
    if call.score == "topk_mean":
        shape += (call.k,)
    return torch.empty(shape, dtype=dtype, device=Q.device)


def _tensors(W, q_mask, d_mask) -> dict:
    tensors = {}
    if W is not None:
        tensors["W"] = W
    if q_mask is not None:
        tensors["q_mask"] = validate.byte_mask(q_mask)
    if d_mask is not None:
        tensors["d_mask"] = validate.byte_mask(d_mask)
    return tensors


def _empty(call: _Call, Q, D) -> bool:
    return Q.shape[0] == 0 or D.shape[0] == 0 or Q.shape[1] == 0 or D.shape[1] == 0


def _out_shape(call: _Call, Q, D) -> tuple[int, ...]:
    return (Q.shape[0], D.shape[0]) if call.layout == "dense" else (Q.shape[0],)


def _forward(call: _Call, Q, D, W, q_mask, d_mask, training: bool):
    out = torch.empty(_out_shape(call, Q, D), dtype=torch.float32, device=Q.device)
    saved = _saved(call, out, Q, D) if training else None
    if _empty(call, Q, D):
        return out.zero_(), saved
    name = _name(call, Q, q_mask is not None, d_mask is not None,
                 "lowmem" if training else "none")  # fmt: skip
    module = registry.load(name)
    Q, D = dispatch.unit_head_stride(Q), dispatch.unit_head_stride(D)
    extra = {"saved": saved} if training else {}
    dispatch.launch_keyed(name, module, Q, Q.shape[1], out, Q, D, **_tensors(W, q_mask, d_mask),
                          **_score_keywords(call), **extra)  # fmt: skip
    return out, saved


def _backward(call: _Call, grad_out, saved, Q, D, W, q_mask, d_mask):
    if _empty(call, Q, D):
        grads = [torch.zeros_like(Q), torch.zeros_like(D)]
        return (*grads, None if W is None else torch.zeros_like(W))
    name = _name(call, Q, q_mask is not None, d_mask is not None, "lowmem")
    module = registry.load(name)
    Q, D = dispatch.unit_head_stride(Q), dispatch.unit_head_stride(D)
    grad_out = grad_out.contiguous()
    arguments = {**_tensors(W, q_mask, d_mask), **_score_keywords(call)}

    def run(config):
        return module.backward(grad_out, saved, Q, D, **arguments, config=config)

    config = configs.call_config(name, module, Q, Q.shape[1], grad_out.numel(), kernel="bwd",
                              run=run)  # fmt: skip
    grads, _ = dispatch.launch_fitted(module.backward, config, grad_out, saved, Q, D, **arguments)
    return grads if W is not None else (*grads, None)


@dataclasses.dataclass(frozen=True)
class _ScoredCall:
    score: str
    layout: str
    normalize: bool
    tau: float
    k: int
    training: bool

    @property
    def call(self) -> _Call:
        return _Call(self.score, self.layout, self.normalize, self.tau, self.k)


def _scored_forward(inputs, params: _ScoredCall):
    Q, D, W, q_mask, d_mask = inputs
    out, saved = _forward(params.call, Q, D, W, q_mask, d_mask, training=params.training)
    return (out,), (saved,)


def _scored_fake(inputs, params: _ScoredCall):
    Q, D = inputs[:2]
    call = params.call
    out = Q.new_empty(_out_shape(call, Q, D), dtype=torch.float32)
    return (out,), (_saved(call, out, Q, D) if params.training else None,)


def _scored_backward(grads, inputs, saved, params: _ScoredCall, needs):
    Q, D, W, q_mask, d_mask = inputs
    return _backward(params.call, grads[0], saved[0], Q, D, W, q_mask, d_mask)


SCORED = ops.Family("scored", _ScoredCall, _scored_forward, _scored_fake, _scored_backward,
                    slots=3)  # fmt: skip


def _kernel_score(call: _Call, Q, D, W, q_mask, d_mask) -> torch.Tensor:
    """Generated kernels, queries longer than heuristics.query_chunk's tokens in chunks
    (token scores add)."""
    total = None
    module = registry.load(_name(call, Q, q_mask is not None, d_mask is not None, "none"))
    chunk = heuristics.query_chunk(module, Q)
    for start in range(0, max(1, Q.shape[1]), chunk):
        stop = min(Q.shape[1], start + chunk)
        whole = start == 0 and stop == Q.shape[1]
        q = Q if whole else Q[:, start:stop]
        w = W if whole or W is None else W[:, start:stop]
        qm = q_mask if whole or q_mask is None else q_mask[:, start:stop]
        inputs = (q, D) if W is None else (q, D, w)
        training = torch.is_grad_enabled() and any(t.requires_grad for t in inputs)
        params = _ScoredCall(call.score, call.layout, call.normalize, call.tau, call.k, training)
        part = SCORED((q, D, w, qm, d_mask), params, training=training)
        total = part if total is None else total + part
    return total


def _score(call: _Call, Q, D, weights, q_mask, d_mask) -> torch.Tensor:
    """Validates, then runs the kernels (CUDA, or CPU under the interpreter) or the
    reference; a [Lq, d] query squeezes the query axis of the result."""
    pairs = call.layout == "pairs"
    q_doc, d_doc = (
        ("[B, Lq, d]", "[B, Ld, d]") if pairs else ("[Nq, Lq, d] or [Lq, d]", "[Nd, Ld, d]")
    )
    Q = validate.tensor("Q", Q, (3,) if pairs else (2, 3), q_doc)
    D = validate.tensor("D", D, (3,), d_doc)
    validate.same_dtype_and_device(Q, D)
    validate.head_dims(Q, D)
    squeeze = Q.dim() == 2
    Q3 = Q.unsqueeze(0) if squeeze else Q
    Nq, Lq, Nd, Ld = Q3.shape[0], Q3.shape[1], D.shape[0], D.shape[1]
    if pairs and Nq != Nd:
        raise ValueError(f"pairs=True needs one doc per query: Q has B={Nq}, D has {Nd}")
    q_shape = (Lq,) if squeeze else (Nq, Lq)
    q_mask = validate.mask("q_mask", q_mask, q_shape, Q.device)
    d_mask = validate.mask("d_mask", d_mask, (Nd, Ld), D.device)
    if weights is not None:
        weights = _weights(weights, q_shape, Q.device)
    if squeeze:
        q_mask = None if q_mask is None else q_mask.unsqueeze(0)
        weights = None if weights is None else weights.unsqueeze(0)
    if not call.normalize:
        norm_warning.check(Q3, D, q_mask, d_mask)
    backend = backends.route("scored", Q)
    if backend == "metal":  # the Metal kernels, or the reference outside them
        metal_call = metal.ScoredCall(call.score, call.layout, call.normalize, call.tau, call.k)
        out = metal.maxsim_scored(metal_call, Q3, D, weights, q_mask, d_mask)
    elif backend == "reference":
        out = maxsim_scored_reference(Q3, D, q_mask, d_mask, score=call.score, weights=weights,
                                      tau=call.tau, k=call.k, normalize=call.normalize,
                                      pairs=pairs).float()  # fmt: skip
    else:
        out = _kernel_score(call, Q3, D, weights, q_mask, d_mask)
    return out[0] if squeeze else out


def _weights(weights: object, expected: tuple[int, ...], device: torch.device) -> torch.Tensor:
    if not isinstance(weights, torch.Tensor):
        raise TypeError(
            f"weights must be a float tensor {list(expected)}, got {type(weights).__name__}"
        )
    if not weights.dtype.is_floating_point or weights.dtype == torch.float64:
        raise TypeError(
            f"weights must be float32, float16 or bfloat16 {list(expected)}, got {weights.dtype}"
        )
    if tuple(weights.shape) != expected:
        raise ValueError(
            f"weights must have shape {expected} (one per query token), got {tuple(weights.shape)}"
        )
    if weights.device != device:
        raise ValueError(f"weights must be on {device} like Q and D, got {weights.device}")
    return weights


def _call(score: str, pairs: object, normalize: object, tau: float = 1.0, k: int = 1) -> _Call:
    """The call of a token score, its bool arguments checked."""
    layout = "pairs" if validate.flag("pairs", pairs) else "dense"
    return _Call(score, layout, validate.flag("normalize", normalize), tau, k)


def maxsim_weighted(
    Q: torch.Tensor,
    D: torch.Tensor,
    weights: torch.Tensor,
    q_mask: torch.Tensor | None = None,
    d_mask: torch.Tensor | None = None,
    *,
    normalize: bool = False,
    pairs: bool = False,
) -> torch.Tensor:
    """sum_s weights[s] * max_t <Q[s], D[t]>: MaxSim with a weight per query token
    (IDF-style or learned). weights [Nq, Lq] ([Lq] for a [Lq, d] query), float; the
    gradient reaches them too. Layouts as in the module docstring (in-batch, or pairs=True:
    the maxsim_pairs layout)."""
    call = _call("weighted", pairs, normalize)
    if weights is None:
        raise TypeError("maxsim_weighted needs weights [Nq, Lq] (use maxsim without weights)")
    return _score(call, Q, D, weights, q_mask, d_mask)


def maxsim_smooth(
    Q: torch.Tensor,
    D: torch.Tensor,
    q_mask: torch.Tensor | None = None,
    d_mask: torch.Tensor | None = None,
    *,
    tau: float = 0.1,
    normalize: bool = False,
    pairs: bool = False,
) -> torch.Tensor:
    """sum_s tau * logsumexp_t(<Q[s], D[t]> / tau): a smooth max over doc tokens that
    tends to MaxSim as tau -> 0 and spreads the gradient over near-winners (colpali-engine's
    use_smooth_max). tau is a positive normal fp32 number (about 1.2e-38 to 3.4e38).
    Layouts as in the module docstring."""
    fp32 = torch.finfo(torch.float32)  # the kernels' dtype: no tau it rounds to 0 or inf
    number = isinstance(tau, int | float) and not isinstance(tau, bool)
    if not number or not fp32.tiny <= tau <= fp32.max:
        raise ValueError(
            f"tau must be a finite positive number that fp32 holds as a normal number "
            f"({fp32.tiny:.4g} <= tau <= {fp32.max:.4g}), got {tau!r}"
        )
    call = _call("smooth", pairs, normalize, tau=float(tau))
    return _score(call, Q, D, None, q_mask, d_mask)


def maxsim_topk_mean(
    Q: torch.Tensor,
    D: torch.Tensor,
    q_mask: torch.Tensor | None = None,
    d_mask: torch.Tensor | None = None,
    *,
    k: int = 4,
    normalize: bool = False,
    pairs: bool = False,
) -> torch.Tensor:
    """sum_s mean of the k largest <Q[s], D[t]> over doc tokens t (XTR-style aggregation;
    k = 1 is MaxSim). A doc with fewer than k valid tokens averages the ones it has; ties
    keep the earlier doc tokens. 1 <= k <= 16. Layouts as in the module docstring."""
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_TOKEN_K:
        raise ValueError(f"k must be an integer in [1, {MAX_TOKEN_K}], got {k!r}")
    call = _call("topk_mean", pairs, normalize, k=k)
    return _score(call, Q, D, None, q_mask, d_mask)
