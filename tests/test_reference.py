"""The reference against a literal loop over the definition, in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lik.runtime import reference
from lik.runtime.reference import maxsim_pairs_reference, maxsim_reference


def literal_maxsim(q, d, q_valid, d_valid):
    """sum over valid query tokens of max over valid doc tokens; 0 if none is valid."""
    total = torch.zeros((), dtype=torch.float64)
    for s in range(q.shape[0]):
        if not q_valid[s]:
            continue
        sims = [q[s] @ d[t] for t in range(d.shape[0]) if d_valid[t]]
        total = total + (max(sims) if sims else 0.0)
    return total


def _inputs(seed, Nq=3, Nd=4, Lq=5, Ld=6, dim=8):
    g = torch.Generator().manual_seed(seed)
    Q = torch.randn(Nq, Lq, dim, generator=g, dtype=torch.float64)
    D = torch.randn(Nd, Ld, dim, generator=g, dtype=torch.float64)
    qm = torch.rand(Nq, Lq, generator=g) < 0.7
    dm = torch.rand(Nd, Ld, generator=g) < 0.6
    dm[1] = False
    return Q, D, qm, dm


@pytest.mark.parametrize("normalize", [False, True])
def test_dense_matches_the_definition(normalize):
    Q, D, qm, dm = _inputs(0)
    out = maxsim_reference(Q, D, qm, dm, normalize=normalize)
    Qn, Dn = (F.normalize(Q, dim=-1), F.normalize(D, dim=-1)) if normalize else (Q, D)
    for i in range(Q.shape[0]):
        for j in range(D.shape[0]):
            assert torch.allclose(out[i, j], literal_maxsim(Qn[i], Dn[j], qm[i], dm[j]))
    assert torch.all(out[:, 1] == 0)


def test_kd_and_pairs_match_dense_slices():
    Q, D, qm, _ = _inputs(1)
    Dk = torch.randn(3, 2, 6, 8, dtype=torch.float64)
    dmk = torch.rand(3, 2, 6) < 0.5
    kd = maxsim_reference(Q, Dk, qm, dmk)
    for i in range(3):
        dense = maxsim_reference(Q[i : i + 1], Dk[i], qm[i : i + 1], dmk[i])
        assert torch.allclose(kd[i], dense[0])
    pairs = maxsim_pairs_reference(Q, D[:3], qm, None)
    assert torch.allclose(pairs, maxsim_reference(Q, D[:3], qm).diagonal())


def test_chunking_does_not_change_results(monkeypatch):
    Q, D, qm, dm = _inputs(2, Nq=4, Nd=9)
    whole = maxsim_reference(Q, D, qm, dm)
    monkeypatch.setattr(reference, "CHUNK_ELEMENTS", 40)  # one doc per chunk
    assert torch.allclose(maxsim_reference(Q, D, qm, dm), whole, rtol=1e-12, atol=1e-12)
    assert torch.allclose(
        maxsim_pairs_reference(Q, D[:4], qm, dm[:4]),
        torch.diagonal(whole[:, :4]),
        rtol=1e-12,
        atol=1e-12,
    )


def test_gradients_pass_gradcheck_and_skip_masked_tokens():
    Q, D, qm, dm = _inputs(3, Nq=2, Nd=3, Lq=3, Ld=4, dim=5)
    Q.requires_grad_()
    D.requires_grad_()
    assert torch.autograd.gradcheck(
        lambda q, d: maxsim_reference(q, d, qm[:2], dm[:3], normalize=True), (Q, D)
    )
    maxsim_reference(Q, D, qm[:2], dm[:3]).sum().backward()
    assert torch.all(D.grad[1] == 0), "a fully masked doc gets zero gradient"
    assert torch.all(D.grad[~dm[:3]] == 0), "masked doc tokens get zero gradient"
    assert torch.all(Q.grad[~qm[:2]] == 0), "masked query tokens get zero gradient"


def test_empty_inputs():
    Q, D, _, _ = _inputs(4)
    assert maxsim_reference(Q[:0], D).shape == (0, 4)
    assert maxsim_reference(Q, D[:0]).shape == (3, 0)
    assert torch.all(maxsim_reference(Q, D[:, :0]) == 0)


@pytest.mark.parametrize("empty", ["Nq", "Lq", "Nd", "Ld"])
def test_empty_inputs_keep_the_graph(empty):
    # Training on the reference path (no kernel: CPU without Triton, CPU tensors beside a
    # GPU) must backpropagate zeros through an empty batch, as the kernels' path does.
    Nq, Lq, Nd, Ld = (0 if empty == axis else size for axis, size in
                      (("Nq", 3), ("Lq", 4), ("Nd", 2), ("Ld", 5)))  # fmt: skip
    Q = torch.randn(Nq, Lq, 8, dtype=torch.float64, requires_grad=True)
    D = torch.randn(Nd, Ld, 8, dtype=torch.float64, requires_grad=True)
    KD = torch.randn(Nq, Nd, Ld, 8, dtype=torch.float64, requires_grad=True)
    P = torch.randn(min(Nq, Nd), Ld, 8, dtype=torch.float64, requires_grad=True)
    scores = (maxsim_reference(Q, D), maxsim_reference(Q, D, normalize=True),
              maxsim_reference(Q, KD), maxsim_pairs_reference(Q[: len(P)], P))  # fmt: skip
    for out, docs in zip(scores, (D, D, KD, P), strict=True):
        assert (out == 0).all()
        Q.grad = docs.grad = None
        out.sum().backward()
        assert Q.grad.shape == Q.shape and docs.grad.shape == docs.shape


def test_empty_packed_batches_keep_the_graph():
    Q = torch.randn(0, 8, dtype=torch.float64, requires_grad=True)
    D = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    none, two_docs = torch.tensor([0]), torch.tensor([0, 2, 6])
    out = reference.score_pairs_packed_reference(Q, D, cu_seqlens_q=none, cu_seqlens_d=two_docs,
                                                 layout="varlen")
    assert out.shape == (0, 2)
    out.sum().backward()
    assert Q.grad.shape == Q.shape and (D.grad == 0).all()


def test_nan_propagates():
    Q, D, _, _ = _inputs(5)
    D[2, 3, 0] = float("nan")
    out = maxsim_reference(Q, D)
    assert torch.isnan(out[:, 2]).all() and not torch.isnan(out[:, [0, 1, 3]]).any()
