"""colpali-engine 0.3.18 scoring through lik.

`enable()` routes `colpali_engine.utils.maxsim.maxsim_inbatch` and `maxsim_kd` through
lik, wherever colpali-engine holds them: `BaseVisualRetrieverProcessor.score_multi_vector`
(and every processor's `score`) and the Colbert loss heads. `ColbertLoss`,
`ColbertPairwiseCELoss` and `ColbertSigmoidLoss` score in-batch through `maxsim_inbatch`;
`ColbertNegativeCELoss` and `ColbertPairwiseNegativeCELoss` get a forward that scores
their positives with `lik.maxsim_pairs` (colpali-engine builds them with an einsum) and
their negatives in the kd layout, then applies the library's own normalization, softplus
and in-batch term. With `use_smooth_max=True` (tau * logsumexp(sim / tau) over doc
tokens instead of the max), the in-batch scores (`ColbertModule._inbatch_scores`) and
the negative-doc losses go through `lik.runtime.variants.maxsim_smooth` instead of
colpali-engine's materialized [B, B, Lq, Ld] einsum. `disable()` restores the
originals; `enabled()` is the with-block form.

Semantics: colpali-engine has no masks. Embeddings are zero-padded, and the padding
takes part in the max like any token:

    score[i, j] = sum_s max_t <Q[i, s], D[j, t]>    over every padded position
                = lik.maxsim(Q, D)                     (no lik masks)

A zero doc row has similarity exactly 0, so it competes as 0 (a padded doc never scores
a query token below 0); a zero query row adds max_t 0 = 0. lik computes exactly this
when called without masks. Scores come back in the embeddings' dtype, as colpali-engine
returns them.

Gradients: equal to colpali-engine's on every row that is not all-zero padding. Where
several zero rows tie for a max, torch's amax splits the gradient among them and lik's
generated backward gives it to one; colpali-engine's models zero padding by multiplying
with the attention mask, so what reaches the weights is the same. (The CPU reference
path without the interpreter uses amax: equal there on every row.)

lik takes a call only when COLPALI_SCORES_BACKEND is unset or "auto"; "torch" and "lik"
(which in colpali-engine names the late-interaction-kernels package) go to the library.
Calls lik has no kernel for (a CPU without TRITON_INTERPRET=1, where colpali-engine's
own backend also leaves the call to its einsum), other dtypes than fp32/fp16/bf16, head
dims above lik's limit, empty inputs, and a smooth max whose tau is not a positive
Python number (a tensor, 0: colpali-engine answers those itself) go to the library too,
as does everything while LIK_DISABLE=1.
The loss forwards are swapped only on the colpali-engine release they mirror; on another
release the loss heads still reach lik through maxsim_inbatch and maxsim_kd.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from importlib.metadata import PackageNotFoundError, version

import torch
import torch.nn.functional as F

from lik import runtime
from lik.integrations import Integration, call_lik, lik_accepts, positive_number
from lik.runtime import variants

MIRRORED_RELEASE = "0.3.18"  # the colpali-engine whose loss forwards ours reproduce
_MAXSIM = "colpali_engine.utils.maxsim"
_LOSSES = "colpali_engine.loss.late_interaction_losses"
_INTEGRATION = Integration("colpali", package="colpali_engine", extra="colpali")


def _auto_backend() -> bool:
    """True when colpali-engine would pick its backend itself: lik only takes over that."""
    return os.environ.get("COLPALI_SCORES_BACKEND", "auto").lower() == "auto"


def _takes_inbatch(query, doc) -> bool:
    return lik_accepts(query, doc) and query.dim() == 3 and doc.dim() == 3


def _takes_kd(query, doc) -> bool:
    return (
        lik_accepts(query, doc)
        and query.dim() == 3
        and doc.dim() == 4
        and doc.shape[0] == query.shape[0]
    )


def _takes_pairs(query, doc) -> bool:
    return _takes_inbatch(query, doc) and doc.shape[0] == query.shape[0]


def _in_library_dtype(scores: torch.Tensor | None, query: torch.Tensor) -> torch.Tensor | None:
    # colpali-engine's einsum returns the embeddings' dtype; lik returns fp32.
    return None if scores is None else scores.to(query.dtype)


def _maxsim_inbatch(query, doc):
    """[B_q, L_q, d] x [B_d, L_d, d] -> [B_q, B_d]; zero padding competes as 0."""
    if not (_auto_backend() and _takes_inbatch(query, doc)):
        return None
    return _in_library_dtype(call_lik(runtime.maxsim, query, doc), query)


def _maxsim_kd(query, doc):
    """[B, L_q, d] x [B, N, L_d, d] -> [B, N]; zero padding competes as 0."""
    if not (_auto_backend() and _takes_kd(query, doc)):
        return None
    return _in_library_dtype(call_lik(runtime.maxsim, query, doc), query)


def _maxsim_pairs(query, doc):
    """[B, L_q, d] x [B, L_d, d] -> [B]: colpali-engine's einsum("bnd,bsd->bns").amax.sum."""
    return _in_library_dtype(call_lik(runtime.maxsim_pairs, query, doc), query)


def _smooth(query, doc, tau, *, pairs):
    return _in_library_dtype(
        call_lik(variants.maxsim_smooth, query, doc, tau=tau, pairs=pairs), query
    )


