"""A variant from a spec written on the spot to a score on the CPU: generate into a
temporary directory, import the generated module, launch it under the Triton
interpreter, compare with the float64 reference (the walk-through of
docs/adding-a-variant.md)."""

from __future__ import annotations

import importlib.util
import json
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import relative_error

from lik.runtime import backends
from lik.runtime.reference import maxsim_reference
from lik.runtime.tuning import LaunchConfig
from lik_gen.cli import main

ROOT = Path(__file__).resolve().parent.parent
SPEC = """
[my_rerank]
doc = "bf16 reranking with padded documents"
op = "maxsim"
layout = "dense"
mask = "d"
normalize = true
dtype = "bf16"
target = "triton"
"""


@pytest.mark.skipif(
    backends.device_backend(torch.device("cpu")) != "interpreter",
    reason="needs the Triton interpreter",
)
def test_spec_to_generated_module_to_scores(tmp_path):
    specs, out = tmp_path / "specs", tmp_path / "generated"
    specs.mkdir()
    (specs / "mine.toml").write_text(textwrap.dedent(SPEC))
    args = ["--specs", str(specs), "--templates", str(ROOT / "templates"), "--out", str(out)]
    assert main([*args, "generate"]) == 0
    assert main([*args, "check"]) == 0

    # The variant is a (kernel, values) pair: its kernel's file, its values as constexprs.
    manifest = json.loads((out / "MANIFEST.json").read_text())
    entry = manifest["variants"]["maxsim_dense_dmask_bf16_triton_norm"]
    assert entry["kernel"] == "maxsim_dense_triton"
    assert entry["values"] == {"mask": "d", "normalize": True, "dtype": "bf16"}
    path = out / manifest["kernels"]["maxsim_dense_triton"]["file"]
    spec = importlib.util.spec_from_file_location("my_rerank_kernel", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    g = torch.Generator().manual_seed(0)
    Q = torch.randn(3, 9, 40, generator=g).bfloat16()
    D = torch.randn(5, 23, 40, generator=g).bfloat16()
    d_mask = torch.rand(5, 23, generator=g) < 0.7
    out_scores = torch.full((3, 5), float("nan"))
    config = LaunchConfig(block_q=16, block_l=16, block_k=64, num_warps=4, num_stages=1,
                          query_group=2, interpret=True)  # fmt: skip
    module.launch(out_scores, Q, D, d_mask=d_mask.view(torch.uint8), normalize=True, config=config)

    ref = maxsim_reference(Q.double(), D.double(), None, d_mask, normalize=True)
    assert relative_error(out_scores, ref) < 1e-5
