"""Padding may hold anything, and non-finite valid values follow one rule (the rule is
written in lik.runtime.reference's docstring).

- Masked positions (query tokens, doc tokens, weights of masked query tokens, hidden
  states of the fused head, PLAID tokens past a doc's length) holding NaN, inf or huge
  values give the scores and gradients of the same call with zeros there, exactly, and
  the gradient at a masked position is exactly 0. A matrix over layout x mask side x
  backward x normalize x token score, on both CPU paths: the reference with every
  poison, the generated kernels under the interpreter with NaN and inf (-inf and huge
  values take the same kernel code, and the interpreter is slow).
- A valid token's -inf similarity row is a real -inf, unlike "no valid doc token", which
  adds 0; whether a mask is passed does not change a score. On both CPU paths.
- The doc mask read as zeros (PyLate's convention, lik.runtime.api.maxsim_masked_as_zero:
  a masked doc token competes with similarity 0) follows the same rules: padding is
  inert, and the -inf rule holds where the doc has no masked token (with one, the 0
  wins over -inf); in every layout and every loop shape of the dense forward.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lik.runtime import (
    api,
    backends,
    configs,
    maxsim,
    maxsim_pairs,
    maxsim_varlen,
    registry,
    retrieval,
    retrieve,
    score_pairs_packed,
    validate,
    variants,
)
from lik.runtime.fp8 import maxsim_inference_fp8
from lik.runtime.head import maxsim_from_hidden
from lik.runtime.plaid import maxsim_residual, packed_bytes
from lik.runtime.reference import (
    maxsim_from_hidden_reference,
    maxsim_pairs_reference,
    maxsim_reference,
    maxsim_scored_reference,
)

NAN, INF = float("nan"), float("inf")
POISONS = {"nan": NAN, "inf": INF, "-inf": -INF, "huge": 3e38}
INTERPRETED_POISONS = ("nan", "inf")
SIDES = ("q", "d", "qd")


# The interpreter's numpy arithmetic warns on inf * 0, log(0) and the like; that is the
# point here.
def quiet_numpy(test):
    test = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")(test)
    test = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")(test)
    return pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning")(test)


@pytest.fixture
def reference_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.fixture
def interpreter_path(monkeypatch):
    """The generated kernels under the interpreter, launched by the test itself."""
    if torch.cuda.is_available():
        pytest.skip("the interpreter runs where there is no GPU")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if backends.device_backend(torch.device("cpu")) != "interpreter":
        pytest.skip("no interpreter path here")


def _paths_and_poisons():
    """(path, poison) pairs of the padding matrices: every poison on the reference path,
    INTERPRETED_POISONS under the interpreter."""
    pairs = [("cpu", poison) for poison in POISONS]
    pairs += [("interpreter", poison) for poison in INTERPRETED_POISONS]
    return [pytest.param(path, poison, id=f"{path}-{poison}") for path, poison in pairs]


def _masks(layout, Nq, Lq, K, Ld, g):
    """Masks with holes: every query keeps its first token, query 0 loses a middle one;
    every doc keeps its first token but one doc is fully masked."""
    q_mask = torch.rand(Nq, Lq, generator=g) < 0.6
    q_mask[:, 0] = True
    q_mask[0, 2] = False
    d_shape = (Nq, K, Ld) if layout == "kd" else (K, Ld)
    d_mask = torch.rand(d_shape, generator=g) < 0.6
    d_mask[..., 0] = True
    d_mask[..., 3] = False
    if layout == "kd":
        d_mask[0, 1] = False
    else:
        d_mask[1] = False
    return q_mask, d_mask


def _poison(X, mask, value):
    """X with its masked tokens set to value (a where: padding as torch.empty leaves it)."""
    return torch.where(mask[..., None], X, torch.full((), value, dtype=X.dtype))


def _inputs(layout, side, seed=0, d=7):
    g = torch.Generator().manual_seed(seed)
    Nq, Lq, Ld = 3, 5, 6
    K = Nq if layout == "pairs" else (2 if layout == "kd" else 4)
    Q = torch.randn(Nq, Lq, d, generator=g)
    D = torch.randn((Nq, K, Ld, d) if layout == "kd" else (K, Ld, d), generator=g)
    q_mask, d_mask = _masks(layout, Nq, Lq, K, Ld, g)
    weights = torch.rand(Nq, Lq, generator=g) + 0.5
    return Q, D, weights, (q_mask if "q" in side else None), (d_mask if "d" in side else None)


def _run(call, tensors):
    """call(*leaves) and the gradients of a weighted sum of its scores to every leaf."""
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out = call(*leaves)
    g = torch.Generator().manual_seed(7)
    (out * (torch.rand(out.shape, generator=g) + 0.5)).sum().backward()
    return out.detach(), [leaf.grad for leaf in leaves]


def _assert_padding_is_inert(call, poisoned, clean, masks):
    """Scores and gradients of the poisoned inputs equal those of the clean ones exactly;
    gradients are finite, and exactly 0 where a mask is False."""
    out, grads = _run(call, poisoned)
    want, want_grads = _run(call, clean)
    assert out.isfinite().all(), f"padding reached a score: {out}"
    assert torch.equal(out, want)
    for i, (grad, want_grad, mask) in enumerate(zip(grads, want_grads, masks, strict=True)):
        assert grad.isfinite().all(), f"padding reached the gradient of input {i}"
        if mask is not None:
            assert (grad[~mask] == 0).all(), f"input {i}: nonzero gradient at masked positions"
        assert torch.equal(grad, want_grad), f"input {i}: gradient differs from the clean one"


@quiet_numpy
@pytest.mark.parametrize("lik_path, poison", _paths_and_poisons(), indirect=["lik_path"])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("backward", ["unified", "lowmem"])
@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("layout", ["dense", "kd", "pairs"])
def test_padding_never_reaches_maxsim(layout, side, backward, normalize, lik_path, poison):
    Q, D, _, q_mask, d_mask = _inputs(layout, side)
    value = POISONS[poison]
    Qp = Q if q_mask is None else _poison(Q, q_mask, value)
    Dp = D if d_mask is None else _poison(D, d_mask, value)
    Qc = Q if q_mask is None else _poison(Q, q_mask, 0.0)
    Dc = D if d_mask is None else _poison(D, d_mask, 0.0)
    entry = maxsim_pairs if layout == "pairs" else maxsim

    def call(q, d):
        return entry(q, d, q_mask, d_mask, normalize=normalize, backward=backward)

    _assert_padding_is_inert(call, (Qp, Dp), (Qc, Dc), (q_mask, d_mask))


@quiet_numpy
@pytest.mark.parametrize("lik_path, poison", _paths_and_poisons(), indirect=["lik_path"])
@pytest.mark.parametrize("backward", [None, "unified", "lowmem"])
@pytest.mark.parametrize("side", ["d", "qd"])
@pytest.mark.parametrize("layout", ["dense", "kd", "pairs"])
def test_padding_never_reaches_masked_as_zero(layout, side, backward, lik_path, poison):
    """A masked doc token competes as similarity 0 whatever it holds: its value is
    padding like any other (a product with the mask, as PyLate computes, would be NaN)."""
    Q, D, _, q_mask, d_mask = _inputs(layout, side)
    value = POISONS[poison]
    Qp = Q if q_mask is None else _poison(Q, q_mask, value)
    Qc = Q if q_mask is None else _poison(Q, q_mask, 0.0)
    Dp, Dc = _poison(D, d_mask, value), _poison(D, d_mask, 0.0)
    pairs = layout == "pairs"
    if backward is None:  # inference: the scores, which a masked token's 0 changes
        out = api.maxsim_masked_as_zero(Qp, Dp, q_mask, d_mask, pairs=pairs)
        want = api.maxsim_masked_as_zero(Qc, Dc, q_mask, d_mask, pairs=pairs)
        assert out.isfinite().all() and torch.equal(out, want)
        own = _reference_of(layout, Qc, Dc, q_mask, d_mask)
        assert not torch.allclose(want, own), "no masked token's 0 won: a weak case"
        return

    def call(q, d):
        return api.maxsim_masked_as_zero(q, d, q_mask, d_mask, pairs=pairs, backward=backward)

    _assert_padding_is_inert(call, (Qp, Dp), (Qc, Dc), (q_mask, d_mask))


def _scored(score, q_mask, d_mask, normalize, pairs):
    kw = {"q_mask": q_mask, "d_mask": d_mask, "normalize": normalize, "pairs": pairs}
    if score == "weighted":
        return lambda q, d, w: variants.maxsim_weighted(q, d, w, **kw)
    if score == "smooth":
        return lambda q, d: variants.maxsim_smooth(q, d, tau=0.3, **kw)
    return lambda q, d: variants.maxsim_topk_mean(q, d, k=3, **kw)


@quiet_numpy
@pytest.mark.parametrize("lik_path, poison", _paths_and_poisons(), indirect=["lik_path"])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("layout", ["dense", "pairs"])
@pytest.mark.parametrize("score", ["weighted", "smooth", "topk_mean"])
def test_padding_never_reaches_a_token_score(score, layout, side, normalize, lik_path, poison):
    """Padded weights follow the rule too: a masked query token's weight is padding."""
    Q, D, weights, q_mask, d_mask = _inputs(layout, side)
    value = POISONS[poison]
    Qp, Qc, Wp, Wc = Q, Q, weights, weights
    if q_mask is not None:
        Qp, Qc = _poison(Q, q_mask, value), _poison(Q, q_mask, 0.0)
        Wp = torch.where(q_mask, weights, value)
        Wc = torch.where(q_mask, weights, 0.0)
    Dp = D if d_mask is None else _poison(D, d_mask, value)
    Dc = D if d_mask is None else _poison(D, d_mask, 0.0)
    call = _scored(score, q_mask, d_mask, normalize, layout == "pairs")
    poisoned, clean, masks = (Qp, Dp, Wp), (Qc, Dc, Wc), (q_mask, d_mask, q_mask)
    n = 3 if score == "weighted" else 2
    _assert_padding_is_inert(call, poisoned[:n], clean[:n], masks[:n])


