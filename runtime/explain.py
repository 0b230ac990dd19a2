"""What a plain `maxsim(Q, D)` call of a given shape launches, and why (`lik explain`):
its generated kernel, tuning key and entry, launch config and strategy, derived by the
same functions a call goes through (dispatch), for a GPU family's committed table.

Off CUDA, or for another family than the local GPU's, the SM count is an H100's, as in
`make tune`'s planning. The config is the one before any out-of-resources shrink, which
only a launch can find."""

from __future__ import annotations

import dataclasses

import torch

from lik.runtime import dispatch, registry, tune, validate
from lik.runtime.keys import LQ_CHUNK, KernelKey, gpu_family
from lik.runtime.tuning import LaunchConfig, config_for, load_table


@dataclasses.dataclass(frozen=True)
class ForwardPlan:
    shape: tuple[int, int, int, int, int]  # Nq, Nd, Lq, Ld, d
    dtype: torch.dtype
    key: KernelKey  # the forward key of the first query chunk
    tuned: bool  # the family's table has an entry for key (else tuning.default_config)
    once_tuned: bool | None  # the same for the "once" key, where docs load once
    config: LaunchConfig  # as launched: doc blocks, token ranges, tail peel, once tiles
    chunks: int  # launches over query-token chunks of at most LQ_CHUNK tokens
    wave: int  # programs of this config the GPU holds at once

    @property
    def programs(self) -> int:
        """Programs of one launch (one query chunk)."""
        nq, nd = self.shape[:2]
        groups = -(-nq // self.config.query_group)
        docs = -(-nd // self.config.docs_per_program)
        return groups * docs * self.config.doc_splits


def explain_forward(
    shape, *, dtype: torch.dtype = torch.bfloat16, family: str | None = None
) -> ForwardPlan:
    """The plan of maxsim(Q [Nq, Lq, d], D [Nd, Ld, d]) in `dtype` for shape (Nq, Nd, Lq,
    Ld, d), on `family`'s table (default: the local CUDA GPU's, else "hopper")."""
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
    key = tune.key_for(("call", nq, nd, lq, ld, d), family, dtype)
    module = registry.load(key.variant)
    once_key = dataclasses.replace(key, kernel="once")
    table = load_table(family)
    key_config = config_for(key, module.smem_bytes)
    config = dispatch.stream_config(
        module, key_config, lambda: config_for(once_key, module.smem_bytes),
        nq, nd, ld, nd * ld * d * dtype.itemsize, device,
    )  # fmt: skip
    return ForwardPlan(
        shape=(nq, nd, lq, ld, d),
        dtype=dtype,
        key=key,
        tuned=key.table_key() in table,
        once_tuned=(once_key.table_key() in table) if config.evict_docs else None,
        config=config,
        chunks=-(-lq // LQ_CHUNK),
        wave=dispatch.wave_for(module, config, device),
    )


def strategy_lines(plan: ForwardPlan) -> list[str]:
    """How the launch walks the docs, one line per choice, each with its reason."""
    config, (nq, nd, _, ld, _) = plan.config, plan.shape
    lines = []
    if plan.chunks > 1:
        lines.append(f"{plan.chunks} launches over query chunks of at most {LQ_CHUNK} tokens, "
                     "summed (a max never spans query tokens)")  # fmt: skip
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


def _entry(tuned: bool, table: str) -> str:
    return f"entry in {table}" if tuned else f"no entry in {table}: the default config"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def render(plan: ForwardPlan) -> str:
    """The plan as the text `lik explain` prints."""
    nq, nd, lq, ld, d = plan.shape
    config = plan.config
    dtype = str(plan.dtype).removeprefix("torch.")
    table = f"runtime/tuning/{plan.key.family}.toml"
    lines = [
        f"maxsim(Q [{nq}, {lq}, {d}], D [{nd}, {ld}, {d}]) in {dtype}, {plan.key.family} GPUs",
        f"  kernel    {plan.key.variant} (generated/triton/{plan.key.variant}.py)",
        f"  key       {plan.key.table_key()} ({_entry(plan.tuned, table)})",
    ]
    if plan.once_tuned is not None:
        lines.append(f"  once key  {plan.key.table_key()}|once ({_entry(plan.once_tuned, table)})")
    lines += [
        f"  config    {config.block_q}-row query tiles x {config.block_l}-token doc tiles, "
        f"head dim {config.block_k}; {_count(config.num_warps, 'warp')}, "
        f"{_count(config.num_stages, 'stage')}",
        f"  programs  {plan.programs} per launch; {plan.wave} fit at once",
    ]
    strategy = strategy_lines(plan)
    lines.append(f"  strategy  {strategy[0]}")
    lines += [f"            {line}" for line in strategy[1:]]
    return "\n".join(lines)
