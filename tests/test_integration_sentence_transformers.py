"""Sentence Transformers 6 integration: with lik routing on, util.similarity's maxsim,
maxsim_pairwise and their mean_ variants, the multi-vector scoring functions and the four
multi-vector losses give ST's own numbers and input gradients; what lik does not take goes
to ST unchanged; disable() puts the originals back by identity.

It needs sentence-transformers 6, which PyLate 1.6 (pinned at ST 5.3 in the main
environment) cannot share: `make test` installs the pinned ST 6 release into its own
folder and runs this file with that folder first on the path (see the Makefile). In the
main environment it is skipped.

Inputs: random fp32 tokens whose query and doc tokens lean apart, so most similarities are
negative and padding would win a max if it competed as 0; masks with holes; a doc with
nothing to score; ragged lists with an empty item. Paths: the CPU reference and the
generated kernels under the interpreter (tiny shapes).
"""

from __future__ import annotations

import sys
import warnings

import numpy as np
import pytest
import torch

st = pytest.importorskip("sentence_transformers", minversion="6")

from sentence_transformers.multi_vector_encoder import losses as st_losses  # noqa: E402
from sentence_transformers.multi_vector_encoder import scoring  # noqa: E402
from sentence_transformers.multi_vector_encoder.scoring import colbert  # noqa: E402
from sentence_transformers.util import similarity  # noqa: E402

from lik import integrations, runtime  # noqa: E402
from lik.integrations import sentence_transformers as lik_st  # noqa: E402
from lik.runtime import backends, norm_warning, variants  # noqa: E402

FP32 = {"rtol": 1e-5, "atol": 1e-5}
ORIGINALS = {
    "maxsim": similarity.maxsim,
    "maxsim_pairwise": similarity.maxsim_pairwise,
    "colbert_scores": colbert.colbert_scores,
    "colbert_kd_scores": colbert.colbert_kd_scores,
}
HAS_KERNEL = integrations.has_kernel
ENTRY_POINTS = (
    (runtime, "maxsim"), (runtime, "maxsim_pairs"), (runtime, "maxsim_varlen"),
    (runtime, "score_pairs_packed"), (variants, "maxsim_weighted"),
)  # fmt: skip
EMPTY = -1e9

# Sizes: small enough for the interpreter.
NA, NB, LQ, LD, DIM = 3, 4, 5, 7, 16


@pytest.fixture(autouse=True)
def integration_off_afterwards():
    yield
    lik_st.disable()


@pytest.fixture(autouse=True)
def reference_path_counts_as_a_kernel(monkeypatch):
    """The adapters are compared on the CPU reference path as well as under the
    interpreter. Outside tests the integration leaves CPU calls without the interpreter
    to ST (test_a_cpu_without_the_interpreter_stays_with_st)."""
    monkeypatch.setattr(integrations, "has_kernel", lambda device: device.type in ("cpu", "cuda"))


@pytest.fixture
def lik_calls(monkeypatch):
    """Names of the lik entry points that returned scores (empty: ST answered alone)."""
    calls = []
    for module, name in ENTRY_POINTS:
        real = getattr(module, name)

        def recording(*args, _real=real, _name=name, **kwargs):
            out = _real(*args, **kwargs)
            calls.append(_name)
            return out

        monkeypatch.setattr(module, name, recording)
    return calls


def _g(seed=0):
    return torch.Generator().manual_seed(seed)


def _tokens(*shape, generator, lean):
    """Unit tokens leaning along axis 0: queries one way, docs the other, so most
    similarities are negative."""
    tokens = torch.randn(*shape, generator=generator)
    tokens[..., 0] += 2.0 * lean
    return torch.nn.functional.normalize(tokens, dim=-1)


def _queries(*shape, generator):
    return _tokens(*shape, generator=generator, lean=1.0)


def _docs(*shape, generator):
    return _tokens(*shape, generator=generator, lean=-1.0)