@pytest.mark.usefixtures("reference_path")
@pytest.mark.parametrize("poison", list(POISONS))
@pytest.mark.parametrize("normalize", [False, True])
def test_padding_never_reaches_the_fused_head(normalize, poison):
    g = torch.Generator().manual_seed(3)
    Q = torch.randn(2, 4, 6, generator=g)
    H = torch.randn(3, 5, 9, generator=g)
    W, b = torch.randn(6, 9, generator=g), torch.randn(6, generator=g)
    d_mask = torch.rand(3, 5, generator=g) < 0.6
    d_mask[:, 0], d_mask[1] = True, False

    def call(q, h, w, bias):
        return maxsim_from_hidden(q, h, w, bias, d_mask, normalize=normalize)

    poisoned = (Q, _poison(H, d_mask, POISONS[poison]), W, b)
    clean = (Q, _poison(H, d_mask, 0.0), W, b)
    _assert_padding_is_inert(call, poisoned, clean, (None, d_mask, None, None))


@pytest.mark.usefixtures("reference_path")
@pytest.mark.parametrize("code", [-7, 1000])
def test_plaid_tokens_past_a_length_reach_no_gradient(code):
    """Codes past a doc's length may be anything: an out-of-range one decodes to NaN,
    which must not reach the score or grad Q."""
    g = torch.Generator().manual_seed(4)
    d, nbits, n_c, Ld = 8, 2, 5, 6
    Q = torch.randn(2, 3, d, generator=g)
    codes = torch.randint(0, n_c, (3, Ld), generator=g)
    residuals = torch.randint(0, 256, (3, Ld, packed_bytes(d, nbits)), generator=g).to(torch.uint8)
    lengths = torch.tensor([6, 2, 4])
    centroids, weights = torch.randn(n_c, d, generator=g), torch.randn(1 << nbits, generator=g)
    past = torch.arange(Ld) >= lengths[:, None]
    garbage = torch.where(past, code, codes)

    def scored(codes_given):
        return lambda q: maxsim_residual(q, codes_given, residuals, lengths, centroids,
                                         weights, nbits)  # fmt: skip

    out, (grad,) = _run(scored(garbage), (Q,))
    want, (want_grad,) = _run(scored(codes), (Q,))
    assert out.isfinite().all() and grad.isfinite().all()
    assert torch.equal(out, want) and torch.equal(grad, want_grad)


