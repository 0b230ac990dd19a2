"""The doc mask read as zeros (PyLate's convention): a masked doc token is not left out of
the max but competes with similarity 0.

    score[i, j] = sum over valid s of max(max over valid t of <Q[i, s], D[j, t]>,
                                          0 if doc j has a masked token)

The float64 reference (lik.runtime.reference, masked_as_zero=True) is checked against
PyLate's own formula, written here (the similarities times the masks, then max and sum),
values and gradients; the kernels (the masked-as-zero variants, a value of the mask axis:
MASKED_AS_ZERO) against the reference on fresh random inputs that lean apart, so that
masked tokens' 0 wins many query tokens; outputs and saved argmax poisoned first. Both
CPU paths: the reference and, where there is no GPU, the generated kernels under the
interpreter (small shapes); with a GPU the same tests run compiled.
"""

from __future__ import annotations

import pytest
import torch
from helpers import TOLERANCE, relative_error, stable_seed

from lik.runtime import api, backends, dispatch, registry
from lik.runtime.keys import variant_name
from lik.runtime.reference import maxsim_pairs_reference, maxsim_reference
from lik_gen.ir import Mask, Variant
from lik_gen.spec import SpecError, load_spec_file

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TORCH_DTYPE = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
LAYOUTS = ("dense", "kd", "pairs")
# (Nq, Nd or K, Lq, Ld, d): one-token queries and docs and odd head dims, a partial
# second doc tile, whole 16-token tiles.
SHAPES = {
    "Lq 1, Ld 1, d 33": (2, 3, 1, 1, 33),
    "Lq 1, d 96": (4, 3, 1, 19, 96),
    "Ld 1, d 48": (3, 2, 5, 1, 48),
    "odd": (3, 4, 7, 37, 48),
    "pretty": (4, 3, 16, 64, 64),
}


# ---------------------------------------------------------------------------------------
# Inputs and PyLate's formula


def _inputs(layout, shape, dtype=torch.float32, seed=0, device="cpu"):
    """Q, D leaning apart along their first axis (about half the best similarities below
    0, at any head dim), a query mask with holes, and a doc mask with holes, one doc with
    none and one fully masked."""
    Nq, Nd, Lq, Ld, d = shape
    lean = 1.6 * d**0.25
    g = torch.Generator().manual_seed(seed)
    d_shape = {"dense": (Nd, Ld), "kd": (Nq, Nd, Ld), "pairs": (Nq, Ld)}[layout]
    Q = torch.randn(Nq, Lq, d, generator=g)
    D = torch.randn(*d_shape, d, generator=g)
    Q[..., 0] += lean
    D[..., 0] -= lean
    q_mask = torch.rand(Nq, Lq, generator=g) < 0.7
    q_mask[:, 0] = True
    d_mask = torch.rand(d_shape, generator=g) < 0.6
    rows = d_mask.view(-1, Ld)
    rows[0] = True  # a doc with no masked token: its maxima may stay below 0
    rows[-1] = False  # a fully masked doc: 0 for every query token
    move = {"device": device}
    return (Q.to(dtype=dtype, **move), D.to(dtype=dtype, **move), q_mask.to(**move),
            d_mask.to(**move))  # fmt: skip


def _pylate(layout, Q, D, q_mask, d_mask):
    """PyLate's torch path (pylate.scores.colbert 1.6): similarities times both masks."""
    spec = {"dense": "ash,bth->abst", "kd": "ash,abth->abst", "pairs": "ash,ath->ast"}[layout]
    sim = torch.einsum(spec, Q, D)
    qm, dm = q_mask.to(sim.dtype), d_mask.to(sim.dtype)
    if layout == "pairs":
        sim = sim * qm[:, :, None] * dm[:, None, :]
    else:
        sim = sim * qm[:, None, :, None]
        sim = sim * (dm[None, :, None, :] if layout == "dense" else dm[:, :, None, :])
    return sim.max(dim=-1).values.sum(dim=-1)


def _reference(layout, Q, D, q_mask, d_mask, masked_as_zero=True):
    reference = maxsim_pairs_reference if layout == "pairs" else maxsim_reference
    return reference(Q, D, q_mask, d_mask, masked_as_zero=masked_as_zero)


def _grads(score, Q, D, seed=1):
    """(scores, grad Q, grad D) of a random weighting of score(Q, D), on leaf copies."""
    Qg, Dg = Q.detach().clone().requires_grad_(), D.detach().clone().requires_grad_()
    out = score(Qg, Dg)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    (out * weights.to(out.device, out.dtype)).sum().backward()
    return out.detach(), Qg.grad, Dg.grad


