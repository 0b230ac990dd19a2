"""Tuning tables: every benchmark shape's key has a committed Hopper entry (no call-time
sweep), configs that do not fit are shrunk instead of failing."""

from __future__ import annotations

import dataclasses
import itertools
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import tune  # noqa: E402 (benchmarks/, on the path above)

from lik.runtime import configs, dispatch, heuristics, registry
from lik.runtime.explain import key_for, once_key
from lik.runtime.keys import LQ_CHUNK, KernelKey
from lik.runtime.tuning import SMEM_LIMIT, LaunchConfig, config_for, load_table

CPU = torch.device("cpu")  # plans splits as on an H100
# Where calls launch kernels: the interpreter on a CPU machine, CUDA on a GPU one (where CPU
# tensors take the reference path and look no config up).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def streamed(config, *args, **kwargs):
    """heuristics.streamed on a GPU that holds 264 programs at once (an H100's 132 SMs at
    two each)."""
    return heuristics.streamed(config, *args, wave=264, **kwargs)


@pytest.mark.parametrize("shape", tune.SHAPES, ids=[s[0] for s in tune.SHAPES])
def test_benchmark_shapes_resolve_to_hopper_entries(shape):
    # A call looks up its forward key, and a small rerank then its "once" key too.
    for key in filter(None, (key_for(shape, "hopper"), once_key(shape, "hopper"))):
        entry = load_table("hopper").get(key.table_key())
        assert entry is not None, f"{key.table_key()} has no entry: run make tune on a Hopper GPU"
        assert {"block_l", "num_warps", "num_stages", "query_group"} <= set(entry)


@pytest.mark.parametrize("nbits", (2, 4, 8))
def test_plaid_benchmark_cases_resolve_to_hopper_entries(nbits, monkeypatch):
    """Every bench_plaid case (both layouts, fp16 centroids) has a committed Hopper entry,
    under the key a Hopper call builds (configs.call_key), which the sweep that wrote the
    entries also built (bench_plaid.table_key)."""
    bench_plaid = pytest.importorskip("bench_plaid")
    from lik.runtime import plaid

    monkeypatch.setattr(configs, "gpu_family", lambda device: "hopper")
    monkeypatch.setattr(configs, "gpu_card", lambda device: "")
    assert nbits in bench_plaid.NBITS
    for n_docs in bench_plaid.CANDIDATES:
        for layout in ("dense", "varlen"):
            name = plaid._variant(layout, torch.empty(0, dtype=torch.float16), nbits)
            # The query as each layout's launch takes it: [1, Lq, d] dense, packed varlen.
            shape = (1, bench_plaid.LQ, bench_plaid.DIM)[layout == "varlen":]
            call = configs.call_key(name, registry.load(name), torch.empty(shape),
                                      bench_plaid.LQ, n_docs, "fwd")  # fmt: skip
            swept = bench_plaid.table_key(name, n_docs, bench_plaid.DIM, "hopper")
            assert swept.table_key() == call.table_key()
            entry = load_table("hopper").get(call.table_key())
            assert entry is not None, f"{call.table_key()} has no entry: bench_plaid --sweep"


def test_small_reranks_tune_their_docs_once_loads_under_their_own_key():
    shapes = {shape[0]: shape for shape in tune.SHAPES}
    tuned = {name: tune.tuned_key(shapes[name], "hopper") for name in shapes}
    assert tuned["colbert-rerank"].kernel == tuned["lateon-edge"].kernel == "once"
    assert tuned["text-long"].kernel == tuned["colpali-rerank"].kernel == "fwd"
    # colbert-rerank no longer shares (and skews) text-long's key.
    groups = tune.shapes_by_key(tune.SHAPES, "hopper")
    assert [s[0] for s in groups[tuned["text-long"].table_key()]] == ["text-long"]
    once = list(tune.candidates(tuned["lateon-edge"]))
    assert {c.num_stages for c in once} == {1} and {c.query_group for c in once} == {1}
    assert {(c.block_l, c.num_warps) for c in once} == set(
        itertools.product(tune.ONCE_BLOCK_L, tune.ONCE_WARPS)
    )


def test_docs_once_defaults_keep_one_tile_size_across_head_dims():
    from lik.runtime.keys import KernelKey
    from lik.runtime.tuning import default_config

    def once(head_dim):
        key = KernelKey("maxsim_dense_nomask_bf16_triton", "hopper", head_dim, 32, "s", 1, "once")
        config = default_config(key)
        return config["block_l"], config["num_warps"], config["num_stages"]

    assert once(128) == (32, 1, 1)
    assert once(64) == (64, 1, 1)
    assert once(256) == (16, 1, 1)


