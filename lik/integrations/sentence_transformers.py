"""Sentence Transformers 6 multi-vector scoring through lik.

`enable()` routes `sentence_transformers.util.similarity.maxsim` and `maxsim_pairwise`
(so `mean_maxsim`, `mean_maxsim_pairwise` and `SimilarityFunction` "maxsim" and
"meanmaxsim"), `MultiVectorEncoder.similarity` and `similarity_pairwise` (patched on the
class: a model keeps the function its `similarity_fn_name` named when set, so one loaded
before enable() reaches lik too), and the multi-vector scoring of
`sentence_transformers.multi_vector_encoder.scoring`: `colbert_scores` (the default
`similarity_fct` of the MultipleNegativesRanking losses, cached or not) becomes one
in-batch launch over the flattened document groups instead of a `maxsim` call per group,
`colbert_kd_scores` (MultiVectorDistillKLDivLoss) one kd launch instead of a
`maxsim_pairwise` call per candidate, and `colbert_scores_pairwise`
(MultiVectorMarginMSELoss) reaches lik through `maxsim_pairwise`; the `mean_` variants
follow. `disable()` restores the originals; `enabled()` is the with-block form.

Semantics: ST's, reproduced exactly. For query i and document j,

    score[i, j] = sum over query tokens s of  w[i, s] * max over valid doc tokens t of <a_s, b_t>

- a doc token is valid where `b_mask` is nonzero; without `b_mask`, a padded 3D tensor's
  all-zero rows are padding and a list item's tokens are its rows. Masks may have holes
  (MultiVectorMask's skiplists). Invalid doc tokens never win, so negative similarities
  survive padding: lik's own mask semantics, with the mask passed (no copy of D).
- w is `a_mask` (bool or 0/1 masks, or real-valued weights, which go through
  `lik.runtime.variants.maxsim_weighted`); without it, a padded tensor's all-zero query
  rows count 0 (they get no gradient, as in ST) and a list item's rows count 1.
- a doc with no valid token scores -1e9 (ST's `_fill_empty_document_scores`, with its
  one-time log message on CPU); `length_normalize=True` (the `mean_` functions) then
  divides by the query's valid token count (at least 1).
- lists of [L_i, d] tensors without masks go through lik's packed path
  (`maxsim_varlen`, `score_pairs_packed`): the host knows the lengths, nothing is padded
  or read back. With masks, or queries longer than the packed path's tile, lists are
  padded on their device and scored with masks.
- a 2D input is one item (a batch of one), scores are fp32 on the documents' device,
  and `chunk_elements` is accepted and not needed: lik scores in one launch without
  materializing the similarity block.

Handed to ST unchanged: calls lik has no kernel for (a CPU without TRITON_INTERPRET=1),
numpy or integer (quantized) embeddings, float64, mixed dtypes or devices, head dims
above lik's limit, empty batches or zero-width documents, masks given as lists or arrays
or of another shape than [N, L] ([L] and [1, L] broadcast in `maxsim`, as in ST), float64
weights, real-valued query weights in the kd layout (ST's per-candidate loop then calls
the routed `maxsim_pairwise`), a `device` other than the documents' own, pairwise batches
of unequal length (ST raises), and everything while LIK_DISABLE=1.

Where lik and ST differ: half-precision inputs, which ST's einsum rounds per similarity
and lik accumulates in fp32 (the scores agree to the half dtype's precision); ties for
a max between several doc tokens, whose gradient lik's kernels give to one of them (as
ST's `max` does, possibly another one); NaN or inf in masked query positions, which ST
propagates (it multiplies the token's max by 0) and lik ignores.
"""

from __future__ import annotations

import contextlib
from importlib.metadata import PackageNotFoundError, version

import torch

from lik import runtime
from lik.integrations import Integration, call_lik, lik_accepts
from lik.runtime import variants
from lik.runtime.keys import LQ_CHUNK

_SIMILARITY = "sentence_transformers.util.similarity"
_COLBERT = "sentence_transformers.multi_vector_encoder.scoring.colbert"
_INTEGRATION = Integration("sentence_transformers", package="sentence_transformers",
                           extra="sentence-transformers")  # fmt: skip
MIRRORED_RELEASE = "6.2.0"  # the Sentence Transformers whose semantics these adapters reproduce
EMPTY_DOCUMENT_SCORE = -1e9  # ST's _EMPTY_DOCUMENT_SCORE


