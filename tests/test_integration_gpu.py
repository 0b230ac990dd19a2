"""The PyLate and colpali-engine integrations on CUDA tensors.

Parity: with lik routing on, each routed PyLate score function and loss and each
colpali-engine MaxSim function and loss head gives the library's own result (scores or
loss, and input gradients) on random padded batches, in fp32 and bf16. fp32 is compared
directly. In bf16 the two round differently (the libraries round every similarity to
bf16, lik accumulates in fp32), so a near-tied max can go either way: there both are
compared with the library's fp32 result on the same bf16 values, and lik must be about
as close to it as the library's own bf16 run.

Training: 20 SGD steps of a tiny token encoder under PyLate's Contrastive loss, from one
seed, on PyLate alone and with lik routing on; the losses must track step by step.

Run with `pytest -m gpu tests/test_integration_gpu.py`; skipped without CUDA or without
the libraries.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

from lik import runtime
from lik.runtime import api, backends

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEVICE = "cuda"
ZERO = "maxsim_masked_as_zero"  # the entry PyLate's bool doc masks take (read as zeros)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
FP32 = {"rtol": 1e-4, "atol": 1e-4}
BF16_FLOOR = 1e-2  # relative error to the fp32 result that lik may always have in bf16
# Sizes: Nq queries of Lq tokens, Nd docs (K per query in the kd layout) of Ld tokens.
NQ, ND, K, LQ, LD, DIM = 4, 6, 3, 16, 24, 128
LEAN = 5.0  # queries and docs lean apart along axis 0: padding often wins a max


def _import(name):
    return pytest.importorskip(name)


@pytest.fixture
def pylate():
    integration = importlib.import_module("lik.integrations.pylate")
    yield _import("pylate.scores.colbert"), _import("pylate.losses"), integration
    integration.disable()


@pytest.fixture
def colpali():
    integration = importlib.import_module("lik.integrations.colpali")
    maxsim = _import("colpali_engine.utils.maxsim")
    losses = _import("colpali_engine.loss.late_interaction_losses")
    processing = _import("colpali_engine.utils.processing_utils")
    yield maxsim, losses, processing, integration
    integration.disable()


@pytest.fixture
def lik_calls(monkeypatch):
    """Names of the lik entry points that returned a result (not a fallback)."""
    backend = backends.device_backend(torch.device(DEVICE))
    assert backend == "triton", "lik would not run its kernels"
    calls = []
    for module, name in ((runtime, "maxsim"), (runtime, "maxsim_pairs"), (api, ZERO)):
        real = getattr(module, name)

        def recording(*args, _real=real, _name=name, **kwargs):
            result = _real(*args, **kwargs)
            calls.append(_name)
            return result

        monkeypatch.setattr(module, name, recording)
    return calls


def _generator(seed):
    return torch.Generator().manual_seed(seed)


def _tokens(*shape, generator, lean, padded=False):
    """Unit token vectors [..., L, d] on the GPU; padded: zero rows after a random length."""
    tokens = torch.randn(*shape, generator=generator)
    tokens[..., 0] += lean
    tokens = F.normalize(tokens, dim=-1)
    if padded:
        rows = tokens.view(-1, *shape[-2:])
        lengths = torch.randint(1, shape[-2] + 1, (rows.shape[0],), generator=generator)
        lengths[0] = shape[-2]
        rows[torch.arange(shape[-2]) >= lengths[:, None]] = 0
    return tokens.to(DEVICE)


def _queries(*shape, generator, padded=False):
    return _tokens(*shape, generator=generator, lean=LEAN, padded=padded)


def _docs(*shape, generator, padded=False):
    return _tokens(*shape, generator=generator, lean=-LEAN, padded=padded)


def _mask(*shape, generator, p=0.6):
    """Random padding, plus one item with none and one fully masked."""
    mask = torch.rand(*shape, generator=generator) < p
    rows = mask.view(-1, shape[-1])
    rows[0] = True
    rows[-1] = False
    return mask.to(DEVICE)


def _outputs(call, tensors):
    """[result, *input gradients] of call(*leaf copies); gradients of a fixed random
    weighting of the result (of the result itself when it is a loss)."""
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out = call(*leaves)
    if out.dim() == 0:
        out.backward()
    else:
        weights = torch.randn(out.shape, generator=_generator(1)).to(out.device)
        (out.float() * weights).sum().backward()
    return [out.detach(), *[leaf.grad for leaf in leaves]]


def _relative_error(out, ref):
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _check(integration, call, tensors, dtype, real_rows=False):
    """call routed through lik against call on the library alone. real_rows: compare
    gradients only on token rows that are not zero padding (colpali-engine: where zero
    rows tie for a max, torch splits the gradient and lik gives it to one of them)."""
    inputs = [t.to(dtype) for t in tensors]
    expected = _outputs(call, inputs)
    with integration.enabled():
        actual = _outputs(call, inputs)
    truth = _outputs(call, [t.float() for t in inputs]) if dtype != torch.float32 else None
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        what = "result" if i == 0 else f"gradient {i}"
        assert a.dtype == e.dtype and a.shape == e.shape, what
        keep = (inputs[i - 1] != 0).any(-1) if real_rows and i > 0 else ...
        a, e = a[keep], e[keep]
        if truth is None:
            torch.testing.assert_close(a, e, **FP32, msg=lambda m, what=what: f"{what}: {m}")
            continue
        t = truth[i][keep]
        lik_err, own_err = _relative_error(a, t), _relative_error(e, t)
        assert lik_err <= max(
            2 * own_err, BF16_FLOOR
        ), f"{what}: lik {lik_err:.3g} vs the library's own bf16 {own_err:.3g} from fp32"


# PyLate score functions and losses.


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_pylate_score_functions(pylate, lik_calls, dtype):
    colbert, _, lik_pylate = pylate
    dtype = DTYPES[dtype]
    g = _generator(0)
    Q, D = _queries(NQ, LQ, DIM, generator=g), _docs(ND, LD, DIM, generator=g)
    D_kd, D_pairs = _docs(NQ, K, LD, DIM, generator=g), _docs(NQ, LD, DIM, generator=g)
    D_grouped = _docs(2, K, LD, DIM, generator=g)
    q_mask = _mask(NQ, LQ, generator=g, p=0.8)
    d_mask, kd_mask = _mask(ND, LD, generator=g), _mask(NQ, K, LD, generator=g)
    grouped_mask = _mask(2, K, LD, generator=g)
    metric = colbert.ColBERTScores()  # made before enabling, as a loss holds it
    cases = [
        (lambda Q, D: colbert.colbert_scores(Q, D, q_mask, d_mask), D, ZERO),
        (lambda Q, D: colbert.colbert_scores(Q, D, documents_mask=d_mask.float()), D, "maxsim"),
        (lambda Q, D: colbert.colbert_kd_scores(Q, D, q_mask, kd_mask), D_kd, ZERO),
        (lambda Q, D: colbert.colbert_scores_pairwise(Q, D), D_pairs, "maxsim_pairs"),
        (lambda Q, D: metric(Q, D, q_mask, grouped_mask), D_grouped, ZERO),
    ]
    for call, docs, entry in cases:
        lik_calls.clear()
        _check(lik_pylate, call, [Q, docs], dtype)
        assert lik_calls == [entry]


class TokenTable(torch.nn.Module):
    """A stand-in PyLate model: token ids -> rows of a table (the tensor gradients reach)."""

    def __init__(self, table, skip_id):
        super().__init__()
        self.table = table
        self.skiplist = [skip_id]
        self.do_query_expansion = False

    def forward(self, features):
        return {"token_embeddings": self.table[features["input_ids"]]}


# Token ids: padding, query words, doc words (one of them in the skiplist).
PAD_ID, QUERY_WORDS, DOC_WORDS, SKIP_ID = 0, range(1, 32), range(32, 64), 40


def _features(batch, length, generator, words):
    """Tokenized texts on the GPU: random ids and trailing padding (the first unpadded)."""
    ids = torch.randint(words.start, words.stop, (batch, length), generator=generator)
    lengths = torch.randint(length // 2, length + 1, (batch,), generator=generator)
    lengths[0] = length
    attention = (torch.arange(length) < lengths[:, None]).long()
    ids = ids * attention + PAD_ID * (1 - attention)
    return {"input_ids": ids.to(DEVICE), "attention_mask": attention.to(DEVICE)}


def _table(generator):
    table = torch.randn(DOC_WORDS.stop, DIM, generator=generator)
    table[QUERY_WORDS.start : QUERY_WORDS.stop, 0] += LEAN
    table[DOC_WORDS.start : DOC_WORDS.stop, 0] -= LEAN
    return table.to(DEVICE)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_pylate_losses(pylate, lik_calls, dtype):
    _, losses, lik_pylate = pylate
    dtype = DTYPES[dtype]
    g = _generator(2)
    batch, candidates = 8, 3
    queries = _features(batch, LQ, g, QUERY_WORDS)
    triplets = [queries, _features(batch, LD, g, DOC_WORDS), _features(batch, LD, g, DOC_WORDS)]
    scored = [queries, _features(batch * candidates, LD, g, DOC_WORDS)]
    labels = torch.randn(batch, candidates, generator=g).to(DEVICE)
    cases = {
        "Contrastive": lambda table: losses.Contrastive(
            TokenTable(table, SKIP_ID), score_mini_batch_size=4
        )(triplets),
        "CachedContrastive": lambda table: losses.CachedContrastive(
            TokenTable(table, SKIP_ID), mini_batch_size=4
        )(triplets[:2]),
        # Built inside the block, the loss takes the routed twin as its score_metric.
        "Distillation": lambda table: losses.Distillation(TokenTable(table, SKIP_ID))(
            scored, labels
        ),
    }
    for name, call in cases.items():
        lik_calls.clear()
        _check(lik_pylate, call, [_table(g)], dtype)
        assert lik_calls and set(lik_calls) == {ZERO}, name  # PyLate's losses: bool masks


# colpali-engine functions and loss heads (zero-padded embeddings, no masks).


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_colpali_functions(colpali, lik_calls, dtype):
    maxsim, _, processing, lik_colpali = colpali
    dtype = DTYPES[dtype]
    g = _generator(3)
    Q = _queries(NQ, LQ, DIM, generator=g, padded=True)
    D = _docs(ND, LD, DIM, generator=g, padded=True)
    D_kd = _docs(NQ, K, LD, DIM, generator=g, padded=True)
    cases = [
        (lambda Q, D: maxsim.maxsim_inbatch(Q, D), D),  # looked up when called: routed
        (lambda Q, D: maxsim.maxsim_kd(Q, D), D_kd),
    ]
    for call, docs in cases:
        lik_calls.clear()
        _check(lik_colpali, call, [Q, docs], dtype, real_rows=True)
        assert lik_calls == ["maxsim"]

    queries = [_queries(n, DIM, generator=g).to(dtype) for n in (4, 16, 9)]
    passages = [_docs(n, DIM, generator=g).to(dtype) for n in (24, 7, 13)]
    score = processing.BaseVisualRetrieverProcessor.score_multi_vector
    expected = score(queries, passages, batch_size=2, device=DEVICE)
    lik_calls.clear()
    with lik_colpali.enabled():
        actual = score(queries, passages, batch_size=2, device=DEVICE)
    assert actual.dtype == expected.dtype
    tolerance = FP32 if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(actual, expected, **tolerance)
    assert lik_calls == ["maxsim"] * 4  # 2 query batches x 2 passage batches


IN_BATCH_LOSSES = ("ColbertLoss", "ColbertPairwiseCELoss", "ColbertSigmoidLoss")
NEGATIVE_LOSSES = ("ColbertNegativeCELoss", "ColbertPairwiseNegativeCELoss")


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_colpali_loss_heads(colpali, lik_calls, dtype):
    _, losses, _, lik_colpali = colpali
    dtype = DTYPES[dtype]
    g = _generator(4)
    batch = 8
    Q = _queries(batch, LQ, DIM, generator=g, padded=True)
    D = _docs(batch, LD, DIM, generator=g, padded=True)
    N = _docs(batch, 2, LD - 4, DIM, generator=g, padded=True)
    for name in IN_BATCH_LOSSES:
        lik_calls.clear()
        _check(lik_colpali, getattr(losses, name)(), [Q, D], dtype, real_rows=True)
        assert lik_calls == ["maxsim"], name
    for name in NEGATIVE_LOSSES:
        lik_calls.clear()
        _check(lik_colpali, getattr(losses, name)(), [Q, D, N], dtype, real_rows=True)
        # positives as pairs, negatives in the kd layout, then the in-batch term
        assert lik_calls == ["maxsim_pairs", "maxsim", "maxsim"], name


# Training smoke test: PyLate's Contrastive loss on a tiny token encoder.

STEPS, BATCH, POOL = 20, 16, 4
# bf16: two valid runs part ways within a few steps (scores of about 10 round to 1/16,
# and the rounding steers the updates): PyLate's own bf16 run differs from its fp32 run
# by up to about 5% per step, and from a lik run by as much. So bf16 asks for 1e-2 on
# the first step (same weights), 1e-1 on every step, and for lik's run to stay about as
# close to PyLate's fp32 run as PyLate's bf16 run does.
FP32_TRACKING = 1e-4
BF16_FIRST_STEP, BF16_EVERY_STEP = 1e-2, 1e-1


class TinyEncoder(torch.nn.Module):
    """Embedding + Linear -> [B, L, DIM] token embeddings in `dtype` (weights stay fp32)."""

    def __init__(self, dtype):
        super().__init__()
        self.embed = torch.nn.Embedding(DOC_WORDS.stop, 64)
        self.proj = torch.nn.Linear(64, DIM)
        self.dtype = dtype
        self.skiplist = [SKIP_ID]
        self.do_query_expansion = False

    def forward(self, features):
        return {"token_embeddings": self.proj(self.embed(features["input_ids"])).to(self.dtype)}


def _training_batches():
    """POOL (query, positive, negative) batches; a positive holds its query's words
    shifted into the doc vocabulary, so there is something to learn."""
    g = _generator(5)
    shift = DOC_WORDS.start - QUERY_WORDS.start
    batches = []
    for _ in range(POOL):
        query = _features(BATCH, LQ, g, QUERY_WORDS)
        positive = _features(BATCH, LD, g, DOC_WORDS)
        ids = positive["input_ids"]
        words = query["input_ids"][:, : LQ // 2]
        ids[:, : LQ // 2] = torch.where(words != PAD_ID, words + shift, ids[:, : LQ // 2])
        batches.append([query, positive, _features(BATCH, LD, g, DOC_WORDS)])
    return batches


def _train(losses, dtype):
    torch.manual_seed(0)
    model = TinyEncoder(dtype).to(DEVICE)
    loss_fn = losses.Contrastive(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    batches = _training_batches()
    history = []
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = loss_fn(batches[step % POOL])
        loss.backward()
        optimizer.step()
        history.append(loss.item())
    return history


def _differences(run, reference):
    return [abs(a - b) / abs(b) for a, b in zip(run, reference, strict=True)]


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_contrastive_training_tracks_pylate(pylate, lik_calls, dtype):
    _, losses, lik_pylate = pylate
    dtype = DTYPES[dtype]
    unpatched = _train(losses, dtype)
    assert lik_calls == []
    with lik_pylate.enabled():
        routed = _train(losses, dtype)
    assert lik_calls == [ZERO] * STEPS
    difference = _differences(routed, unpatched)
    report = f"PyLate {unpatched}, with lik {routed}"
    if dtype == torch.float32:
        assert max(difference) < FP32_TRACKING, report
    else:
        assert difference[0] < BF16_FIRST_STEP, report
        assert max(difference) < BF16_EVERY_STEP, report
        fp32 = _train(losses, torch.float32)
        own, ours = _differences(unpatched, fp32), _differences(routed, fp32)
        assert sum(ours) <= 2 * sum(own) + 5e-3 * STEPS, f"{report}, fp32 {fp32}"
    assert sum(routed[-POOL:]) < 0.9 * sum(routed[:POOL]), "the loss should go down"
