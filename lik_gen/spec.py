"""Spec files -> variants.

A spec file (`specs/*.toml`) holds families. A family lists each axis as one value or a
list of values; the compiler expands the product, then drops the combinations matched by
the family's `[[NAME.exclude]]` rules, each of which must say `why`:

    [maxsim_forward]
    doc = "MaxSim forward for padded batches"
    op = "maxsim"
    layout = ["dense", "kd", "pairs"]
    mask = ["none", "q", "d", "qd"]
    ...

    [[maxsim_forward.exclude]]
    layout = "pairs"
    dtype = "fp8e4m3"
    why = "..."

Validation is strict and all-or-nothing: every problem raises SpecError naming the file,
the family, the key, the bad value and the allowed values, before anything is written.
"""

from __future__ import annotations

import dataclasses
import itertools
import tomllib
from collections.abc import Callable, Iterable
from pathlib import Path

from lik_gen.ir import (
    AXES,
    CORE_AXES,
    DEFAULTS,
    Backward,
    Decompression,
    DType,
    Layout,
    Mask,
    Op,
    Score,
    Variant,
    allowed_values,
    coerce,
)

FAMILY_KEYS = ("doc", "exclude")
EXCLUDE_KEYS = ("why",)


class SpecError(ValueError):
    """A spec problem, located precisely enough to fix without reading the compiler."""

    def __init__(
        self,
        file: Path | str,
        message: str,
        *,
        family: str | None = None,
        key: str | None = None,
        value: object = None,
        allowed: Iterable[object] | None = None,
    ) -> None:
        parts = [str(file)]
        if family is not None:
            parts.append(f"family {family!r}")
        if key is not None:
            parts.append(f"key {key!r}")
        text = ": ".join(parts) + f": {message}"
        if value is not None:
            text += f" (got {value!r})"
        if allowed is not None:
            text += "; allowed: " + ", ".join(_spell(a) for a in allowed)
        super().__init__(text)
        self.file, self.family, self.key, self.value = str(file), family, key, value