def _assert_zero_wins(zero, own, D):
    """The inputs tell the conventions apart: a masked token's 0 beats some query token's
    max (with one-token docs a doc with a masked token has no valid one: both give 0)."""
    if D.shape[-2] > 1:
        assert (zero > own).any(), "no masked token's 0 won: a weak case"


# ---------------------------------------------------------------------------------------
# The reference is PyLate's formula


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_reference_is_pylates_formula(layout, shape):
    Q, D, q_mask, d_mask = _inputs(layout, SHAPES[shape], torch.float64)
    want, want_q, want_d = _grads(lambda q, d: _pylate(layout, q, d, q_mask, d_mask), Q, D)
    out, gq, gd = _grads(lambda q, d: _reference(layout, q, d, q_mask, d_mask), Q, D)
    own = _reference(layout, Q, D, q_mask, d_mask, masked_as_zero=False)
    _assert_zero_wins(want, own, D)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gq, want_q, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gd, want_d, rtol=1e-12, atol=1e-12)
    assert (gd[~d_mask] == 0).all() and (gq[~q_mask] == 0).all()


def test_a_doc_without_masked_tokens_keeps_its_negative_maxima():
    # One query token against a valid doc of negative similarities, and the same doc with
    # a masked token added: -1 once, 0 once.
    Q = torch.tensor([[[1.0, 0.0]]], dtype=torch.float64)
    D = torch.tensor([[[-1.0, 0.0], [-2.0, 0.0]], [[-1.0, 0.0], [5.0, 0.0]]], dtype=torch.float64)
    d_mask = torch.tensor([[True, True], [True, False]])
    out = maxsim_reference(Q, D, None, d_mask, masked_as_zero=True)
    assert out.tolist() == [[-1.0, 0.0]]
    assert maxsim_reference(Q, D, None, d_mask).tolist() == [[-1.0, -1.0]]


# ---------------------------------------------------------------------------------------
# The kernels (and the reference path) against the reference


def _entry(layout, backward=None):
    def score(Q, D, q_mask, d_mask):
        return api.maxsim_masked_as_zero(Q, D, q_mask, d_mask, pairs=layout == "pairs",
                                         backward=backward)  # fmt: skip

    return score


def _bounds(dtype, path):
    """(scores, gradients) bounds: DESIGN.md's on a GPU and for the CPU backend's 16-bit
    scores (its bf16 dots round like eager PyTorch's); under the interpreter the dots run
    in fp32 or wider, so scores are held to 1e-5, and only gradients, which come back in
    the input dtype, keep a 16-bit dtype's rounding."""
    if DEVICE == "cuda" or (path == "cpu" and dtype != torch.float32):
        return TOLERANCE[dtype], TOLERANCE[dtype]
    return 1e-5, 1e-5 if dtype == torch.float32 else TOLERANCE[dtype]


