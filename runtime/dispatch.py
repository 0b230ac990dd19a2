"""Validated call -> KernelKey -> generated kernel -> launch, for the op families'
kernel backends (lik.runtime.backends picks the backend: Triton on CUDA or under the
interpreter, lik.runtime.metal on MPS).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

import torch

from lik.runtime import autotune, backends, launch_plan, metal, registry, validate
from lik.runtime.keys import (
    LQ_CHUNK,
    MIN_BLOCK,
    KernelKey,
    cuda_index,
    gpu_card,
    gpu_family,
    lq_bucket,
    next_power_of_two,
    padded_head_dim,
    query_bucket,
    size_class,
    variant_name,
)
from lik.runtime.launch_cache import _current_device, hooks_set, launches_every_kernel_cached
from lik.runtime.tuning import (
    BACKWARD_WARPS,
    DEFAULT_SMEM_LIMIT,
    SMEM_LIMIT,
    STACKED_ROWS,
    LaunchConfig,
    committed_source,
    config_for,
    default_config,
    one_warpgroup_backward,
    stacked_queries,
    tile_warps,
)
from lik.runtime.workspace import raw_stream


def unit_head_stride(t: torch.Tensor) -> torch.Tensor:
    """t with its last (head dim) axis contiguous, copied where it is not. Kernels read
    tiles along that axis: with another stride their loads do not coalesce, and Triton
    3.6 miscompiles the nested-docs loop over docs stored token-major (an illegal address
    on an H200: D [1111, 202, 100] of strides (20200, 1, 202), 8 docs per program)."""
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _chunks(lq: int, chunk: int = LQ_CHUNK):
    """Query-token ranges scored per launch: `chunk` tokens at most."""
    return [(start, min(lq, start + chunk)) for start in range(0, lq, chunk)]


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


_configs: dict[KernelKey, object] = {}  # a key's config, looked up once (_key_config)

# Dense inference kernels can stream a block of docs through each program (see
# lik_gen.plan.streams_docs). Only docs of at most STREAM_MAX_TILES tiles stream: on an
# H200, streaming took corpus-100k (Ld 128) from 4.81 to 3.80 ms, while docs of 5+ tiles
# lost 10-25% to the per-step bookkeeping (inbatch-256 0.357 -> 0.407 ms). Blocks are
# sized for about STREAM_TARGET_PROGRAMS programs, a power of two within the bounds.
STREAM_MAX_TILES = 2
STREAM_TARGET_PROGRAMS = 1024
STREAM_DOCS_PER_PROGRAM = (1, 64)


def _docs_per_program(nd: int, groups: int, target: int, bounds: tuple[int, int]) -> int:
    """Docs each program walks so that `groups` query groups over nd docs make about
    `target` programs: a power of two within bounds."""
    low, high = bounds
    return min(high, max(low, next_power_of_two(-(-nd * groups // target))))


def stream_docs_per_program(nd: int, groups: int) -> int:
    """Docs per program of a streamed forward over nd docs and `groups` query groups."""
    return _docs_per_program(nd, groups, STREAM_TARGET_PROGRAMS, STREAM_DOCS_PER_PROGRAM)


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
    return _docs_per_program(nd, groups, NEST_TARGET_PROGRAMS, NEST_DOCS_PER_PROGRAM)


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


def _call_key(name: str, module, Q: torch.Tensor, lq: int, programs: int, kernel: str):
    """The KernelKey of a call of variant `name` (module) with queries Q."""
    queries = query_bucket(Q.shape[0]) if module.LAYOUT == "dense" else 1
    return KernelKey(name, gpu_family(Q.device), padded_head_dim(Q.shape[-1]), lq_bucket(lq),
                     size_class(programs), queries, kernel, gpu_card(Q.device))  # fmt: skip


def _key_config(name: str, module, Q: torch.Tensor, lq: int, programs: int, kernel: str):
    """The config of a call's tuning key (committed entry, autotuned entry or default),
    looked up once per key."""
    key = _call_key(name, module, Q, lq, programs, kernel)
    config = _configs.get(key)
    if config is None:
        entry = autotuned_entry(key, Q.device)
        config = _configs.setdefault(key, config_for(key, module.smem_bytes, entry))
    return config


def autotuned_entry(key: KernelKey, device: torch.device) -> dict | None:
    """A key's autotuned entry, where it has no committed one and autotune applies (a call
    on `device`; lik explain asks as for a CUDA call)."""
    if not autotune.applies(key, device) or committed_source(key) is not None:
        return None
    return autotune.cached_entry(key)


def _keyed_config(
    name: str, module, Q: torch.Tensor, lq: int, programs: int, docs: int, doc_tokens: int,
    kernel: str, key_config=None,
):  # fmt: skip
    """The launch config of a call: its tuning key's config (or key_config in its place),
    then, for kernels that stream docs, the doc blocks or token ranges `docs` and
    `doc_tokens` (Nd and Ld) call for, and for docs loaded once the tile and warps of the
    "once" key."""
    config = key_config or _key_config(name, module, Q, lq, programs, kernel)
    if not getattr(module, "DOC_STREAM", False):  # streaming modules: never a "bwd" key
        return config
    dense_bytes = docs * doc_tokens * Q.shape[-1] * Q.element_size()
    return stream_config(module, config, lambda: _key_config(name, module, Q, lq, programs, "once"),
                         Q.shape[0], docs, doc_tokens, dense_bytes, Q.device)  # fmt: skip


def _autotune(name: str, module, Q: torch.Tensor, lq: int, programs: int, docs: int,
              doc_tokens: int, kernel: str, run) -> None:  # fmt: skip
    """Sweeps the call's `kernel` key ("fwd" or "bwd"), once, where no table and no
    earlier sweep covers it (lik.runtime.autotune): each candidate entry is shaped into a
    launch config as the call would shape the key's entry, configs that shape alike are
    timed once, and run(config) launches the call with it and returns its output(s)."""
    key = _call_key(name, module, Q, lq, programs, kernel)
    if not autotune.applies(key, Q.device) or autotune.capturing(Q.device):
        return
    if committed_source(key) is not None or autotune.cached_entry(key) is not None:
        return
    base = default_config(key)
    backward = kernel == "bwd"
    # Queries stack in forward tiles only; a backward keeps the key's default.
    stackable = base["query_group"] if backward else min(key.queries, 2 * STACKED_ROWS // key.lq)
    # 2 and 8 warps won none of nine plain lowmem backwards (tuning.default_config).
    warps = (BACKWARD_WARPS,) if one_warpgroup_backward(key) else None
    entries, launched = [], {}
    for entry in autotune.candidates(base, lq=key.lq, max_query_group=max(1, stackable),
                                     backward=backward, warps=warps):  # fmt: skip
        key_config = config_for(key, module.smem_bytes, entry)
        config = _keyed_config(name, module, Q, lq, programs, docs, doc_tokens, kernel,
                               key_config)  # fmt: skip
        if config not in launched.values():
            entries.append(entry)
            launched[id(entry)] = config
    docs_shape = f", D [{docs}, {doc_tokens}, {Q.shape[-1]}]" if docs else ""
    shape = f"call-time sweep: Q {list(Q.shape)}{docs_shape}, {programs} outputs"
    if autotune.sweep(key, entries, lambda entry: run(launched[id(entry)]), Q.device, shape,
                      graph=backward):  # fmt: skip
        _configs.pop(key, None)  # the key's config is the winner's from now on


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


# Each call's config by its exact sizes: shapes repeat from call to call, so the hot path
# is one dict hit instead of bucketing and the per-call derivations (a rerank kernel takes
# ~30 us; every microsecond of host work per call shows on small calls). Cleared when
# full, so a stream of distinct shapes cannot grow it without bound.
_call_configs: dict[tuple, object] = {}
CALL_CONFIG_CACHE_SIZE = 4096


def _config(
    name: str, module, Q: torch.Tensor, lq: int, programs: int, *, docs=0, doc_tokens=0,
    kernel="fwd", run=None,
):  # fmt: skip
    """The launch config of a call (see _keyed_config), remembered per call shape.
    kernel: "fwd", or "bwd" for a training variant's backward kernels. run(config) -> its
    output(s), where given, launches the call: a key without an entry is autotuned with it."""
    call = (name, Q.get_device(), Q.shape[0], Q.shape[-1], lq, programs, docs, doc_tokens,
            kernel)  # fmt: skip
    config = _call_configs.get(call)
    if config is None:
        if len(_call_configs) >= CALL_CONFIG_CACHE_SIZE:
            _call_configs.clear()
        if run is not None:
            _autotune(name, module, Q, lq, programs, docs, doc_tokens, kernel, run)
        config = _keyed_config(name, module, Q, lq, programs, docs, doc_tokens, kernel)
        _call_configs[call] = config
    return config


def _smaller(config):
    """The next config down when a launch runs out of shared memory or registers."""
    if config.query_group > 1:
        return dataclasses.replace(config, query_group=config.query_group // 2)
    if config.num_stages > 1:
        return dataclasses.replace(config, num_stages=config.num_stages - 1)
    if config.block_l > 16:
        return dataclasses.replace(config, block_l=config.block_l // 2)
    return None


# (launcher, config) that did not fit this process's GPU -> the smaller config that
# did. Empty on the GPUs the table was tuned for, so the hot path pays only a truth test.
_fitted: dict = {}


def _launch(launch, config, *args, **kwargs):
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
    if key is not None:
        planned = launch_plan.lookup(key)
        if planned is not launch_plan.NOT_PLANNED:
            plan, ran = planned
            if plan is not None and not hooks_set():
                device = key[-1]
                if device == _current_device():
                    return plan.replay(tensors, raw_stream(device)), ran
            key = None  # recorded already: launch as the launcher does
        elif not launches_every_kernel_cached(launch):
            launch_plan.remember(key, (None, config))
            key = None
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
        if key is not None:
            launch_plan.remember(key, (log.plan(result), config))
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
    if backends.of(Q) == "metal":  # the generated Metal kernels
        if masked_as_zero:
            raise NotImplementedError("no Metal kernel reads a doc mask as zeros")
        return metal.forward(
            layout, Q, D, q_mask, d_mask, normalize, out, backward=backward, argmax=argmax
        )
    name = variant_name(layout, q_mask is not None, d_mask is not None, normalize, Q.dtype,
                        backward=backward, masked_as_zero=masked_as_zero)  # fmt: skip
    Q, D = unit_head_stride(Q), unit_head_stride(D)
    shared = {"D": D}
    if d_mask is not None:
        shared["d_mask"] = validate.byte_mask(d_mask)
    per_token = {"q_mask": validate.byte_mask(q_mask), "argmax": argmax}
    return launch_in_query_chunks(name, out, Q, per_token, shared, docs=D.shape[0],
                                  doc_tokens=D.shape[-2])  # fmt: skip


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
    tokens = LQ_CHUNK if lq <= ALWAYS_FITTING_QUERY_TOKENS else query_chunk(module, Q)
    if lq <= tokens:
        return launch_keyed(name, module, Q, lq, out, Q=Q, **shared, **per_token, **sizes)
    for start, stop in _chunks(lq, tokens):
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

    config = _config(name, module, queries, lq, out.numel(), docs=docs, doc_tokens=doc_tokens,
                     run=run)  # fmt: skip
    if adjust is not None:
        config = adjust(config)
    _launch(module.launch, config, out, *args, **kwargs)
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
    if backends.of(Q) == "metal":  # the generated Metal kernels
        return metal.backward(
            layout, grad_out, argmax, Q, D, has_q_mask, has_d_mask, normalize, strategy
        )
    # The variant's backward kernels read only the argmax: masked_as_zero names the variant.
    name = variant_name(layout, has_q_mask, has_d_mask, normalize, Q.dtype, backward=strategy,
                        masked_as_zero=masked_as_zero)  # fmt: skip
    module = registry.load(name)
    Q, D = unit_head_stride(Q), unit_head_stride(D)
    grad_q_chunks, grad_d = [], None
    for start, stop in _chunks(lq, query_chunk(module, Q)):  # the forward's chunks
        whole = stop - start == lq
        chunk_q = Q if whole else Q[:, start:stop]
        chunk_argmax = argmax if whole else argmax[..., start:stop]

        def run(config, chunk_q=chunk_q, chunk_argmax=chunk_argmax):
            return module.backward(grad_out, chunk_argmax, chunk_q, D, config=config)

        config = _config(name, module, Q, stop - start, grad_out.numel(), kernel="bwd", run=run)
        (gq, gd), _ = _launch(module.backward, config, grad_out, chunk_argmax, chunk_q, D)
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
    name = variant_name(layout, False, False, normalize, Q.dtype, backward=backward)
    module = registry.load(name)
    Q, D = unit_head_stride(Q), unit_head_stride(D)
    fitting = query_chunk(module, Q)
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
    launch_keyed(name, module, Q, max_seqlen_q, out, Q, D, **tensors, max_seqlen_q=max_seqlen_q,
                 adjust=adjust, **extra)  # fmt: skip
    return out


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
    name = variant_name(layout, False, False, normalize, Q.dtype, backward=strategy)
    module = registry.load(name)
    Q, D = unit_head_stride(Q), unit_head_stride(D)

    def run(config):
        return module.backward(grad_out, argmax, Q, D, **tensors, max_seqlen_q=max_seqlen_q,
                               config=config)  # fmt: skip

    config = _config(name, module, Q, max_seqlen_q, grad_out.numel(), kernel="bwd", run=run)
    grads, _ = _launch(
        module.backward, config, grad_out, argmax, Q, D, **tensors, max_seqlen_q=max_seqlen_q
    )
    return grads


# Programs the top-k epilogue aims for; each walks a block of docs, a power of two
# between these bounds. Measured on an H200 (16 queries x 100k docs): 1024 programs
# 5.65 ms, 4096 programs 5.82 ms.
TOPK_TARGET_PROGRAMS = 1024
TOPK_DOCS_PER_PROGRAM = (16, 1024)


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
    config = _config(name, module, Q, Q.shape[1], Nq * Nd)
    groups = -(-Nq // config.query_group)
    docs = _docs_per_program(Nd, groups, TOPK_TARGET_PROGRAMS, TOPK_DOCS_PER_PROGRAM)
    config = dataclasses.replace(config, top_k=next_power_of_two(k), docs_per_program=docs)
    blocks = -(-Nd // docs)
    scores = torch.empty((Nq, blocks, config.top_k), dtype=torch.float32, device=Q.device)
    doc_ids = torch.empty((Nq, blocks, config.top_k), dtype=torch.int64, device=Q.device)
    masks = {}
    if q_mask is not None:
        masks["q_mask"] = validate.byte_mask(q_mask)
    if d_mask is not None:
        masks["d_mask"] = validate.byte_mask(d_mask)
    _launch(module.launch, config, scores, Q, D, cand_docs=doc_ids, **masks)
    return scores, doc_ids
