"""Planning for the scaled fp8 (e4m3) family: which variants its kernel serves, and the
per-token dequantization scales that kernel reads.

Both scale granularities share one kernel: the runtime expands a per-tensor scale to the
per-token shape with stride 0, so the kernel always reads scale_Q[query, s] and
scale_D[doc, t] through strides.
"""

from __future__ import annotations

from lik_gen.ir import Decompression, DType, Layout, Op, Score, Variant

SCALED_DTYPES = frozenset({DType.FP8E4M3})

# (kernel argument, launcher expression, stride prefix, stride axes) per scale tensor:
# scale_Q [Nq, Lq] and scale_D [Nd, Ld], fp32.
SCALE_TENSORS = (
    ("scale_Q", "scale_Q", "sq", ("b", "s")),
    ("scale_D", "scale_D", "sd", ("b", "t")),
)


def is_scaled(variant: Variant) -> bool:
    """Whether the variant's inputs carry dequantization scales (fp8 storage)."""
    return variant.dtype in SCALED_DTYPES


def unsupported(variant: Variant) -> str | None:
    """Why the scaled kernel cannot serve this fp8 variant, or None when it can."""
    if not is_scaled(variant):
        return None
    if variant.op is not Op.MAXSIM or variant.layout is not Layout.DENSE:
        return "fp8 inputs are scored by the dense MaxSim forward only (op maxsim, layout dense)"
    if variant.decompression is not Decompression.NONE:
        return "fp8 inputs are stored uncompressed (decompression none)"
    if variant.score is not Score.MAX:
        return "fp8 inputs are scored with the built-in max (score max)"
    return None
