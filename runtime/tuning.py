"""KernelKey -> LaunchConfig, from the committed tuning tables of the GPU family and card.

Tables live in runtime/tuning/<family>.toml, and a card's own entries (where it differs
from the card the family's were tuned on) in runtime/tuning/<family>/<card>.toml, which
cards whose names extend that card's read too (card_table); `make tune` writes both on a
GPU. A key with neither is swept on its first CUDA call (lik.runtime.autotune, cached
per machine; LIK_AUTOTUNE=0 turns it off), else it gets the family's heuristic default.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import re
import tomllib

from lik.runtime.keys import KernelKey
from lik_gen.ir import Mask, Variant

# Shared memory per block a kernel may claim, by family (bytes). Bigger pipelines are
# cut down to fit rather than failing to launch.
SMEM_LIMIT = {"hopper": 227 * 1024, "blackwell": 227 * 1024, "ampere": 163 * 1024, "ada": 99 * 1024}
DEFAULT_SMEM_LIMIT = 99 * 1024


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    block_q: int
    block_l: int
    block_k: int
    num_warps: int
    num_stages: int
    block_n: int = 8  # docs per program of the unified backward
    query_group: int = 1  # queries stacked per forward program (dense and varlen layouts)
    top_k: int = 1  # candidates kept per query and doc block (top-k epilogue)
    docs_per_program: int = 1  # docs each program of a top-k or streaming forward walks
    flat_docs: bool = False  # streaming forward: its docs in one flat (doc, tile) loop
    doc_splits: int = 1  # token ranges each doc of a streaming forward splits into
    peel_tail: bool = False  # streaming forward: a partial last doc tile after the loop
    evict_docs: bool = False  # streaming forward: doc loads hint L2 to evict them first
    column_argmax: bool = False  # dense training forward: the argmax kept per tile column
    interpret: bool = False


TABLES = importlib.resources.files("lik.runtime") / "tuning"


def table_file(family: str, card: str = "") -> str:
    """A committed table's path under runtime/tuning: <family>.toml, or a card's own
    entries in <family>/<card name, non-alphanumerics as _>.toml."""
    if not card:
        return f"{family}.toml"
    return f"{family}/{re.sub(r'[^A-Za-z0-9]+', '_', card).strip('_')}.toml"


def load_table(family: str, card: str = "") -> dict[str, dict]:
    """The committed table of a family, or of one of its cards ({} if none): table_key ->
    config fields (plus the ms, shape and card it was tuned with)."""
    return _read_table(table_file(family, card))


@functools.cache
def _read_table(name: str) -> dict[str, dict]:
    resource = TABLES.joinpath(*name.split("/"))
    if not resource.is_file():
        return {}
    return tomllib.loads(resource.read_text()).get("configs", {})


def load_tables() -> None:
    """Reads every committed table ahead of the first call (lik.runtime.prewarm)."""
    for resource in TABLES.iterdir():
        if resource.name.endswith(".toml"):
            _read_table(resource.name)
        elif resource.is_dir():
            for card in resource.iterdir():
                if card.name.endswith(".toml"):
                    _read_table(f"{resource.name}/{card.name}")


@functools.cache
def card_table(family: str, card: str) -> str | None:
    """The committed card table (table_file) a card reads: its own, else that of the card
    whose name its own extends, the longest such ("NVIDIA H200 NVL" reads "NVIDIA H200"'s:
    the same chip and memory, another board); None where there is none."""
    folder = TABLES.joinpath(family)
    if not card or not folder.is_dir():
        return None
    tables = {f"{family}/{r.name}" for r in folder.iterdir() if r.name.endswith(".toml")}
    own = table_file(family, card)
    if own in tables:
        return own
    stem = own.removesuffix(".toml")
    extended = [name for name in tables if stem.startswith(name.removesuffix(".toml") + "_")]
    return max(extended, key=len, default=None)


def unmasked_key(key: KernelKey) -> KernelKey | None:
    """The same key for the variant without masks, for a masked variant's key (else None).
    Masks add a load and a select per tile, not another tiling: where a masked variant
    has no entry of its own, its unmasked twin's tuned entry is a closer fit than the
    default (H100, in-batch 256 x 256 with a doc mask: 0.63 -> 0.41 ms, unmasked 0.33;
    commit 50f0d7d)."""
    variant = Variant.parse(key.variant)
    if variant.mask is Mask.NONE:
        return None
    unmasked = dataclasses.replace(variant, mask=Mask.NONE).name
    return dataclasses.replace(key, variant=unmasked)


def committed_source(key: KernelKey) -> tuple[str, str] | None:
    """(table, table key) of the entry a key takes: its own, in its card's table
    (card_table) and then its family's; else its unmasked twin's (unmasked_key), the same
    way; None where there is none (tuning.default_config then)."""
    card = card_table(key.family, key.card)
    tables = [card, table_file(key.family)] if card else [table_file(key.family)]
    for candidate in (key, unmasked_key(key)):
        if candidate is None:
            continue
        for name in tables:
            if candidate.table_key() in _read_table(name):
                return name, candidate.table_key()
    return None


def committed_entry(key: KernelKey) -> dict | None:
    """The entry a key takes (committed_source), None where it has none."""
    source = committed_source(key)
    return None if source is None else _read_table(source[0])[source[1]]


# A query tile of at most THIN_ROWS rows (one short query) is too thin for a warpgroup's
# tensor-core instruction, and its reranks are bound by their loads: fewer warps per
# program are candidates too (H200, colbert-rerank: 2 warps 0.0306 ms, 4 warps 0.0316;
# commit 13a00e6).
THIN_ROWS = 32

# Rows of a stacked query tile: 128 fills a Hopper tensor-core tile (wgmma M = 64 per
# warpgroup, two warpgroups); one 32-token query alone leaves it three-quarters empty.
STACKED_ROWS = 128


def stacked_queries(queries: int, lq: int) -> int:
    """Queries one forward program stacks by default: as many lq-row slots as fill
    STACKED_ROWS rows, and no more than there are queries."""
    return max(1, min(queries, STACKED_ROWS // lq))


def default_query_group(key: KernelKey) -> int:
    return stacked_queries(key.queries, key.lq)


def tile_warps(rows: int) -> int:
    """A forward query tile's default warps: one warpgroup up to 32 rows, else two."""
    return 4 if rows <= 32 else 8


