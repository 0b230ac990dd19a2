"""retrieve: exact top-k against full scores + a stable sort, chunked and not.

Scores come from lik.runtime.maxsim, so on a CPU these run the generated kernels under
the Triton interpreter (conftest): shapes stay tiny. Exactness is checked two ways:
integer-valued embeddings, whose dot products are exact in fp32 whatever the
accumulation order (so ties are real ties on every path), and random normalized
embeddings with duplicated docs, checked against maxsim's own full [Nq, Nd] scores.
"""

from __future__ import annotations

import pytest
import torch

from lik.runtime import backends, maxsim
from lik.runtime import retrieval as retrieval_module
from lik.runtime.reference import maxsim_reference
from lik.runtime.retrieval import merge_top_k, retrieve

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference_top_k(scores: torch.Tensor, k: int, largest: bool = True):
    """Full scores -> k best per row, equal scores by ascending index (stable sort)."""
    order = torch.sort(scores, dim=1, descending=largest, stable=True)
    return order.values[:, :k], order.indices[:, :k]


def integer_corpus(generator, Nq=2, Nd=20, Lq=4, Ld=5, d=8):
    """Embeddings in {-1, 0, 1}, with docs 7, 12 and 19 copies of doc 3 (and 15 of 0):
    exact integer scores with many ties."""
    Q = torch.randint(-1, 2, (Nq, Lq, d), generator=generator).float()
    D = torch.randint(-1, 2, (Nd, Ld, d), generator=generator).float()
    D[[7, 12, 19]] = D[3].clone()
    D[15] = D[0].clone()
    return Q.to(DEVICE), D.to(DEVICE)


def random_corpus(generator, Nq=2, Nd=17, Lq=5, Ld=6, d=16):
    Q = torch.randn(Nq, Lq, d, generator=generator)
    D = torch.randn(Nd, Ld, d, generator=generator)
    D[[5, 11]] = D[2].clone()  # exact duplicates: equal scores, lower index first
    return Q.to(DEVICE), D.to(DEVICE)


@pytest.fixture(scope="module")
def integer_case():
    Q, D = integer_corpus(torch.Generator().manual_seed(0))
    return Q, D, maxsim_reference(Q.double(), D.double()).float()


# chunk: whole corpus, one doc, a size that leaves a partial last chunk, more than Nd;
# top_k: one, some, exactly Nd, more than Nd.
@pytest.mark.parametrize(
    "top_k, chunk",
    [(1, None), (5, 1), (5, 7), (20, 7), (33, None), (33, 50), (5, 50), (1, 7)],
)
def test_integer_scores_exact_with_ties(integer_case, top_k, chunk):
    Q, D, full = integer_case
    scores, indices = retrieve(Q, D, top_k, normalize=False, chunk=chunk)
    expected_scores, expected_indices = reference_top_k(full, min(top_k, D.shape[0]))
    assert indices.dtype == torch.int64 and scores.dtype == torch.float32
    assert torch.equal(indices.cpu(), expected_indices.cpu())
    assert torch.equal(scores.cpu(), expected_scores.cpu())


@pytest.mark.parametrize("chunk", [None, 3])
def test_smallest_scores_exact_with_ties(integer_case, chunk):
    Q, D, full = integer_case
    scores, indices = retrieve(Q, D, 6, normalize=False, chunk=chunk, largest=False)
    expected_scores, expected_indices = reference_top_k(full, 6, largest=False)
    assert torch.equal(indices.cpu(), expected_indices.cpu())
    assert torch.equal(scores.cpu(), expected_scores.cpu())


def test_ties_really_occur(integer_case):
    # Guards the test data: without ties the tie rule would go unchecked.
    _, _, full = integer_case
    top = reference_top_k(full, 5)[0]
    assert any(len(set(row.tolist())) < 5 for row in top)


