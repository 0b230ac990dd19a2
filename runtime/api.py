"""Public entry points: maxsim and maxsim_pairs (the contract: the README's "API in brief")."""

from __future__ import annotations

import torch

from lik.runtime import autograd, backends, metal, norm_warning, validate
from lik.runtime.reference import maxsim_pairs_reference, maxsim_reference

_Q_DOC = "[Nq, Lq, d] or [Lq, d]"
_D_DOC = "[Nd, Ld, d], [Nq, K, Ld, d] or [Ld, d]"


def _needs_grad(Q: torch.Tensor, D: torch.Tensor) -> bool:
    return (Q.requires_grad or D.requires_grad) and torch.is_grad_enabled()


# "auto" takes unified for an in-batch call whose queries outnumber its docs, or whose docs
# outnumber its queries, this many times or more, and lowmem for every other call (see
# choose_backward).
LOPSIDED_QUERIES = 32
LOPSIDED_DOCS = 64
AUTO_RULE = (f"unified where queries outnumber docs {LOPSIDED_QUERIES} times or more, or docs "
             f"outnumber queries {LOPSIDED_DOCS} times or more; else lowmem")  # fmt: skip


def choose_backward(backward: str | None, layout: str, nq: int, nd: int) -> str:
    """The backward strategy a call uses: the caller's choice, or "auto"'s.

    lowmem owns each gradient element in one program and writes it in the input dtype: a
    third of unified's memory. H200, in-batch training steps replayed, lowmem against
    unified: 1.2-4.3x faster up to 16 times as many docs as queries or the other way (4 x 4
    to 64 x 64, 256 x 16); slower from 32 times as many queries (128 x 4 and 256 x 8 1.16x)
    and from 64 times as many docs (8 x 1000 1.2x, 1 x 1000 1.7x; 1 x 250 the exception),
    where its per-query grad_Q or per-doc grad_D has too few owners to spread; faster still
    at 50 and 62 docs per query (4 x 200, 16 x 1000) (benchmarks/results/
    commit b29daf8). kd and pairs: lowmem. varlen (ragged in-batch) follows dense:
    lowmem 1.4-1.8x faster from 16 x 16 to 128 x 128 sequences, 1.26x slower at 256 x 8,
    2.3x slower at 1 x 1000 (benchmarks/results/backward/H200.md). A pair list (packed_pairs) has
    only unified.
    """
    if layout == "packed_pairs":
        return "unified"
    if backward in ("unified", "lowmem"):
        return backward
    lopsided = nq >= LOPSIDED_QUERIES * nd or nd >= LOPSIDED_DOCS * nq
    if layout in ("dense", "varlen") and lopsided:
        return "unified"
    return "lowmem"


def _score(layout, Q, D, q_mask, d_mask, normalize, backward, masked_as_zero=False):
    """Generated-kernel path, through the custom op (autograd and torch.compile aware)."""
    strategy = "none"
    if _needs_grad(Q, D):
        strategy = choose_backward(backward, layout, Q.shape[0], D.shape[0])
    return autograd.score(Q, D, q_mask, d_mask, layout, normalize, strategy, masked_as_zero)


def maxsim(
    Q: torch.Tensor,
    D: torch.Tensor,
    q_mask: torch.Tensor | None = None,
    d_mask: torch.Tensor | None = None,
    *,
    normalize: bool = False,
    backward: str | None = None,
) -> torch.Tensor:
    """Late-interaction scores: sum over query tokens of the max similarity over doc tokens.

    Q [Nq, Lq, d] (or [Lq, d], squeezing the query axis of the result) against
    D [Nd, Ld, d] -> [Nq, Nd] (in-batch cross product), D [Nq, K, Ld, d] -> [Nq, K]
    (distillation / hard negatives, one launch), or D [Ld, d] -> [Nq]. Masks are bool,
    True = valid: q_mask [Nq, Lq]; d_mask [Nd, Ld], [Nq, K, Ld] or [Ld]. A masked doc
    token never wins; a query token with no valid doc token adds 0; masked query tokens
    add 0. normalize=True L2-normalizes tokens inside the kernel. Output fp32.
    """
    validate.backward_choice(backward)
    normalize = validate.flag("normalize", normalize)
    Q = validate.tensor("Q", Q, (2, 3), _Q_DOC)
    D = validate.tensor("D", D, (2, 3, 4), _D_DOC)
    validate.same_dtype_and_device(Q, D)
    validate.head_dims(Q, D)
    squeeze_query = Q.dim() == 2
    Q3 = Q.unsqueeze(0) if squeeze_query else Q
    if q_mask is not None:  # expected shapes are built only for masks given (a hot path)
        q_expected = tuple(Q.shape[:-1])
        q_mask = validate.mask("q_mask", q_mask, q_expected, Q.device)
        if squeeze_query:
            q_mask = q_mask.unsqueeze(0)

    if D.dim() == 4:
        if D.shape[0] != Q3.shape[0]:
            raise ValueError(
                f"D in the kd layout [Nq, K, Ld, d] must have Nq={Q3.shape[0]} rows like Q, "
                f"got shape {tuple(D.shape)}"
            )
        layout, D3, squeeze_doc = "kd", D, False
    else:
        squeeze_doc = D.dim() == 2
        layout, D3 = "dense", D.unsqueeze(0) if squeeze_doc else D
    if d_mask is not None:
        d_mask = validate.mask("d_mask", d_mask, tuple(D.shape[:-1]), D.device)
        if squeeze_doc:
            d_mask = d_mask.unsqueeze(0)

    if not normalize:
        norm_warning.check(Q3, D3, q_mask, d_mask)
    backend = backends.route("maxsim", Q)
    if backend == "metal":  # the Metal kernels, or the reference outside their envelope
        out = metal.maxsim(layout, Q3, D3, q_mask, d_mask, normalize)
    elif backend == "reference":
        out = maxsim_reference(Q3, D3, q_mask, d_mask, normalize=normalize).float()
    else:  # the generated kernels: Triton on CUDA, or under the interpreter
        out = _score(layout, Q3, D3, q_mask, d_mask, normalize, backward)
    if squeeze_doc:
        out = out[:, 0]
    return out[0] if squeeze_query else out