@pytest.mark.usefixtures("reference_path")
def test_fp8_padding_never_reaches_a_score():
    """fp8 padding may hold e4m3's NaN pattern, and per-token scales of padding NaN."""
    g = torch.Generator().manual_seed(5)
    Q = torch.randn(2, 4, 16, generator=g).to(torch.float8_e4m3fn)
    D = torch.randn(3, 5, 16, generator=g).to(torch.float8_e4m3fn)
    scale_Q, scale_D = torch.rand(2, 4, generator=g) + 0.5, torch.rand(3, 5, generator=g) + 0.5
    q_mask, d_mask = torch.rand(2, 4, generator=g) < 0.6, torch.rand(3, 5, generator=g) < 0.6
    q_mask[:, 0], d_mask[:, 0], d_mask[1] = True, True, False
    nan8 = torch.tensor(NAN).to(torch.float8_e4m3fn)
    Qp = torch.where(q_mask[..., None], Q, nan8)
    Dp = torch.where(d_mask[..., None], D, nan8)
    out = maxsim_inference_fp8(Qp, Dp, scale_Q=torch.where(q_mask, scale_Q, NAN),
                               scale_D=torch.where(d_mask, scale_D, NAN), q_mask=q_mask,
                               d_mask=d_mask)  # fmt: skip
    want = maxsim_inference_fp8(Q, D, scale_Q=scale_Q, scale_D=scale_D, q_mask=q_mask,
                                d_mask=d_mask)  # fmt: skip
    assert out.isfinite().all() and torch.equal(out, want)


