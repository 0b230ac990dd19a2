"""Variant names: canonical, round-tripping, and strict to parse."""

from __future__ import annotations

from pathlib import Path

import pytest

from lik_gen.ir import Backward, Decompression, DType, Layout, Mask, Op, Target, Variant
from lik_gen.spec import load_specs

SPECS = Path(__file__).resolve().parent.parent / "specs"


@pytest.mark.parametrize("declared", load_specs(SPECS), ids=lambda d: d.variant.name)
def test_every_spec_variant_round_trips(declared):
    assert Variant.parse(declared.variant.name) == declared.variant


def test_optional_flags_appear_only_when_not_default():
    base = Variant(Op.MAXSIM, Layout.DENSE, Mask.QD, DType.BF16, Target.TRITON)
    assert base.name == "maxsim_dense_qdmask_bf16_triton"
    flagged = Variant(
        Op.MAXSIM,
        Layout.KD,
        Mask.NONE,
        DType.FP16,
        Target.TRITON,
        True,
        Decompression.RESIDUAL4,
        Backward.LOWMEM,
    )
    assert flagged.name == "maxsim_kd_nomask_fp16_triton_norm_res4_lowmem"
    assert Variant.parse(flagged.name) == flagged


@pytest.mark.parametrize(
    "bad",
    [
        "maxsim_dense_qdmask_bf16",  # missing core token
        "maxsim_dense_qdmask_bf17_triton",  # unknown token
        "maxsim_qdmask_dense_bf16_triton",  # core tokens out of order
        "maxsim_dense_qdmask_bf16_triton_lowmem_norm",  # optional flags out of order
        "maxsim_dense_qdmask_bf16_triton_norm_norm",  # repeated flag
    ],
)
def test_parse_rejects_non_canonical_names(bad):
    with pytest.raises(ValueError):
        Variant.parse(bad)