def _holes(*shape, generator, empty_last=True):
    """A mask with holes (a skiplist's), the first row full, the last fully masked."""
    mask = torch.rand(*shape, generator=generator) < 0.6
    rows = mask.view(-1, shape[-1])
    rows[0] = True
    if empty_last:
        rows[-1] = False
    return mask


def _zero_padded(tokens, generator):
    """Trailing all-zero rows (padding ST infers without a mask), one item all zeros."""
    rows = tokens.view(-1, *tokens.shape[-2:])
    lengths = torch.randint(1, tokens.shape[-2] + 1, (rows.shape[0],), generator=generator)
    lengths[0] = tokens.shape[-2]
    rows[torch.arange(tokens.shape[-2]) >= lengths[:, None]] = 0
    rows[-1] = 0
    return tokens


def _leaves(tensors):
    out = []
    for t in tensors:
        if isinstance(t, list):
            out.append([x.clone().requires_grad_() for x in t])
        else:
            out.append(t.clone().requires_grad_())
    return out


def _grads(leaves):
    grads = []
    for leaf in leaves:
        grads.extend(x.grad for x in (leaf if isinstance(leaf, list) else [leaf]))
    return grads


def _run(call, tensors, seed=1):
    leaves = _leaves(tensors)
    out = call(*leaves)
    weights = torch.randn(out.shape, generator=_g(seed))
    real = out.detach() > EMPTY / 2  # -1e9 entries carry no gradient either way
    (out * weights * real).sum().backward()
    return out.detach(), _grads(leaves)


def _compare(call, tensors):
    """Scores and input gradients of call with routing on, against ST alone."""
    expected = _run(call, tensors)
    with lik_st.enabled():
        actual = _run(call, tensors)
    (out, grads), (ref, ref_grads) = actual, expected
    assert out.dtype == ref.dtype == torch.float32
    torch.testing.assert_close(out, ref, **FP32)
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        if ref_grad is None:
            assert grad is None or not grad.any()
        else:
            torch.testing.assert_close(grad, ref_grad, **FP32)
    return out


MASKS = ["zero-row padding, no masks", "bool masks with holes", "long masks",
         "float query weights"]  # fmt: skip


def _padded_inputs(mask_kind, pairs, seed=0):
    g = _g(seed)
    nb = NA if pairs else NB
    a, b = _queries(NA, LQ, DIM, generator=g), _docs(nb, LD, DIM, generator=g)
    if mask_kind == "zero-row padding, no masks":
        return _zero_padded(a, g), _zero_padded(b, g), None, None
    a_mask = _holes(NA, LQ, generator=g, empty_last=False)
    b_mask = _holes(nb, LD, generator=g)
    if mask_kind == "long masks":
        return a, b, a_mask.long(), b_mask.long()
    if mask_kind == "float query weights":
        return a, b, a_mask * torch.rand(NA, LQ, generator=g), b_mask.float()
    return a, b, a_mask, b_mask


@pytest.mark.parametrize("length_normalize", [False, True])
@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("name", ["maxsim", "maxsim_pairwise"])
def test_padded_tensors(lik_path, lik_calls, name, mask_kind, length_normalize):
    pairs = name == "maxsim_pairwise"
    a, b, a_mask, b_mask = _padded_inputs(mask_kind, pairs)

    def call(a, b):
        fn = getattr(similarity, name)
        return fn(a, b, a_mask=a_mask, b_mask=b_mask, length_normalize=length_normalize)

    out = _compare(call, [a, b])
    assert (out[..., -1] < -1e7).all(), "the last doc has nothing to score: -1e9"
    weighted = mask_kind == "float query weights"
    assert lik_calls == [
        "maxsim_weighted" if weighted else ("maxsim_pairs" if pairs else "maxsim")
    ]


@pytest.mark.parametrize("name", ["mean_maxsim", "mean_maxsim_pairwise"])
def test_mean_variants(lik_path, lik_calls, name):
    pairs = name == "mean_maxsim_pairwise"
    a, b, a_mask, b_mask = _padded_inputs("bool masks with holes", pairs, seed=1)
    out = _compare(lambda a, b: getattr(similarity, name)(a, b, a_mask, b_mask), [a, b])
    assert (out[..., -1] < -1e7).all()
    assert lik_calls == ["maxsim_pairs" if pairs else "maxsim"]


