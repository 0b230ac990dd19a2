"""Planning for PLAID residual-compressed documents (decompression residual2/4/8).

A residual kernel is the uncompressed kernel of the same layout with its doc source
swapped: instead of D [.., Ld, d] the kernel reads PLAID's compressed tokens and decodes
them tile by tile in the `load_doc_tile` hook (templates/triton/load_doc_tile/residual.py.j2):

    codes           dense [B, Ld] / varlen [T]          int32 or int64 centroid ids
    residuals       dense [B, Ld, P] / varlen [T, P]    uint8, P = ceil(d * nbits / 8)
    centroids       [n_centroids, d]                    the variant's dtype
    bucket_weights  [2 ** nbits]                        fp16, bf16 or fp32
    doc_lengths     dense only, [B]                     valid tokens per doc, in [0, Ld]

so this module plans the doc source part (lik_gen.plan_base.DocSource) that the Triton
planner composes in place of uncompressed D; everything else (query tiles,
normalization, reduction, grid) is shared.

The launcher also takes residuals as their int32 word view ([.., P / 4], P a multiple of 4,
rows 4-byte aligned: lik.runtime.plaid passes that view whenever torch can make it); the
kernel then reads whole words per token (constexpr RESIDUAL_WORDS, set from the dtype).
"""

from __future__ import annotations

from lik_gen.ir import Decompression, Kernel, Layout
from lik_gen.plan_base import DocSource, KernelArg, PlanError, strides

RESIDUAL_BITS = {
    Decompression.RESIDUAL2: 2,
    Decompression.RESIDUAL4: 4,
    Decompression.RESIDUAL8: 8,
}
RESIDUAL_HOOK = "triton/load_doc_tile/residual.py.j2"

# Per layout: the stride axes of the codes and the residuals.
_CODES = {Layout.DENSE: ("b", "t"), Layout.VARLEN: ("t",)}
_RESIDUALS = {Layout.DENSE: ("b", "t", "p"), Layout.VARLEN: ("t", "p")}


def residual_docs(kernel: Kernel) -> DocSource:
    """PLAID residual docs: codes, residuals, centroids and bucket weights (plus per-doc
    lengths, dense), decoded in the doc-tile hook. The spec's contradictions already keep
    residual kernels to the MaxSim forward over dense or varlen docs."""
    layout = kernel.layout
    if layout not in _CODES:
        raise PlanError(f"{kernel.name}: residual docs are scored in the dense and varlen layouts")
    dense = layout is Layout.DENSE
    tensors = [
        KernelArg("Codes", "codes"),
        KernelArg("Residuals", "residuals"),
        KernelArg("Centroids", "centroids"),
        KernelArg("BucketWeights", "bucket_weights"),
    ] + ([KernelArg("DocLengths", "doc_lengths")] if dense else [])
    doc_strides = (
        strides("c", "codes", _CODES[layout])
        + strides("r", "residuals", _RESIDUALS[layout])
        + strides("cent", "centroids", ("n", "k"))
        + strides("w", "bucket_weights", ("b",))
        + (strides("len", "doc_lengths", ("b",)) if dense else [])
    )
    tile_inputs = ("Codes", "Residuals", "Centroids", "BucketWeights", "code_base", "residual_base")
    tile_params = (
        "stride_ct",
        "stride_rt",
        "stride_rp",
        "stride_centn",
        "stride_centk",
        "stride_wb",
        "n_centroids",
        "RESIDUAL_WORDS",
    )
    if kernel.decompression is not Decompression.RESIDUAL4:
        tile_params += ("EVEN_K",)
    # nbits 2 loads each tile's centroid ids a tile ahead and scores its decoded tiles as
    # the left MMA operand (residual.py.j2 says why).
    nbits2 = kernel.decompression is Decompression.RESIDUAL2
    ahead = ("Codes", "code_base", "stride_ct") if nbits2 else ()
    return DocSource(
        hook=RESIDUAL_HOOK,
        tensors=tuple(tensors),
        strides=tuple(doc_strides),
        launcher=("codes", "residuals", "centroids", "bucket_weights")
        + (("doc_lengths",) if dense else ()),
        shape_of="codes",
        # What _doc_tile_ahead reads, _load_doc_tile does not (it takes that result).
        tile_inputs=tuple(a for a in tile_inputs if a not in ahead),
        tile_params=tuple(a for a in tile_params if a not in ahead),
        bases=(("code_base", "c"), ("residual_base", "r")),
        lengths=dense,
        ahead=ahead,
        token_rows=nbits2,
        nbits=RESIDUAL_BITS[kernel.decompression],
        sizes=(KernelArg("n_centroids", "centroids.shape[0]"),),
        dot_dtype_of="centroids",
    )  # fmt: skip