class _Side:
    """One side of a call, ready for lik: padded [N, L, d] tokens with a bool mask (None:
    all valid) and optional real-valued query weights, or packed tokens of a ragged list."""

    def __init__(self, tokens, mask=None, weights=None, lengths=None):
        self.tokens = tokens  # [N, L, d] padded, or [sum L_i, d] packed (lengths given)
        self.mask = mask
        self.weights = weights
        self.lengths = lengths  # list[int] for a packed side

    @property
    def packed(self) -> bool:
        return self.lengths is not None

    def __len__(self) -> int:
        return len(self.lengths) if self.packed else self.tokens.shape[0]

    def padded(self) -> _Side:
        """A packed side padded on its device, its mask from the lengths."""
        if not self.packed:
            return self
        pieces = torch.split(self.tokens, self.lengths)
        tokens = torch.nn.utils.rnn.pad_sequence(list(pieces), batch_first=True)
        lengths = torch.tensor(self.lengths, device=tokens.device)
        mask = torch.arange(tokens.shape[1], device=tokens.device) < lengths[:, None]
        return _Side(tokens, mask)

    def valid(self) -> torch.Tensor:
        """[N, L] bool: the valid tokens of a padded side."""
        if self.mask is not None:
            return self.mask
        return torch.ones(self.tokens.shape[:2], dtype=torch.bool, device=self.tokens.device)

    def empty(self) -> torch.Tensor:
        """[N] bool: items without a valid token."""
        if self.packed:
            return torch.tensor([n == 0 for n in self.lengths], device=self.tokens.device)
        return ~self.valid().any(dim=-1)

    def counts(self) -> torch.Tensor:
        """[N] valid query tokens, at least 1 (ST's MeanMaxSim divisor)."""
        if self.packed:
            return torch.tensor([max(n, 1) for n in self.lengths], device=self.tokens.device)
        return self.valid().sum(dim=-1).clamp(min=1)

    def offsets(self) -> torch.Tensor:
        cumulative = [0]
        for n in self.lengths:
            cumulative.append(cumulative[-1] + n)
        return torch.tensor(cumulative, dtype=torch.int32).to(self.tokens.device)


def _fit(mask, rows: int, width: int, device, broadcast: bool) -> torch.Tensor | None:
    """A real-valued tensor mask of exactly [rows, width] on device, broadcast from
    [width] or [1, width] where ST's maxsim broadcasts; None where lik does not take it."""
    if not isinstance(mask, torch.Tensor) or mask.dtype.is_complex or mask.device != device:
        return None
    if broadcast and mask.dim() == 1:
        mask = mask.unsqueeze(0)
    if broadcast and mask.dim() == 2 and mask.shape[0] == 1 and mask.shape[1] == width:
        mask = mask.expand(rows, width).contiguous()
    return mask if tuple(mask.shape) == (rows, width) else None


def _side(embeddings, mask, *, query: bool, broadcast: bool) -> _Side | None:
    """One side of an ST call in lik's terms, or None for what lik does not take."""
    if isinstance(embeddings, list):
        items = list(embeddings)
        if not items or not all(isinstance(t, torch.Tensor) and t.dim() == 2 for t in items):
            return None
        if not lik_accepts(*[t for t in items if t.shape[0] > 0] or items[:1]):
            return None
        if len({(t.shape[-1], t.dtype, t.device) for t in items}) != 1:
            return None
        lengths = [t.shape[0] for t in items]
        side = _Side(torch.cat(items), lengths=lengths)
        if mask is None:
            return side
        side = side.padded()
        tokens = side.tokens
    elif isinstance(embeddings, torch.Tensor) and embeddings.dim() in (2, 3):
        tokens = embeddings.unsqueeze(0) if embeddings.dim() == 2 else embeddings
        if isinstance(mask, torch.Tensor) and embeddings.dim() == 2 and mask.dim() == 1:
            mask = mask.unsqueeze(0)
        if not lik_accepts(tokens):
            return None
        if mask is None:  # ST's zero-row inference: all-zero rows are padding
            return _Side(tokens, tokens.any(dim=-1))
    else:
        return None
    mask = _fit(mask, tokens.shape[0], tokens.shape[1], tokens.device, broadcast)
    if mask is None:
        return None
    if query and mask.dtype.is_floating_point:
        if mask.dtype == torch.float64:
            return None  # ST's scores would promote to float64
        # Real-valued weights: sum_s w_s * max_t; a token counts where its weight is nonzero.
        return _Side(tokens, mask != 0, weights=mask)
    return _Side(tokens, mask != 0)  # nonzero = valid, as ST's .bool() reads it