def test_a_docs_once_call_takes_the_tile_of_its_once_key(monkeypatch):
    import torch

    from lik.runtime import maxsim, tuning

    monkeypatch.setattr(configs, "_configs", {})
    monkeypatch.setattr(configs, "_call_configs", {})
    monkeypatch.setattr(heuristics, "loads_docs_once", lambda config, nq, doc_bytes: True)
    asked = []

    def recording_config_for(key, smem_bytes, entry=None):
        asked.append(key.kernel)
        config = tuning.config_for(key, smem_bytes, entry)
        if key.kernel == "once":  # a tile the forward key would not give
            config = dataclasses.replace(config, block_l=16, num_warps=2)
        return config

    monkeypatch.setattr(configs, "config_for", recording_config_for)
    Q = torch.randn(1, 5, 16, device=DEVICE)
    D = torch.randn(3, 40, 16, device=DEVICE)
    out = maxsim(Q, D)
    assert asked == ["fwd", "once"]
    (config,) = configs._call_configs.values()
    tile = (config.block_l, config.num_warps, config.num_stages, config.evict_docs)
    assert tile == (16, 2, 1, True)
    ref = torch.einsum("sd,ntd->nst", Q[0].double(), D.double()).amax(-1).sum(-1)
    assert torch.allclose(out[0].double(), ref, rtol=1e-4, atol=1e-4)


def test_every_committed_entry_names_the_card_it_was_tuned_on():
    from lik.runtime.tuning import load_table

    cards = {key: entry.get("card", "") for key, entry in load_table("hopper").items()}
    assert cards and all(card.startswith("NVIDIA H") for card in cards.values()), cards


def committed_card_tables():
    """(family, card file name, its entries) of every committed card table."""
    from lik.runtime.tuning import TABLES, _read_table

    return [(family.name, table.name, _read_table(f"{family.name}/{table.name}"))
            for family in TABLES.iterdir() if family.is_dir()
            for table in family.iterdir() if table.name.endswith(".toml")]  # fmt: skip


def test_a_card_table_holds_entries_tuned_on_that_card():
    from lik.runtime.tuning import table_file

    tables = committed_card_tables()
    assert tables, "no card table is committed (the H200 has one)"
    for family, name, entries in tables:
        assert entries, f"{family}/{name} has no entries"
        for key, entry in entries.items():
            assert table_file(family, entry["card"]) == f"{family}/{name}", key
            assert {"block_l", "num_warps", "num_stages", "query_group"} <= set(entry), key


def test_a_card_s_own_entries_come_before_its_family_s():
    from lik.runtime.keys import KernelKey
    from lik.runtime.tuning import committed_source, config_for, table_file

    def committed_table(key):
        source = committed_source(key)
        return None if source is None else source[0]

    assert table_file("hopper", "NVIDIA H100 80GB HBM3") == "hopper/NVIDIA_H100_80GB_HBM3.toml"
    colpali = key_for(("colpali-rerank", 1, 1000, 128, 1024, 128), "hopper")
    module = registry.load(colpali.variant)

    def tile(card):
        key = dataclasses.replace(colpali, card=card)
        config = config_for(key, module.smem_bytes)
        return committed_table(key), config.block_l, config.num_warps, config.num_stages

    family = tile("")
    assert family[0] == "hopper.toml"
    assert tile("NVIDIA H100 80GB HBM3") == family  # no table of its own
    h200 = tile("NVIDIA H200")
    assert h200[0] == "hopper/NVIDIA_H200.toml" and h200[1:] != family[1:]
    # A key the card's table lacks takes the family's entry.
    longdoc = key_for(("longdoc", 16, 32, 32, 8192, 128), "hopper", card="NVIDIA H200")
    assert committed_table(longdoc) == "hopper.toml"
    unknown = KernelKey("maxsim_dense_nomask_bf16_triton", "hopper", 128, 16, "l", 1, card="X")
    assert committed_table(unknown) is None