def maxsim_pairs(
    Q: torch.Tensor,
    D: torch.Tensor,
    q_mask: torch.Tensor | None = None,
    d_mask: torch.Tensor | None = None,
    *,
    normalize: bool = False,
    backward: str | None = None,
) -> torch.Tensor:
    """Diagonal MaxSim: Q [B, Lq, d] with D [B, Ld, d] -> [B], query b against doc b.

    Never builds the [B, B] cross product. Masks and normalize as in maxsim.
    """
    validate.backward_choice(backward)
    normalize = validate.flag("normalize", normalize)
    Q = validate.tensor("Q", Q, (3,), "[B, Lq, d]")
    D = validate.tensor("D", D, (3,), "[B, Ld, d]")
    validate.same_dtype_and_device(Q, D)
    validate.head_dims(Q, D)
    if Q.shape[0] != D.shape[0]:
        raise ValueError(
            f"maxsim_pairs needs one doc per query: Q has B={Q.shape[0]}, D has {D.shape[0]}"
        )
    B, Lq, Ld = Q.shape[0], Q.shape[1], D.shape[1]
    q_mask = validate.mask("q_mask", q_mask, (B, Lq), Q.device, "[B, Lq]")
    d_mask = validate.mask("d_mask", d_mask, (B, Ld), D.device, "[B, Ld]")
    if not normalize:
        norm_warning.check(Q, D, q_mask, d_mask)
    backend = backends.route("maxsim", Q)
    if backend == "metal":  # the Metal kernels, or the reference outside their envelope
        return metal.maxsim("pairs", Q, D, q_mask, d_mask, normalize)
    if backend == "reference":
        return maxsim_pairs_reference(Q, D, q_mask, d_mask, normalize=normalize).float()
    return _score("pairs", Q, D, q_mask, d_mask, normalize, backward)


def maxsim_masked_as_zero(
    Q: torch.Tensor,
    D: torch.Tensor,
    q_mask: torch.Tensor | None = None,
    d_mask: torch.Tensor | None = None,
    *,
    pairs: bool = False,
    backward: str | None = None,
) -> torch.Tensor:
    """Internal (lik.integrations.pylate; not re-exported, not in API.md): maxsim, or
    maxsim_pairs with pairs=True, with the doc mask read as zeros, PyLate's convention. A
    masked doc token is not left out of the max but competes with similarity 0:

        score[i, j] = sum over valid s of max(max over valid t of <Q[i, s], D[j, t]>,
                                              0 if doc j has a masked token)

    A query token the 0 beats (strictly) adds 0 and takes no gradient; a fully masked doc
    scores 0; masked query tokens add 0. Q [Nq, Lq, d]; D [Nd, Ld, d] -> [Nq, Nd],
    D [Nq, K, Ld, d] -> [Nq, K], or with pairs=True D [B, Ld, d] -> [B]; masks as in
    maxsim. No normalize. CUDA and a CPU under TRITON_INTERPRET=1 run the generated
    kernels (the masked-as-zero variants, lik_gen.ir.Mask.as_zero), a plain CPU the
    reference; MPS raises NotImplementedError (no Metal kernel reads a mask so): callers
    keep their own formulation there.
    """
    validate.backward_choice(backward)
    pairs = validate.flag("pairs", pairs)
    Q = validate.tensor("Q", Q, (3,), "[Nq, Lq, d]")
    d_doc = "[B, Ld, d]" if pairs else "[Nd, Ld, d] or [Nq, K, Ld, d]"
    D = validate.tensor("D", D, (3,) if pairs else (3, 4), d_doc)
    validate.same_dtype_and_device(Q, D)
    validate.head_dims(Q, D)
    layout = "pairs" if pairs else "kd" if D.dim() == 4 else "dense"
    if layout != "dense" and D.shape[0] != Q.shape[0]:
        raise ValueError(
            f"D {d_doc} must have {Q.shape[0]} rows like Q, got shape {tuple(D.shape)}"
        )
    q_mask = validate.mask("q_mask", q_mask, tuple(Q.shape[:-1]), Q.device)
    d_mask = validate.mask("d_mask", d_mask, tuple(D.shape[:-1]), D.device)
    backend = backends.route("maxsim", Q)
    if backend == "metal":
        raise NotImplementedError("no Metal kernel reads a doc mask as zeros")
    if backend == "reference":
        reference = maxsim_pairs_reference if pairs else maxsim_reference
        return reference(Q, D, q_mask, d_mask, masked_as_zero=True).float()
    return _score(layout, Q, D, q_mask, d_mask, False, backward, masked_as_zero=True)