def _same_kind(a: _Side, b: _Side) -> bool:
    return a.tokens.dtype == b.tokens.dtype and a.tokens.device == b.tokens.device


def _device_ok(device, b: _Side) -> bool:
    """ST's `device` names where to score: lik takes only the documents' own device."""
    if device is None:
        return True
    wanted, own = torch.device(device), b.tokens.device
    return wanted.type == own.type and wanted.index in (None, own.index)


def _fill_empty(scores: torch.Tensor, empty: torch.Tensor) -> torch.Tensor:
    """ST's own fill (and its one-time log message), where this release has it."""
    from sentence_transformers.util import similarity

    fill = getattr(similarity, "_fill_empty_document_scores", None)
    if fill is None:
        return scores.masked_fill(empty, EMPTY_DOCUMENT_SCORE)
    return fill(scores, empty)


def _dense(a: _Side, b: _Side, *, pairs: bool) -> torch.Tensor | None:
    if a.weights is not None:
        return call_lik(variants.maxsim_weighted, a.tokens, b.tokens, a.weights,
                        None, b.mask, pairs=pairs)  # fmt: skip
    score = runtime.maxsim_pairs if pairs else runtime.maxsim
    return call_lik(score, a.tokens, b.tokens, a.mask, b.mask)


def _packed(a: _Side, b: _Side, *, pairs: bool) -> torch.Tensor | None:
    bound_q, bound_d = max(a.lengths), max(b.lengths)
    if bound_q > LQ_CHUNK or bound_q == 0 or bound_d == 0:
        return None
    cu_q, cu_d = a.offsets(), b.offsets()
    if pairs:
        index = torch.arange(len(a), dtype=torch.int32, device=a.tokens.device)
        return call_lik(runtime.score_pairs_packed, a.tokens, b.tokens, cu_q, cu_d, index,
                        index, max_seqlen_q=bound_q, max_seqlen_d=bound_d)  # fmt: skip
    return call_lik(runtime.maxsim_varlen, a.tokens, b.tokens, cu_q, cu_d, bound_q, bound_d)


def _score(a: _Side, b: _Side, *, pairs: bool, length_normalize: bool) -> torch.Tensor | None:
    """ST's scores of two prepared sides, or None to leave the call to ST."""
    if not _same_kind(a, b) or a.tokens.shape[-1] != b.tokens.shape[-1]:
        return None
    if pairs and len(a) != len(b):
        return None
    scores = None
    if a.packed and b.packed:
        scores = _packed(a, b, pairs=pairs)
    if scores is None:
        a, b = a.padded(), b.padded()
        scores = _dense(a, b, pairs=pairs)
    if scores is None:
        return None
    empty = b.empty()
    scores = _fill_empty(scores, empty if pairs else empty.unsqueeze(0))
    if length_normalize:
        counts = a.counts().to(scores.dtype)
        scores = scores / (counts if pairs else counts.unsqueeze(1))
    return scores


def _maxsim(a, b, a_mask=None, b_mask=None, chunk_elements=None, length_normalize=False,
            device=None):  # fmt: skip
    """util.similarity.maxsim: [Na, Nb] fp32."""
    A = _side(a, a_mask, query=True, broadcast=True)
    B = None if A is None else _side(b, b_mask, query=False, broadcast=True)
    if B is None or not _device_ok(device, B):
        return None
    return _score(A, B, pairs=False, length_normalize=length_normalize)


def _maxsim_pairwise(a, b, a_mask=None, b_mask=None, chunk_elements=None,
                     length_normalize=False, device=None):  # fmt: skip
    """util.similarity.maxsim_pairwise: [B] fp32, query i against doc i."""
    A = _side(a, a_mask, query=True, broadcast=False)
    B = None if A is None else _side(b, b_mask, query=False, broadcast=False)
    if B is None or not _device_ok(device, B):
        return None
    return _score(A, B, pairs=True, length_normalize=length_normalize)


def _colbert_scores(queries_embeddings, documents_embeddings, queries_mask=None,
                    documents_mask=None, chunk_elements=None, length_normalize=False):  # fmt: skip
    """scoring.colbert_scores: docs [Qd, N, Ld, d] -> [Qq, Qd * N], group j's doc n at
    column j * N + n, which is the flattened doc order: one in-batch launch."""
    D = documents_embeddings
    if not (isinstance(D, torch.Tensor) and D.dim() == 4 and D.shape[1] > 0):
        return None
    Q = queries_embeddings
    if not (isinstance(Q, torch.Tensor) and Q.dim() == 3):
        return None
    if documents_mask is not None:
        if not (isinstance(documents_mask, torch.Tensor) and documents_mask.dim() == 3):
            return None
        documents_mask = documents_mask.flatten(0, 1)
    A = _side(Q, queries_mask, query=True, broadcast=True)
    B = None if A is None else _side(D.flatten(0, 1), documents_mask, query=False, broadcast=False)
    if B is None:
        return None
    return _score(A, B, pairs=False, length_normalize=length_normalize)


