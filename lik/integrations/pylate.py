"""PyLate 1.6 scoring through lik.

`enable()` routes `pylate.scores.colbert_scores`, `colbert_kd_scores`,
`colbert_scores_pairwise` and `ColBERTScores` through lik, and with them the losses that
captured them at import time: `Contrastive` and `CachedContrastive` (a `ColBERTScores`
instance, patched on the class) and `Distillation` (its `score_metric` default).
`disable()` restores the originals; `enabled()` is the with-block form.

Semantics: PyLate's torch path, reproduced exactly. PyLate multiplies the similarity
block by the masks, so a masked doc token is not skipped: it competes with similarity 0.
A masked query token scores max over t of 0, i.e. 0. For any mask values (bool, 0/1,
or real weights):

    score[i, j] = sum_s max_t  q_mask[i, s] * d_mask[j, t] * <Q[i, s], D[j, t]>
                = lik.maxsim(Q * q_mask, D * d_mask)          (no lik masks)

since <m Q_s, n D_t> = m n <Q_s, D_t>. With bool masks that is, in lik's mask terms,
sum over valid s of max(0 if doc j has a masked token else -inf, max over valid t of
<Q_s, D_t>): a doc with padding never scores a query token below 0. Bool masks (what
PyLate's losses pass) go to lik as they are, with no copy of Q or D: the query mask as
lik's own (a masked query token adds 0 in both conventions), the doc mask read as zeros
(`lik.runtime.api.maxsim_masked_as_zero`, the masked-as-zero kernel variants). Gradients
follow PyLate's products: nothing flows to masked tokens, and a query token whose max a
masked doc token's 0 wins gets none (a tie at 0 keeps the valid token, up to which exact
ties PyLate's max breaks otherwise). Masks of another dtype (0/1 floats or integers, or
real weights) multiply the tokens instead, through zeroed copies, as does any call where
lik has no masked-as-zero kernel. One difference: padding is inert in lik (a masked
token holding NaN or inf scores as a zero token would), where PyLate's product with a 0
keeps a NaN. The kd layout (D [Nq, K, Ld, d], d_mask [Nq, K, Ld]) is the same formula
per candidate; colbert_scores_pairwise has no masks and is lik.maxsim_pairs(Q, D).
Scores come back in the dtype PyLate would return (the embeddings' dtype promoted with
the masks').

lik takes a call only when PyLate's backend choice is its default, "auto" (the `backend`
argument, else PYLATE_SCORES_BACKEND); an explicit "torch", "flash" or "lik" (which in
PyLate names the late-interaction-kernels package) goes to PyLate. Calls lik has no
kernel for (a CPU without TRITON_INTERPRET=1, which PyLate's own kernel backends also
leave to its torch path), non-tensor inputs (lists, arrays), dtypes other than
fp32/fp16/bf16, head dims above lik's limit, empty inputs and masks that are not exactly
[N, L] go to PyLate too, as does everything while LIK_DISABLE=1.
"""

from __future__ import annotations

import contextlib
import os

import torch

from lik import runtime
from lik.integrations import Integration, call_lik, lik_accepts, mask_fits
from lik.runtime import api as runtime_api

_COLBERT = "pylate.scores.colbert"
_INTEGRATION = Integration("pylate", package="pylate", extra="pylate")


def _auto_backend(backend: str | None) -> bool:
    """True when PyLate would pick its backend itself: lik only takes over that choice."""
    chosen = backend if backend is not None else os.environ.get("PYLATE_SCORES_BACKEND", "auto")
    return isinstance(chosen, str) and chosen.lower() == "auto"


def _result_dtype(embeddings: torch.Tensor, *masks: torch.Tensor | None) -> torch.dtype:
    # PyLate's similarities take the embeddings' dtype, and each mask product promotes it.
    dtype = embeddings.dtype
    for mask in masks:
        if mask is not None:
            dtype = torch.promote_types(dtype, mask.dtype)
    return dtype


