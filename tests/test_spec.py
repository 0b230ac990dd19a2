"""Spec language: expansion, exclusions and strict, located errors."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from lik_gen.cli import main
from lik_gen.spec import SpecError, load_specs

GOOD_FAMILY = """
[fam]
op = "maxsim"
layout = ["dense", "pairs"]
mask = ["none", "d"]
normalize = [false, true]
dtype = "bf16"
target = "triton"
"""


def write_spec(directory: Path, text: str, name: str = "spec.toml") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(textwrap.dedent(text))
    return path


def test_product_is_expanded(tmp_path):
    write_spec(tmp_path, GOOD_FAMILY)
    names = [d.variant.name for d in load_specs(tmp_path)]
    assert len(names) == 2 * 2 * 2
    assert "maxsim_pairs_dmask_bf16_triton_norm" in names
    assert names == sorted(names)


def test_exclude_removes_matching_combinations(tmp_path):
    write_spec(
        tmp_path,
        GOOD_FAMILY
        + """
[[fam.exclude]]
layout = "pairs"
normalize = true
why = "not needed by any client"
""",
    )
    names = {d.variant.name for d in load_specs(tmp_path)}
    assert len(names) == 6
    assert not any(n.startswith("maxsim_pairs") and n.endswith("_norm") for n in names)


def expect_error(tmp_path, text, *fragments):
    path = write_spec(tmp_path, text)
    with pytest.raises(SpecError) as caught:
        load_specs(tmp_path)
    message = str(caught.value)
    assert str(path) in message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


def test_unknown_key(tmp_path):
    expect_error(
        tmp_path,
        GOOD_FAMILY + 'colour = "red"\n',
        "family 'fam'",
        "key 'colour'",
        "unknown key",
        "allowed: op, layout",
    )


def test_bad_value_names_allowed_values(tmp_path):
    expect_error(
        tmp_path,
        GOOD_FAMILY.replace('"d"]', '"doc"]'),
        "family 'fam'",
        "key 'mask'",
        "got 'doc'",
        "allowed: none, q, d, qd",
    )


def test_bad_bool_value(tmp_path):
    expect_error(
        tmp_path,
        GOOD_FAMILY.replace("[false, true]", '"yes"'),
        "key 'normalize'",
        "got 'yes'",
        "allowed: false, true",
    )


def test_missing_core_axis(tmp_path):
    expect_error(
        tmp_path,
        GOOD_FAMILY.replace('target = "triton"\n', ""),
        "key 'target'",
        "missing required axis",
    )


def test_contradictory_combination(tmp_path):
    text = GOOD_FAMILY.replace('dtype = "bf16"', 'dtype = "fp8e4m3"\nbackward = "unified"')
    message = expect_error(tmp_path, text, "family 'fam'", "contradictory combination")
    assert "fp8" in message and "backward" in message


def test_duplicate_variant_across_families(tmp_path):
    write_spec(tmp_path, GOOD_FAMILY, "a.toml")
    other = write_spec(tmp_path, GOOD_FAMILY.replace("[fam]", "[other]"), "b.toml")
    with pytest.raises(SpecError) as caught:
        load_specs(tmp_path)
    message = str(caught.value)
    assert str(other) in message and "duplicate variant" in message and "'fam'" in message


def test_exclude_needs_why(tmp_path):
    expect_error(
        tmp_path, GOOD_FAMILY + '[[fam.exclude]]\nlayout = "pairs"\n', "needs a non-empty 'why'"
    )


def test_exclude_matching_nothing_is_an_error(tmp_path):
    text = GOOD_FAMILY + '[[fam.exclude]]\nlayout = "kd"\nwhy = "stale rule"\n'
    expect_error(tmp_path, text, "matches no variant")


def test_exclude_with_unknown_axis(tmp_path):
    text = GOOD_FAMILY + '[[fam.exclude]]\nshape = "big"\nwhy = "x"\n'
    expect_error(tmp_path, text, "key 'shape'", "unknown key in exclude rule #1")


def test_invalid_toml(tmp_path):
    expect_error(tmp_path, "[fam\n", "not valid TOML")


def test_empty_spec_directory(tmp_path):
    with pytest.raises(SpecError, match="no spec files"):
        load_specs(tmp_path)


def test_nothing_is_written_on_a_spec_error(tmp_path, capsys):
    specs, out = tmp_path / "specs", tmp_path / "generated"
    write_spec(specs, GOOD_FAMILY.replace('"d"]', '"doc"]'))
    out.mkdir()
    (out / "keep.txt").write_text("untouched")
    code = main(["--specs", str(specs), "--out", str(out), "generate"])
    assert code == 2
    assert "nothing was written" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