@pytest.mark.parametrize("chunk", [None, 1, 7, 40])
def test_normalized_random_matches_full_scores(chunk):
    Q, D = random_corpus(torch.Generator().manual_seed(1))
    d_mask = torch.rand(D.shape[:2], generator=torch.Generator().manual_seed(2)) < 0.8
    d_mask = d_mask.to(DEVICE)
    full = maxsim(Q, D, d_mask=d_mask, normalize=True)
    scores, indices = retrieve(Q, D, 6, d_mask=d_mask, chunk=chunk)
    expected_scores, expected_indices = reference_top_k(full, 6)
    assert torch.equal(indices, expected_indices)
    assert torch.equal(scores, expected_scores)
    # and the scores themselves agree with the float64 reference
    exact = maxsim_reference(Q.double(), D.double(), None, d_mask, normalize=True)
    torch.testing.assert_close(scores.double(), exact.gather(1, indices), rtol=1e-5, atol=1e-5)


def test_duplicates_of_the_best_doc_come_in_index_order():
    generator = torch.Generator().manual_seed(3)
    Q = torch.randn(1, 5, 16, generator=generator).to(DEVICE)
    D = torch.randn(9, 6, 16, generator=generator).to(DEVICE)
    best = int(maxsim(Q, D, normalize=True).argmax())
    D[[1, 4, 8]] = D[best].clone()
    expected = sorted({1, 4, 8, best})
    for chunk in (None, 1, 2):
        _, indices = retrieve(Q, D, 4, chunk=chunk)
        assert indices[0].tolist() == expected


def test_query_mask_and_unsorted():
    Q, D = random_corpus(torch.Generator().manual_seed(4))
    q_mask = torch.tensor([[True, True, False, True, False], [True] * 5], device=DEVICE)
    full = maxsim(Q, D, q_mask, normalize=True)
    scores, indices = retrieve(Q, D, 4, q_mask, chunk=5, sorted=False)
    # sorted=False promises the same set, not an order
    expected_scores, expected_indices = reference_top_k(full, 4)
    for row in range(2):
        assert set(indices[row].tolist()) == set(expected_indices[row].tolist())
    assert torch.equal(scores.sort(dim=1, descending=True).values, expected_scores)


def test_single_query_drops_the_query_axis():
    Q, D = random_corpus(torch.Generator().manual_seed(5))
    scores, indices = retrieve(Q[0], D, 3, chunk=4)
    batch_scores, batch_indices = retrieve(Q[:1], D, 3)
    assert scores.shape == (3,) and torch.equal(indices, batch_indices[0])
    assert torch.equal(scores, batch_scores[0])


@pytest.mark.parametrize("chunk", [None, 4])
def test_empty_corpus_gives_empty_results(chunk):
    Q, D = random_corpus(torch.Generator().manual_seed(6))
    scores, indices = retrieve(Q, D[:0], 5, chunk=chunk)
    assert scores.shape == (2, 0) and indices.shape == (2, 0)
    assert scores.dtype == torch.float32 and indices.dtype == torch.int64


def test_chunked_never_scores_more_than_chunk_docs(monkeypatch):
    seen = []

    def recording_maxsim(Q, D, *args, **kwargs):
        seen.append(D.shape[0])
        return maxsim(Q, D, *args, **kwargs)

    monkeypatch.setattr(retrieval_module, "maxsim", recording_maxsim)
    Q, D = random_corpus(torch.Generator().manual_seed(7))
    retrieve(Q, D, 3, chunk=5)
    assert seen == [5, 5, 5, 2]


def test_inputs_that_require_grad_are_scored_without_grad():
    Q, D = random_corpus(torch.Generator().manual_seed(8))
    scores, _ = retrieve(Q.requires_grad_(), D, 2)
    assert not scores.requires_grad


Q_SMALL = torch.randn(2, 3, 8)
D_SMALL = torch.randn(5, 4, 8)


@pytest.mark.parametrize(
    "call, error, fragments",
    [
        (lambda: retrieve(Q_SMALL, D_SMALL, 0), ValueError, ["top_k", ">= 1", "got 0"]),
        (lambda: retrieve(Q_SMALL, D_SMALL, -3), ValueError, ["top_k", "got -3"]),
        (lambda: retrieve(Q_SMALL, D_SMALL, 2.0), TypeError, ["top_k", "float"]),
        (lambda: retrieve(Q_SMALL, D_SMALL, 2, chunk=0), ValueError, ["chunk", "got 0"]),
        (lambda: retrieve(Q_SMALL, D_SMALL[0], 2), ValueError, ["D must be [Nd, Ld, d]"]),
        (
            lambda: retrieve(Q_SMALL, D_SMALL, 2, None, torch.ones(4, 4, dtype=torch.bool)),
            ValueError,
            ["d_mask must have shape (5, 4)", "got (4, 4)"],
        ),
        (lambda: retrieve(Q_SMALL, D_SMALL[..., :4], 2), ValueError, ["head dim"]),
    ],
)
def test_bad_arguments_raise_named_errors(call, error, fragments):
    with pytest.raises(error) as caught:
        call()
    for fragment in fragments:
        assert fragment in str(caught.value), f"{fragment!r} not in {caught.value}"


