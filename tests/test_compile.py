"""Every public entry under torch.compile(fullgraph=True): no graph break, the eager result.

On the CPU the entries run the generated kernels under the interpreter, through the
custom ops of lik.runtime.ops (aot_eager is enough to catch a break: it traces the
forward and the backward). Trainable entries also compare gradients with eager ones.
"""

from __future__ import annotations

import pytest
import torch
from test_plaid import _flatten, _index

import lik.runtime as rt
from lik.runtime import backends, fp8, head, plaid

pytestmark = pytest.mark.skipif(
    backends.device_backend(torch.device("cpu")) != "interpreter" or torch.cuda.is_available(),
    reason="the kernels under the interpreter, on a CPU-only machine",
)


def _tokens(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.nn.functional.normalize(torch.randn(*shape, generator=g), dim=-1)


def _mask(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(*shape, generator=g) > 0.3
    mask[..., 0] = True
    return mask


def _fp8_inputs(q, d):
    (q8, scale_q), (d8, scale_d) = fp8.quantize_fp8_per_token(q), fp8.quantize_fp8_per_token(d)
    return {"Q": q8, "D": d8, "scale_Q": scale_q, "scale_D": scale_d}


def entries(device: str = "cpu") -> dict:
    """name -> (entry(*inputs), inputs, indices of the inputs that take a gradient): every
    public entry, small shapes, masks with holes where the entry takes them."""
    Q, D = _tokens(2, 5, 16, seed=1), _tokens(3, 7, 16, seed=2)
    q_mask, d_mask = _mask(2, 5, seed=3), _mask(3, 7, seed=4)
    cu_q = torch.tensor([0, 3, 5], dtype=torch.int32)
    cu_d = torch.tensor([0, 4, 9, 12], dtype=torch.int32)
    QP, DP = _tokens(5, 16, seed=5), _tokens(12, 16, seed=6)
    weights = torch.rand(2, 5, generator=torch.Generator().manual_seed(7))
    H, W, bias = _tokens(3, 7, 24, seed=8), _tokens(16, 24, seed=9), _tokens(16, seed=10)
    codes, residuals, lengths, centroids, buckets, _ = _index(nbits=4, B=3, Ld=6, dim=16)
    pair_q, pair_d = torch.tensor([0, 1, 1]), torch.tensor([2, 0, 1])
    q_len, d_len = torch.tensor([5, 3]), torch.tensor([[7, 3], [2, 6]])
    flat = _flatten(codes, residuals, lengths)
    (Q, D, q_mask, d_mask, cu_q, cu_d, QP, DP, weights, H, W, bias, codes, residuals, lengths,
     centroids, buckets, pair_q, pair_d, q_len, d_len) = (t.to(device) for t in (
        Q, D, q_mask, d_mask, cu_q, cu_d, QP, DP, weights, H, W, bias, codes, residuals,
        lengths, centroids, buckets, pair_q, pair_d, q_len, d_len))
    flat = tuple(t.to(device) for t in flat)
    kd = _tokens(2, 3, 7, 16, seed=11).to(device)
    return {
        "maxsim": (lambda q, d: rt.maxsim(q, d, q_mask, d_mask), (Q, D), (0, 1)),
        "maxsim kd": (lambda q, d: rt.maxsim(q, d), (Q, kd), (0, 1)),
        "maxsim_pairs": (lambda q, d: rt.maxsim_pairs(q, d, q_mask, d_mask[:2]), (Q, D[:2]),
                         (0, 1)),
        "maxsim_varlen": (lambda q, d: rt.maxsim_varlen(q, d, cu_q, cu_d), (QP, DP), (0, 1)),
        "maxsim_varlen bounds": (lambda q, d: rt.maxsim_varlen(q, d, cu_q, cu_d, 3, 5),
                                 (QP, DP), (0, 1)),
        "score_pairs_packed": (
            lambda q, d: rt.score_pairs_packed(q, d, cu_q, cu_d, pair_q, pair_d),
            (QP, DP), (0, 1),
        ),
        "score_pairs_packed bounds": (
            lambda q, d: rt.score_pairs_packed(q, d, cu_q, cu_d, pair_q, pair_d,
                                               max_seqlen_q=3, max_seqlen_d=5),
            (QP, DP), (0, 1),
        ),
        "maxsim_padded": (lambda q, d: rt.maxsim_padded(q, d, q_len, d_len),
                          (Q, D[:2].unsqueeze(0).repeat(2, 1, 1, 1)), (0, 1)),
        "retrieve": (lambda q, d: rt.retrieve(q, d, 2), (Q, D), ()),
        "MaxSimScorer": (lambda q, d: rt.MaxSimScorer()(q, d, q_mask, d_mask), (Q, D), (0, 1)),
        "maxsim_weighted": (lambda q, d, w: rt.maxsim_weighted(q, d, w, q_mask, d_mask),
                            (Q, D, weights), (0, 1, 2)),
        "maxsim_smooth": (lambda q, d: rt.maxsim_smooth(q, d, None, d_mask), (Q, D), (0, 1)),
        "maxsim_topk_mean": (lambda q, d: rt.maxsim_topk_mean(q, d, k=2), (Q, D), (0, 1)),
        "maxsim_inference_fp8": (
            lambda q, d: fp8.maxsim_inference_fp8(**_fp8_inputs(q, d), q_mask=q_mask,
                                                  d_mask=d_mask),
            (Q, D), (),
        ),
        "maxsim_from_hidden": (lambda q, h, w, b: head.maxsim_from_hidden(q, h, w, b, d_mask),
                               (Q, H, W, bias), (0, 1, 2, 3)),
        "maxsim_residual": (
            lambda q: plaid.maxsim_residual(q, codes, residuals, lengths, centroids, buckets, 4),
            (Q,), (0,),
        ),
        "maxsim_residual_varlen": (
            lambda q: plaid.maxsim_residual_varlen(q, *flat, centroids, buckets, 4), (Q,), (),
        ),
    }  # fmt: skip


ENTRIES = entries()


def _outputs(result) -> tuple[torch.Tensor, ...]:
    return result if isinstance(result, tuple) else (result,)


def _weights_like(t: torch.Tensor) -> torch.Tensor:
    return torch.linspace(0.5, 1.5, t.numel(), device=t.device).view(t.shape)


def step(entry, leaves, trains):
    """The entry's outputs on these leaves, and the gradients of a weighted sum of them
    for the leaves `trains` names."""
    outputs = _outputs(entry(*leaves))
    grads = ()
    if trains:
        loss = sum((o.float() * _weights_like(o)).sum() for o in outputs)
        grads = torch.autograd.grad(loss, [leaves[i] for i in trains])
    return outputs, grads


def run(entry, inputs, trains):
    """step() on fresh leaves holding the inputs."""
    return step(entry, [t.clone().requires_grad_(i in trains) for i, t in enumerate(inputs)],
                trains)  # fmt: skip


@pytest.mark.parametrize("name", list(ENTRIES))
def test_compiled_entry_matches_eager(name, monkeypatch):
    entry, inputs, trains = ENTRIES[name]
    if name == "maxsim_from_hidden":  # the fused kernels' own backward, not the composed one
        monkeypatch.setattr(head, "COMPOSED_TRAINING_MAX_DOC_VALUES", 0)
    torch._dynamo.reset()
    eager, eager_grads = run(entry, inputs, trains)
    compiled = torch.compile(entry, fullgraph=True, backend="aot_eager")
    got, got_grads = run(compiled, inputs, trains)
    for want, have in zip(eager + eager_grads, got + got_grads, strict=True):
        torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-6, equal_nan=True)
