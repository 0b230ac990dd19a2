"""The variant IR: one frozen dataclass over enums, whose canonical name is its identity.

The name is the file stem, the registry key and the custom-op name. Core axes always
appear in it; optional axes only when they differ from their default, in a fixed order,
so adding an axis later renames nothing.

    maxsim_dense_qdmask_bf16_triton            core: op, layout, mask, dtype, target
    maxsim_kd_dmask_fp16_triton_norm_unified   + optional flags that are not default

A variant is a (kernel, constexpr values) pair. Its `kernel` drops the value axes
(VALUE_AXES: mask presence, normalize, input dtype), which change no code structure: one
generated file serves every value, as constexprs (Triton) or function constants (Metal).
The mask axis also says how a doc mask reads (Mask.as_zero: PyLate's convention, the
MASKED_AS_ZERO constexpr of the kernels that take it, Kernel.takes_zero_mask).

    maxsim_dense_triton          every mask, normalize and dtype of dense Triton MaxSim
    maxsim_dense_fp8_triton      fp8 storage carries scale tensors: a kernel of its own
    maxsim_kd_triton_unified     + the optional structural flags, as in the variant name

This module is the one contract between the generator and the runtime: the runtime
builds names with `Variant` and reads the limits below from here.
"""

from __future__ import annotations

import dataclasses
import enum


class Op(enum.Enum):
    MAXSIM = "maxsim"
    # MaxSim scores reduced in the kernel to each block of docs' best candidates per
    # query (retrieval without an [Nq, Nd] buffer).
    TOPK = "topk"
    # Fused projection head: raw doc hidden states are projected (and normalized) inside
    # the MaxSim kernel, so the projected documents never reach memory.
    HEAD = "head"


class Layout(enum.Enum):
    DENSE = "dense"  # D [Nd, Ld, d] -> [Nq, Nd]
    KD = "kd"  # D [Nq, K, Ld, d] -> [Nq, K]
    PAIRS = "pairs"  # D [B, Ld, d] -> [B], query b against doc b
    VARLEN = "varlen"
    PACKED_PAIRS = "packed_pairs"


class Mask(enum.Enum):
    """Which masks a call has. A masked doc token never wins the max (d, qd), or, with
    the doc mask read as zeros (dzero, qdzero: PyLate's convention, whose torch path
    multiplies the similarities by the masks), competes with similarity 0: a query token
    whose best valid similarity is below 0 scores 0 against a doc with a masked token.
    Masked query tokens add 0 either way."""

    NONE = "none"
    Q = "q"
    D = "d"
    QD = "qd"
    D_ZERO = "dzero"
    QD_ZERO = "qdzero"

    @property
    def has_q(self) -> bool:
        return self in (Mask.Q, Mask.QD, Mask.QD_ZERO)

    @property
    def has_d(self) -> bool:
        return self in (Mask.D, Mask.QD, Mask.D_ZERO, Mask.QD_ZERO)

    @property
    def as_zero(self) -> bool:
        """Masked doc tokens compete with similarity 0 (the MASKED_AS_ZERO constexpr)."""
        return self in (Mask.D_ZERO, Mask.QD_ZERO)

    @classmethod
    def of(cls, has_q: bool, has_d: bool, as_zero: bool = False) -> Mask:
        """The mask of a call that has a query mask, a doc mask, both or neither; as_zero
        reads its doc mask as zeros (without a doc mask there is nothing to read)."""
        return _MASK_OF[(bool(has_q), bool(has_d), bool(as_zero) and bool(has_d))]


_MASK_OF = {(False, False, False): Mask.NONE, (True, False, False): Mask.Q,
            (False, True, False): Mask.D, (True, True, False): Mask.QD,
            (False, True, True): Mask.D_ZERO, (True, True, True): Mask.QD_ZERO}  # fmt: skip


class DType(enum.Enum):
    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"
    FP8E4M3 = "fp8e4m3"


class Decompression(enum.Enum):
    NONE = "none"
    RESIDUAL2 = "residual2"
    RESIDUAL4 = "residual4"
    RESIDUAL8 = "residual8"
    CENTROID = "centroid"


class Backward(enum.Enum):
    NONE = "none"
    UNIFIED = "unified"
    LOWMEM = "lowmem"


class Score(enum.Enum):
    """How a query token's similarities to one doc's tokens reduce to its token score."""

    MAX = "max"  # the built-in reduction (argmax saved for the backward)
    WEIGHTED = "weighted"  # max, times a per-query-token weight w[Nq, Lq]
    SMOOTH = "smooth"  # tau * logsumexp(sim / tau) over doc tokens
    TOPK_MEAN = "topk_mean"  # mean of the k best doc tokens (XTR-style), k constexpr


