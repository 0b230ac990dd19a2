"""Launch heuristics: how a call's config is shaped for its sizes, each rule beside the
measurement that set its constants.

Query tokens per launch (shared memory); streaming blocks of short docs; token ranges of
few long docs (programs per wave); peeling a partial last tile; nesting docs under a
stacked query tile; evict-first loads for a rerank of a few L2s of docs; stacking packed
queries; the top-k epilogue's doc blocks. The tuning table (lik.runtime.tuning) gives a
key's tiles; these derive the per-call values from them.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from lik.runtime import backends, registry
from lik.runtime.keys import (
    LQ_CHUNK,
    MIN_BLOCK,
    cuda_index,
    gpu_family,
    next_power_of_two,
    padded_head_dim,
    query_bucket,
    variant_name,
)
from lik.runtime.tuning import (
    DEFAULT_SMEM_LIMIT,
    SMEM_LIMIT,
    LaunchConfig,
    stacked_queries,
    tile_warps,
)

# Query tokens per launch that fit every family's shared memory whatever the variant
# (fp32 at head dim 256 under the smallest limit): shorter queries skip query_chunk.
ALWAYS_FITTING_QUERY_TOKENS = 32


def query_chunk(module, Q: torch.Tensor) -> int:
    """Query tokens a launch of `module` scores at most on Q's device: LQ_CHUNK, or fewer
    where a tile of that many query tokens and the smallest doc tile would not fit its
    shared memory (fp32 at head dim 256 on an H100 or H200: 64; bf16 there: 256)."""
    return family_query_chunk(module, Q.shape[-1], gpu_family(Q.device))


def layout_query_chunk(layout: str, Q: torch.Tensor, op: str = "maxsim") -> int:
    """query_chunk of `layout`'s `op` kernels for Q, whose masked and normalizing variants
    share one tile model; LQ_CHUNK where Q takes the reference path."""
    if backends.of(Q) not in backends.GENERATED_TRITON:
        return LQ_CHUNK
    return query_chunk(registry.load(variant_name(layout, False, False, False, Q.dtype, op=op)), Q)


def family_query_chunk(module, d: int, family: str) -> int:
    """query_chunk for head dim d on a GPU of `family` ("interpreter": LQ_CHUNK, no shared
    memory to run out of)."""
    if family == "interpreter":
        return LQ_CHUNK
    return _fitting_query_tokens(module.smem_bytes, padded_head_dim(d),
                                 SMEM_LIMIT.get(family, DEFAULT_SMEM_LIMIT))  # fmt: skip


@functools.cache
def _fitting_query_tokens(smem_bytes, head_dim: int, limit: int) -> int:
    tokens = LQ_CHUNK
    while tokens > MIN_BLOCK and smem_bytes(tokens, MIN_BLOCK, head_dim, 1) > limit:
        tokens //= 2
    return tokens



# Dense inference kernels can stream a block of docs through each program (see
# lik_gen.plan.streams_docs). Only docs of at most STREAM_MAX_TILES tiles stream: on an
# H200, streaming took corpus-100k (Ld 128) from 4.81 to 3.80 ms, while docs of 5+ tiles
# lost 10-25% to the per-step bookkeeping (inbatch-256 0.357 -> 0.407 ms). Blocks are
# sized for about STREAM_TARGET_PROGRAMS programs, a power of two within the bounds.
STREAM_MAX_TILES = 2
STREAM_TARGET_PROGRAMS = 1024
STREAM_DOCS_PER_PROGRAM = (1, 64)


def docs_per_program(nd: int, groups: int, target: int, bounds: tuple[int, int]) -> int:
    """Docs each program walks so that `groups` query groups over nd docs make about
    `target` programs: a power of two within bounds."""
    low, high = bounds
    return min(high, max(low, next_power_of_two(-(-nd * groups // target))))


def stream_docs_per_program(nd: int, groups: int) -> int:
    """Docs per program of a streamed forward over nd docs and `groups` query groups."""
    return docs_per_program(nd, groups, STREAM_TARGET_PROGRAMS, STREAM_DOCS_PER_PROGRAM)


def streamed_blocks(config, nq: int, nd: int, ld: int) -> int:
    """DOCS_PER_PROGRAM of a streaming kernel's call: 1 (one program per doc) unless the
    docs are short enough to stream."""
    if -(-ld // config.block_l) > STREAM_MAX_TILES:
        return 1
    return stream_docs_per_program(nd, -(-nq // config.query_group))


# Few long docs leave most of the GPU idle with one program per (query group, doc):
# longdoc (16 queries x 32 docs of 8192 tokens) makes 64 programs for 132 SMs. Such docs
# split into token ranges (DOC_SPLITS) so that the programs make about one wave: as many
# as the GPU holds at once (programs_per_wave), within a power of two. Each range is at
# least SPLIT_MIN_TILES tiles long so its loads still pipeline, and calls of
# SPLIT_MAX_PROGRAMS programs or more keep whole docs (1000 docs of 1024 tokens ran 2-18%
# slower in 2-8 ranges: commit 4906768; on an H200,
# 1000 docs of 300 tokens 28 -> 34 us at best: commit f6a76bd). On an H100
# (commit d2c3490) longdoc takes 4 ranges (0.120 ms
# unsplit, 0.057 split); against a fixed 256-program target, one query over 64 docs of
# 8192 tokens at d 48 takes 32 ranges instead of 4 (GPU time 0.033 -> 0.025 ms).
SPLIT_MIN_TILES = 4
SPLIT_MAX_PROGRAMS = 256
# The last range reduces the others' maxima with their loads unrolled 64 at a time, so
# that compile time stays flat past that (commit e24bb39). One doc of
# 2**20 tokens: H100 0.152 ms in 128 ranges, 0.102 in 256, 0.104 in 512; H200 0.150 in
# 128, 0.090 in 256.
SPLIT_MAX_RANGES = 256
# What bounds the programs an SM holds: its shared memory and its registers, at this many
# per thread (the compiler's count is known only after compiling).
REGISTERS_PER_THREAD = 128


@dataclasses.dataclass(frozen=True)
class Multiprocessors:
    count: int
    shared_memory: int  # bytes per SM
    registers: int = 65536  # 32-bit registers per SM


# Off CUDA (the interpreter, or `make tune` planning on a CPU), splits are derived as on
# an H100 SXM.
H100_MULTIPROCESSORS = Multiprocessors(132, 228 * 1024)


@functools.cache
def _cuda_multiprocessors(index: int) -> Multiprocessors:
    # Cached: device properties cost microseconds, and are read once per call shape.
    count = torch.cuda.get_device_properties(index).multi_processor_count
    family = gpu_family(torch.device("cuda", index))
    return Multiprocessors(count, SMEM_LIMIT.get(family, DEFAULT_SMEM_LIMIT) + 1024)


def multiprocessors(device: torch.device) -> Multiprocessors:
    """The SMs of a CUDA device (their count, and the shared memory and registers each
    holds), or an H100's off CUDA."""
    if device.type != "cuda":
        return H100_MULTIPROCESSORS
    return _cuda_multiprocessors(cuda_index(device))