# ---------------------------------------------------------------------------------------
# Non-finite valid values: the rule of the reference docstring, on both CPU paths.

def _issue_example(mask):
    Q = torch.tensor([[[-INF, 0.0], [1.0, 1.0]]])
    D = torch.tensor([[[1.0, 0.5], [2.0, -0.5]]])
    return Q, D, (torch.ones(1, 2, dtype=torch.bool) if mask else None)


def _losing_neg_inf_doc_token(mask):
    """A valid doc token at -inf similarity loses the max: a finite score."""
    Q = torch.tensor([[[1.0, 0.0]]])
    D = torch.tensor([[[-INF, 0.0], [2.0, 1.0]]])
    return Q, D, (torch.ones(1, 2, dtype=torch.bool) if mask else None)


def _pos_inf_query_token(mask):
    Q = torch.tensor([[[INF, 0.0], [1.0, 1.0]]])
    D = torch.tensor([[[1.0, 0.5], [2.0, -0.5]]])
    return Q, D, (torch.ones(1, 2, dtype=torch.bool) if mask else None)


def _neg_inf_row_beside_a_masked_doc(mask):
    """One query token's valid row is all -inf (-inf), the other doc is fully masked (0
    for every query token): the -inf survives the mask of the other doc."""
    Q = torch.tensor([[[-INF, 0.0], [1.0, 1.0]]])
    D = torch.tensor([[[1.0, 0.5], [2.0, -0.5]], [[1.0, 1.0], [1.0, 1.0]]])
    d_mask = torch.tensor([[True, True], [False, False]])
    return Q, D, d_mask


def _fully_masked_doc(mask):
    """No valid doc token adds 0, whatever the padding holds."""
    Q = torch.tensor([[[-INF, 0.0], [1.0, 1.0]]])
    D = torch.tensor([[[1.0, 0.5], [2.0, -0.5]]])
    return Q, D, torch.zeros(1, 2, dtype=torch.bool)


INF_CASES = {
    # case: (builder, whether it passes an all-True d_mask, expected scores)
    "-inf row, no mask": (_issue_example, False, [[-INF]]),
    "-inf row, all-True mask": (_issue_example, True, [[-INF]]),
    "+inf row, all-True mask": (_pos_inf_query_token, True, [[INF]]),
    "losing -inf doc token, no mask": (_losing_neg_inf_doc_token, False, [[2.0]]),
    "losing -inf doc token, all-True mask": (_losing_neg_inf_doc_token, True, [[2.0]]),
    "-inf row beside a fully masked doc": (_neg_inf_row_beside_a_masked_doc, True, [[-INF, 0.0]]),
    "fully masked doc": (_fully_masked_doc, True, [[0.0]]),
}


def _inf_params():
    return [
        pytest.param(path, case, id=f"{path}-{case}")
        for path in ("cpu", "interpreter")
        for case in INF_CASES
    ]


def _expect(out, expected):
    expected = torch.tensor(expected, dtype=torch.float32)
    assert out.shape == expected.shape
    assert torch.equal(out.isnan(), expected.isnan()), f"{out} vs {expected}"
    finite_or_inf = ~expected.isnan()
    assert torch.allclose(out[finite_or_inf], expected[finite_or_inf]), f"{out} vs {expected}"