def _ragged(lengths, generator, lean):
    return [_tokens(n, DIM, generator=generator, lean=lean) for n in lengths]


@pytest.mark.parametrize("length_normalize", [False, True])
@pytest.mark.parametrize("name", ["maxsim", "maxsim_pairwise"])
def test_ragged_lists_go_through_the_packed_path(lik_path, lik_calls, name, length_normalize):
    pairs = name == "maxsim_pairwise"
    g = _g(2)
    a = _ragged([3, 5, 1], g, 1.0)
    b = _ragged([4, 0, 6] if pairs else [4, 0, 6, 2], g, -1.0)  # an empty doc: -1e9

    def call(a, b):
        return getattr(similarity, name)(a, b, length_normalize=length_normalize)

    out = _compare(call, [a, b])
    assert (out[..., 1] < -1e7).all()
    assert lik_calls == ["score_pairs_packed" if pairs else "maxsim_varlen"]


def test_ragged_lists_with_masks_are_padded_on_their_device(lik_path, lik_calls):
    g = _g(3)
    a, b = _ragged([3, 5, 2], g, 1.0), _ragged([4, 6, 2, 5], g, -1.0)
    a_mask = _holes(3, 5, generator=g, empty_last=False)
    b_mask = _holes(4, 6, generator=g)
    _compare(lambda a, b: similarity.maxsim(a, b, a_mask, b_mask), [a, b])
    assert lik_calls == ["maxsim"]


def test_negative_similarities_survive_padding(lik_path):
    """A doc whose real tokens all score below 0 keeps its negative score: padding (zero
    rows, or masked tokens) never wins the max."""
    g = _g(4)
    positive = torch.randn(1, 3, DIM, generator=g).abs()
    a = torch.nn.functional.normalize(positive, dim=-1)  # every component positive
    b = -torch.nn.functional.normalize(torch.rand(2, 4, DIM, generator=g), dim=-1)
    b[0, 2:] = 0  # zero-row padding, inferred without a mask: every real similarity < 0
    mask = torch.tensor([[True, True, False, False], [True, True, False, False]])
    for call in (lambda: similarity.maxsim(a, b), lambda: similarity.maxsim(a, b, b_mask=mask),
                 lambda: similarity.maxsim_pairwise(a.expand(2, -1, -1), b, b_mask=mask),
                 lambda: similarity.maxsim([a[0]], [b[0, :2], b[1, :2]])):  # fmt: skip
        expected = call()
        with lik_st.enabled():
            actual = call()
        torch.testing.assert_close(actual, expected, **FP32)
        assert (actual < 0).all()


def test_a_doc_with_nothing_to_score_gives_minus_1e9(lik_path, lik_calls):
    g = _g(5)
    a = _queries(2, 3, DIM, generator=g)
    b = _docs(3, 4, DIM, generator=g)
    b_mask = torch.ones(3, 4, dtype=torch.bool)
    b_mask[1] = False
    zeroed = b.clone()
    zeroed[2] = 0
    D4 = b.view(3, 1, 4, DIM).expand(3, 2, 4, DIM).contiguous()
    m4 = b_mask.view(3, 1, 4).expand(3, 2, 4).contiguous()
    cases = {
        "masked out": lambda: similarity.maxsim(a, b, b_mask=b_mask)[:, 1],
        "all-zero rows": lambda: similarity.maxsim(a, zeroed)[:, 2],
        "an empty list item": lambda: similarity.maxsim(list(a), [b[0], b[1, :0]])[:, 1],
        "pairwise": lambda: similarity.maxsim_pairwise(a, b[:2], b_mask=b_mask[:2])[1],
        "colbert_scores": lambda: colbert.colbert_scores(a, D4[:2], None, m4[:2])[:, 2:],
        "colbert_kd_scores": lambda: colbert.colbert_kd_scores(a, D4[:2], None, m4[:2])[1],
    }
    for case, call in cases.items():
        expected = call()
        with lik_st.enabled():
            actual = call()
        assert (expected == EMPTY).all(), case
        assert (actual == EMPTY).all(), case
    assert len(lik_calls) == len(cases)


