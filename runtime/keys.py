"""Call -> KernelKey: which generated variant, and which tuning bucket, serves a call.

Nq, Nd and Ld never enter a key (they are runtime arguments of every kernel); the head
dim and the query length enter only as buckets, so new shapes reuse compiled kernels.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from lik_gen.ir import (
    MAX_HEAD_DIM,  # noqa: F401  (re-exported: the runtime reads limits through keys)
    Backward,
    Decompression,
    Layout,
    Mask,
    Op,
    Score,
    Target,
    Variant,
    dtype_of,
)

# Longest query one launch scores; longer queries are cut into chunks of this many
# tokens whose per-chunk sums add up exactly (a max never spans query tokens).
LQ_CHUNK = 512
MIN_BLOCK = 16  # tl.dot needs every tile dimension >= 16

# fp8 has its own entry (lik.runtime.fp8), so it names variants but is not a maxsim dtype.
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def next_power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def padded_head_dim(d: int) -> int:
    return max(MIN_BLOCK, next_power_of_two(d))


def lq_bucket(lq: int) -> int:
    return min(LQ_CHUNK, max(MIN_BLOCK, next_power_of_two(lq)))


def size_class(programs: int) -> str:
    """Coarse grid size: tiny launches want latency-lean configs, big ones throughput."""
    if programs < 1024:
        return "s"
    if programs < 65536:
        return "m"
    return "l"


def cuda_index(device: torch.device) -> int:
    """The index of a CUDA device, the current one where it names none ("cuda")."""
    return torch.cuda.current_device() if device.index is None else device.index


def gpu_family(device: torch.device) -> str:
    """Tuning-table family of a device: the GPU generation, or 'interpreter' on CPU."""
    if device.type != "cuda":
        return "interpreter"
    return _cuda_family(cuda_index(device))


def gpu_card(device: torch.device) -> str:
    """The GPU's name ("NVIDIA H200"), whose own tuning entries come before its family's;
    "" off CUDA."""
    if device.type != "cuda":
        return ""
    return _cuda_card(cuda_index(device))


@functools.cache  # a driver query, as the capability's; read once per device
def _cuda_card(index: int) -> str:
    return torch.cuda.get_device_name(index)


@functools.cache
def _cuda_family(index: int) -> str:
    # Cached: reading the capability costs ~10 us per call, in calls of a few tens of us.
    major, minor = torch.cuda.get_device_capability(index)
    if torch.version.hip is not None:
        return "rocm"
    if major >= 10:
        return "blackwell"
    if major == 9:
        return "hopper"
    if (major, minor) == (8, 9):
        return "ada"
    if major == 8:
        return "ampere"
    return "older"


@functools.cache  # a handful of distinct names; looked up every call
def variant_name(
    layout: str,
    has_q_mask: bool,
    has_d_mask: bool,
    normalize: bool,
    dtype: torch.dtype,
    target: str = "triton",
    backward: str = "none",
    op: str = "maxsim",
    score: str = "max",
    decompression: str = "none",
    masked_as_zero: bool = False,
) -> str:
    """The canonical generated-variant name of a call, built by lik_gen.ir.Variant;
    masked_as_zero reads its doc mask as zeros (Mask.as_zero)."""
    return Variant(
        op=Op(op),
        layout=Layout(layout),
        mask=Mask.of(has_q_mask, has_d_mask, masked_as_zero),
        dtype=dtype_of(dtype),
        target=Target(target),
        normalize=normalize,
        decompression=Decompression(decompression),
        backward=Backward(backward),
        score=Score(score),
    ).name


MAX_QUERY_GROUP = 8


def query_bucket(nq: int) -> int:
    """How many queries one program could stack: a power of two, at most MAX_QUERY_GROUP."""
    return min(MAX_QUERY_GROUP, next_power_of_two(max(1, nq)))


@dataclasses.dataclass(frozen=True)
class KernelKey:
    variant: str
    family: str
    head_dim: int  # padded to a power of two
    lq: int  # Lq bucket
    size: str  # size_class of the grid
    queries: int = 1  # query_bucket(Nq) for layouts that stack queries (dense), else 1
    # "fwd"; "bwd" for a training variant's backward kernels: they tile differently from
    # its forward (grad_D's one-hot dots) and are tuned apart; "once" for the tile and
    # warps of a small rerank's unpipelined, evict-first doc loads (heuristics.streamed).
    kernel: str = "fwd"
    # The GPU's name (gpu_card): cards of one family differ in bandwidth (an H200 reads
    # 1.4x as fast as an H100), so a card's own table, where it has one, comes first.
    # Not part of the table key.
    card: str = ""

    def table_key(self) -> str:
        key = f"{self.variant}|{self.head_dim}|{self.lq}|{self.size}|q{self.queries}"
        return key if self.kernel == "fwd" else f"{key}|{self.kernel}"