def programs_per_wave(config, smem_bytes: int, sms: Multiprocessors) -> int:
    """Programs of a config (smem_bytes of shared memory each, plus the 1 KB the
    hardware reserves per program) that the GPU runs at once."""
    per_sm = min(
        sms.shared_memory // (smem_bytes + 1024),
        sms.registers // (REGISTERS_PER_THREAD * 32 * config.num_warps),
    )
    return sms.count * max(1, per_sm)


def _power_of_two_at_most(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def doc_splits(config, nq: int, nd: int, ld: int, wave: int) -> int:
    """Token ranges each doc of an unstreamed (one doc per program) forward splits into,
    for about `wave` programs (programs_per_wave)."""
    programs = -(-nq // config.query_group) * nd
    tiles = -(-ld // config.block_l)
    if programs >= SPLIT_MAX_PROGRAMS or tiles < 2 * SPLIT_MIN_TILES:
        return 1
    wanted = 1 << max(0, round(math.log2(wave / programs)))  # the nearest power of two
    return min(wanted, _power_of_two_at_most(tiles // SPLIT_MIN_TILES), SPLIT_MAX_RANGES)


# A doc of whole tiles and a partial last one can score the whole ones without a length
# mask and the partial one once, after the loop, in a tile just wide enough for it (the
# launcher's tail_tile: Ld 200 in 64-token tiles leaves 8 tokens, scored in a 16-token
# tile). That pays where the tensor cores bound the call: stacked query tiles of at least
# PEEL_MIN_ROWS rows, and docs of PEEL_MIN_TILES whole tiles, or of NARROW_PEEL_MIN_TILES
# when the last tile narrows. On an H200 (commit 9f51040,
# each line one shape: unpeeled, then peeled in a full and in a narrow last tile),
# 256 x 256 queries and docs: Ld 130 0.253 -> 0.211 ms, Ld 200 0.296 -> 0.256, Ld 300
# 0.354 -> 0.343; a thin single-query rerank loses to the last load, which is not
# pipelined (1000 docs of 520 tokens: 0.0489 -> 0.0496 ms, 0.0520 in a full tile).
PEEL_MIN_ROWS = 128
PEEL_MIN_TILES = 4
NARROW_PEEL_MIN_TILES = 2


def peels_tail(config, ld: int) -> bool:
    """Whether a one-doc-per-program forward over docs of ld tokens peels their partial
    last tile (see PEEL_MIN_ROWS)."""
    whole, left = divmod(ld, config.block_l)
    if left == 0 or config.query_group * config.block_q < PEEL_MIN_ROWS:
        return False
    narrows = max(16, left) <= config.block_l // 2  # tail_tile(ld, block_l) < block_l
    return whole >= (NARROW_PEEL_MIN_TILES if narrows else PEEL_MIN_TILES)


# Docs of more tiles than stream (above) still walk a few docs per program, each in its
# own tile loop, under a stacked query tile of at least NEST_MIN_ROWS rows: such a tile
# (256 rows x 128 dims: 64 KB) costs about as much to load as the doc's tiles, and is
# loaded once for all of them. Blocks are sized for about NEST_TARGET_PROGRAMS programs.
# Measured on an H200 (commit 0a14a52), 8 docs per
# program on 4 warps against one: 256 x 256 queries and docs at Ld 300 0.340 -> 0.325
# ms, at Ld 192 0.219 -> 0.186; 16 x 20000 at Ld 300 1.84 -> 1.65. On 8 warps 2-4 docs
# gained at most 4% and lost up to 15%, and 16 docs ran 2-4x slower.
NEST_MIN_ROWS = 128
NEST_TARGET_PROGRAMS = 1024
NEST_DOCS_PER_PROGRAM = (1, 8)
NEST_MAX_WARPS = 4


def nested_docs_per_program(config, nq: int, nd: int) -> int:
    """Docs each program of an unstreamed, unsplit forward walks, one tile loop each."""
    if config.query_group * config.block_q < NEST_MIN_ROWS or config.num_warps > NEST_MAX_WARPS:
        return 1
    groups = -(-nq // config.query_group)
    return docs_per_program(nd, groups, NEST_TARGET_PROGRAMS, NEST_DOCS_PER_PROGRAM)


# A rerank by one thin query tile (at most ONCE_MAX_ROWS rows: it reads each doc once)
# of more than an L2 of docs but at most a few (ONCE_DOC_BYTES) loads its doc tiles
# straight to registers with an evict-first hint instead of pipelining them: L2 lines
# that earlier kernels left dirty then stay put instead of being written back as the docs
# stream through, up to an L2 (50 MB) of writes the rerank would otherwise wait on.
# Triton's pipelined loads carry no such hint. Such loads want their own tile and warps,
# so they have their own tuning key (kernel "once"; defaults: lik.runtime.tuning).
# On an H100 (commit 3411533; do_bench overwrites L2
# before each call): 1000 docs of 300 tokens 0.040 -> 0.037 ms, of 512 0.059 -> 0.056,
# lateon-edge 0.049 -> 0.047; under an L2 of docs the lean pipeline lost (100 docs of
# 180 tokens 0.010 -> 0.013), and at 1000 docs of 1024 tokens (262 MB) it gained nothing.
ONCE_MAX_ROWS = 64
ONCE_DOC_BYTES = (64 << 20, 128 << 20)


def loads_docs_once(config, nq: int, doc_bytes: int) -> bool:
    """Whether an unsplit, unblocked streaming forward takes the evict-first loads above."""
    rows = config.query_group * config.block_q
    low, high = ONCE_DOC_BYTES
    return rows <= ONCE_MAX_ROWS and nq <= config.query_group and low < doc_bytes <= high


def streamed(config, nq: int, nd: int, ld: int, doc_bytes: int = 0, *, wave: int):
    """A streaming kernel's config for one call: blocks of short docs per program in one
    flat loop; token ranges of few long docs (for about `wave` programs), or blocks of
    many; long docs with a partial last tile peel it; a small rerank's docs load once,
    unpipelined, with evict-first hints (their tile and warps then come from the "once"
    key: with_once_tiles). doc_bytes: the docs' size (0: unknown, no such loads). (Called
    once per call shape: _config remembers the result.)"""
    blocks = streamed_blocks(config, nq, nd, ld)
    if blocks > 1:
        return dataclasses.replace(config, docs_per_program=blocks, flat_docs=True)
    splits = doc_splits(config, nq, nd, ld, wave)
    nested = nested_docs_per_program(config, nq, nd) if splits == 1 else 1
    config = dataclasses.replace(config, docs_per_program=nested, flat_docs=False,
                                 doc_splits=splits, peel_tail=peels_tail(config, ld))  # fmt: skip
    if splits == 1 and loads_docs_once(config, nq, doc_bytes):
        return dataclasses.replace(config, num_stages=1, evict_docs=True)
    return config


def with_once_tiles(config, once):
    """A docs-once config (streamed) with the doc tile and warps of `once`, the config of
    its call's "once" key: loads in registers want other tiles than pipelined ones."""
    return dataclasses.replace(config, block_l=once.block_l, num_warps=once.num_warps)


def stream_config(module, config, once_config, nq: int, nd: int, ld: int, dense_bytes: int,
                  device):  # fmt: skip
    """A streaming module's call config from its key's (streamed_for), with the tile and
    warps of its "once" key's config (once_config(), asked only then) where its docs load
    once. Calls and `lik explain` both go through here."""
    config = streamed_for(module, config, nq, nd, ld, dense_bytes, device)
    return with_once_tiles(config, once_config()) if config.evict_docs else config


def wave_for(module, config, device) -> int:
    """programs_per_wave of a module's config on `device` (an H100's off CUDA)."""
    rows = config.block_q * config.query_group
    smem = module.smem_bytes(rows, config.block_l, config.block_k, config.num_stages)
    return programs_per_wave(config, smem, multiprocessors(device))


def streamed_for(module, config, nq: int, nd: int, ld: int, dense_bytes: int, device):
    """streamed() for a streaming module's call on `device`, whose docs take dense_bytes
    stored uncompressed; modules whose doc loads take no evict-first hint (compressed PLAID
    docs) never get those loads. Calls and `make tune` both shape configs through here."""
    hinted = getattr(module, "EVICT_DOCS_OPTION", False)
    wave = wave_for(module, config, device)
    return streamed(config, nq, nd, ld, dense_bytes if hinted else 0, wave=wave)


def stack_ragged_queries(config: LaunchConfig, *, queries: int) -> LaunchConfig:
    """A varlen forward's config with the padded default's query stacking and at least
    that tile's default warps (tuning.stacked_queries, tuning.tile_warps; BLOCK_Q is
    max_seqlen_q's bucket). Its key has no query count (Q is packed tokens), so the group
    is set per call, as padded batches' keys set it."""
    return _stacked(config, query_bucket(queries))


@functools.lru_cache(maxsize=256)
def _stacked(config: LaunchConfig, queries: int) -> LaunchConfig:
    # Cached: replacing the dataclass took ~5 us per call (Python 3.11, a 2-core CPU host).
    group = stacked_queries(queries, config.block_q)
    if group == config.query_group:
        return config
    warps = max(config.num_warps, tile_warps(group * config.block_q))
    return dataclasses.replace(config, query_group=group, num_warps=warps)


# Programs the top-k epilogue aims for; each walks a block of docs, a power of two
# between these bounds. Measured on an H200 (16 queries x 100k docs): 1024 programs
# 5.65 ms, 4096 programs 5.82 ms.
TOPK_TARGET_PROGRAMS = 1024
TOPK_DOCS_PER_PROGRAM = (16, 1024)


def topk_docs_per_program(nd: int, groups: int) -> int:
    """Docs each top-k program walks, over nd docs and `groups` query groups."""
    return docs_per_program(nd, groups, TOPK_TARGET_PROGRAMS, TOPK_DOCS_PER_PROGRAM)