@pytest.mark.parametrize("length_normalize", [False, True])
@pytest.mark.parametrize("with_masks", [True, False])
def test_colbert_scores_is_one_in_batch_launch(lik_path, lik_calls, with_masks, length_normalize):
    g = _g(6)
    Q, D = _queries(NA, LQ, DIM, generator=g), _docs(2, 3, LD, DIM, generator=g)
    q_mask = _holes(NA, LQ, generator=g, empty_last=False) if with_masks else None
    d_mask = _holes(2, 3, LD, generator=g) if with_masks else None
    if not with_masks:
        _zero_padded(Q, g), _zero_padded(D, g)

    def call(Q, D):
        return colbert.colbert_scores(Q, D, q_mask, d_mask, length_normalize=length_normalize)

    out = _compare(call, [Q, D])
    assert out.shape == (NA, 6)
    assert lik_calls == ["maxsim"]  # ST loops over the 3 document slots


@pytest.mark.parametrize("length_normalize", [False, True])
@pytest.mark.parametrize("with_masks", [True, False])
def test_colbert_kd_scores_is_one_kd_launch(lik_path, lik_calls, with_masks, length_normalize):
    g = _g(7)
    Q, D = _queries(NA, LQ, DIM, generator=g), _docs(NA, 3, LD, DIM, generator=g)
    q_mask = _holes(NA, LQ, generator=g, empty_last=False) if with_masks else None
    d_mask = _holes(NA, 3, LD, generator=g) if with_masks else None
    if not with_masks:
        _zero_padded(Q, g), _zero_padded(D, g)

    def call(Q, D):
        return colbert.colbert_kd_scores(Q, D, q_mask, d_mask, length_normalize=length_normalize)

    out = _compare(call, [Q, D])
    assert out.shape == (NA, 3)
    assert lik_calls == ["maxsim"]  # ST loops over the 3 candidates


@pytest.mark.parametrize("name", ["mean_colbert_scores", "mean_colbert_kd_scores",
                                  "colbert_scores_pairwise", "mean_colbert_scores_pairwise"])
def test_other_scoring_functions(lik_path, lik_calls, name):
    g = _g(8)
    Q = _queries(NA, LQ, DIM, generator=g)
    q_mask = _holes(NA, LQ, generator=g, empty_last=False)
    pairwise = name.endswith("pairwise")
    shape = (NA, LD) if pairwise else (NA, 2, LD)
    D, d_mask = _docs(*shape, DIM, generator=g), _holes(*shape, generator=g)
    _compare(lambda Q, D: getattr(scoring, name)(Q, D, q_mask, d_mask), [Q, D])
    assert lik_calls == ["maxsim_pairs" if pairwise else "maxsim"]


def test_similarity_function_names(lik_path, lik_calls):
    g = _g(9)
    a, b = _ragged([3, 4], g, 1.0), _ragged([5, 2, 3], g, -1.0)
    to_fn = similarity.SimilarityFunction.to_similarity_fn  # resolves the name per call
    for name in ("maxsim", "meanmaxsim"):
        _compare(lambda a, b, name=name: to_fn(name)(a, b), [a, b])
    assert lik_calls == ["maxsim_varlen", "maxsim_varlen"]