def test_mask_checked_against_the_whole_corpus_when_chunked():
    # A mask one row short would fit every slice but the last; it must fail up front.
    with pytest.raises(ValueError, match="d_mask must have shape"):
        retrieve(Q_SMALL, D_SMALL, 2, None, torch.ones(4, 4, dtype=torch.bool), chunk=2)


def test_merge_top_k_orders_signed_zeros_infinities_and_ties():
    scores = torch.tensor([[-0.0, 0.0, -1.5, float("inf"), float("-inf"), 3.0, 3.0]])
    ids = torch.tensor([[10, 2, 7, 0, 1, 9, 4]])
    best_scores, best_ids = merge_top_k(
        [(scores[:, :3], ids[:, :3]), (scores[:, 3:], ids[:, 3:])], 7
    )
    assert best_ids.tolist() == [[0, 4, 9, 2, 10, 7, 1]]
    assert best_scores.tolist() == [[float("inf"), 3.0, 3.0, 0.0, 0.0, -1.5, float("-inf")]]
    low_scores, low_ids = merge_top_k([(scores, ids)], 3, largest=False)
    assert low_ids.tolist() == [[1, 7, 2]] and low_scores.tolist() == [[float("-inf"), -1.5, 0.0]]


@pytest.mark.parametrize("largest", [True, False])
def test_merge_top_k_in_small_key_blocks(monkeypatch, largest):
    # Wide candidate lists are encoded a block at a time; blocks of 2 columns exercise it.
    monkeypatch.setattr(retrieval_module, "KEY_BLOCK_ELEMENTS", 6)
    generator = torch.Generator().manual_seed(9)
    scores = torch.randint(-3, 4, (3, 40), generator=generator).float()  # many ties
    ids = torch.arange(40).expand(3, -1)
    best_scores, best_ids = merge_top_k([(scores, ids)], 11, largest=largest)
    expected_scores, expected_ids = reference_top_k(scores, 11, largest=largest)
    assert torch.equal(best_ids, expected_ids) and torch.equal(best_scores, expected_scores)


@pytest.mark.skipif(
    backends.device_backend(torch.device(DEVICE)) not in backends.GENERATED_TRITON,
    reason="the top-k epilogue runs on the kernel path",
)
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("top_k", [1, 3, 6])
def test_in_kernel_top_k_matches_full_scores_across_doc_blocks(monkeypatch, top_k, masked):
    """Unchunked retrieve keeps only each doc block's best inside the kernel; with 40
    docs in blocks of 16 and duplicates across blocks, ties still keep the lower index."""
    monkeypatch.setattr(retrieval_module, "TOPK_EPILOGUE_MIN_SCORES", 1)
    calls = []
    real = retrieval_module.dispatch.topk_candidates
    monkeypatch.setattr(
        retrieval_module.dispatch,
        "topk_candidates",
        lambda *a, **k: calls.append(a) or real(*a, **k),
    )
    Q, D = integer_corpus(torch.Generator().manual_seed(3), Nq=3, Nd=40)
    D[[21, 35]] = D[3].clone()  # copies of doc 3 in the second and third blocks
    d_mask = torch.rand(40, 5, generator=torch.Generator().manual_seed(4)) < 0.8
    d_mask = d_mask.to(DEVICE) if masked else None  # unmasked: exact ties across blocks
    full = maxsim_reference(Q.double(), D.double(), None, d_mask).float()
    scores, indices = retrieve(Q, D, top_k, d_mask=d_mask, normalize=False)
    want_scores, want_indices = reference_top_k(full, top_k)
    assert calls, "the epilogue path was not taken"
    assert torch.equal(indices.cpu(), want_indices.cpu())
    assert torch.equal(scores.cpu(), want_scores.cpu())