@quiet_numpy
@pytest.mark.parametrize("lik_path, case", _inf_params(), indirect=["lik_path"])
def test_inf_rule_maxsim(lik_path, case):
    build, mask, expected = INF_CASES[case]
    Q, D, d_mask = build(mask)
    _expect(maxsim(Q, D, d_mask=d_mask), expected)


SCORED_INF_CASES = {
    # score: the issue example's expected score; every token score adds -inf for it
    "smooth": lambda Q, D, m: variants.maxsim_smooth(Q, D, d_mask=m, tau=0.5),
    "topk_mean": lambda Q, D, m: variants.maxsim_topk_mean(Q, D, d_mask=m, k=2),
    "weighted": lambda Q, D, m: variants.maxsim_weighted(Q, D, torch.ones(1, 2), d_mask=m),
}


def _scored_inf_params():
    params = []
    for path in ("cpu", "interpreter"):
        for score in SCORED_INF_CASES:
            for mask in (False, True):
                name = f"{path}-{score}-{'all-True mask' if mask else 'no mask'}"
                params.append(pytest.param(path, score, mask, id=name))
    return params


@quiet_numpy
@pytest.mark.parametrize("lik_path, score, mask", _scored_inf_params(), indirect=["lik_path"])
def test_inf_rule_token_scores(lik_path, score, mask):
    Q, D, d_mask = _issue_example(mask)
    _expect(SCORED_INF_CASES[score](Q, D, d_mask), [[-INF]])


# ---------------------------------------------------------------------------------------
# The inf rule in every layout and loop shape of the kernels: valid rows of -inf, a fully
# masked doc, docs whose first tiles are masked, and NaN padding, against the reference.


def _neg_inf_rows(layout, masked, Ld=37):
    """Q [2, 3, 4] whose token (0, 0) has -inf similarity to every doc token (doc tokens'
    first coordinate is positive); with `masked`, doc 1 is fully masked, doc 2 valid past
    its first 32 tokens only, doc 3 at its last token only, and query token (1, 2) is
    masked; masked tokens hold NaN."""
    g = torch.Generator().manual_seed(12)
    Q = torch.randn(2, 3, 4, generator=g)
    Q[0, 0] = torch.tensor([-INF, 0.0, 0.0, 0.0])
    doc_axes = {"dense": (4,), "kd": (2, 4), "pairs": (2,)}[layout]
    D = torch.randn(*doc_axes, Ld, 4, generator=g)
    D[..., 0] = D[..., 0].abs() + 0.5
    if not masked:
        return Q, D, None, None
    q_mask = torch.ones(2, 3, dtype=torch.bool)
    q_mask[1, 2] = False
    d_mask = torch.ones(*doc_axes, Ld, dtype=torch.bool)
    if layout == "pairs":
        d_mask[1, :32] = False
    else:
        d_mask[..., 1, :] = False
        d_mask[..., 2, :32] = False
        d_mask[..., 3, :-1] = False
    return _poison(Q, q_mask, NAN), _poison(D, d_mask, NAN), q_mask, d_mask


def _reference_of(layout, Q, D, q_mask, d_mask, normalize=False, masked_as_zero=False):
    reference = maxsim_pairs_reference if layout == "pairs" else maxsim_reference
    return reference(Q.double(), D.double(), q_mask, d_mask, normalize=normalize,
                     masked_as_zero=masked_as_zero).float()  # fmt: skip


def _expect_tensor(out, want):
    assert out.shape == want.shape
    assert torch.equal(out.isnan(), want.isnan()), f"{out} vs {want}"
    finite = want.isfinite()
    infinite = want.isinf()
    assert torch.equal(out[infinite], want[infinite]), f"{out} vs {want}"
    assert torch.allclose(out[finite], want[finite], rtol=1e-5, atol=1e-5), f"{out} vs {want}"


# Every loop shape of the streamed dense forward (inference): one loop per doc, docs in a
# row, whole tiles then a tail, token ranges with their reduce, and the flat (doc, tile)
# loop, with docs of two tiles and of one.
DENSE_LOOPS = {
    "per doc": dict(block_l=16),
    "2 docs per program": dict(block_l=16, docs_per_program=2),
    "peeled": dict(block_l=16, peel_tail=True),
    "2 ranges": dict(block_l=16, doc_splits=2),
    "3 ranges, peeled": dict(block_l=16, doc_splits=3, peel_tail=True),
    "flat, 2 tiles a doc": dict(block_l=32, flat_docs=True, docs_per_program=2),
    "flat, 1 tile a doc": dict(block_l=64, flat_docs=True, docs_per_program=3),
}