@pytest.mark.parametrize("backward", [None, "unified", "lowmem"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_scores_and_gradients_match_the_reference(lik_path, layout, shape, dtype, backward):
    dtype = TORCH_DTYPE[dtype]
    seed = stable_seed(layout, shape, dtype, backward)
    Q, D, q_mask, d_mask = _inputs(layout, SHAPES[shape], dtype, seed, device=DEVICE)
    Q64, D64 = Q.double(), D.double()
    score = _entry(layout, backward)
    ref, ref_q, ref_d = _grads(lambda q, d: _reference(layout, q, d, q_mask, d_mask), Q64, D64)
    own = _reference(layout, Q64, D64, q_mask, d_mask, masked_as_zero=False)
    _assert_zero_wins(ref, own, D)
    bound, grad_bound = _bounds(dtype, lik_path)
    if backward is None:
        out = score(Q, D, q_mask, d_mask)
        assert out.dtype == torch.float32 and not out.isnan().any()
        assert relative_error(out, ref) < bound, relative_error(out, ref)
        return
    out, gq, gd = _grads(lambda q, d: score(q, d, q_mask, d_mask), Q, D)
    assert gq.dtype == dtype and gd.dtype == dtype
    assert relative_error(out, ref) < bound
    assert relative_error(gq, ref_q) < grad_bound, f"grad Q {relative_error(gq, ref_q):.3g}"
    assert relative_error(gd, ref_d) < grad_bound, f"grad D {relative_error(gd, ref_d):.3g}"
    assert (gd[~d_mask] == 0).all() and (gq[~q_mask] == 0).all()


def _kernel_path():
    if backends.device_backend(torch.device(DEVICE)) not in backends.GENERATED_TRITON:
        pytest.skip("no Triton path on this machine")


def _winners(layout, Q, D, q_mask, d_mask):
    """The saved argmax the forward must write: each query token's earliest valid doc
    token of the max, -1 where the query token is masked, the doc fully masked, or a
    masked token's 0 beats the max (strictly)."""
    spec = {"dense": "isk,jtk->ijst", "kd": "isk,ijtk->ijst", "pairs": "isk,itk->ist"}[layout]
    sim = torch.einsum(spec, Q.double(), D.double())
    if layout == "dense":
        dm, qm = d_mask[None, :, None, :], q_mask[:, None, :]
    elif layout == "kd":
        dm, qm = d_mask[:, :, None, :], q_mask[:, None, :]
    else:
        dm, qm = d_mask[:, None, :], q_mask
    best, index = sim.masked_fill(~dm, float("-inf")).max(dim=-1)
    counted = qm & dm.any(dim=-1)
    zero_wins = counted & ~dm.all(dim=-1) & (best < 0)
    return torch.where(counted & ~zero_wins, index, -1), zero_wins


@pytest.mark.parametrize("backward", ["unified", "lowmem"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_output_and_winner_is_written(layout, backward):
    """The training forward into poisoned buffers: every score written, and the argmax
    -1 exactly where a masked token's 0 wins (no gradient there)."""
    _kernel_path()
    Q, D, q_mask, d_mask = _inputs(layout, SHAPES["odd"], seed=3, device=DEVICE)
    out_shape = {"dense": (3, 4), "kd": (3, 4), "pairs": (3,)}[layout]
    out = torch.full(out_shape, float("nan"), device=DEVICE)
    argmax = torch.full(out_shape + (Q.shape[1],), 12345, dtype=torch.int16, device=DEVICE)
    dispatch.forward(layout, Q, D, q_mask, d_mask, False, out, backward=backward,
                     argmax=argmax, masked_as_zero=True)  # fmt: skip
    assert relative_error(out, _reference(layout, Q.double(), D.double(), q_mask, d_mask)) < 1e-3
    want, zero_wins = _winners(layout, Q.cpu(), D.cpu(), q_mask.cpu(), d_mask.cpu())
    assert zero_wins.any(), "no masked token's 0 won: a weak case"
    assert torch.equal(argmax.cpu().long(), want)


@pytest.mark.parametrize("backward", [None, "unified", "lowmem"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_tie_at_zero_keeps_the_valid_token(lik_path, layout, backward):
    """A valid token at similarity 0 exactly, beside a masked one: the score is 0 and the
    valid token keeps the gradient (the 0 wins only strictly)."""
    Q = torch.tensor([[[1.0, 0.0]]] * 2)
    doc = torch.tensor([[0.0, 1.0], [7.0, 7.0], [-1.0, 0.0]])
    D = doc.expand(2, 2, 3, 2).clone() if layout == "kd" else doc.expand(2, 3, 2).clone()
    d_mask = torch.tensor([True, False, True]).expand(D.shape[:-1]).clone()
    q_mask = torch.ones(2, 1, dtype=torch.bool)
    Q, D, q_mask, d_mask = Q.to(DEVICE), D.to(DEVICE), q_mask.to(DEVICE), d_mask.to(DEVICE)
    score = _entry(layout, backward)
    if backward is None:
        assert (score(Q, D, q_mask, d_mask) == 0).all()
        return
    out, gq, gd = _grads(lambda q, d: score(q, d, q_mask, d_mask), Q, D)
    ref, ref_q, ref_d = _grads(lambda q, d: _reference(layout, q, d, q_mask, d_mask), Q, D)
    assert (out == 0).all() and (gq[..., 1] != 0).all()
    torch.testing.assert_close(gq, ref_q)
    torch.testing.assert_close(gd, ref_d)


# ---------------------------------------------------------------------------------------
# Names, spec, registry and the entry's checks


def test_names_round_trip_and_calls_name_their_variant():
    for mask in (Mask.D_ZERO, Mask.QD_ZERO):
        assert mask.has_d and mask.as_zero and mask.has_q == (mask is Mask.QD_ZERO)
    assert Mask.of(True, True, True) is Mask.QD_ZERO and Mask.of(False, True, True) is Mask.D_ZERO
    # Without a doc mask there is nothing to read as zeros: the plain variant.
    assert Mask.of(True, False, True) is Mask.Q and Mask.of(False, False, True) is Mask.NONE
    name = variant_name("kd", True, True, False, torch.bfloat16, backward="lowmem",
                        masked_as_zero=True)  # fmt: skip
    assert name == "maxsim_kd_qdzeromask_bf16_triton_lowmem"
    variant = Variant.parse(name)
    assert variant.name == name and variant.kernel.name == "maxsim_kd_triton_lowmem"
    assert variant.values() == {"mask": "qdzero", "normalize": False, "dtype": "bf16"}
    zero = [n for n in registry.names() if Variant.parse(n).mask.as_zero]
    assert len(zero) == 3 * 2 * 3 * 3  # layouts x masks x dtypes x backwards
    assert {Variant.parse(n).kernel.name for n in zero} == {
        f"maxsim_{layout}_triton{suffix}"
        for layout in LAYOUTS
        for suffix in ("", "_unified", "_lowmem")
    }


def test_the_registry_binds_the_mode_to_the_kernel_s_launcher():
    zero = registry.load("maxsim_dense_dzeromask_fp32_triton")
    plain = registry.load("maxsim_dense_dmask_fp32_triton")
    assert zero.module is plain.module  # one structural kernel, two values
    assert zero.launch.keywords["masked_as_zero"] is True
    assert plain.launch.keywords["masked_as_zero"] is False
    # Kernels that cannot read a mask as zeros take no such argument.
    for other in ("topk_dense_dmask_fp32_triton", "maxsim_dense_dmask_fp32_triton_smooth"):
        assert "masked_as_zero" not in registry.load(other).launch.keywords


@pytest.mark.parametrize(
    "axes",
    [
        'op = "topk"\nlayout = "dense"',
        'op = "maxsim"\nlayout = "dense"\nscore = "smooth"\nbackward = "lowmem"',
        'op = "maxsim"\nlayout = "dense"\ntarget = "metal"',
    ],
)
def test_the_spec_refuses_the_mode_where_no_kernel_reads_it(tmp_path, axes):
    target = "" if "target" in axes else 'target = "triton"\n'
    spec = tmp_path / "zero.toml"
    spec.write_text(f'[zero]\n{axes}\nmask = "dzero"\ndtype = "fp32"\n{target}')
    with pytest.raises(SpecError, match="doc mask read as zeros"):
        load_spec_file(spec)


def test_the_entry_checks_its_inputs():
    Q, D = torch.randn(2, 3, 8), torch.randn(4, 5, 8)
    with pytest.raises(TypeError, match="d_mask must be bool"):
        api.maxsim_masked_as_zero(Q, D, d_mask=torch.ones(4, 5))
    with pytest.raises(ValueError, match="d_mask must have shape"):
        api.maxsim_masked_as_zero(Q, D, d_mask=torch.ones(4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="rows like Q"):
        api.maxsim_masked_as_zero(Q, torch.randn(3, 2, 5, 8))
    with pytest.raises(ValueError, match="rows like Q"):
        api.maxsim_masked_as_zero(Q, D, pairs=True)
    with pytest.raises(ValueError, match="backward must be one of"):
        api.maxsim_masked_as_zero(Q, D, backward="fast")
    with pytest.raises(ValueError, match="Q must be"):
        api.maxsim_masked_as_zero(Q[0], D)


def test_torch_compile_sees_no_graph_break():
    """The entry goes through the same custom ops as maxsim: one graph, the mode carried."""
    _kernel_path()
    torch._dynamo.reset()
    Q, D, q_mask, d_mask = _inputs("dense", SHAPES["odd"], seed=8, device=DEVICE)

    def loss_fn(q, d):
        return api.maxsim_masked_as_zero(q, d, q_mask, d_mask, backward="lowmem").sum()

    compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")
    Qc, Dc = Q.clone().requires_grad_(), D.clone().requires_grad_()
    compiled(Qc, Dc).backward()
    Qe, De = Q.clone().requires_grad_(), D.clone().requires_grad_()
    loss_fn(Qe, De).backward()
    ref = _reference("dense", Q.double(), D.double(), q_mask, d_mask).sum()
    assert torch.allclose(compiled(Q, D), ref.float().to(DEVICE), rtol=1e-4)
    assert torch.equal(Qc.grad, Qe.grad) and torch.equal(Dc.grad, De.grad)