class Target(enum.Enum):
    TRITON = "triton"
    METAL = "metal"


# Every axis of the spec language, in name order. The token tables below spell each
# value inside a variant name; tokens are unique across all axes so parsing is a lookup.
AXES: dict[str, type[enum.Enum]] = {
    "op": Op,
    "layout": Layout,
    "mask": Mask,
    "dtype": DType,
    "target": Target,
    "normalize": bool,  # type: ignore[dict-item]
    "decompression": Decompression,
    "backward": Backward,
    "score": Score,
}
CORE_AXES = ("op", "layout", "mask", "dtype", "target")
OPTIONAL_AXES = ("normalize", "decompression", "backward", "score")
DEFAULTS = {
    "normalize": False,
    "decompression": Decompression.NONE,
    "backward": Backward.NONE,
    "score": Score.MAX,
}

_TOKENS: dict[str, dict[object, str]] = {
    "op": {Op.MAXSIM: "maxsim", Op.TOPK: "topk", Op.HEAD: "head"},
    "layout": {
        Layout.DENSE: "dense",
        Layout.KD: "kd",
        Layout.PAIRS: "pairs",
        Layout.VARLEN: "varlen",
        Layout.PACKED_PAIRS: "packedpairs",
    },
    "mask": {
        Mask.NONE: "nomask",
        Mask.Q: "qmask",
        Mask.D: "dmask",
        Mask.QD: "qdmask",
        Mask.D_ZERO: "dzeromask",
        Mask.QD_ZERO: "qdzeromask",
    },
    "dtype": {DType.FP32: "fp32", DType.FP16: "fp16", DType.BF16: "bf16", DType.FP8E4M3: "fp8"},
    "target": {Target.TRITON: "triton", Target.METAL: "metal"},
    "normalize": {True: "norm", False: ""},
    "decompression": {
        Decompression.NONE: "",
        Decompression.RESIDUAL2: "res2",
        Decompression.RESIDUAL4: "res4",
        Decompression.RESIDUAL8: "res8",
        Decompression.CENTROID: "centroid",
    },
    "backward": {Backward.NONE: "", Backward.UNIFIED: "unified", Backward.LOWMEM: "lowmem"},
    "score": {
        Score.MAX: "",
        Score.WEIGHTED: "weighted",
        Score.SMOOTH: "smooth",
        Score.TOPK_MEAN: "topkmean",
    },
}
_FROM_TOKEN: dict[str, tuple[str, object]] = {
    token: (axis, value)
    for axis, table in _TOKENS.items()
    for value, token in table.items()
    if token
}


# Axes whose values are constexprs inside one kernel, not separate kernels. fp8 storage
# is the exception within dtype: it adds scale tensors (Kernel.scaled).
VALUE_AXES = ("mask", "normalize", "dtype")

# Limits the generated kernels are built for, read by the runtime from here.
MAX_HEAD_DIM = 512  # the widest BLOCK_K a Triton tuning table names
# Metal: head dims up to this, in whole 8-wide tiles, so that a block of 8 query tokens
# fits in 16 simdgroup fragments (32 registers per lane) and grad rows in 4 floats a lane.
METAL_MAX_HEAD_DIM = 128
# topk_mean: the doc-token slots a query token keeps, TOKEN_K per row of a tile in
# registers (Metal: per lane); past 16 the register file spills.
MAX_TOKEN_K = 16

TORCH_DTYPE_NAME = {
    DType.FP32: "float32",
    DType.FP16: "float16",
    DType.BF16: "bfloat16",
    DType.FP8E4M3: "float8_e4m3fn",
}
_DTYPE_OF_TORCH_NAME = {name: dtype for dtype, name in TORCH_DTYPE_NAME.items()}


def dtype_of(torch_dtype: object) -> DType:
    """The DType of a torch dtype (torch.bfloat16 -> DType.BF16); KeyError if none."""
    return _DTYPE_OF_TORCH_NAME[str(torch_dtype).removeprefix("torch.")]


def allowed_values(axis: str) -> list[object]:
    """The values an axis accepts, as written in a spec file."""
    kind = AXES[axis]
    if kind is bool:
        return [False, True]
    return [member.value for member in kind]


def coerce(axis: str, raw: object) -> object:
    """Turns a spec value into the axis's enum member; raises ValueError if not allowed."""
    kind = AXES[axis]
    if kind is bool:
        if isinstance(raw, bool):
            return raw
        raise ValueError(raw)
    return kind(raw)


