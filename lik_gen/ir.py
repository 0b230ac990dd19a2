"""The variant IR: one frozen dataclass over enums, whose canonical name is its identity.

The name is the file stem, the registry key and the custom-op name. Core axes always
appear in it; optional axes only when they differ from their default, in a fixed order,
so adding an axis later renames nothing.

    maxsim_dense_qd_bf16_triton            core: op, layout, mask, dtype, target
    maxsim_kd_d_fp16_triton_norm_unified   + optional flags that are not default
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
    NONE = "none"
    Q = "q"
    D = "d"
    QD = "qd"

    @property
    def has_q(self) -> bool:
        return self in (Mask.Q, Mask.QD)

    @property
    def has_d(self) -> bool:
        return self in (Mask.D, Mask.QD)


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
    "mask": {Mask.NONE: "nomask", Mask.Q: "qmask", Mask.D: "dmask", Mask.QD: "qdmask"},
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