def test_a_card_whose_name_extends_a_card_table_s_reads_it():
    from lik.runtime.tuning import card_table

    # Another board of the same chip and memory (the H200 NVL) reads the H200's entries;
    # names that merely start with the same characters, and other cards, do not.
    assert card_table("hopper", "NVIDIA H200") == "hopper/NVIDIA_H200.toml"
    assert card_table("hopper", "NVIDIA H200 NVL") == "hopper/NVIDIA_H200.toml"
    assert card_table("hopper", "NVIDIA H2000") is None
    assert card_table("hopper", "NVIDIA H100 80GB HBM3") is None
    assert card_table("hopper", "") is None
    assert card_table("ampere", "NVIDIA H200 NVL") is None  # no table folder


def test_a_masked_key_without_an_entry_takes_its_unmasked_twin_s(monkeypatch):
    from lik.runtime import tuning
    from lik.runtime.keys import KernelKey

    tables = {
        "hopper.toml": {
            "maxsim_dense_nomask_bf16_triton|128|32|s|q8": {"block_l": 64, "num_warps": 4,
                                                           "num_stages": 3, "query_group": 8},
            "maxsim_dense_qmask_bf16_triton|128|32|l|q8": {"block_l": 32, "num_warps": 8,
                                                          "num_stages": 2, "query_group": 2},
        },
        "hopper/A_card.toml": {
            "maxsim_dense_nomask_bf16_triton|128|32|l|q8": {"block_l": 128, "num_warps": 4,
                                                           "num_stages": 2, "query_group": 4},
        },
    }  # fmt: skip
    monkeypatch.setattr(tuning, "_read_table", lambda name: tables.get(name, {}))
    monkeypatch.setattr(tuning, "card_table", lambda family, card: "hopper/A_card.toml")

    def key(mask, size="l"):
        return KernelKey(f"maxsim_dense_{mask}_bf16_triton", "hopper", 128, 32, size, 8)

    # No entry of its own: the unmasked variant's, from the table that has it.
    assert tuning.committed_source(key("dmask", "s")) == (
        "hopper.toml", "maxsim_dense_nomask_bf16_triton|128|32|s|q8")
    assert tuning.committed_entry(key("qdmask", "s"))["query_group"] == 8
    assert tuning.committed_source(key("dmask")) == (
        "hopper/A_card.toml", "maxsim_dense_nomask_bf16_triton|128|32|l|q8")
    # An entry of its own (here the family's) wins over the twin's (here the card's).
    assert tuning.committed_source(key("qmask")) == (
        "hopper.toml", "maxsim_dense_qmask_bf16_triton|128|32|l|q8")
    assert tuning.committed_entry(key("qmask"))["block_l"] == 32
    # Unmasked keys, and keys whose twin has no entry either, keep what they had.
    assert tuning.unmasked_key(key("nomask")) is None
    assert tuning.committed_source(key("dmask", "m")) is None
    assert tuning.unmasked_key(key("qdmask")).variant == "maxsim_dense_nomask_bf16_triton"


def test_a_call_keys_its_config_by_the_gpu_it_runs_on(monkeypatch):
    from lik.runtime import maxsim, tuning

    monkeypatch.setattr(configs, "_configs", {})
    monkeypatch.setattr(configs, "_call_configs", {})
    monkeypatch.setattr(configs, "gpu_card", lambda device: "a card")
    cards = []

    def recording_config_for(key, smem_bytes, entry=None):
        cards.append(key.card)
        return tuning.config_for(key, smem_bytes, entry)

    monkeypatch.setattr(configs, "config_for", recording_config_for)
    maxsim(torch.randn(2, 5, 16, device=DEVICE), torch.randn(3, 20, 16, device=DEVICE))
    assert cards and set(cards) == {"a card"}


@pytest.mark.parametrize("shape", tune.TRAIN_SHAPES, ids=[s[0] for s in tune.TRAIN_SHAPES])
def test_training_shapes_resolve_forward_and_backward_hopper_entries(shape):
    forward, backward = tune.train_keys(shape, "hopper")
    assert backward.table_key() == forward.table_key() + "|bwd"
    for key in (forward, backward):
        entry = load_table("hopper").get(key.table_key())
        assert entry is not None, f"{key.table_key()} has no entry: run make tune on a Hopper GPU"