@quiet_numpy
@pytest.mark.parametrize("masked", [False, True], ids=["no masks", "masks"])
@pytest.mark.parametrize("loop", list(DENSE_LOOPS))
@pytest.mark.usefixtures("interpreter_path")
def test_inf_rule_in_every_dense_loop_shape(loop, masked):
    Q, D, q_mask, d_mask = _neg_inf_rows("dense", masked)
    name = f"maxsim_dense_{'qdmask' if masked else 'nomask'}_fp32_triton"
    module = registry.load(name)
    config = configs.call_config(name, module, Q, Q.shape[1], Q.shape[0])
    config = dataclasses.replace(config, **DENSE_LOOPS[loop])
    out = torch.full((2, 4), 123.0)
    module.launch(out, Q, D, validate.byte_mask(q_mask), validate.byte_mask(d_mask),
                  normalize=False, config=config)  # fmt: skip
    want = _reference_of("dense", Q, D, q_mask, d_mask)
    assert want[0].isinf().any() and (not masked or want[0, 1] == 0)
    _expect_tensor(out, want)


@quiet_numpy
@pytest.mark.parametrize("loop", list(DENSE_LOOPS))
@pytest.mark.usefixtures("interpreter_path")
def test_masked_as_zero_in_every_dense_loop_shape(loop):
    """The doc mask read as zeros in each loop shape: doc 0 has no masked token (its -inf
    row stays -inf), the others have some, so their 0 beats -inf and every negative max."""
    Q, D, q_mask, d_mask = _negative_rows("dense")
    name = "maxsim_dense_qdzeromask_fp32_triton"
    module = registry.load(name)
    config = configs.call_config(name, module, Q, Q.shape[1], Q.shape[0])
    config = dataclasses.replace(config, **DENSE_LOOPS[loop])
    out = torch.full((2, 4), 123.0)
    module.launch(out, Q, D, validate.byte_mask(q_mask), validate.byte_mask(d_mask),
                  config=config)  # fmt: skip
    want = _reference_of("dense", Q, D, q_mask, d_mask, masked_as_zero=True)
    own = _reference_of("dense", Q, D, q_mask, d_mask)
    assert want[0, 0] == -INF and want[0, 1:].isfinite().all()
    assert (want > own).any(), "no masked token's 0 won: a weak case"
    _expect_tensor(out, want)


def _negative_rows(layout):
    """_neg_inf_rows with masks, and query token (1, 0) at a negative similarity to every
    doc token: a doc's masked token (its 0) wins it wherever the doc has one."""
    Q, D, q_mask, d_mask = _neg_inf_rows(layout, True)
    Q[1, 0] = torch.tensor([-1.0, 0.0, 0.0, 0.0])
    return Q, D, q_mask, d_mask


def _zero_entry(layout, backward):
    def call(Q, D, qm, dm):
        out = api.maxsim_masked_as_zero(Q.requires_grad_(backward is not None), D, qm, dm,
                                        pairs=layout == "pairs", backward=backward)  # fmt: skip
        return out.detach()

    return call


ZERO_ENTRIES = {
    f"{layout}{'' if backward is None else f', {backward} training forward'}": (
        layout, _zero_entry(layout, backward))
    for layout in ("dense", "kd", "pairs")
    for backward in (None, "unified", "lowmem")
}  # fmt: skip


@quiet_numpy
@pytest.mark.parametrize("entry", list(ZERO_ENTRIES))
def test_masked_as_zero_in_every_layout(lik_path, entry):
    layout, call = ZERO_ENTRIES[entry]
    Q, D, q_mask, d_mask = _negative_rows(layout)
    want = _reference_of(layout, Q, D, q_mask, d_mask, masked_as_zero=True)
    own = _reference_of(layout, Q, D, q_mask, d_mask)
    assert (want > own).any(), "no masked token's 0 won: a weak case"
    _expect_tensor(call(Q.clone(), D, q_mask, d_mask), want)