def _colbert_kd_scores(queries_embeddings, documents_embeddings, queries_mask=None,
                       documents_mask=None, chunk_elements=None,
                       length_normalize=False):  # fmt: skip
    """scoring.colbert_kd_scores: Q [B, Lq, d], docs [B, K, Ld, d] -> [B, K]: one kd launch."""
    Q, D = queries_embeddings, documents_embeddings
    if not (isinstance(Q, torch.Tensor) and isinstance(D, torch.Tensor)):
        return None
    if not (Q.dim() == 3 and D.dim() == 4 and D.shape[0] == Q.shape[0] and D.shape[1] > 0):
        return None
    if not (lik_accepts(Q, D) and Q.shape[-1] == D.shape[-1]):
        return None
    A = _side(Q, queries_mask, query=True, broadcast=False)
    if A is None or A.weights is not None:  # no weighted kd layout: ST loops over maxsim_pairwise
        return None
    if documents_mask is None:
        d_mask = D.any(dim=-1)
    else:
        if not (isinstance(documents_mask, torch.Tensor) and not documents_mask.dtype.is_complex):
            return None
        if tuple(documents_mask.shape) != tuple(D.shape[:3]) or documents_mask.device != D.device:
            return None
        d_mask = documents_mask != 0
    scores = call_lik(runtime.maxsim, Q, D, A.mask, d_mask)
    if scores is None:
        return None
    scores = _fill_empty(scores, ~d_mask.any(dim=-1))
    if length_normalize:
        scores = scores / A.counts().to(scores.dtype).unsqueeze(1)
    return scores


_KEYWORDS = {"a_mask", "b_mask", "chunk_elements", "length_normalize", "device"}


def _model_scores(adapter, model, embeddings1, embeddings2, kwargs):
    """MultiVectorEncoder.similarity(_pairwise): the model's function, looked up now. A
    model holds the function its similarity_fn_name named when it was set, so one built
    before enable() would keep ST's own; maxsim and meanmaxsim are routed here."""
    name = model.similarity_fn_name
    if name not in ("maxsim", "meanmaxsim") or not set(kwargs) <= _KEYWORDS:
        return None
    kwargs = {"length_normalize": name == "meanmaxsim", **kwargs}
    return adapter(embeddings1, embeddings2, **kwargs)


def _model_similarity(self, embeddings1, embeddings2, **kwargs):
    return _model_scores(_maxsim, self, embeddings1, embeddings2, kwargs)


def _model_similarity_pairwise(self, embeddings1, embeddings2, **kwargs):
    return _model_scores(_maxsim_pairwise, self, embeddings1, embeddings2, kwargs)


_MODEL = "sentence_transformers.multi_vector_encoder.model:MultiVectorEncoder"
_ROUTES = {
    f"{_SIMILARITY}:maxsim": _maxsim,
    f"{_SIMILARITY}:maxsim_pairwise": _maxsim_pairwise,
    f"{_COLBERT}:colbert_scores": _colbert_scores,
    f"{_COLBERT}:colbert_kd_scores": _colbert_kd_scores,
    f"{_MODEL}.similarity": _model_similarity,
    f"{_MODEL}.similarity_pairwise": _model_similarity_pairwise,
}


def _installed_release() -> str | None:
    try:
        return version("sentence-transformers")
    except PackageNotFoundError:
        return None


def enable() -> None:
    """Route Sentence Transformers 6's multi-vector scoring (and its losses) through lik."""
    if _INTEGRATION.active:
        return
    installed = _installed_release()
    if installed is not None and int(installed.split(".")[0]) < 6:
        raise ImportError(
            f"lik.integrations.sentence_transformers needs sentence-transformers 6 "
            f"(pip install 'lik[sentence-transformers]'), found {installed}"
        )
    _INTEGRATION.enable(_ROUTES)


def disable() -> None:
    """Put Sentence Transformers' own functions back (by identity)."""
    _INTEGRATION.disable()


def is_enabled() -> bool:
    return _INTEGRATION.active


def enabled() -> contextlib.AbstractContextManager[None]:
    """Context manager: enabled inside the block, as before after it."""
    return _INTEGRATION.scope(enable)
