"""What a `maxsim(Q, D)` call of a given shape launches, and why (`lik explain`):
its generated kernel, tuning key and entry, launch config and strategy, derived by the
same functions a call goes through (dispatch), for a GPU family's committed table.

Off CUDA, or for another family than the local GPU's, the SM count is an H100's, as in
`make tune`'s planning. The config is the one before any out-of-resources shrink, which
only a launch can find."""

from __future__ import annotations

import dataclasses

import torch

from lik.runtime import autotune, configs, heuristics, registry, validate
from lik.runtime.api import AUTO_RULE, choose_backward
from lik.runtime.keys import (
    LQ_CHUNK,
    KernelKey,
    gpu_card,
    gpu_family,
    lq_bucket,
    padded_head_dim,
    query_bucket,
    size_class,
    variant_name,
)
from lik.runtime.tuning import LaunchConfig, committed_source, config_for, table_file


@dataclasses.dataclass(frozen=True)
class BackwardPlan:
    strategy: str  # "unified" or "lowmem", as api.choose_backward picks it
    reason: str  # why that strategy
    key: KernelKey  # the backward kernels' key ("bwd")
    source: tuple[str, str] | None  # as ForwardPlan.source
    autotuned: bool
    config: LaunchConfig


@dataclasses.dataclass(frozen=True)
class ForwardPlan:
    shape: tuple[int, int, int, int, int]  # Nq, Nd, Lq, Ld, d
    dtype: torch.dtype
    key: KernelKey  # the forward key of the first query chunk
    # (table, table key) of the entry key takes (tuning.committed_source: its own, or a
    # masked variant's unmasked twin's), or None
    source: tuple[str, str] | None
    once_source: tuple[str, str] | None  # the same for the "once" key (docs loaded once)
    masks: str  # the call's mask arguments: "", "q_mask", "d_mask" or "q_mask, d_mask"
    autotuned: bool  # no committed entry; the config comes from this machine's autotune cache
    config: LaunchConfig  # as launched: doc blocks, token ranges, tail peel, once tiles
    chunks: int  # launches over query-token chunks of at most query_chunk tokens
    query_chunk: int  # LQ_CHUNK, or fewer where shared memory is short (heuristics.query_chunk)
    wave: int  # programs of this config the GPU holds at once
    backward: BackwardPlan | None = None  # a training call's (inputs requiring grad)

    @property
    def table(self) -> str | None:
        """The table whose entry the key takes, or None (the default config)."""
        return None if self.source is None else self.source[0]

    @property
    def programs(self) -> int:
        """Programs of one launch (one query chunk)."""
        nq, nd = self.shape[:2]
        groups = -(-nq // self.config.query_group)
        docs = -(-nd // self.config.docs_per_program)
        return groups * docs * self.config.doc_splits



def key_for(shape, family: str, dtype: torch.dtype = torch.bfloat16, card: str = "", *,
            q_mask: bool = False, d_mask: bool = False,
            backward: str = "none") -> KernelKey:  # fmt: skip
    """The KernelKey dispatch builds for a maxsim(Q, D) call of this shape on a card of the
    family, with a query and/or doc mask where asked, and for a training call the forward
    key of its backward strategy's variant (see configs.call_config; queries longer than
    LQ_CHUNK tokens are keyed by their first chunk). card "": the family's own entries
    alone."""
    _, nq, nd, lq, _, d = shape
    name = variant_name("dense", q_mask, d_mask, False, dtype, backward=backward)
    return KernelKey(name, family, padded_head_dim(d), lq_bucket(min(lq, LQ_CHUNK)),
                     size_class(nq * nd), query_bucket(nq), card=card)  # fmt: skip


def once_key(shape, family: str, card: str = "") -> KernelKey | None:
    """The "once" key of a plain forward of this shape whose docs load once, else None;
    decided from its forward key's committed config (or default), as a call decides it."""
    _, nq, nd, lq, ld, d = shape
    key = key_for(shape, family, card=card)
    module = registry.load(key.variant)
    config = config_for(key, module.smem_bytes)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # cpu: as on an H100
    if not heuristics.streamed_for(module, config, nq, nd, ld, nd * ld * d * 2, device).evict_docs:
        return None
    return dataclasses.replace(key, kernel="once")


def explain_forward(
    shape, *, dtype: torch.dtype = torch.bfloat16, family: str | None = None,
    card: str | None = None, q_mask: bool = False, d_mask: bool = False,
    backward: str | None = None,
) -> ForwardPlan:  # fmt: skip
    """The plan of maxsim(Q [Nq, Lq, d], D [Nd, Ld, d]) in `dtype` for shape (Nq, Nd, Lq,
    Ld, d), with a query and/or doc mask where asked, on `family`'s table (default: the
    local CUDA GPU's, else "hopper") and, first, `card`'s own (default: the local GPU's
    where it is of that family, else none). backward ("auto", "unified" or "lowmem"):
    the plan of a training call with that argument, its backward's included."""
    nq, nd, lq, ld, d = (int(size) for size in shape)
    if min(nq, nd, lq, ld, d) < 1:
        raise ValueError(f"shape must be five positive sizes (Nq, Nd, Lq, Ld, d), got {shape}")
    # The call's own checks, on tensors that hold no data.
    validate.head_dims(torch.empty(nq, lq, d, device="meta"), torch.empty(nd, ld, d, device="meta"))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if family is None:
        family = gpu_family(device) if device.type == "cuda" else "hopper"
    elif device.type == "cuda" and family != gpu_family(device):
        device = torch.device("cpu")  # another GPU's plan: an H100's SM count
    if card is None:
        card = gpu_card(device)
    strategy = "none" if backward is None else choose_backward(backward, "dense", nq, nd)

    def call_key(query_tokens):
        return key_for(("call", nq, nd, query_tokens, ld, d), family, dtype, card,
                       q_mask=q_mask, d_mask=d_mask, backward=strategy)  # fmt: skip

    key = call_key(lq)
    module = registry.load(key.variant)
    chunk = heuristics.family_query_chunk(module, d, family)
    if lq > chunk:  # keyed by its first chunk
        key = call_key(chunk)
    once = dataclasses.replace(key, kernel="once")
    # A key without an entry takes the one its first CUDA call on this card autotuned.
    tuned = configs.autotuned_entry(key, torch.device("cuda"))
    key_config = config_for(key, module.smem_bytes, tuned)
    config = heuristics.stream_config(
        module, key_config, lambda: config_for(once, module.smem_bytes),
        nq, nd, ld, nd * ld * d * dtype.itemsize, device,
    )  # fmt: skip
    return ForwardPlan(
        shape=(nq, nd, lq, ld, d),
        dtype=dtype,
        key=key,
        source=committed_source(key),
        once_source=committed_source(once),
        masks=", ".join(name for name, on in (("q_mask", q_mask), ("d_mask", d_mask)) if on),
        autotuned=tuned is not None,
        config=config,
        chunks=-(-lq // chunk),
        query_chunk=chunk,
        wave=heuristics.wave_for(module, config, device),
        backward=None if backward is None else _backward_plan(backward, strategy, key, module),
    )


def _backward_plan(asked: str, strategy: str, key: KernelKey, module) -> BackwardPlan:
    """The backward of a training call whose forward key is `key`: the strategy and why,
    its key (the forward's, kernel "bwd") and that key's config."""
    if asked != "auto":
        reason = "asked"
    else:
        reason = f"auto: {AUTO_RULE}"
    bwd_key = dataclasses.replace(key, kernel="bwd")
    tuned = configs.autotuned_entry(bwd_key, torch.device("cuda"))
    return BackwardPlan(strategy=strategy, reason=reason, key=bwd_key,
                        source=committed_source(bwd_key), autotuned=tuned is not None,
                        config=config_for(bwd_key, module.smem_bytes, tuned))  # fmt: skip


def strategy_lines(plan: ForwardPlan) -> list[str]:
    """How the launch walks the docs, one line per choice, each with its reason."""
    config, (nq, nd, _, ld, _) = plan.config, plan.shape
    lines = []
    if plan.chunks > 1:
        lines.append(f"{plan.chunks} launches over query chunks of at most {plan.query_chunk} "
                     "tokens, summed (a max never spans query tokens)")  # fmt: skip
    if config.query_group > 1:
        lines.append(f"{config.query_group} queries' tokens stacked per tile "
                     f"({config.query_group * config.block_q} rows): each doc tile is read "
                     "once for all of them")  # fmt: skip
    if config.flat_docs:
        lines.append(f"{config.docs_per_program} short docs per program in one flat loop over "
                     "(doc, tile): the next doc loads while one is scored")  # fmt: skip
    elif config.docs_per_program > 1:
        lines.append(f"{config.docs_per_program} docs per program, each in its own tile loop, "
                     "under the query tile loaded once")  # fmt: skip
    if config.doc_splits > 1:
        lines.append(f"{config.doc_splits} token ranges per doc, so that few long docs fill "
                     f"about one wave ({plan.wave} programs); the last range of a doc to "
                     "finish reduces their maxima")  # fmt: skip
    if config.peel_tail:
        lines.append(f"whole {config.block_l}-token tiles without a length mask, the partial "
                     f"last one ({ld % config.block_l} tokens) after them")  # fmt: skip
    if config.evict_docs:
        lines.append("docs loaded once, unpipelined, with evict-first hints (a thin query "
                     "tile over 64-128 MiB of docs); tile and warps from the once key")  # fmt: skip
    if not lines:
        lines.append(f"one program per (query, doc), {nq} x {nd}, each walking its doc's "
                     f"{-(-ld // config.block_l)} tiles")  # fmt: skip
    return lines


def _entry(key: str, source: tuple[str, str] | None, family: str, *, autotuned=False,
           sweeps=True) -> str:  # fmt: skip
    """Where the entry of table key `key` comes from, as `lik explain` prints it. sweeps:
    a forward or backward key, which its first CUDA call autotunes where it has no entry
    ("once" keys do not)."""
    if autotuned:
        return f"no entry in runtime/tuning; autotuned on this machine, {autotune.cache_path()}"
    if source is None:
        later = " until its first CUDA call autotunes it" if sweeps else ""
        return f"no entry in runtime/tuning/{table_file(family)}: the default config{later}"
    table, taken = source
    if taken != key:
        return f"none of its own: its unmasked twin's, {taken} in runtime/tuning/{table}"
    return f"entry in runtime/tuning/{table}"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def render(plan: ForwardPlan) -> str:
    """The plan as the text `lik explain` prints."""
    nq, nd, lq, ld, d = plan.shape
    config = plan.config
    dtype = str(plan.dtype).removeprefix("torch.")
    family = plan.key.family
    gpus = f"{plan.key.card} ({family} family)" if plan.key.card else f"{family} GPUs"
    masks = f", {plan.masks}" if plan.masks else ""
    if plan.backward is not None:
        asked = plan.backward.strategy if plan.backward.reason == "asked" else "auto"
        masks += f', backward="{asked}"'
    key = plan.key.table_key()
    lines = [
        f"maxsim(Q [{nq}, {lq}, {d}], D [{nd}, {ld}, {d}]{masks}) in {dtype}, {gpus}",
        f"  kernel    {plan.key.variant} (generated/{registry.kernel_file(plan.key.variant)})",
        f"  key       {key} ({_entry(key, plan.source, family, autotuned=plan.autotuned)})",
    ]
    if config.evict_docs:
        once = _entry(f"{key}|once", plan.once_source, family, sweeps=False)
        lines.append(f"  once key  {key}|once ({once})")
    lines += [
        f"  config    {config.block_q}-row query tiles x {config.block_l}-token doc tiles, "
        f"head dim {config.block_k}; {_count(config.num_warps, 'warp')}, "
        f"{_count(config.num_stages, 'stage')}",
        f"  programs  {plan.programs} per launch; {plan.wave} fit at once",
    ]
    strategy = strategy_lines(plan)
    lines.append(f"  strategy  {strategy[0]}")
    lines += [f"            {line}" for line in strategy[1:]]
    if plan.backward is not None:
        lines += backward_lines(plan.backward)
    return "\n".join(lines)


def backward_lines(plan: BackwardPlan) -> list[str]:
    """A training call's backward: strategy, key and config, as `lik explain` prints them."""
    config, key = plan.config, plan.key.table_key()
    warps = f"{_count(config.num_warps, 'warp')}"
    if plan.strategy == "unified":  # one kernel: (query, doc block) programs, fp32 atomics
        tiling = f"{config.block_n} docs per program, fp32 atomics then a cast pass; {warps}"
    else:
        tiling = (f"{config.block_l}-token doc tiles, each gradient element from one owner; "
                  f"{warps}, {_count(config.num_stages, 'stage')}")  # fmt: skip
    entry = _entry(key, plan.source, plan.key.family, autotuned=plan.autotuned)
    return [
        f"  backward  {plan.strategy} ({plan.reason})",
        f"  bwd key   {key} ({entry})",
        f"  bwd tiles {tiling}",
    ]