@pytest.mark.parametrize("fn_name", ["maxsim", "meanmaxsim"])
@pytest.mark.parametrize("method", ["similarity", "similarity_pairwise"])
def test_a_model_loaded_before_enable_scores_through_lik(lik_path, lik_calls, method, fn_name):
    """MultiVectorEncoder holds the function its similarity_fn_name named when set: the
    class's methods are routed, so a model made before enable() reaches lik as well."""
    from types import SimpleNamespace

    from sentence_transformers.multi_vector_encoder.model import MultiVectorEncoder

    pairwise = method == "similarity_pairwise"
    model = SimpleNamespace(similarity_fn_name=fn_name)  # its state, set before enabling
    model._similarity = similarity.SimilarityFunction.to_similarity_fn(fn_name)
    model._similarity_pairwise = similarity.SimilarityFunction.to_similarity_pairwise_fn(fn_name)
    g = _g(15)
    a, b = _ragged([3, 4, 2], g, 1.0), _ragged([5, 2, 3] if pairwise else [5, 2], g, -1.0)
    _compare(lambda a, b: getattr(MultiVectorEncoder, method)(model, a, b), [a, b])
    assert lik_calls == ["score_pairs_packed" if pairwise else "maxsim_varlen"]


# Losses, through a stand-in model: token ids -> rows of a learnable table, a scoring mask
# with holes (a skiplist id), as MultiVectorMask writes it into attention_mask.
QUERY_WORDS, DOC_WORDS, PAD_ID, SKIP_ID = range(1, 20), range(20, 40), 0, 27


class TokenTable(torch.nn.Module):
    def __init__(self):
        super().__init__()
        table = torch.randn(DOC_WORDS.stop, DIM, generator=_g(10))
        table[QUERY_WORDS.start : QUERY_WORDS.stop, 0] += 2.0
        table[DOC_WORDS.start : DOC_WORDS.stop, 0] -= 2.0
        self.table = torch.nn.Parameter(torch.nn.functional.normalize(table, dim=-1))

    def forward(self, features, task=None):
        ids = features["input_ids"]
        mask = features["attention_mask"].bool() & (ids != SKIP_ID)
        tokens = self.table[ids] * features["attention_mask"].unsqueeze(-1)
        return {**features, "token_embeddings": tokens, "attention_mask": mask}


def _features(batch, length, generator, words=DOC_WORDS):
    ids = torch.randint(words.start, words.stop, (batch, length), generator=generator)
    ids[ids % 5 == 0] = SKIP_ID
    lengths = torch.randint(2, length + 1, (batch,), generator=generator)
    lengths[0] = length
    attention = (torch.arange(length) < lengths[:, None]).long()
    return {"input_ids": ids * attention + PAD_ID * (1 - attention), "attention_mask": attention}


def _loss_and_grad(make_loss, features, labels):
    model = TokenTable()
    loss = make_loss(model)(features, labels)
    loss.backward()
    return loss.detach(), model.table.grad


LOSSES = {
    "MultiVectorMultipleNegativesRankingLoss": (
        lambda m: st_losses.MultiVectorMultipleNegativesRankingLoss(m, score_mini_batch_size=2),
        3, None, ["maxsim", "maxsim"]),  # two query chunks, each one launch
    "CachedMultiVectorMultipleNegativesRankingLoss": (
        lambda m: st_losses.CachedMultiVectorMultipleNegativesRankingLoss(m, mini_batch_size=2),
        3, None, ["maxsim", "maxsim"]),
    "MultiVectorDistillKLDivLoss": (
        lambda m: st_losses.MultiVectorDistillKLDivLoss(m), 3, "scores", ["maxsim"]),
    "MultiVectorMarginMSELoss": (
        lambda m: st_losses.MultiVectorMarginMSELoss(m), 3, "margins",
        ["maxsim_pairs", "maxsim_pairs"]),
}  # fmt: skip


@pytest.mark.parametrize("name", list(LOSSES))
def test_losses(lik_path, lik_calls, name):
    make_loss, columns, label_kind, calls = LOSSES[name]
    g = _g(11)
    features = [_features(3, 6, g, QUERY_WORDS)] + [_features(3, 8, g) for _ in range(columns - 1)]
    labels = None
    if label_kind == "scores":
        labels = torch.randn(3, columns - 1, generator=g)
    elif label_kind == "margins":
        labels = torch.randn(3, columns - 2, generator=g)
    expected = _loss_and_grad(make_loss, features, labels)
    with lik_st.enabled():
        actual = _loss_and_grad(make_loss, features, labels)  # built inside: the twin default
    torch.testing.assert_close(actual[0], expected[0], **FP32)
    torch.testing.assert_close(actual[1], expected[1], **FP32)
    assert lik_calls == calls


