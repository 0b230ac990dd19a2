"""Property-based tests: random tiny shapes, masks, dtypes and memory layouts against the
float64 reference, through the public entries.

Under the Triton interpreter each example costs a fraction of a second, so every property
draws a fixed, small budget of examples (derandomized: CI runs the same examples each
time, and a failure reproduces).
"""

from __future__ import annotations

import pytest
import torch
from helpers import INTERPRETER_FP32_TOLERANCE, TOLERANCE, relative_error
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lik.runtime import backends, maxsim, maxsim_pairs
from lik.runtime.reference import maxsim_pairs_reference, maxsim_reference
from lik.runtime.retrieval import retrieve

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETER = DEVICE == "cpu"
pytestmark = pytest.mark.skipif(
    backends.device_backend(torch.device(DEVICE)) not in backends.GENERATED_TRITON,
    reason="no Triton path on this machine",
)
BUDGET = settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# layout -> (Q dims, D dims): every shape maxsim and maxsim_pairs accept.
LAYOUTS = {
    "dense": ("[Nq, Lq, d]", "[Nd, Ld, d]"),
    "kd": ("[Nq, Lq, d]", "[Nq, K, Ld, d]"),
    "pairs": ("[B, Lq, d]", "[B, Ld, d]"),
    "one query": ("[Lq, d]", "[Nd, Ld, d]"),
    "one doc": ("[Nq, Lq, d]", "[Ld, d]"),
}


def _tolerance(dtype):
    return (
        INTERPRETER_FP32_TOLERANCE if INTERPRETER and dtype == torch.float32 else TOLERANCE[dtype]
    )


def _layout_view(draw, shape, generator):
    """A tensor of `shape` in a drawn memory layout: contiguous, a slice of a larger tensor,
    or a permuted storage seen through the inverse permutation."""
    kind = draw(st.sampled_from(["contiguous", "sliced", "permuted"]))
    if kind == "sliced" and shape:
        big = torch.randn(*shape[:-1], 2 * shape[-1] + 1, generator=generator)
        return big[..., 1::2]
    if kind == "permuted" and len(shape) > 1:
        order = draw(st.permutations(range(len(shape))))
        stored = torch.randn(*[shape[i] for i in order], generator=generator)
        inverse = sorted(range(len(order)), key=order.__getitem__)
        return stored.permute(*inverse)
    return torch.randn(*shape, generator=generator)


@st.composite
def cases(draw, head_dims=(1, 3, 8, 16, 24, 33)):
    layout = draw(st.sampled_from(list(LAYOUTS)))
    dtype = draw(st.sampled_from(DTYPES))
    Nq, Nd, Lq, Ld = (draw(st.integers(1, n)) for n in (3, 3, 9, 9))
    d = draw(st.sampled_from(head_dims))
    q_shape = {"one query": (Lq, d)}.get(layout, (Nq, Lq, d))
    d_shape = {"kd": (Nq, Nd, Ld, d), "pairs": (Nq, Ld, d), "one doc": (Ld, d)}.get(
        layout, (Nd, Ld, d)
    )
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    Q = _layout_view(draw, q_shape, g).to(dtype)
    D = _layout_view(draw, d_shape, g).to(dtype)
    q_mask = d_mask = None
    if draw(st.booleans()):
        q_mask = torch.rand(q_shape[:-1], generator=g) < draw(st.sampled_from([0.0, 0.5, 1.0]))
    if draw(st.booleans()):
        d_mask = torch.rand(d_shape[:-1], generator=g) < draw(st.sampled_from([0.0, 0.5, 1.0]))
    normalize = draw(st.booleans())
    return layout, Q, D, q_mask, d_mask, normalize


def _entries(layout):
    if layout == "pairs":
        return maxsim_pairs, maxsim_pairs_reference
    return maxsim, maxsim_reference


def _on_device(*tensors):
    return [None if t is None else t.to(DEVICE) for t in tensors]


@BUDGET
@given(cases())
def test_scores_match_the_reference(case):
    layout, Q, D, q_mask, d_mask, normalize = case
    score, reference = _entries(layout)
    out = score(*_on_device(Q, D, q_mask, d_mask), normalize=normalize)
    ref = reference(Q.double(), D.double(), q_mask, d_mask, normalize=normalize)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert not out.isnan().any()
    assert relative_error(out, ref) < _tolerance(Q.dtype)


# Head dims of at least 8 for gradients: with d = 1 low-precision inputs tie exactly, and
# the reference splits a tied max's gradient where the kernels pick the first token.
@BUDGET
@given(cases(head_dims=(8, 24, 40)), st.sampled_from(["unified", "lowmem"]), st.integers(0, 99))
def test_gradients_match_the_reference(case, backward, seed):
    layout, Q, D, q_mask, d_mask, normalize = case
    score, reference = _entries(layout)
    out_shape = reference(Q[..., :0].double(), D[..., :0].double(), q_mask, d_mask).shape
    weights = torch.randn(out_shape, generator=torch.Generator().manual_seed(seed))
    Qk, Dk = (t.detach().to(DEVICE).requires_grad_() for t in (Q, D))
    out = score(Qk, Dk, *_on_device(q_mask, d_mask), normalize=normalize, backward=backward)
    (out * weights.to(DEVICE)).sum().backward()
    Qr, Dr = (t.detach().double().requires_grad_() for t in (Q, D))
    ref = reference(Qr, Dr, q_mask, d_mask, normalize=normalize)
    (ref * weights.double()).sum().backward()
    assert Qk.grad.dtype == Q.dtype and Dk.grad.dtype == D.dtype
    for got, want, name in ((Qk.grad, Qr.grad, "grad_Q"), (Dk.grad, Dr.grad, "grad_D")):
        err = relative_error(got, want)
        assert err < _tolerance(Q.dtype), f"{name} relative error {err:.3g}"
    if q_mask is not None:  # masked query tokens take no gradient
        assert not Qk.grad[~q_mask.to(DEVICE)].any()
    if d_mask is not None:  # nor do masked doc tokens
        assert not Dk.grad[~d_mask.to(DEVICE)].any()


@BUDGET
@given(cases(), st.integers(1, 5), st.one_of(st.none(), st.integers(1, 4)))
def test_retrieve_is_the_stable_top_k_of_the_scores(case, top_k, chunk):
    layout, Q, D, q_mask, _, normalize = case
    if layout not in ("dense", "one query"):
        D = D.reshape(-1, *D.shape[-2:])  # retrieve takes a [Nd, Ld, d] corpus
    Q, D, q_mask = _on_device(Q, D, q_mask)
    scores, ids = retrieve(Q, D, top_k, q_mask, normalize=normalize, chunk=chunk)
    full = maxsim(Q, D, q_mask, normalize=normalize).reshape(-1, D.shape[0])
    order = torch.sort(full, dim=1, descending=True, stable=True)
    k = min(top_k, D.shape[0])
    assert torch.equal(ids.reshape(-1, k), order.indices[:, :k])
    assert torch.equal(scores.reshape(-1, k), order.values[:, :k])