ENTRIES = {
    "dense": lambda Q, D, qm, dm: maxsim(Q, D, qm, dm),
    "dense, unified training forward": lambda Q, D, qm, dm: maxsim(
        Q.requires_grad_(), D, qm, dm, backward="unified"
    ).detach(),
    "dense, lowmem training forward": lambda Q, D, qm, dm: maxsim(
        Q.requires_grad_(), D, qm, dm, backward="lowmem"
    ).detach(),
    "kd": lambda Q, D, qm, dm: maxsim(Q, D, qm, dm),
    "kd, lowmem training forward": lambda Q, D, qm, dm: maxsim(
        Q.requires_grad_(), D, qm, dm, backward="lowmem"
    ).detach(),
    "pairs": lambda Q, D, qm, dm: maxsim_pairs(Q, D, qm, dm),
    "pairs, unified training forward": lambda Q, D, qm, dm: maxsim_pairs(
        Q.requires_grad_(), D, qm, dm, backward="unified"
    ).detach(),
}


@quiet_numpy
@pytest.mark.parametrize("masked", [False, True], ids=["no masks", "masks"])
@pytest.mark.parametrize("entry", list(ENTRIES))
def test_inf_rule_in_every_layout(lik_path, entry, masked):
    layout = entry.split(",")[0]
    Q, D, q_mask, d_mask = _neg_inf_rows(layout, masked)
    want = _reference_of(layout, Q, D, q_mask, d_mask)
    assert want.isinf().any()
    _expect_tensor(ENTRIES[entry](Q.clone(), D, q_mask, d_mask), want)


@quiet_numpy
@pytest.mark.parametrize("backward", [None, "unified", "lowmem"])
@pytest.mark.parametrize("layout", ["dense", "kd", "pairs"])
def test_a_normalized_inf_token_against_a_fully_masked_doc_adds_0(lik_path, layout, backward):
    """Normalized, a query token holding inf is NaN: its scores against docs with a valid
    token are NaN, and against a fully masked doc it adds 0 (the kernels scale the max by
    the query's inverse norm, NaN here, after deciding which tokens count)."""
    Q, D, q_mask, d_mask = _neg_inf_rows(layout, True)
    Q[0, 0] = torch.tensor([INF, 0.0, 0.0, 0.0])
    if layout == "pairs":
        d_mask[0] = False
        D = _poison(D, d_mask, NAN)
    entry = maxsim_pairs if layout == "pairs" else maxsim
    out = entry(Q.requires_grad_(backward is not None), D, q_mask, d_mask, normalize=True,
                backward=backward)  # fmt: skip
    want = _reference_of(layout, Q.detach(), D, q_mask, d_mask, normalize=True)
    assert (want[0] == 0).any() and (layout == "pairs" or want[0].isnan().any())
    _expect_tensor(out.detach(), want)


@quiet_numpy
@pytest.mark.parametrize("masked", [False, True], ids=["no masks", "masks"])
def test_inf_rule_in_retrieval(lik_path, masked, monkeypatch):
    """The top-k epilogue ranks a -inf score last and a fully masked doc's 0 as a 0."""
    monkeypatch.setattr(retrieval, "TOPK_EPILOGUE_MIN_SCORES", 1)  # the epilogue, small
    Q, D, q_mask, d_mask = _neg_inf_rows("dense", masked)
    scores, ids = retrieve(Q, D, 4, q_mask, d_mask, normalize=False)
    want = _reference_of("dense", Q, D, q_mask, d_mask)
    _expect_tensor(scores, want.gather(1, ids))
    _expect_tensor(scores, want.sort(dim=1, descending=True, stable=True).values)


@quiet_numpy
def test_inf_rule_in_ragged_layouts(lik_path):
    """Packed sequences: a valid -inf row adds -inf, an empty doc 0 (by its length)."""
    Q, D, _, _ = _neg_inf_rows("dense", False, Ld=5)
    Q_packed, D_packed = Q.reshape(6, 4), torch.cat([D[0], D[1, :0], D[2]])
    cu_q = torch.tensor([0, 3, 6], dtype=torch.int32)
    cu_d = torch.tensor([0, 5, 5, 10], dtype=torch.int32)
    empty_doc = torch.tensor([[True] * 5, [False] * 5, [True] * 5])
    want = maxsim_reference(Q.double(), D[:3].double(), d_mask=empty_doc).float()
    _expect_tensor(maxsim_varlen(Q_packed, D_packed, cu_q, cu_d, max_seqlen_q=3), want)
    pairs = torch.tensor([0, 0, 1, 0]), torch.tensor([0, 1, 2, 2])
    out = score_pairs_packed(Q_packed, D_packed, cu_q, cu_d, *pairs, max_seqlen_q=3)
    _expect_tensor(out, want[pairs])