def test_a_loss_built_before_enable_keeps_st_scoring(lik_calls):
    loss = st_losses.MultiVectorDistillKLDivLoss(TokenTable())
    assert loss.similarity_fct is ORIGINALS["colbert_kd_scores"]
    with lik_st.enabled():
        built = st_losses.MultiVectorDistillKLDivLoss(TokenTable())
        assert built.similarity_fct.__wrapped__ is ORIGINALS["colbert_kd_scores"]
        assert built.get_config_dict()["similarity_fct"] == "colbert_kd_scores"


# Every argument kind ST's maxsim family takes: who answers it with the integration on.
LIK, ORIGINAL = "lik", "original"


def _table():
    g = _g(12)
    a, b = _queries(2, 3, DIM, generator=g), _docs(3, 4, DIM, generator=g)
    am, bm = _holes(2, 3, generator=g, empty_last=False), _holes(3, 4, generator=g)
    la, lb = list(a), list(b)
    S, C = similarity, colbert
    half = {"tolerance": 2e-2}
    D4, m4 = b.view(3, 1, 4, DIM).repeat(1, 2, 1, 1), bm.view(3, 1, 4).repeat(1, 2, 1)
    wide = torch.randn(2, 5, 520, generator=g)
    return {
        "tensors": (lambda: S.maxsim(a, b), LIK),
        "bool masks": (lambda: S.maxsim(a, b, am, bm), LIK),
        "int32 masks": (lambda: S.maxsim(a, b, am.int(), bm.int()), LIK),
        "float masks": (lambda: S.maxsim(a, b, am.float(), bm.float()), LIK),
        "fp16 masks": (lambda: S.maxsim(a, b, am.half(), bm.half()), LIK),
        "float64 query mask": (lambda: S.maxsim(a, b, am.double(), bm), ORIGINAL),
        "float64 doc mask": (lambda: S.maxsim(a, b, am, bm.double()), LIK),
        "mask [Ld], broadcast": (lambda: S.maxsim(a, b, None, bm[0]), LIK),
        "mask [1, Ld], broadcast": (lambda: S.maxsim(a, b, None, bm[:1]), LIK),
        "pairwise mask [1, Ld]": (lambda: S.maxsim_pairwise(a, b[:2], None, bm[:1]), ORIGINAL),
        "masks as lists": (lambda: S.maxsim(a, b, list(am), list(bm)), ORIGINAL),
        "masks as arrays": (lambda: S.maxsim(a, b, am.numpy(), bm.numpy()), ORIGINAL),
        "a mask of another width": (lambda: S.maxsim(a, b, None, bm[:, :3]), ORIGINAL),
        "fp16": (lambda: S.maxsim(a.half(), b.half(), am, bm), LIK, half),
        "bf16": (lambda: S.maxsim(a.bfloat16(), b.bfloat16(), am, bm), LIK, half),
        "float64": (lambda: S.maxsim(a.double(), b.double()), ORIGINAL),
        "mixed dtypes": (lambda: S.maxsim(a, b.half()), ORIGINAL),
        "integer (quantized) embeddings": (
            lambda: S.maxsim((a * 100).round().to(torch.int8), (b * 100).to(torch.int8)),
            ORIGINAL),
        "numpy": (lambda: S.maxsim(a.numpy(), b.numpy()), ORIGINAL),
        "lists of numpy": (lambda: S.maxsim([x.numpy() for x in la], lb), ORIGINAL),
        "lists of tensors": (lambda: S.maxsim(la, lb), LIK),
        "a list against a tensor": (lambda: S.maxsim(la, b, None, bm), LIK),
        "2D inputs (one item each)": (lambda: S.maxsim(a[0], b[0], am[0], bm[0]), LIK),
        "head dim 1": (lambda: S.maxsim(a[..., :1], b[..., :1], am, bm), LIK),
        "head dim 3": (lambda: S.maxsim(a[..., :3], b[..., :3]), LIK),
        "head dim 520": (lambda: S.maxsim(wide[:, :2], wide[:, 2:]), ORIGINAL),
        "head dims differ": (lambda: S.maxsim(a, b[..., :8]), ORIGINAL),
        "no queries": (lambda: S.maxsim(a[:0], b), ORIGINAL),
        "no docs (empty list)": (lambda: S.maxsim(a, []), ORIGINAL),
        "zero-width docs": (lambda: S.maxsim(a, b[:, :0]), ORIGINAL),
        "only empty list items": (lambda: S.maxsim(la, [b[0, :0]]), ORIGINAL),
        "chunk_elements": (lambda: S.maxsim(a, b, am, bm, chunk_elements=50), LIK),
        "device='cpu'": (lambda: S.maxsim(a, b, device="cpu"), LIK),
        "device=torch.device('cpu')": (lambda: S.maxsim(a, b, device=torch.device("cpu")), LIK),
        "length_normalize": (lambda: S.maxsim(a, b, am, bm, length_normalize=True), LIK),
        "pairwise, unequal batches": (lambda: S.maxsim_pairwise(a, b), ORIGINAL),
        "pairwise, lists": (lambda: S.maxsim_pairwise(la, lb[:2]), LIK),
        "pairwise, no pairs": (lambda: S.maxsim_pairwise(a[:0], b[:0]), ORIGINAL),
        "colbert_scores, lists (ST stacks them; its loop calls the routed maxsim)": (
            lambda: C.colbert_scores(la, [D4[0], D4[1]]), LIK),
        "colbert_scores, float64": (lambda: C.colbert_scores(a.double(), D4.double()), ORIGINAL),
        "colbert_kd_scores, float query weights (ST's loop over the routed pairwise)": (
            lambda: C.colbert_kd_scores(a, D4[:2], am * 0.5, m4[:2]), LIK),
        "colbert_kd_scores, float64": (
            lambda: C.colbert_kd_scores(a.double(), D4[:2].double()), ORIGINAL),
        "colbert_kd_scores, fp16": (
            lambda: C.colbert_kd_scores(a.half(), D4[:2].half(), am, m4[:2]), LIK, half),
    }  # fmt: skip