@dataclasses.dataclass(frozen=True)
class Kernel:
    """A structural kernel: one generated file. Its name is the variant name without the
    value axes, plus "fp8" where the storage carries dequantization scales."""

    op: Op
    layout: Layout
    target: Target
    scaled: bool = False
    decompression: Decompression = Decompression.NONE
    backward: Backward = Backward.NONE
    score: Score = Score.MAX

    @property
    def name(self) -> str:
        tokens = [_TOKENS["op"][self.op], _TOKENS["layout"][self.layout]]
        if self.scaled:
            tokens.append(_TOKENS["dtype"][DType.FP8E4M3])
        tokens.append(_TOKENS["target"][self.target])
        for axis in OPTIONAL_AXES:
            if axis in VALUE_AXES:
                continue
            value = getattr(self, axis)
            if value != DEFAULTS[axis]:
                tokens.append(_TOKENS[axis][value])
        return "_".join(tokens)

    @property
    def takes_zero_mask(self) -> bool:
        """Whether the kernel reads a doc mask as zeros where a variant asks (Mask.as_zero):
        the Triton MaxSim kernels of the padded layouts with the plain max, which PyLate's
        score functions call (kernel_lib.masked_as_zero)."""
        return (
            self.op is Op.MAXSIM
            and self.layout in (Layout.DENSE, Layout.KD, Layout.PAIRS)
            and self.target is Target.TRITON
            and not self.scaled
            and self.decompression is Decompression.NONE
            and self.score is Score.MAX
        )

    def spec(self) -> dict[str, object]:
        """The kernel as plain JSON-able values, for headers and the manifest."""
        out: dict[str, object] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            out[field.name] = value if isinstance(value, bool) else value.value
        return out

    def widest(self) -> Variant:
        """The variant of this kernel with every optional input its layout and op can take
        (both masks, normalize): a plan reads it for argument lists, which hold every
        input any value needs (an input a call lacks is passed as None)."""
        ragged = self.layout in (Layout.VARLEN, Layout.PACKED_PAIRS)
        lengths = ragged or self.decompression is not Decompression.NONE  # no masks
        mask = Mask.NONE if lengths else Mask.D if self.op is Op.HEAD else Mask.QD
        return Variant(
            op=self.op,
            layout=self.layout,
            mask=mask,
            dtype=DType.FP8E4M3 if self.scaled else DType.BF16,
            target=self.target,
            normalize=not self.scaled,
            decompression=self.decompression,
            backward=self.backward,
            score=self.score,
        )


@dataclasses.dataclass(frozen=True, order=False)
class Variant:
    op: Op
    layout: Layout
    mask: Mask
    dtype: DType
    target: Target
    normalize: bool = False
    decompression: Decompression = Decompression.NONE
    backward: Backward = Backward.NONE
    score: Score = Score.MAX

    @property
    def name(self) -> str:
        tokens = [_TOKENS[axis][getattr(self, axis)] for axis in CORE_AXES]
        for axis in OPTIONAL_AXES:
            value = getattr(self, axis)
            if value != DEFAULTS[axis]:
                tokens.append(_TOKENS[axis][value])
        return "_".join(tokens)

    @property
    def kernel(self) -> Kernel:
        """The structural kernel (generated file) that serves this variant."""
        return Kernel(
            op=self.op,
            layout=self.layout,
            target=self.target,
            scaled=self.dtype is DType.FP8E4M3,
            decompression=self.decompression,
            backward=self.backward,
            score=self.score,
        )

    def values(self) -> dict[str, object]:
        """The value axes, as JSON-able values: the constexprs this variant binds."""
        spec = self.spec()
        return {axis: spec[axis] for axis in VALUE_AXES}

    @classmethod
    def parse(cls, name: str) -> Variant:
        """Inverse of `name`. Raises ValueError naming the bad token."""
        tokens = name.split("_")
        if len(tokens) < len(CORE_AXES):
            raise ValueError(f"variant name {name!r} has fewer than {len(CORE_AXES)} tokens")
        fields: dict[str, object] = {}
        for position, token in enumerate(tokens):
            if token not in _FROM_TOKEN:
                raise ValueError(f"variant name {name!r}: unknown token {token!r}")
            axis, value = _FROM_TOKEN[token]
            expected = CORE_AXES[position] if position < len(CORE_AXES) else None
            if expected is not None and axis != expected:
                raise ValueError(f"variant name {name!r}: token {token!r} where {expected} goes")
            if expected is None and (axis not in OPTIONAL_AXES or axis in fields):
                raise ValueError(f"variant name {name!r}: misplaced token {token!r}")
            fields[axis] = value
        variant = cls(**fields)  # type: ignore[arg-type]
        if variant.name != name:
            raise ValueError(f"variant name {name!r} is not canonical (expected {variant.name!r})")
        return variant

    def spec(self) -> dict[str, object]:
        """The variant as plain JSON-able values, for headers and the manifest."""
        out: dict[str, object] = {}
        for axis in AXES:
            value = getattr(self, axis)
            out[axis] = value if isinstance(value, bool) else value.value
        return out