@quiet_numpy
@pytest.mark.parametrize("masked", [False, True], ids=["no masks", "masks"])
@pytest.mark.parametrize("pairs", [False, True], ids=["dense", "pairs"])
@pytest.mark.parametrize("score", ["weighted", "smooth", "topk_mean"])
def test_inf_rule_in_token_score_layouts(lik_path, score, pairs, masked):
    """Every token score adds -inf for a valid row of -inf similarities and 0 for a query
    token with no valid doc token (a fully masked doc, or masked first tiles and a valid
    token after them)."""
    layout = "pairs" if pairs else "dense"
    Q, D, q_mask, d_mask = _neg_inf_rows(layout, masked)
    weights = torch.rand(2, 3, generator=torch.Generator().manual_seed(3)) + 0.5
    call = _scored(score, q_mask, d_mask, False, pairs)
    out = call(Q, D, weights) if score == "weighted" else call(Q, D)
    want = maxsim_scored_reference(Q.double(), D.double(), q_mask, d_mask, score=score,
                                   weights=weights if score == "weighted" else None, tau=0.3,
                                   k=3, pairs=pairs)  # fmt: skip
    assert want.isinf().any()
    _expect_tensor(out, want.float())


@quiet_numpy
@pytest.mark.parametrize("masked", [True, False], ids=["masked", "valid"])
@pytest.mark.parametrize("pairs", [False, True], ids=["dense", "pairs"])
@pytest.mark.parametrize("score", ["weighted", "smooth", "topk_mean"])
def test_a_nan_query_token_against_long_docs(lik_path, score, pairs, masked):
    """A query token of NaN against docs of 40 tokens: masked, the scores are those of a
    zero token there; valid, its query's scores are NaN and no other. (The interpreter
    takes tl.max's index with np.nanargmax, which raised 'All-NaN slice encountered' on
    such a row once a doc had 32 tokens.)"""
    g = torch.Generator().manual_seed(6)
    Q, D = torch.randn(2, 4, 8, generator=g), torch.randn(2, 40, 8, generator=g)
    Q[0, 1] = NAN
    weights = torch.rand(2, 4, generator=g) + 0.5
    q_mask = torch.ones(2, 4, dtype=torch.bool)
    q_mask[0, 1] = not masked
    call = _scored(score, q_mask, None, False, pairs)
    args = (weights,) if score == "weighted" else ()
    out = call(Q, D, *args)
    if masked:
        assert torch.equal(out, call(_poison(Q, q_mask, 0.0), D, *args))
    else:
        assert out[0].isnan().all() and out[1].isfinite().all()


@quiet_numpy
@pytest.mark.parametrize("train", [False, True], ids=["inference", "training forward"])
@pytest.mark.parametrize("mask", ["none", "all-True", "one doc masked"])
def test_inf_rule_in_the_fused_head(lik_path, mask, train):
    """The fused head's reduce: a valid row of -inf similarities adds -inf (the projected
    doc tokens' first coordinate is large), a fully masked doc 0; and a NaN query token
    against 40-token docs scores NaN, not an interpreter error."""
    g = torch.Generator().manual_seed(1)
    Q, H = torch.randn(3, 3, 4, generator=g), torch.randn(3, 40, 6, generator=g)
    W, b = torch.randn(4, 6, generator=g), torch.zeros(4)
    b[0] = 100.0
    Q[0, 0] = torch.tensor([-INF, 0.0, 0.0, 0.0])
    Q[2, 1] = NAN
    d_mask = None if mask == "none" else torch.ones(3, 40, dtype=torch.bool)
    if mask == "one doc masked":
        d_mask[1] = False
    out = maxsim_from_hidden(Q.requires_grad_(train), H, W, b, d_mask, normalize=False)
    want = maxsim_from_hidden_reference(Q.detach().double(), H.double(), W.double(),
                                        b.double(), d_mask, normalize=False).float()  # fmt: skip
    assert want[0].isinf().any() and want[2].isnan().any()
    _expect_tensor(out.detach(), want)