# Warps of a plain lowmem backward's programs: one warpgroup (see default_config).
BACKWARD_WARPS = 4


def one_warpgroup_backward(key: KernelKey) -> bool:
    """A plain lowmem backward's key (not unified, not a token-score variant's): one
    warpgroup, unpipelined, by default, and the warps its call-time sweep keeps."""
    return key.kernel == "bwd" and key.variant.endswith("_lowmem")


# Docs loaded once (unpipelined, evict-first; lik.runtime.heuristics.streamed) keep a tile
# of ONCE_TILE_ELEMENTS in flight per warp by default: one warp of 32 tokens at d 128,
# 64 at d 64. On an H100 (1000 docs of 1024 tokens at d 48, padded to 64), 64-token tiles
# read in 44.5 us where 32-token ones took 48.2 (commit ee7ed93).
ONCE_TILE_ELEMENTS = 4096


def default_config(key: KernelKey) -> dict[str, int]:
    if key.kernel == "once" and key.family != "interpreter":
        return {"block_l": max(16, ONCE_TILE_ELEMENTS // key.head_dim), "num_warps": 1,
                "num_stages": 1, "block_n": 8, "query_group": default_query_group(key)}  # fmt: skip
    if key.family == "interpreter":
        # The interpreter runs whole tiles in numpy: fewer, larger steps are faster.
        return {"block_l": 32, "num_warps": 4, "num_stages": 1, "block_n": 4,
                "query_group": default_query_group(key)}  # fmt: skip
    block_l = 64 if key.head_dim <= 128 else 32
    if one_warpgroup_backward(key):
        # A plain lowmem backward gathers its winners' rows: one warpgroup, unpipelined,
        # was the fastest or within 11% of it on each of nine training steps (H200,
        # in-batch, colpali and KD), where the forward's 8 warps and 3 stages took up to
        # 2.2x as long. Unified backwards (1.5x slower so) and the token-score variants'
        # (1.06-1.12x) keep the forward's rule (commit bb819b4).
        return {"block_l": block_l, "num_warps": BACKWARD_WARPS, "num_stages": 1,
                "block_n": 8, "query_group": default_query_group(key)}  # fmt: skip
    if "_fp8_" in key.variant:
        # 1-byte elements: twice the doc tokens per tile keeps each pipeline stage (and
        # the bytes in flight per program) at the bf16 default's size.
        block_l *= 2
    query_group = default_query_group(key)
    num_warps = tile_warps(key.lq * query_group)
    stages = 3
    if any(f"_res{nbits}" in key.variant for nbits in (2, 4, 8)):
        # Decoding a residual tile (centroid gather, bit unpacking) is register-heavy:
        # unpipelined tiles ran 4-7x faster than 3 stages (H200, 1000 docs, nbits 2: 0.09
        # vs 0.52 ms), and 64-token tiles on 4 warps were the fastest or within 15% of it
        # on each case of benchmarks/bench_plaid.py --sweep (H100, word-read residuals).
        stages = 1
    return {"block_l": block_l, "num_warps": num_warps, "num_stages": stages, "block_n": 8,
            "query_group": query_group}  # fmt: skip


def config_for(key: KernelKey, smem_bytes, entry: dict | None = None) -> LaunchConfig:
    """The launch config for a key: `entry` where given (an autotuned one), else its
    committed entry, else the default; smem_bytes(BLOCK_Q, BLOCK_L, BLOCK_K, stages) caps
    its query stacking and stages."""
    entry = entry or committed_entry(key) or default_config(key)
    stages = entry["num_stages"]
    limit = SMEM_LIMIT.get(key.family, DEFAULT_SMEM_LIMIT)
    query_group = entry.get("query_group", 1)
    # Fewer stacked queries where even one stage would not fit (fp32 at head dim 256),
    # then fewer stages.
    while query_group > 1 and smem_bytes(key.lq * query_group, entry["block_l"],
                                         key.head_dim, 1) > limit:  # fmt: skip
        query_group //= 2
    rows = key.lq * query_group
    while stages > 1 and smem_bytes(rows, entry["block_l"], key.head_dim, stages) > limit:
        stages -= 1
    return LaunchConfig(
        block_q=key.lq,
        block_l=entry["block_l"],
        block_k=key.head_dim,
        num_warps=entry["num_warps"],
        num_stages=stages,
        block_n=entry.get("block_n", 8),
        query_group=query_group,
        column_argmax=entry.get("column_argmax", False),
        interpret=key.family == "interpreter",
    )