@pytest.mark.parametrize("row", list(_table()))
def test_input_table(lik_calls, monkeypatch, row):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if backends.device_backend(torch.device("cpu")) != "interpreter":
        pytest.skip("the table runs CPU tensors under the Triton interpreter")
    call, expected, *options = _table()[row]
    tolerance = options[0]["tolerance"] if options else 1e-5

    def outcome():
        try:
            return call(), None
        except Exception as error:
            return None, type(error)

    plain, plain_error = outcome()
    with lik_st.enabled():
        routed, routed_error = outcome()
    who = LIK if lik_calls else ORIGINAL
    assert who == expected, f"answered by {who} ({lik_calls}), the table says {expected}"
    assert routed_error == plain_error
    if plain_error is None:
        assert routed.dtype == plain.dtype and routed.shape == plain.shape
        exact = who == ORIGINAL
        torch.testing.assert_close(routed, plain, rtol=0 if exact else tolerance,
                                   atol=0 if exact else tolerance)  # fmt: skip


def test_nothing_of_lik_is_warned(monkeypatch, lik_calls):
    monkeypatch.delenv(norm_warning.ENV, raising=False)
    norm_warning._reset()
    g = _g(13)
    a, b = torch.randn(2, 3, DIM, generator=g) * 3, torch.randn(3, 4, DIM, generator=g) * 3
    D4 = b.view(3, 1, 4, DIM).repeat(1, 2, 1, 1)
    try:
        with lik_st.enabled(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                similarity.maxsim(a, b)
                similarity.maxsim_pairwise(a, b[:2])
                similarity.maxsim(list(a), list(b))
                colbert.colbert_scores(a, D4)
                colbert.colbert_kd_scores(a, D4[:2])
        assert [str(w.message) for w in caught if str(w.message).startswith("lik")] == []
        assert len(lik_calls) == 10
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            runtime.maxsim(a, b)  # the process's own calls are still checked
        assert any("look unnormalized" in str(w.message) for w in caught)
    finally:
        norm_warning._reset()


@pytest.mark.parametrize("interpret", ["0", "1"])
def test_a_cpu_without_the_interpreter_stays_with_st(lik_calls, monkeypatch, interpret):
    monkeypatch.setattr(integrations, "has_kernel", HAS_KERNEL)
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    if interpret == "1" and backends.device_backend(torch.device("cpu")) != "interpreter":
        pytest.skip("no interpreter here")
    g = _g(14)
    a, b = _queries(2, 3, DIM, generator=g).bfloat16(), _docs(3, 4, DIM, generator=g).bfloat16()
    expected = similarity.maxsim(a, b)
    with lik_st.enabled():
        actual = similarity.maxsim(a, b)
    if interpret == "0":
        assert lik_calls == []
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    else:
        assert lik_calls == ["maxsim"]
        torch.testing.assert_close(actual, expected, rtol=2e-2, atol=2e-2)


def test_lik_disable(lik_calls, monkeypatch):
    a, b = torch.randn(2, 3, 8), torch.randn(3, 4, 8)
    lik_st.enable()
    monkeypatch.setenv("LIK_DISABLE", "1")  # read on every call
    similarity.maxsim(a, b)
    colbert.colbert_kd_scores(a, b[:2, None])
    assert lik_calls == []
    monkeypatch.delenv("LIK_DISABLE")
    similarity.maxsim(a, b)
    assert lik_calls == ["maxsim"]


def _st_holders():
    """Every (module, name) in ST that holds one of the original functions."""
    return [
        (module, name)
        for module_name, module in list(sys.modules.items())
        if module_name.startswith("sentence_transformers")
        for name, value in vars(module).items()
        if any(value is original for original in ORIGINALS.values())
    ]


def test_enable_and_disable_swap_by_identity():
    from sentence_transformers.multi_vector_encoder.losses import distill_kl_div
    from sentence_transformers.multi_vector_encoder.model import MultiVectorEncoder

    methods = {name: vars(MultiVectorEncoder)[name]
               for name in ("similarity", "similarity_pairwise")}  # fmt: skip
    holders = _st_holders()
    assert (similarity, "maxsim") in holders and (scoring, "colbert_scores") in holders
    assert (distill_kl_div, "colbert_kd_scores") in holders
    lik_st.enable()
    lik_st.enable()  # idempotent
    assert lik_st.is_enabled()
    for module, name in holders:
        twin = getattr(module, name)
        assert twin is not ORIGINALS[name] and twin.__wrapped__ is ORIGINALS[name]
    for name, method in methods.items():
        assert vars(MultiVectorEncoder)[name].__wrapped__ is method
    lik_st.disable()
    for module, name in holders:
        assert getattr(module, name) is ORIGINALS[name]
    for name, method in methods.items():
        assert vars(MultiVectorEncoder)[name] is method


def test_context_manager_restores_the_previous_state():
    with lik_st.enabled():
        assert similarity.maxsim is not ORIGINALS["maxsim"]
    assert similarity.maxsim is ORIGINALS["maxsim"]
    lik_st.enable()
    with lik_st.enabled():
        pass
    assert lik_st.is_enabled(), "a block inside enable() leaves it enabled"


def test_sentence_transformers_5_is_refused(monkeypatch):
    monkeypatch.setattr(lik_st, "_installed_release", lambda: "5.3.0")
    with pytest.raises(ImportError, match="sentence-transformers 6"):
        lik_st.enable()
    assert not lik_st.is_enabled()


def test_numpy_results_stay_st_s(lik_calls):
    a, b = np.random.default_rng(0).random((2, 3, 8)), np.random.default_rng(1).random((2, 4, 8))
    expected = similarity.maxsim(a, b)
    with lik_st.enabled():
        torch.testing.assert_close(similarity.maxsim(a, b), expected, rtol=0, atol=0)
    assert lik_calls == []
