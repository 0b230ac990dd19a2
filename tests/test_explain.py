"""`lik explain`: the plan it prints is the config a maxsim call of that shape launches."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lik.cli import main
from lik.runtime import configs, dispatch, heuristics
from lik.runtime.explain import explain_forward, render
from lik.runtime.keys import gpu_family

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize(
    "shape, strategy",
    [
        ((1, 2, 5, 300, 48), "doc_splits"),  # two long docs: token ranges
        ((5, 12, 7, 20, 48), "flat_docs"),  # short docs: blocks streamed per program
        ((3, 4, 9, 37, 40), None),  # one program per (query group, doc)
    ],
)
def test_the_plan_is_the_config_a_call_launches(monkeypatch, shape, strategy):
    # A call on this machine (the interpreter without a GPU) remembers the config it
    # launched; the plan for this machine's family must be that config. Blocks of docs
    # are sized for 4 programs, so that 12 short docs stream.
    monkeypatch.setattr(heuristics, "STREAM_TARGET_PROGRAMS", 4)
    nq, nd, lq, ld, d = shape
    generator = torch.Generator().manual_seed(3)
    Q = torch.randn(nq, lq, d, generator=generator).bfloat16().to(DEVICE)
    D = torch.randn(nd, ld, d, generator=generator).bfloat16().to(DEVICE)
    configs._call_configs.clear()
    dispatch.forward("dense", Q, D, None, None, False, torch.empty(nq, nd, device=DEVICE))
    (launched,) = configs._call_configs.values()
    plan = explain_forward(shape, dtype=torch.bfloat16, family=gpu_family(DEVICE))
    assert plan.config == launched
    if DEVICE.type == "cuda":  # the strategies below are planned for an H100's 132 SMs
        return
    if strategy == "doc_splits":
        assert plan.config.doc_splits > 1 and plan.programs == nd * plan.config.doc_splits
    elif strategy == "flat_docs":
        assert plan.config.flat_docs and plan.config.docs_per_program > 1
    else:
        assert plan.config.doc_splits == plan.config.docs_per_program == 1


@pytest.mark.parametrize("masks", ["q", "d", "qd"])
def test_a_masked_call_s_plan_is_the_config_it_launches(masks):
    nq, nd, lq, ld, d = shape = (3, 5, 6, 21, 32)
    generator = torch.Generator().manual_seed(4)
    Q = torch.randn(nq, lq, d, generator=generator).bfloat16().to(DEVICE)
    D = torch.randn(nd, ld, d, generator=generator).bfloat16().to(DEVICE)
    q_mask = torch.rand(nq, lq, generator=generator).to(DEVICE) < 0.8 if "q" in masks else None
    d_mask = torch.rand(nd, ld, generator=generator).to(DEVICE) < 0.8 if "d" in masks else None
    configs._call_configs.clear()
    dispatch.forward("dense", Q, D, q_mask, d_mask, False, torch.empty(nq, nd, device=DEVICE))
    ((launched_key, *_), launched), = configs._call_configs.items()
    plan = explain_forward(shape, family=gpu_family(DEVICE), q_mask=q_mask is not None,
                           d_mask=d_mask is not None)  # fmt: skip
    assert plan.key.variant == launched_key and plan.config == launched


@pytest.mark.parametrize(
    "shape, backward, strategy",
    [
        ((3, 5, 6, 21, 32), "auto", "lowmem"),
        ((1, 70, 5, 9, 16), "auto", "unified"),  # 70 docs for one query: lopsided
        ((3, 5, 6, 21, 32), "unified", "unified"),
    ],
)
def test_a_training_call_s_plan_is_the_configs_it_launches(shape, backward, strategy):
    # A training call (inputs requiring grad) launches its strategy's forward and its
    # backward kernels; the plan with --backward names both keys and their configs.
    from lik.runtime import maxsim

    nq, nd, lq, ld, d = shape
    generator = torch.Generator().manual_seed(5)
    Q = torch.randn(nq, lq, d, generator=generator).bfloat16().to(DEVICE).requires_grad_()
    D = torch.randn(nd, ld, d, generator=generator).bfloat16().to(DEVICE).requires_grad_()
    configs._call_configs.clear()
    configs._configs.clear()
    maxsim(Q, D, backward=backward).sum().backward()
    plan = explain_forward(shape, family=gpu_family(DEVICE), backward=backward)
    assert plan.backward.strategy == strategy
    assert plan.key.variant == f"maxsim_dense_nomask_bf16_triton_{strategy}"
    # The configs the call launched, by kernel ("fwd", "bwd"; the last of a call's fields).
    launched = {call[-1]: (call[0], config) for call, config in configs._call_configs.items()}
    assert launched == {"fwd": (plan.key.variant, plan.config),
                        "bwd": (plan.backward.key.variant, plan.backward.config)}  # fmt: skip
    text = render(plan)
    assert f'backward="{backward}") in bfloat16' in text
    assert f"  backward  {strategy} (" in text
    assert f"  bwd key   {plan.backward.key.table_key()} (" in text


def test_a_training_plan_on_the_committed_table(capsys):
    # inbatch-256's training step: lowmem, both keys committed; 1 query x 1000 docs: unified.
    assert main(["explain", "--shape", "256,256,32,300,128", "--family", "hopper", "--card", "",
                 "--backward", "auto"]) == 0  # fmt: skip
    text = capsys.readouterr().out
    key = "maxsim_dense_nomask_bf16_triton_lowmem|128|32|l|q8"
    assert f"  key       {key} (entry in runtime/tuning/hopper.toml)" in text
    assert f"  bwd key   {key}|bwd (entry in runtime/tuning/hopper.toml)" in text
    tiles = "  bwd tiles 64-token doc tiles, each gradient element from one owner; 4 warps, 1 stage"
    assert tiles in text
    lopsided = render(explain_forward((1, 1000, 32, 300, 128), family="hopper", card="",
                                      backward="auto"))  # fmt: skip
    assert "  backward  unified (auto: unified where queries outnumber docs 32 times" in lopsided
    assert "docs per program, fp32 atomics then a cast pass" in lopsided


def test_a_masked_key_shows_the_unmasked_twin_s_entry_it_takes(capsys):
    assert main(["explain", "--shape", "256,256,32,300,128", "--family", "hopper", "--card", "",
                 "--masks", "d"]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert "D [256, 300, 128], d_mask) in bfloat16" in text
    assert ("maxsim_dense_dmask_bf16_triton|128|32|l|q8 (none of its own: its unmasked twin's, "
            "maxsim_dense_nomask_bf16_triton|128|32|l|q8 in runtime/tuning/hopper.toml)") in text
    assert "8 queries' tokens stacked per tile (256 rows)" in text  # the twin's query group


def test_prints_the_kernel_key_config_and_strategy_of_a_shape(capsys):
    # longdoc on the committed Hopper table: 8 queries stacked, 4 token ranges per doc.
    assert main(["explain", "--shape", "16,32,32,8192,128", "--family", "hopper"]) == 0
    text = capsys.readouterr().out
    key = "maxsim_dense_nomask_bf16_triton|128|32|s|q8"
    assert f"{key} (entry in runtime/tuning/hopper.toml)" in text
    assert "8 queries' tokens stacked per tile (256 rows)" in text
    assert "4 token ranges per doc" in text and "256 per launch" in text


def test_small_reranks_show_their_once_key_and_long_queries_their_chunks():
    colbert = render(explain_forward((1, 1000, 32, 300, 128), family="hopper"))
    assert "|once (entry in runtime/tuning/hopper.toml)" in colbert
    assert "evict-first" in colbert
    colpali = explain_forward((1, 500, 1024, 1024, 128), family="ampere")
    assert colpali.chunks == 2 and colpali.table is None
    assert "2 launches over query chunks of at most 512 tokens" in render(colpali)
    assert ("no entry in runtime/tuning/ampere.toml: the default config until its first CUDA "
            "call autotunes it") in render(colpali)  # fmt: skip


def test_a_card_with_its_own_entries_takes_them_before_its_family_s(capsys):
    # colpali-rerank's tile: the H200's own table has one, the H100 takes the family's.
    shape = "1,1000,128,1024,128"
    assert main(["explain", "--shape", shape, "--family", "hopper", "--card", "NVIDIA H200"]) == 0
    h200 = capsys.readouterr().out
    assert "in bfloat16, NVIDIA H200 (hopper family)" in h200
    assert "|q1 (entry in runtime/tuning/hopper/NVIDIA_H200.toml)" in h200
    assert "64-token doc tiles, head dim 128; 8 warps, 4 stages" in h200
    h100 = explain_forward((1, 1000, 128, 1024, 128), family="hopper", card="NVIDIA H100 80GB HBM3")
    assert h100.table == "hopper.toml"
    assert (h100.config.num_warps, h100.config.num_stages) == (4, 3)


@pytest.mark.parametrize("shape", ["1,2,3", "1,2,3,4,0", "a,b,c,d,e"])
def test_a_bad_shape_exits_2_naming_the_option(shape, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["explain", "--shape", shape])
    assert exit_info.value.code == 2
    assert "--shape: expected five positive integers NQ,ND,LQ,LD,D" in capsys.readouterr().err


def test_the_documented_example_is_what_the_command_prints():
    doc = (Path(__file__).resolve().parents[1] / "docs" / "launch-strategies.md").read_text()
    start = doc.index("    $ lik explain --shape 16,32,32,8192,128")
    block = doc[start:].split("\n\n", 1)[0].splitlines()[1:]
    printed = render(explain_forward((16, 32, 32, 8192, 128), family="hopper", card=""))
    assert [line.removeprefix("    ") for line in block] == printed.splitlines()


def test_a_head_dim_past_the_largest_exits_2_as_maxsim_raises(capsys):
    assert main(["explain", "--shape", "4,100,32,180,1000"]) == 2
    assert "head dim 1000 exceeds the largest supported, 512" in capsys.readouterr().err