def test_backward_kernels_take_their_own_tuning_key(monkeypatch):
    import torch

    from lik.runtime import maxsim, tuning

    monkeypatch.setattr(configs, "_configs", {})
    monkeypatch.setattr(configs, "_call_configs", {})
    asked = []

    def recording_config_for(key, smem_bytes, entry=None):
        asked.append(key)
        return tuning.config_for(key, smem_bytes, entry)

    monkeypatch.setattr(configs, "config_for", recording_config_for)
    Q = torch.randn(3, 5, 16, device=DEVICE, requires_grad=True)
    D = torch.randn(4, 7, 16, device=DEVICE, requires_grad=True)
    maxsim(Q, D, backward="lowmem").sum().backward()
    assert [(key.variant, key.kernel) for key in asked] == [
        ("maxsim_dense_nomask_fp32_triton_lowmem", "fwd"),
        ("maxsim_dense_nomask_fp32_triton_lowmem", "bwd"),
    ]
    assert Q.grad is not None and D.grad is not None


def test_out_of_resources_shrinks_the_config_step_by_step(monkeypatch):
    monkeypatch.setattr(dispatch, "_fitted", {})

    class OutOfResources(Exception):
        pass

    tried = []

    def launch(*, config):
        tried.append(config)
        if config.query_group > 1 or config.num_stages > 2:
            raise OutOfResources("shared memory")
        return "ok"

    start = LaunchConfig(32, 64, 128, 8, 3, query_group=4)
    result, fitted = dispatch.launch_fitted(launch, start)
    assert result == "ok"
    assert [(c.query_group, c.num_stages) for c in tried] == [(4, 3), (2, 3), (1, 3), (1, 2)]
    assert fitted == LaunchConfig(32, 64, 128, 8, 2, query_group=1)
    # The next launch of the same config goes straight to the one that fitted.
    tried.clear()
    assert dispatch.launch_fitted(launch, start) == ("ok", fitted)
    assert tried == [fitted]
    # Another launcher with the same config (a forward beside its backward) keeps it.
    assert dispatch.launch_fitted(lambda *, config: config, start) == (start, start)


def test_other_launch_errors_are_not_swallowed():
    def launch(*, config):
        raise ValueError("bad argument")

    with pytest.raises(ValueError, match="bad argument"):
        dispatch.launch_fitted(launch, LaunchConfig(32, 64, 128, 8, 3))


def test_only_few_long_docs_split_into_token_ranges():
    # About one wave of programs (the nearest power of two), ranges of at least 4 tiles,
    # calls of 256 programs or more unsplit; streamed blocks of short docs never split.
    config = LaunchConfig(32, 64, 128, 8, 3, query_group=8)
    wave = 264  # an H100 holding two such programs per SM
    assert heuristics.doc_splits(config, nq=16, nd=32, ld=8192, wave=wave) == 4  # longdoc: 64
    assert heuristics.doc_splits(config, nq=16, nd=32, ld=8192, wave=396) == 8  # 6.2 -> 8
    assert heuristics.doc_splits(config, nq=1, nd=1, ld=8192, wave=wave) == 32  # 4 tiles a range
    assert heuristics.doc_splits(config, nq=1, nd=1, ld=64 * 12, wave=wave) == 2  # 3 ranges of 4
    assert heuristics.doc_splits(config, nq=1, nd=200, ld=1024, wave=wave) == 1  # 1.3 -> 1
    assert heuristics.doc_splits(config, nq=1, nd=1000, ld=1024, wave=2000) == 1  # 256+
    assert heuristics.doc_splits(config, nq=1, nd=4, ld=7 * 64, wave=wave) == 1  # too short
    split = heuristics.streamed(config, nq=16, nd=32, ld=8192, wave=wave)
    assert (split.docs_per_program, split.doc_splits) == (1, 4)
    split = heuristics.streamed(config, nq=1, nd=4, ld=128, wave=wave)
    assert (split.docs_per_program, split.doc_splits) == (1, 1)