def _smooth_kd(query, negatives, tau):
    """[B, L_q, d] x [B, N, L_d, d] -> [B, N] smooth scores, as B * N diagonal pairs (the
    query repeated per negative: a [B * N, L_q, d] copy, small beside the negatives)."""
    B, N = negatives.shape[0], negatives.shape[1]
    repeated = query.unsqueeze(1).expand(B, N, *query.shape[1:]).reshape(B * N, *query.shape[1:])
    scores = _smooth(repeated, negatives.reshape(B * N, *negatives.shape[2:]), tau, pairs=True)
    return None if scores is None else scores.view(B, N)


def _inbatch_scores(self, query_embeddings, doc_embeddings):
    """ColbertModule._inbatch_scores with use_smooth_max: lik's smooth kernels, then the
    library's length normalization. Hard max: None (the library's body, whose
    maxsim_inbatch is already lik's)."""
    if not (self.use_smooth_max and _auto_backend() and positive_number(self.tau)):
        return None
    if not _takes_inbatch(query_embeddings, doc_embeddings):
        return None
    scores = _smooth(query_embeddings, doc_embeddings, self.tau, pairs=False)
    if scores is not None and self.normalize_scores:
        lengths = (query_embeddings[:, :, 0] != 0).sum(dim=1)
        scores = self._apply_normalization(scores, lengths)
    return scores


def _explicit_negatives_loss(loss, query, positives, negatives, in_batch_term):
    """The body both negative-doc losses share in colpali-engine 0.3.18, scored by lik
    (smooth max included). None (use the library's forward) for inputs lik does not take.
    """
    if not _auto_backend() or (loss.use_smooth_max and not positive_number(loss.tau)):
        return None
    if not (_takes_pairs(query, positives) and _takes_kd(query, negatives)):
        return None
    lengths = (query[:, :, 0] != 0).sum(dim=1)
    if loss.use_smooth_max:
        pos_scores = _smooth(query, positives, loss.tau, pairs=True)
        neg_scores = None if pos_scores is None else _smooth_kd(query, negatives, loss.tau)
    else:
        pos_scores = _maxsim_pairs(query, positives)
        neg_scores = None if pos_scores is None else _maxsim_kd(query, negatives)
    if neg_scores is None:
        return None
    if loss.normalize_scores:
        pos_scores = loss._apply_normalization(pos_scores, lengths)
        neg_scores = loss._apply_normalization(neg_scores, lengths)
    result = F.softplus((neg_scores - pos_scores.unsqueeze(1)) / loss.temperature).mean()
    if loss.in_batch_term_weight > 0:
        weight = loss.in_batch_term_weight
        result = result * (1 - weight) + in_batch_term() * weight
    return result


def _negative_ce_forward(self, query_embeddings, doc_embeddings, neg_doc_embeddings, offset=0):
    """ColbertNegativeCELoss.forward: positives sliced by the negatives' batch size."""
    positives = doc_embeddings[offset : offset + neg_doc_embeddings.size(0)]
    return _explicit_negatives_loss(
        self,
        query_embeddings,
        positives,
        neg_doc_embeddings,
        lambda: self.inner_loss(query_embeddings, doc_embeddings, offset),
    )


def _pairwise_negative_ce_forward(
    self, query_embeddings, doc_embeddings, neg_doc_embeddings, offset=0
):
    """ColbertPairwiseNegativeCELoss.forward: positives sliced by the queries' batch size."""
    positives = doc_embeddings[offset : offset + query_embeddings.size(0)]
    return _explicit_negatives_loss(
        self,
        query_embeddings,
        positives,
        neg_doc_embeddings,
        lambda: self.inner_pairwise(query_embeddings, doc_embeddings, offset),
    )


_FUNCTION_ROUTES = {
    f"{_MAXSIM}:maxsim_inbatch": _maxsim_inbatch,
    f"{_MAXSIM}:maxsim_kd": _maxsim_kd,
}
_LOSS_FORWARD_ROUTES = {
    f"{_LOSSES}:ColbertModule._inbatch_scores": _inbatch_scores,
    f"{_LOSSES}:ColbertNegativeCELoss.forward": _negative_ce_forward,
    f"{_LOSSES}:ColbertPairwiseNegativeCELoss.forward": _pairwise_negative_ce_forward,
}


def _installed_release() -> str | None:
    try:
        return version("colpali-engine")
    except PackageNotFoundError:
        return None


def _routes() -> dict:
    installed = _installed_release()
    if installed in (MIRRORED_RELEASE, None):  # None: not installed, enable() says so
        return {**_FUNCTION_ROUTES, **_LOSS_FORWARD_ROUTES}
    warnings.warn(
        f"lik.integrations.colpali mirrors colpali-engine {MIRRORED_RELEASE}'s negative-doc "
        f"loss forwards; found {installed}: those losses keep their own forward (their "
        "negatives and in-batch terms still go through lik)",
        stacklevel=3,
    )
    return dict(_FUNCTION_ROUTES)


def enable() -> None:
    """Route colpali-engine's MaxSim scoring and Colbert loss heads through lik."""
    if not _INTEGRATION.active:
        _INTEGRATION.enable(_routes())


def disable() -> None:
    """Put colpali-engine's own functions and loss forwards back (by identity)."""
    _INTEGRATION.disable()


def is_enabled() -> bool:
    return _INTEGRATION.active


def enabled() -> contextlib.AbstractContextManager[None]:
    """Context manager: enabled inside the block, as before after it."""
    return _INTEGRATION.scope(enable)
