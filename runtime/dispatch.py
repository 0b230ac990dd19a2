"""Validated call -> KernelKey -> generated kernel -> launch, for the op families'
kernel backends (lik.runtime.backends picks the backend: Triton on CUDA or under the
interpreter; maxsim's forward and backward hand MPS calls to lik.runtime.metal and CPU
calls to lik.runtime.cpu).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import threading

import torch

from lik.runtime import backends, cpu, heuristics, launch_plan, metal, registry, validate
from lik.runtime.configs import call_config
from lik.runtime.heuristics import (
    ALWAYS_FITTING_QUERY_TOKENS,
    stack_ragged_queries,
    topk_docs_per_program,
)
from lik.runtime.keys import (
    LQ_CHUNK,
    next_power_of_two,
    variant_name,
)
from lik.runtime.workspace import raw_stream


def unit_head_stride(t: torch.Tensor) -> torch.Tensor:
    """t with its last (head dim) axis contiguous, copied where it is not. Kernels read
    tiles along that axis: with another stride their loads do not coalesce, and Triton
    3.6 miscompiles the nested-docs loop over docs stored token-major (an illegal address
    on an H200: D [1111, 202, 100] of strides (20200, 1, 202), 8 docs per program)."""
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _query_tokens(module, Q: torch.Tensor, lq: int) -> int:
    """Query tokens one launch of `module` scores: query_chunk's, without asking it for
    queries short enough to fit whatever the variant (this runs every call)."""
    return LQ_CHUNK if lq <= ALWAYS_FITTING_QUERY_TOKENS else heuristics.query_chunk(module, Q)


def query_ranges(lq: int, chunk: int = LQ_CHUNK):
    """Query-token ranges scored per launch: `chunk` tokens at most."""
    return [(start, min(lq, start + chunk)) for start in range(0, lq, chunk)]


def _smaller(config):
    """The next config down when a launch runs out of shared memory or registers."""
    if config.query_group > 1:
        return dataclasses.replace(config, query_group=config.query_group // 2)
    if config.num_stages > 1:
        return dataclasses.replace(config, num_stages=config.num_stages - 1)
    if config.block_l > 16:
        return dataclasses.replace(config, block_l=config.block_l // 2)
    return None


_local = threading.local()  # .launches: what _launch ran while a call is captured, else None


def _captured(plan, tensors) -> None:
    launches = getattr(_local, "launches", None)
    if launches is not None:
        launches.append((plan, tensors))


def _replayed(key: tuple, call_tensors: tuple):
    """The result of replaying a call signature's single launch on this call's tensors,
    or NOT_PLANNED where it has none (or a launch hook, or another current device, asks
    for the launcher's own path)."""
    entry = launch_plan.call_plan(key)
    if not entry:
        return launch_plan.NOT_PLANNED
    plan, sources, device = entry
    cache = sys.modules.get("lik.runtime.launch_cache")
    if cache is None or cache.hooks_set() or device != cache._current_device():
        return launch_plan.NOT_PLANNED
    return plan.replay([None if s is None else call_tensors[s] for s in sources],
                       raw_stream(device))  # fmt: skip


def replayed_call(backend: str, call_tensors: tuple, *flags):
    """(key, result): a call's signature (None off CUDA) and, where that signature made a
    single replayable launch before, the result of replaying it on call_tensors, else
    NOT_PLANNED. A call that is not replayed launches inside capturing(key, ...)."""
    key = _call_key(backend, call_tensors, *flags)
    if key is None:
        return None, launch_plan.NOT_PLANNED
    return key, _replayed(key, call_tensors)


@contextlib.contextmanager
def capturing(key: tuple | None, call_tensors: tuple):
    """Runs a call's launches and, where the call signature is new, remembers whether
    it made a single replayable launch (launch_plan.remember_call)."""
    if key is None or launch_plan.call_plan(key) is not None:
        yield
        return
    outer, _local.launches = getattr(_local, "launches", None), []
    try:
        yield
        launch_plan.remember_call(key, _local.launches, call_tensors)
    finally:
        _local.launches = outer


# (launcher, config) that did not fit this process's GPU -> the smaller config that
# did. Empty on the GPUs the table was tuned for, so the hot path pays only a truth test.
_fitted: dict = {}


def launch_fitted(launch, config, *args, **kwargs):
    """Launches; a config that does not fit this GPU (shared memory estimates are not
    exact: fp32 tf32x3 dots need more) is shrunk step by step, and the one that fitted is
    launched directly next time (per-call derived configs included). What fits is per
    launcher: a backward that had to shrink must not shrink the forward of the same config
    (a different tile would change its rounding, and lowmem training is bitwise repeatable).
    Each CUDA signature's first launch is recorded as a launch plan, which its later calls
    replay (lik.runtime.launch_plan). Returns (the launcher's result, the config it ran)."""
    requested = config
    if _fitted:
        config = _fitted.get((launch, requested), requested)
    key, tensors = launch_plan.signature(launch, config, args, kwargs)
    # A CUDA launch: its generated module has loaded launch_cache (which imports Triton,
    # so importing lik does not).
    cache = sys.modules.get("lik.runtime.launch_cache")
    if key is not None and cache is not None:
        planned = launch_plan.lookup(key)
        if planned is not launch_plan.NOT_PLANNED:
            plan, ran = planned
            if plan is not None and not cache.hooks_set():
                device = key[-1]
                if device == cache._current_device():
                    _captured(plan, tensors)
                    return plan.replay(tensors, raw_stream(device)), ran
            key = None  # recorded already: launch as the launcher does
        elif not cache.launches_every_kernel_cached(launch):
            launch_plan.remember(key, (None, config))
            key = None
    else:
        key = None
    if key is None:
        _captured(None, None)
    while True:
        log = launch_plan.Recording(tensors) if key is not None else contextlib.nullcontext()
        try:
            with log:
                result = launch(*args, config=config, **kwargs)
        except Exception as error:
            if type(error).__name__ != "OutOfResources":
                raise
            config = _smaller(config)
            if config is None:
                raise
            continue
        if config is not requested:
            _fitted[(launch, requested)] = config
        if key is not None and not log.aliased:
            plan = log.plan(result)
            launch_plan.remember(key, (plan, config))
            _captured(plan, tensors)
        elif key is not None:
            _captured(None, None)
        return result, config


def forward(
    layout: str,
    Q: torch.Tensor,
    D: torch.Tensor,
    q_mask,
    d_mask,
    normalize: bool,
    out: torch.Tensor,
    *,
    backward: str = "none",
    argmax: torch.Tensor | None = None,
    masked_as_zero: bool = False,
) -> torch.Tensor:
    """Scores into `out` (fp32, shaped for the layout) with the generated kernel.

    With a backward strategy, the training variant also writes each query token's winning
    doc token into `argmax` (out.shape + (Lq,): int16, int32 from 2**15 doc tokens; -1
    where no token wins).
    Queries longer than query_chunk's tokens (LQ_CHUNK, fewer where shared memory is
    short) are scored chunk by chunk and summed: exact, since each query token's max is
    independent of the others.
    masked_as_zero: d_mask reads as zeros (a masked doc token competes with similarity 0:
    lik_gen.ir.Mask.as_zero); Triton kernels only.
    """
    lq = Q.shape[1]
    if out.numel() == 0 or lq == 0 or D.shape[-2] == 0:
        if argmax is not None:
            argmax.fill_(-1)  # no winners; on the kernel path the kernel writes every entry
        return out.zero_()
    backend = backends.of(Q)
    if backend == "cpu":  # chunked matmuls (lik.runtime.cpu)
        return cpu.forward(layout, Q, D, q_mask, d_mask, normalize, out, backward=backward,
                           argmax=argmax, masked_as_zero=masked_as_zero)  # fmt: skip
    if backend == "metal":  # the generated Metal kernels
        if masked_as_zero:
            raise NotImplementedError("no Metal kernel reads a doc mask as zeros")
        return metal.forward(
            layout, Q, D, q_mask, d_mask, normalize, out, backward=backward, argmax=argmax
        )
    Q, D = unit_head_stride(Q), unit_head_stride(D)
    q_bytes, d_bytes = validate.byte_mask(q_mask), validate.byte_mask(d_mask)
    call = (out, Q, D, q_bytes, d_bytes, argmax)
    key, replayed = replayed_call(backend, call, "forward", layout, normalize, backward,
                                  masked_as_zero)  # fmt: skip
    if replayed is not launch_plan.NOT_PLANNED:
        return out
    name = variant_name(layout, q_mask is not None, d_mask is not None, normalize, Q.dtype,
                        backward=backward, masked_as_zero=masked_as_zero)  # fmt: skip
    shared = {"D": D}
    if d_bytes is not None:
        shared["d_mask"] = d_bytes
    per_token = {"q_mask": q_bytes, "argmax": argmax}
    with capturing(key, call):
        return launch_in_query_chunks(name, out, Q, per_token, shared, docs=D.shape[0],
                                      doc_tokens=D.shape[-2])  # fmt: skip


def _call_key(backend: str, call_tensors: tuple, *flags) -> tuple | None:
    """A CUDA call's signature for launch_plan's call plans: its flags and each of its
    tensors' launch_plan.tensor_key; None off CUDA."""
    if backend != "triton":
        return None
    return (*flags, *map(launch_plan.tensor_key, call_tensors))


def launch_in_query_chunks(name, out, Q, per_token, shared, *, docs=0, doc_tokens=0,
                           adjust=None):  # fmt: skip
    """Launches variant `name` into out over Q [N, Lq, d] in chunks of at most
    query_chunk's query tokens, whose scores add exactly (a max never spans query tokens).

    per_token: tensors whose last axis is Lq (masks, argmax, scales; None entries are
    left out), sliced with Q; shared: the other launcher arguments, by name. adjust maps
    the looked-up config to the one launched (e.g. a variant's tile minimums).
    """
    module = registry.load(name)
    lq = Q.shape[1]
    per_token = {key: value for key, value in per_token.items() if value is not None}
    sizes = {"docs": docs, "doc_tokens": doc_tokens, "adjust": adjust}
    # One launch, no slicing: the common case (this runs every call).
    tokens = _query_tokens(module, Q, lq)
    if lq <= tokens:
        return launch_keyed(name, module, Q, lq, out, Q=Q, **shared, **per_token, **sizes)
    for start, stop in query_ranges(lq, tokens):
        sliced = {k: v[..., start:stop] for k, v in per_token.items()}
        target = out if start == 0 else torch.empty_like(out)
        chunk = Q[:, start:stop]
        launch_keyed(name, module, chunk, stop - start, target, Q=chunk, **shared, **sliced,
                     **sizes)  # fmt: skip
        if start > 0:
            out += target
    return out


def launch_keyed(name, module, queries, lq, out, *args, docs=0, doc_tokens=0, adjust=None,
                 **kwargs):  # fmt: skip
    """Launches variant `name` (module) into out with its call's config: the key of its
    queries [N, Lq, d] (lq tokens bucketed) and out.numel() outputs, its committed or
    autotuned entry (autotuned here on a key's first call where it has neither), shaped
    for docs x doc_tokens and by adjust. args and kwargs go to module.launch. Returns out."""

    def run(config):
        module.launch(out, *args, config=adjust(config) if adjust else config, **kwargs)
        return out

    config = call_config(name, module, queries, lq, out.numel(), docs=docs, doc_tokens=doc_tokens,
                     run=run)  # fmt: skip
    if adjust is not None:
        config = adjust(config)
    launch_fitted(module.launch, config, out, *args, **kwargs)
    return out


def backward(
    layout: str,
    grad_out: torch.Tensor,
    argmax: torch.Tensor,
    Q: torch.Tensor,
    D: torch.Tensor,
    has_q_mask: bool,
    has_d_mask: bool,
    normalize: bool,
    strategy: str,
    masked_as_zero: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_Q, grad_D) of sum(grad_out * scores) from the argmax the forward saved."""
    lq = Q.shape[1]
    if grad_out.numel() == 0 or lq == 0 or D.shape[-2] == 0:
        return torch.zeros_like(Q), torch.zeros_like(D)
    backend = backends.of(Q)
    if backend == "cpu":
        return cpu.backward(layout, grad_out, argmax, Q, D, has_q_mask, has_d_mask, normalize,
                            strategy, masked_as_zero)  # fmt: skip
    if backend == "metal":  # the generated Metal kernels
        return metal.backward(
            layout, grad_out, argmax, Q, D, has_q_mask, has_d_mask, normalize, strategy
        )
    Q, D = unit_head_stride(Q), unit_head_stride(D)
    call = (grad_out, argmax, Q, D)
    key, grads = replayed_call(backend, call, "backward", layout, has_q_mask, has_d_mask,
                               normalize, strategy, masked_as_zero)  # fmt: skip
    if grads is not launch_plan.NOT_PLANNED:
        return grads
    with capturing(key, call):
        return _backward_in_query_chunks(layout, grad_out, argmax, Q, D, has_q_mask, has_d_mask,
                                         normalize, strategy, masked_as_zero)  # fmt: skip


def _backward_in_query_chunks(layout, grad_out, argmax, Q, D, has_q_mask, has_d_mask,
                              normalize, strategy, masked_as_zero):  # fmt: skip
    # The variant's backward kernels read only the argmax: masked_as_zero names the variant.
    name = variant_name(layout, has_q_mask, has_d_mask, normalize, Q.dtype, backward=strategy,
                        masked_as_zero=masked_as_zero)  # fmt: skip
    module = registry.load(name)
    lq = Q.shape[1]
    grad_q_chunks, grad_d = [], None
    for start, stop in query_ranges(lq, _query_tokens(module, Q, lq)):  # the forward's chunks
        whole = stop - start == lq
        chunk_q = Q if whole else Q[:, start:stop]
        chunk_argmax = argmax if whole else argmax[..., start:stop]

        def run(config, chunk_q=chunk_q, chunk_argmax=chunk_argmax):
            return module.backward(grad_out, chunk_argmax, chunk_q, D, config=config)

        config = call_config(name, module, Q, stop - start, grad_out.numel(), kernel="bwd", run=run)
        (gq, gd), _ = launch_fitted(module.backward, config, grad_out, chunk_argmax, chunk_q, D)
        grad_q_chunks.append(gq)
        grad_d = gd if grad_d is None else grad_d + gd
    grad_q = grad_q_chunks[0] if len(grad_q_chunks) == 1 else torch.cat(grad_q_chunks, dim=1)
    return grad_q, grad_d


def forward_ragged(
    layout: str,
    Q: torch.Tensor,
    D: torch.Tensor,
    tensors: dict[str, torch.Tensor],
    max_seqlen_q: int,
    normalize: bool,
    out: torch.Tensor,
    *,
    backward: str = "none",
    argmax: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scores packed sequences (varlen: all pairs; packed_pairs: listed pairs) into `out`.

    The Lq bucket comes from max_seqlen_q, so the many distinct maxima of real batches
    share a handful of compiled kernels.
    """
    # Only an empty output returns early: with no query tokens (max_seqlen_q == 0) or no doc
    # tokens the kernels still check every offset and index, and poison what is bad.
    if out.numel() == 0:
        if argmax is not None:
            argmax.fill_(-1)
        return out.zero_()
    Q, D = unit_head_stride(Q), unit_head_stride(D)
    # A signature seen before passed the checks below: its launch replays.
    call = (out, Q, D, *tensors.values(), argmax)
    key, replayed = replayed_call(backends.of(Q), call, "forward_ragged", layout, max_seqlen_q,
                                  normalize, backward)  # fmt: skip
    if replayed is not launch_plan.NOT_PLANNED:
        return out
    name = variant_name(layout, False, False, normalize, Q.dtype, backward=backward)
    module = registry.load(name)
    fitting = heuristics.query_chunk(module, Q)
    if max_seqlen_q > fitting:  # packed queries cannot be scored in token chunks
        raise ValueError(
            f"max_seqlen_q={max_seqlen_q}: {Q.dtype} queries of head dim {Q.shape[-1]} fit "
            f"this GPU's shared memory {fitting} tokens at a time, and ragged queries are "
            "scored whole; use maxsim on a padded batch (it scores long queries in chunks), "
            "or bf16/fp16 queries"
        )
    extra = {"argmax": argmax} if argmax is not None else {}
    # Every packed query scores every doc (varlen): queries stack in the query tile.
    adjust = None
    if layout == "varlen":
        adjust = functools.partial(stack_ragged_queries, queries=out.shape[0])
    with capturing(key, call):
        launch_keyed(name, module, Q, max_seqlen_q, out, Q, D, **tensors,
                     max_seqlen_q=max_seqlen_q, adjust=adjust, **extra)  # fmt: skip
    return out


def backward_ragged(
    layout: str,
    grad_out: torch.Tensor,
    argmax: torch.Tensor,
    Q: torch.Tensor,
    D: torch.Tensor,
    tensors: dict[str, torch.Tensor],
    max_seqlen_q: int,
    normalize: bool,
    strategy: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    # No token can have won here: zero gradients, whatever the offsets (a pair poisoned
    # with NaN takes no gradient on any path).
    if grad_out.numel() == 0 or max_seqlen_q == 0 or D.shape[0] == 0 or Q.shape[0] == 0:
        return torch.zeros_like(Q), torch.zeros_like(D)
    Q, D = unit_head_stride(Q), unit_head_stride(D)
    call = (grad_out, argmax, Q, D, *tensors.values())
    key, grads = replayed_call(backends.of(Q), call, "backward_ragged", layout, max_seqlen_q,
                               normalize, strategy)  # fmt: skip
    if grads is not launch_plan.NOT_PLANNED:
        return grads
    name = variant_name(layout, False, False, normalize, Q.dtype, backward=strategy)
    module = registry.load(name)

    def run(config):
        return module.backward(grad_out, argmax, Q, D, **tensors, max_seqlen_q=max_seqlen_q,
                               config=config)  # fmt: skip

    config = call_config(name, module, Q, max_seqlen_q, grad_out.numel(), kernel="bwd", run=run)
    with capturing(key, call):
        grads, _ = launch_fitted(module.backward, config, grad_out, argmax, Q, D, **tensors,
                                 max_seqlen_q=max_seqlen_q)  # fmt: skip
    return grads


def topk_candidates(Q, D, q_mask, d_mask, normalize: bool, k: int):
    """Each doc block's best top_k (scores fp32, docs int64) per query, from the top-k
    epilogue: [Nq, blocks, K] each, with K = k rounded up to a power of two. Empty
    slots score -inf with negative docs. Q [Nq, Lq, d] of at most query_chunk tokens,
    D [Nd, Ld, d]."""
    name = variant_name("dense", q_mask is not None, d_mask is not None, normalize, Q.dtype,
                        op="topk")  # fmt: skip
    module = registry.load(name)
    Q, D = unit_head_stride(Q), unit_head_stride(D)
    Nq, Nd = Q.shape[0], D.shape[0]
    config = call_config(name, module, Q, Q.shape[1], Nq * Nd)
    groups = -(-Nq // config.query_group)
    docs = topk_docs_per_program(Nd, groups)
    config = dataclasses.replace(config, top_k=next_power_of_two(k), docs_per_program=docs)
    blocks = -(-Nd // docs)
    scores = torch.empty((Nq, blocks, config.top_k), dtype=torch.float32, device=Q.device)
    doc_ids = torch.empty((Nq, blocks, config.top_k), dtype=torch.int64, device=Q.device)
    masks = {}
    if q_mask is not None:
        masks["q_mask"] = validate.byte_mask(q_mask)
    if d_mask is not None:
        masks["d_mask"] = validate.byte_mask(d_mask)
    launch_fitted(module.launch, config, scores, Q, D, cand_docs=doc_ids, **masks)
    return scores, doc_ids