def test_a_wave_is_the_programs_the_gpu_holds_at_once():
    # Shared memory (plus 1 KB reserved per program) and 128 registers per thread bound
    # an SM's share; the measured splits of
    # commit d2c3490 follow.
    h100 = heuristics.H100_MULTIPROCESSORS
    longdoc = LaunchConfig(32, 64, 128, 8, 3, query_group=8)  # 112 KB: 2 per SM
    assert heuristics.programs_per_wave(longdoc, 112 * 1024, h100) == 264
    thin = LaunchConfig(32, 128, 128, 2, 2)  # 72 KB on 2 warps: 3 per SM
    assert heuristics.programs_per_wave(thin, 72 * 1024, h100) == 396
    assert heuristics.doc_splits(thin, nq=1, nd=8, ld=32768, wave=396) == 64  # 49.5
    assert heuristics.doc_splits(thin, nq=1, nd=32, ld=8192, wave=396) == 16  # 12.4
    assert heuristics.doc_splits(thin, nq=1, nd=1, ld=2**20, wave=2112) == 256  # at most
    registers = LaunchConfig(32, 64, 128, 8, 3, query_group=2)  # 64 KB fits 3; registers 2
    assert heuristics.programs_per_wave(registers, 64 * 1024, h100) == 264
    tiny = LaunchConfig(16, 16, 16, 1, 1)  # registers: 16 one-warp programs
    assert heuristics.programs_per_wave(tiny, 1024, h100) == 132 * 16
    assert heuristics.programs_per_wave(longdoc, 300 * 1024, h100) == 132  # at least one
    assert heuristics.multiprocessors(CPU) == h100
    # Through a module, as a call derives it: the module's shared memory, the device's SMs.
    dense = registry.load("maxsim_dense_nomask_bf16_triton")
    assert heuristics.streamed_for(dense, longdoc, 16, 32, 8192, 0, CPU).doc_splits == 4
    assert heuristics.streamed_for(dense, thin, 1, 8, 32768, 0, CPU).doc_splits == 64


def test_many_long_docs_under_a_stacked_query_tile_nest_a_few_per_program():
    # About 1024 programs, at most 8 docs each, and only under a tile of 128+ rows on up
    # to 4 warps; short docs keep the flat stream, few long docs their token ranges.
    stacked = LaunchConfig(32, 64, 128, 4, 3, query_group=8)
    inbatch = streamed(stacked, nq=256, nd=256, ld=300)  # 8192 programs -> 1024
    assert (inbatch.docs_per_program, inbatch.flat_docs, inbatch.doc_splits) == (8, False, 1)
    assert streamed(stacked, nq=64, nd=64, ld=300).docs_per_program == 1  # 512
    assert streamed(stacked, nq=256, nd=48, ld=300).docs_per_program == 2  # 1536
    assert streamed(stacked, nq=16, nd=10**6, ld=300).docs_per_program == 8  # capped
    longdoc = streamed(stacked, nq=16, nd=32, ld=8192)
    assert (longdoc.docs_per_program, longdoc.doc_splits) == (1, 4)
    corpus = streamed(stacked, nq=16, nd=10**5, ld=128)  # two tiles: flat stream
    assert corpus.flat_docs and corpus.docs_per_program > 1
    wide = dataclasses.replace(stacked, num_warps=8)
    assert streamed(wide, nq=256, nd=256, ld=300).docs_per_program == 1
    thin = LaunchConfig(32, 64, 128, 4, 3, query_group=2)  # 64 rows
    assert streamed(thin, nq=256, nd=256, ld=300).docs_per_program == 1


def test_small_reranks_load_their_docs_once_with_evict_first_hints():
    # One thin query tile over 64-128 MiB of docs: no pipeline, evict-first loads (in the
    # tile and warps of the "once" key, applied by with_once_tiles). Smaller or larger
    # docs, taller tiles, several query groups (each doc read more than once), split or
    # unknown sizes keep the tuned pipeline.
    thin = LaunchConfig(32, 64, 128, 2, 2)
    colbert = streamed(thin, nq=1, nd=1000, ld=300, doc_bytes=1000 * 300 * 128 * 2)
    assert colbert.evict_docs
    assert (colbert.block_l, colbert.num_warps, colbert.num_stages) == (64, 2, 1)
    tiled = heuristics.with_once_tiles(colbert, LaunchConfig(32, 32, 128, 1, 1))
    assert (tiled.block_l, tiled.num_warps, tiled.num_stages, tiled.evict_docs) == (32, 1, 1, True)
    text_long = streamed(thin, nq=1, nd=1000, ld=1024, doc_bytes=1000 * 1024 * 256)
    assert not text_long.evict_docs and text_long == streamed(thin, 1, 1000, 1024)
    assert not streamed(thin, nq=1, nd=1000, ld=300).evict_docs  # size unknown
    assert not streamed(thin, nq=1, nd=100, ld=180, doc_bytes=100 * 180 * 256).evict_docs
    assert not streamed(thin, nq=4, nd=1000, ld=300, doc_bytes=10**8).evict_docs
    tall = LaunchConfig(128, 64, 128, 4, 3)  # colpali-rerank's 128-token queries
    assert not streamed(tall, nq=1, nd=400, ld=1024, doc_bytes=10**8).evict_docs
    split = streamed(thin, nq=1, nd=1, ld=2**18, doc_bytes=10**8)
    assert split.doc_splits > 1 and not split.evict_docs
    # Through a module: only those whose doc loads take the hint (not PLAID's).
    dense = registry.load("maxsim_dense_nomask_bf16_triton")
    plaid = registry.load("maxsim_dense_nomask_bf16_triton_norm_res2")
    assert dense.EVICT_DOCS_OPTION and not plaid.EVICT_DOCS_OPTION
    assert heuristics.streamed_for(dense, thin, 1, 1000, 300, 1000 * 300 * 256, CPU).evict_docs
    assert not heuristics.streamed_for(plaid, thin, 1, 1000, 300, 1000 * 300 * 256, CPU).evict_docs