def _zero_masked(tokens: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """tokens [..., L, d] scaled by mask [..., L]: masked tokens become zero vectors."""
    if mask is None:
        return tokens
    return tokens * mask.to(tokens.dtype).unsqueeze(-1)


def _fits(Q, D, queries_mask, documents_mask, doc_rank: int) -> bool:
    if not (lik_accepts(Q, D) and Q.dim() == 3 and D.dim() == doc_rank):
        return False
    if doc_rank == 4 and D.shape[0] != Q.shape[0]:
        return False  # kd layout: one candidate list per query
    return mask_fits(queries_mask, Q.shape[:2], Q.device) and mask_fits(
        documents_mask, D.shape[:-1], D.device
    )


def _is_bool(mask: torch.Tensor | None) -> bool:
    return mask is not None and mask.dtype == torch.bool


def _masked_scores(Q, D, queries_mask, documents_mask) -> torch.Tensor | None:
    """sum_s max_t qm_s dm_t <Q_s, D_t> through lik (D [Nd, Ld, d] or [Nq, K, Ld, d]):
    bool masks as they are (the doc mask read as zeros), others through zeroed copies."""
    q_tokens, q_mask = (Q, queries_mask) if _is_bool(queries_mask) else (
        _zero_masked(Q, queries_mask), None)  # fmt: skip
    scores = None
    if _is_bool(documents_mask):
        scores = call_lik(runtime_api.maxsim_masked_as_zero, q_tokens, D, q_mask, documents_mask)
    if scores is None:  # no bool doc mask, or no masked-as-zero kernel here: the copies
        scores = call_lik(runtime.maxsim, q_tokens, _zero_masked(D, documents_mask), q_mask)
    if scores is None:
        return None
    return scores.to(_result_dtype(Q, queries_mask, documents_mask))


def _colbert_scores(
    queries_embeddings,
    documents_embeddings,
    queries_mask=None,
    documents_mask=None,
    backend=None,
):
    Q, D = queries_embeddings, documents_embeddings
    if not (_auto_backend(backend) and _fits(Q, D, queries_mask, documents_mask, doc_rank=3)):
        return None
    return _masked_scores(Q, D, queries_mask, documents_mask)


def _colbert_kd_scores(
    queries_embeddings,
    documents_embeddings,
    queries_mask=None,
    documents_mask=None,
    backend=None,
):
    Q, D = queries_embeddings, documents_embeddings
    if not (_auto_backend(backend) and _fits(Q, D, queries_mask, documents_mask, doc_rank=4)):
        return None
    return _masked_scores(Q, D, queries_mask, documents_mask)


def _colbert_scores_pairwise(queries_embeddings, documents_embeddings, backend=None):
    Q, D = queries_embeddings, documents_embeddings
    if not (_auto_backend(backend) and lik_accepts(Q, D) and Q.dim() == 3 and D.dim() == 3):
        return None
    if Q.shape[0] != D.shape[0]:
        return None  # PyLate zips the two batches: leave its truncation to it
    scores = call_lik(runtime.maxsim_pairs, Q, D)
    return None if scores is None else scores.to(Q.dtype)


def _colbert_scores_call(
    self,
    queries_embeddings,
    documents_embeddings,
    queries_mask=None,
    documents_mask=None,
    backend=None,
):
    """ColBERTScores: docs [Qd, N, Ld, d] -> [Nq, Qd * N], doc d's slot k at column d*N + k.

    Flattening the groups gives exactly that column order, so one lik call replaces
    PyLate's loop over the N slots.
    """
    D = documents_embeddings
    if not (isinstance(D, torch.Tensor) and D.dim() == 4):
        return None
    if documents_mask is not None:
        if not (isinstance(documents_mask, torch.Tensor) and documents_mask.dim() == 3):
            return None
        documents_mask = documents_mask.flatten(0, 1)
    return _colbert_scores(
        queries_embeddings, D.flatten(0, 1), queries_mask, documents_mask, backend
    )


_ROUTES = {
    f"{_COLBERT}:colbert_scores": _colbert_scores,
    f"{_COLBERT}:colbert_kd_scores": _colbert_kd_scores,
    f"{_COLBERT}:colbert_scores_pairwise": _colbert_scores_pairwise,
    f"{_COLBERT}:ColBERTScores.__call__": _colbert_scores_call,
}


def enable() -> None:
    """Route PyLate's ColBERT scoring (and the losses built on it) through lik."""
    _INTEGRATION.enable(_ROUTES)


def disable() -> None:
    """Put PyLate's own scoring functions back (by identity)."""
    _INTEGRATION.disable()


def is_enabled() -> bool:
    return _INTEGRATION.active


def enabled() -> contextlib.AbstractContextManager[None]:
    """Context manager: enabled inside the block, as before after it."""
    return _INTEGRATION.scope(enable)
