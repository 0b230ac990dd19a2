"""Planning for PLAID residual-compressed documents (decompression residual2/4/8).

A residual variant is the uncompressed variant of the same layout with its doc source
swapped: instead of D [.., Ld, d] the kernel reads PLAID's compressed tokens and decodes
them tile by tile in the `load_doc_tile` hook (templates/triton/load_doc_tile/residual.py.j2):

    codes           dense [B, Ld] / varlen [T]          int32 or int64 centroid ids
    residuals       dense [B, Ld, P] / varlen [T, P]    uint8, P = ceil(d * nbits / 8)
    centroids       [n_centroids, d]                    the variant's dtype
    bucket_weights  [2 ** nbits]                        fp16, bf16 or fp32
    doc_lengths     dense only, [B]                     valid tokens per doc, in [0, Ld]

so this module plans the uncompressed variant and replaces its doc tensors, their strides
and sizes; everything else (query tiles, normalization, reduction, grid) is shared.

The launcher also takes residuals as their int32 word view ([.., P / 4], P a multiple of 4,
rows 4-byte aligned: lik.runtime.plaid passes that view whenever torch can make it); the
kernel then reads whole words per token (constexpr RESIDUAL_WORDS, set from the dtype).
"""

from __future__ import annotations

import dataclasses

from lik_gen.ir import Backward, Decompression, DType, Layout, Mask, Op, Score, Variant
from lik_gen.plan import KernelArg, PlanError, RenderContext, plan

RESIDUAL_BITS = {
    Decompression.RESIDUAL2: 2,
    Decompression.RESIDUAL4: 4,
    Decompression.RESIDUAL8: 8,
}
RESIDUAL_HOOK = "triton/load_doc_tile/residual.py.j2"

# Per layout: the doc tensors (kernel argument, launcher name, stride prefix, axes).
_CODES = {Layout.DENSE: ("b", "t"), Layout.VARLEN: ("t",)}
_RESIDUALS = {Layout.DENSE: ("b", "t", "p"), Layout.VARLEN: ("t", "p")}


def is_residual(variant: Variant) -> bool:
    return variant.decompression in RESIDUAL_BITS


def _unsupported(variant: Variant) -> str | None:
    if variant.op is not Op.MAXSIM or variant.layout not in _CODES:
        return "residual docs are scored by the MaxSim forward, layout dense or varlen"
    if variant.mask is not Mask.NONE:
        return "residual docs carry lengths (doc_lengths or cu_seqlens_d), not masks"
    if variant.backward is not Backward.NONE or variant.score is not Score.MAX:
        return "residual docs have a forward only (the runtime derives grad_Q in PyTorch)"
    if variant.dtype is DType.FP8E4M3:
        return "residual centroids are fp32, fp16 or bf16"
    return None


def _strides(prefix: str, tensor: str, axes: tuple[str, ...]) -> list[KernelArg]:
    return [
        KernelArg(f"stride_{prefix}{axis}", f"{tensor}.stride({i})") for i, axis in enumerate(axes)
    ]


def plan_residual(variant: Variant) -> RenderContext:
    problem = _unsupported(variant)
    if problem is not None:
        raise PlanError(f"{variant.name}: {problem}")
    base = plan(dataclasses.replace(variant, decompression=Decompression.NONE))
    layout = variant.layout
    dense = layout is Layout.DENSE
    doc_tensors = [
        KernelArg("Codes", "codes"),
        KernelArg("Residuals", "residuals"),
        KernelArg("Centroids", "centroids"),
        KernelArg("BucketWeights", "bucket_weights"),
    ] + ([KernelArg("DocLengths", "doc_lengths")] if dense else [])
    doc_strides = (
        _strides("c", "codes", _CODES[layout])
        + _strides("r", "residuals", _RESIDUALS[layout])
        + _strides("cent", "centroids", ("n", "k"))
        + _strides("w", "bucket_weights", ("b",))
        + (_strides("len", "doc_lengths", ("b",)) if dense else [])
    )
    args: list[KernelArg] = []
    for arg in base.fwd_args:
        if arg.name == "D":
            args += doc_tensors
        elif arg.expr.startswith("D.stride"):  # D's strides give way to the doc tensors'
            if doc_strides[0] not in args:
                args += doc_strides
        else:
            args.append(arg)
        if arg.name == "dim":
            args.append(KernelArg("n_centroids", "n_centroids"))
    launcher = ["Q", "codes", "residuals", "centroids", "bucket_weights"]
    launcher += ["doc_lengths"] if dense else []
    launcher += [name for name in base.launcher_args if name not in ("Q", "D")]
    sizes = [KernelArg(s.name, s.expr.replace("D.shape", "codes.shape")) for s in base.size_exprs]
    sizes.append(KernelArg("n_centroids", "centroids.shape[0]"))
    tile_inputs = ("Codes", "Residuals", "Centroids", "BucketWeights", "code_base",
                   "residual_base")
    tile_params = ("stride_ct", "stride_rt", "stride_rp", "stride_centn", "stride_centk",
                   "stride_wb", "n_centroids", "RESIDUAL_WORDS")
    if variant.decompression is not Decompression.RESIDUAL4:
        tile_params += ("EVEN_K",)
    # nbits 2 loads each tile's centroid ids a tile ahead and scores its decoded tiles as
    # the left MMA operand (residual.py.j2 says why).
    nbits2 = variant.decompression is Decompression.RESIDUAL2
    ahead = ("Codes", "code_base", "stride_ct") if nbits2 else ()
    return dataclasses.replace(
        base,
        name=variant.name,
        purpose="forward over PLAID residual-compressed documents",
        fwd_args=tuple(args),
        fwd_dynamic=tuple(base.fwd_dynamic) + ("n_centroids",),
        size_exprs=tuple(sizes),
        launcher_args=tuple(launcher),
        doc_tile_hook=RESIDUAL_HOOK,
        # What _doc_tile_ahead reads, _load_doc_tile does not (it takes that result).
        doc_tile_inputs=tuple(a for a in tile_inputs if a not in ahead),
        doc_tile_params=tuple(a for a in tile_params if a not in ahead),
        doc_bases=(("code_base", "c"), ("residual_base", "r")),
        doc_lengths=dense,
        doc_tile_ahead=ahead,
        doc_token_rows=nbits2,
        even_tiles=False,  # a doc ends at its own length
        nbits=RESIDUAL_BITS[variant.decompression],
    )  # fmt: skip