def test_long_docs_with_a_partial_tile_peel_it():
    stacked = LaunchConfig(32, 64, 128, 8, 3, query_group=8)  # 256-row query tiles
    assert streamed(stacked, nq=256, nd=256, ld=300).peel_tail  # 4 whole + 44
    assert not streamed(stacked, nq=256, nd=256, ld=256).peel_tail  # no partial tile
    assert streamed(stacked, nq=256, nd=256, ld=200).peel_tail  # 3 whole + 8: narrows
    assert streamed(stacked, nq=256, nd=256, ld=130).peel_tail  # 2 whole + 2: narrows
    assert not streamed(stacked, nq=256, nd=256, ld=180).peel_tail  # 2 whole + 52
    assert not streamed(stacked, nq=256, nd=256, ld=70).peel_tail  # 1 whole + 6
    assert not streamed(stacked, nq=16, nd=10**5, ld=100).peel_tail  # streamed blocks
    thin = LaunchConfig(32, 128, 128, 4, 4)  # one 32-token query: bound by its loads
    assert not streamed(thin, nq=1, nd=1000, ld=520).peel_tail
    assert not streamed(thin, nq=1, nd=1000, ld=264).peel_tail


@pytest.mark.parametrize("ld", [300, 256, 200, 130, 77, 16, 15, 1])
@pytest.mark.parametrize("block_l", [16, 32, 64, 128])
def test_the_tail_tile_covers_what_is_left_of_a_doc(ld, block_l):
    # The launcher's tail tile: a power of two from 16 to BLOCK_L holding the tokens past
    # the last whole tile, no wider than it must be.
    module = registry.load("maxsim_dense_nomask_bf16_triton")
    width, left = module.tail_tile(ld, block_l), ld % block_l
    assert width in (16, 32, 64, 128) and width <= block_l
    if left == 0:
        assert width == block_l
    else:
        assert width >= left and (width == 16 or width < 2 * left)
    # Dispatch's test for a narrower tail (docs of two whole tiles peel only then) agrees.
    stacked = LaunchConfig(32, block_l, 128, 8, 3, query_group=8)
    assert heuristics.peels_tail(stacked, 2 * block_l + left) == (0 < left and width < block_l)


def test_only_short_docs_stream_in_blocks():
    # Docs of at most two tiles stream (sized for ~1024 programs, capped at 64 per
    # program); longer docs keep one program per doc, and so do calls already that wide.
    config = LaunchConfig(32, 64, 128, 4, 3, query_group=4)
    assert heuristics.streamed_blocks(config, nq=16, nd=100_000, ld=128) == 64
    assert heuristics.streamed_blocks(config, nq=16, nd=8192, ld=100) == 32
    assert heuristics.streamed_blocks(config, nq=256, nd=256, ld=300) == 1  # five tiles
    assert heuristics.streamed_blocks(config, nq=1, nd=1000, ld=128) == 1  # 1000 programs


def test_call_configs_are_remembered_per_call_shape_and_bounded(monkeypatch):
    import torch

    from lik.runtime import registry

    monkeypatch.setattr(configs, "_call_configs", {})
    monkeypatch.setattr(configs, "CALL_CONFIG_CACHE_SIZE", 3)
    name = "maxsim_dense_nomask_bf16_triton"
    module = registry.load(name)
    Q = torch.randn(16, 32, 128)

    def config(nd, ld):
        return configs.call_config(name, module, Q, 32, 16 * nd, docs=nd, doc_tokens=ld)

    long_docs = config(32, 8192)
    assert long_docs.doc_splits > 1  # the per-call derivation is part of what is cached
    assert config(32, 8192) is long_docs and len(configs._call_configs) == 1
    short_docs = config(32, 128)  # same tuning key, other sizes: its own derivation
    assert short_docs.doc_splits == 1 and len(configs._call_configs) == 2
    config(33, 128)
    config(34, 128)  # a fourth shape clears the full cache first
    assert len(configs._call_configs) == 1
    assert config(32, 8192) == long_docs