def _spell(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


@dataclasses.dataclass(frozen=True)
class SpecVariant:
    """A variant together with where it was declared."""

    variant: Variant
    family: str
    file: str


# Combinations that can never be built, whatever a spec says. Each is (test, why).
CONTRADICTIONS: tuple[tuple[Callable[[Variant], bool], str], ...] = (
    (
        lambda v: v.op is Op.TOPK
        and (v.layout is not Layout.DENSE or v.backward is not Backward.NONE),
        "the top-k epilogue ranks a corpus (dense layout) for inference: no backward",
    ),
    (
        lambda v: v.dtype is DType.FP8E4M3 and v.backward is not Backward.NONE,
        "fp8 is an inference format: a backward needs fp32, fp16 or bf16 inputs",
    ),
    (
        lambda v: v.layout in (Layout.VARLEN, Layout.PACKED_PAIRS) and v.mask.value != "none",
        "ragged layouts carry lengths (cu_seqlens), not masks",
    ),
    (
        lambda v: v.decompression is not Decompression.NONE
        and v.layout not in (Layout.DENSE, Layout.VARLEN),
        "compressed documents are scored in the dense and varlen layouts only",
    ),
    (
        lambda v: v.decompression is not Decompression.NONE and not v.normalize,
        "decompressed residuals are L2-normalized after decoding, as PLAID does",
    ),
    (
        lambda v: v.decompression is not Decompression.NONE and v.mask is not Mask.NONE,
        "compressed docs carry lengths (doc_lengths or cu_seqlens_d), not masks",
    ),
    (
        lambda v: v.decompression is not Decompression.NONE
        and (v.backward is not Backward.NONE or v.dtype is DType.FP8E4M3),
        "compressed docs have a forward only (the runtime derives grad_Q in PyTorch) over "
        "fp32, fp16 or bf16 centroids",
    ),
    (
        lambda v: v.op is Op.HEAD and v.mask.has_q,
        "the fused head takes a doc mask only (its queries come projected and unmasked)",
    ),
    (
        lambda v: v.dtype is DType.FP8E4M3 and v.normalize,
        "fp8 inputs are quantized from normalized embeddings; normalize must be false",
    ),
    (
        lambda v: v.score is not Score.MAX
        and (v.op is not Op.MAXSIM or v.layout not in (Layout.DENSE, Layout.PAIRS)),
        "the score hook is planned for MaxSim over padded dense and pairs layouts",
    ),
    (
        lambda v: v.score is not Score.MAX and v.backward is Backward.UNIFIED,
        "hooked scores train with the recompute backward (backward = lowmem)",
    ),
    (
        lambda v: v.score is not Score.MAX
        and (v.decompression is not Decompression.NONE or v.dtype is DType.FP8E4M3),
        "the score hook reads uncompressed fp32/fp16/bf16 documents",
    ),
    (
        lambda v: v.mask.as_zero and not v.kernel.takes_zero_mask,
        "a doc mask read as zeros (dzero, qdzero) is planned for the Triton MaxSim kernels of "
        "the dense, kd and pairs layouts with the plain max (Kernel.takes_zero_mask)",
    ),
)


def load_specs(spec_dir: Path) -> list[SpecVariant]:
    """Every variant declared under spec_dir, sorted by name. Raises SpecError."""
    files = sorted(spec_dir.glob("*.toml"))
    if not files:
        raise SpecError(spec_dir, "no spec files (*.toml) found")
    seen: dict[str, SpecVariant] = {}
    for path in files:
        for declared in load_spec_file(path):
            name = declared.variant.name
            if name in seen:
                first = seen[name]
                raise SpecError(
                    path,
                    f"duplicate variant {name!r}, already declared by family "
                    f"{first.family!r} in {first.file}",
                    family=declared.family,
                )
            seen[name] = declared
    return [seen[name] for name in sorted(seen)]


def load_spec_file(path: Path) -> list[SpecVariant]:
    try:
        document = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as error:
        raise SpecError(path, f"not valid TOML: {error}") from None
    out = []
    for family, table in document.items():
        if not isinstance(table, dict):
            raise SpecError(path, "top-level entries must be family tables", key=family)
        out.extend(_expand_family(path, family, table))
    return out


def _axis_values(path: Path, family: str, key: str, raw: object) -> list[object]:
    items = raw if isinstance(raw, list) else [raw]
    if not items:
        raise SpecError(path, "empty list", family=family, key=key, allowed=allowed_values(key))
    values = []
    for item in items:
        try:
            values.append(coerce(key, item))
        except (ValueError, TypeError):
            raise SpecError(
                path, "bad value", family=family, key=key, value=item, allowed=allowed_values(key)
            ) from None
    if len(set(values)) != len(values):
        raise SpecError(path, "value listed twice", family=family, key=key, value=raw)
    return values


def _expand_family(path: Path, family: str, table: dict) -> list[SpecVariant]:
    allowed_keys = list(AXES) + list(FAMILY_KEYS)
    for key in table:
        if key not in allowed_keys:
            raise SpecError(path, "unknown key", family=family, key=key, allowed=allowed_keys)
    for key in CORE_AXES:
        if key not in table:
            raise SpecError(path, "missing required axis", family=family, key=key)
    axes = {
        axis: _axis_values(path, family, axis, table[axis]) if axis in table else [DEFAULTS[axis]]
        for axis in AXES
    }
    rules = _parse_excludes(path, family, table.get("exclude", []))
    used = [False] * len(rules)
    variants = []
    for combo in itertools.product(*axes.values()):
        variant = Variant(**dict(zip(axes, combo, strict=True)))  # type: ignore[arg-type]
        hits = [i for i, rule in enumerate(rules) if _matches(rule, variant)]
        for i in hits:
            used[i] = True
        if hits:
            continue
        for test, why in CONTRADICTIONS:
            if test(variant):
                raise SpecError(
                    path,
                    f"contradictory combination {variant.spec()}: {why}; "
                    "narrow the axes or add an [[exclude]] rule",
                    family=family,
                )
        variants.append(SpecVariant(variant, family, str(path)))
    for i, rule in enumerate(rules):
        if not used[i]:
            raise SpecError(
                path,
                f"exclude rule #{i + 1} matches no variant",
                family=family,
                key="exclude",
                value=_plain(rule),
            )
    if not variants:
        raise SpecError(path, "every combination is excluded", family=family)
    return variants


def _parse_excludes(path: Path, family: str, raw: object) -> list[dict[str, list[object]]]:
    if not isinstance(raw, list) or not all(isinstance(rule, dict) for rule in raw):
        raise SpecError(
            path, "must be an array of tables ([[family.exclude]])", family=family, key="exclude"
        )
    rules = []
    for i, rule in enumerate(raw):
        where = f"exclude rule #{i + 1}"
        why = rule.get("why")
        if not isinstance(why, str) or not why.strip():
            raise SpecError(path, f"{where} needs a non-empty 'why'", family=family, key="why")
        conditions = {}
        for key, value in rule.items():
            if key in EXCLUDE_KEYS:
                continue
            if key not in AXES:
                raise SpecError(
                    path,
                    f"unknown key in {where}",
                    family=family,
                    key=key,
                    allowed=list(AXES) + list(EXCLUDE_KEYS),
                )
            conditions[key] = _axis_values(path, family, key, value)
        if not conditions:
            raise SpecError(path, f"{where} names no axis", family=family, key="exclude")
        rules.append(conditions)
    return rules


def _matches(rule: dict[str, list[object]], variant: Variant) -> bool:
    return all(getattr(variant, axis) in values for axis, values in rule.items())


def _plain(rule: dict[str, list[object]]) -> dict[str, list[object]]:
    return {k: [v if isinstance(v, bool) else v.value for v in vs] for k, vs in rule.items()}