def test_shapes_sharing_a_key_are_tuned_together():
    shapes = [*tune.SHAPES, ("rerank-900x2048", 1, 900, 32, 2048, 128)]
    groups = tune.shapes_by_key(shapes, "hopper")
    names = [[shape[0] for shape in shapes] for shapes in groups.values()]
    assert ["text-long", "rerank-900x2048"] in names  # they differ only in Nd and Ld
    assert sum(len(n) for n in names) == len(shapes)
    # The winner is the smallest multiple of each shape's own best, not either's fastest;
    # a config that failed on one shape is out.
    times = {"short-first": [1.0, 1.5], "balanced": [1.1, 1.1], "long-first": [2.0, 1.0],
             "failed": [0.5, None]}  # fmt: skip
    assert tune.best_joint(times) == "balanced"
    assert tune.best_joint({"failed": [None, 1.0]}) is None


def test_thin_query_tiles_also_sweep_fewer_warps():
    # One 32-token query's tile is too thin for a warpgroup: 1 and 2 warps are candidates
    # there, and only there (stacked tiles, long queries and backward kernels keep 4, 8).
    def warps(key, *groups):
        return {c.num_warps for c in tune.candidates(key) if not groups or c.query_group in groups}

    def key(shape):
        return key_for(shape, "hopper")

    assert warps(key(("colbert-rerank", 1, 1000, 32, 300, 128))) == {1, 2, 4, 8}
    inbatch = key(("inbatch-256", 256, 256, 32, 300, 128))
    assert warps(inbatch, 1) == {1, 2, 4, 8} and warps(inbatch, 2, 4, 8) == {4, 8}
    assert warps(key(("colpali-rerank", 1, 1000, 128, 1024, 128))) == {4, 8}
    assert warps(tune.train_keys(tune.TRAIN_SHAPES[0], "hopper")[1]) == {4, 8}


def test_a_written_table_reads_back_as_written(tmp_path):
    import tomllib

    entry = {"block_l": 32, "num_warps": 8, "query_group": 2, "ms": [0.07, 0.4],
             "shape": "a, b", "column_argmax": True, "card": "a GPU"}  # fmt: skip
    entries = {"v|128|32|l|q8": entry}
    tune.write_table(tmp_path / "hopper.toml", "hopper", entries)
    assert tomllib.loads((tmp_path / "hopper.toml").read_text())["configs"] == entries
    tune.write_table(tmp_path / "card.toml", "hopper", entries, card="a GPU")
    text = (tmp_path / "card.toml").read_text()
    assert "Keys absent here use hopper.toml" in text
    assert tomllib.loads(text)["configs"] == entries


def test_a_near_tie_clearly_faster_with_l2_clean_takes_the_key():
    # do_bench times (us) for two shapes: "close" ties with "best" (within 1%), "slow" not.
    times = {"best": [44.2, 100.0], "close": [44.3, 100.5], "slow": [47.0, 103.0]}
    clean = {"best": [43.0, 91.0], "close": [40.2, 90.0], "slow": [38.0, 80.0]}
    asked = []

    def clean_times(candidate):
        asked.append(candidate)
        return clean[candidate]

    # "close" runs 4% under "best" with L2 clean: it wins; "slow" is no near-tie.
    assert tune.clean_l2_tie_break(times, clean_times) == "close"
    assert sorted(asked) == ["best", "close"]
    # A gain under CLEAN_WIN's 3% is noise: do_bench's winner stays.
    clean["close"] = [42.0, 89.5]
    assert tune.clean_l2_tie_break(times, clean_times) == "best"
    # Without a near-tie nothing is timed again.
    asked.clear()
    alone = {"best": times["best"], "slow": times["slow"]}
    assert tune.clean_l2_tie_break(alone, clean_times) == "best"
    assert asked == []
    assert tune.clean_l2_tie_break({"failed": [None, 1.0]}, clean_times) is None


def test_a_sweep_checks_each_config_against_the_first_and_records_why_one_is_out(monkeypatch):
    # tune.sweep is the selection make tune and the fp8, head and PLAID sweeps share. Its
    # timer is faked (do_bench needs a GPU); the checks and the choice are the real ones.
    import triton.testing

    def config(block_l):
        return LaunchConfig(32, block_l, 128, num_warps=4, num_stages=2)

    first, broken, wrong, faster, near = (config(b) for b in (16, 32, 64, 128, 256))
    base = torch.arange(6.0)
    outputs = {first: base, wrong: base + 1, faster: base * (1 + 1e-5), near: base}
    do_bench_ms = {first: 1.0, faster: 0.90, near: 0.905}
    launched = []

    def run(c):
        launched.append(c)
        if c == broken:
            raise RuntimeError("out of resources")
        return (outputs[c],)

    def timer(ms):  # runs the call, then reads the time of the config it launched
        return lambda fn, **_: (fn(), ms[launched[-1]])[1]

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(triton.testing, "do_bench", timer(do_bench_ms))
    monkeypatch.setattr(tune, "clean_l2_ms", timer({faster: 0.80, near: 0.70}))

    found = tune.sweep([run], [first, broken, first, wrong, faster], quick=True)
    assert list(found.times) == [first, broken, wrong, faster]  # the repeated default ran once
    assert found.times[broken] == [None] and found.times[wrong] == [None]
    assert found.failures == {broken: "does not launch: RuntimeError",
                              wrong: "results differ from the first config's"}  # fmt: skip
    assert found.winner == faster
    # A near-tie (within NEAR_TIE) 12% faster with L2 clean takes the key.
    assert tune.sweep([run], [first, faster, near], quick=True).winner == near
    # Nothing ran: no winner.
    assert tune.sweep([run], [broken], quick=True).winner is None
    assert tune.labeller([first, faster])(faster) == "block_l=128"


def test_the_demo_s_gpu_call_has_a_hopper_entry():
    # lik.demo scores 4 queries against 64 fp16 docs with a doc mask, normalized: on a
    # Hopper GPU its first call takes a committed config instead of sweeping one.
    from lik.runtime.keys import KernelKey, variant_name
    from lik.runtime.tuning import committed_source

    name = variant_name("dense", False, True, True, torch.float16)
    key = KernelKey(name, "hopper", 128, 32, "s", 4)
    assert committed_source(key) == ("hopper.toml", key.table_key())


def test_query_chunks_and_stacking_fit_the_shared_memory():
    # fp32 dots run as tf32x3, which keeps a high and a low part of each operand: twice
    # its bytes (offline sm_90 compile with Triton 3.6, and the H200's out-of-resources
    # error: 288 KB for 128 query tokens at head dim 256 beside one 16-token doc tile).
    fp32 = registry.load("maxsim_dense_nomask_fp32_triton")
    bf16 = registry.load("maxsim_dense_nomask_bf16_triton")
    assert fp32.smem_bytes(128, 16, 256, 1) == 288 * 1024
    chunk = heuristics.family_query_chunk
    assert [chunk(fp32, d, "hopper") for d in (256, 200, 128)] == [64, 64, 128]
    assert [chunk(bf16, d, "hopper") for d in (256, 128)] == [256, LQ_CHUNK]
    assert chunk(fp32, 256, "interpreter") == LQ_CHUNK
    for family in [*SMEM_LIMIT, "some other family"]:  # the chunk's fast path holds for all
        assert chunk(fp32, 256, family) >= heuristics.ALWAYS_FITTING_QUERY_TOKENS
    # A default entry stacking two 64-token fp32 queries at head dim 256 would need 384 KB
    # even unpipelined: one query per tile.
    key = KernelKey("maxsim_dense_nomask_fp32_triton", "hopper", 256, 64, "s", 8, "fwd", "")
    config = config_for(key, fp32.smem_bytes, {"block_l": 32, "num_warps": 8, "num_stages": 3,
                                               "query_group": 2})  # fmt: skip
    assert config.query_group == 1 and config.num_stages == 1
    assert fp32.smem_bytes(64, 32, 256, 1) <= SMEM_LIMIT["hopper"]


def test_routed_grad_d_rows_fit_the_shared_memory():
    lowmem = registry.load("maxsim_dense_nomask_fp32_triton_lowmem")
    # 128 rows at head dim 256 in tf32x3 took 256 KB (offline sm_90 compile); 64 take 128.
    assert lowmem.routed_rows(256, "tf32x3") == 64
    assert lowmem.routed_rows(128, "tf32x3") == lowmem.routed_rows(256, "ieee") == 128
