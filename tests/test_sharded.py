"""retrieve_sharded over 2 CPU processes (gloo): the same results as retrieve on the
concatenated corpus, for uneven shards, an empty shard, ties across shards, top_k above
the corpus size, chunking and masks, under torch.compile(fullgraph=True) too (with a
group of its own as well); and the torchrun launcher of the command line.

One spawn runs every scenario, so the processes start (and import torch) only once. The
child processes score on the reference path: the cross-rank merge is what is under test
here (test_retrieval runs the kernels), and the interpreter would triple the run time.
Integer-valued embeddings keep every score exact, so both paths agree bit for bit.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lik.runtime.retrieval import retrieve, retrieve_sharded

WORLD_SIZE = 2
pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed+gloo"
)


@dataclass(frozen=True)
class Scenario:
    name: str
    shard_sizes: tuple[int, int]
    top_k: int
    chunk: int | None = None
    largest: bool = True
    with_masks: bool = False


SCENARIOS = [
    Scenario("even", (6, 6), 4),
    Scenario("uneven-chunked", (9, 4), 5, chunk=2),
    Scenario("rank1-empty", (8, 0), 3),
    Scenario("rank0-empty", (0, 7), 3, chunk=3),
    Scenario("top_k-above-corpus", (3, 2), 20),
    Scenario("masks-smallest", (5, 6), 4, largest=False, with_masks=True),
]

# Compiled with fullgraph=True: the exchange between ranks is one opaque op.
COMPILED_SCENARIOS = [SCENARIOS[1], SCENARIOS[5]]


def corpus(scenario: Scenario):
    """Integer-valued embeddings (exact scores on every path) with duplicates that straddle
    the shard boundary, so equal scores sit on both ranks."""
    generator = torch.Generator().manual_seed(len(scenario.name))
    total = sum(scenario.shard_sizes)
    Q = torch.randint(-1, 2, (2, 3, 8), generator=generator).float()
    D = torch.randint(-1, 2, (total, 4, 8), generator=generator).float()
    if total >= 4:
        D[total - 1] = D[0].clone()
        D[total // 2] = D[1].clone()
    q_mask = d_mask = None
    if scenario.with_masks:
        q_mask = torch.tensor([[True, False, True], [True, True, True]])
        d_mask = torch.rand(total, 4, generator=generator) < 0.75
    return Q, D, q_mask, d_mask


def expected_results(scenario: Scenario):
    Q, D, q_mask, d_mask = corpus(scenario)
    return retrieve(
        Q, D, scenario.top_k, q_mask, d_mask,
        normalize=False, chunk=scenario.chunk, largest=scenario.largest,
    )  # fmt: skip


def run_scenario(scenario: Scenario, rank: int, call=retrieve_sharded):
    Q, D, q_mask, d_mask = corpus(scenario)
    start = sum(scenario.shard_sizes[:rank])
    shard = slice(start, start + scenario.shard_sizes[rank])
    return call(
        Q, D[shard], scenario.top_k, q_mask, None if d_mask is None else d_mask[shard],
        normalize=False, chunk=scenario.chunk, largest=scenario.largest,
    )  # fmt: skip


def bad_input_on_rank_1(rank: int) -> str:
    """Rank 1 passes a corpus of the wrong head dim; both ranks must raise, none hang."""
    Q, D = torch.randn(2, 3, 8), torch.randn(4, 4, 8 if rank == 0 else 6)
    try:
        retrieve_sharded(Q, D, 2)
    except (ValueError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def compiled_results(rank: int) -> dict:
    """retrieve_sharded under torch.compile(fullgraph=True): a graph break would raise."""
    compiled = torch.compile(retrieve_sharded, backend="aot_eager", fullgraph=True)
    results = {s.name: run_scenario(s, rank, call=compiled) for s in COMPILED_SCENARIOS}
    group = dist.new_group(list(range(WORLD_SIZE)))  # not the default: the op takes its name
    results["group"] = run_scenario(COMPILED_SCENARIOS[0], rank,
                                    call=functools.partial(compiled, group=group))  # fmt: skip
    return results


def worker(rank: int, store_path: str, out_dir: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{store_path}", rank=rank, world_size=WORLD_SIZE
    )
    try:
        results = {s.name: run_scenario(s, rank) for s in SCENARIOS}
        results["bad-input"] = bad_input_on_rank_1(rank)
        results["compiled"] = compiled_results(rank)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _children_use_the_reference_path():
    """Environment for child processes: no interpreter (see the module docstring)."""
    return {**os.environ, "TRITON_INTERPRET": "0", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("sharded")
    saved = dict(os.environ)
    os.environ.update(_children_use_the_reference_path())  # spawned children inherit it
    try:
        mp.spawn(worker, args=(str(out_dir / "store"), str(out_dir)), nprocs=WORLD_SIZE)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return [torch.load(out_dir / f"rank{rank}.pt") for rank in range(WORLD_SIZE)]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_every_rank_gets_the_single_process_results(rank_results, scenario):
    expected_scores, expected_ids = expected_results(scenario)
    for rank, results in enumerate(rank_results):
        scores, ids = results[scenario.name]
        assert torch.equal(ids, expected_ids), f"rank {rank}: {ids} != {expected_ids}"
        assert torch.equal(scores, expected_scores), f"rank {rank}"


@pytest.mark.parametrize("name", [*(s.name for s in COMPILED_SCENARIOS), "group"])
def test_compiled_gives_the_eager_results(rank_results, name):
    scenario = next((s for s in COMPILED_SCENARIOS if s.name == name), COMPILED_SCENARIOS[0])
    expected_scores, expected_ids = expected_results(scenario)
    for rank, results in enumerate(rank_results):
        scores, ids = results["compiled"][name]
        assert torch.equal(ids, expected_ids), f"rank {rank}: {ids} != {expected_ids}"
        assert torch.equal(scores, expected_scores), f"rank {rank}"


def test_scenarios_exercise_ties_across_shards():
    # Guards the data: a duplicate of doc 0 sits in the last shard.
    scenario = SCENARIOS[0]
    _, D, _, _ = corpus(scenario)
    assert torch.equal(D[0], D[-1]) and sum(scenario.shard_sizes) - 1 >= scenario.shard_sizes[0]


def test_a_bad_shard_fails_every_rank(rank_results):
    assert rank_results[1]["bad-input"].startswith("ValueError: Q and D must share the head dim")
    assert rank_results[0]["bad-input"] == (
        "RuntimeError: retrieve_sharded failed on rank(s) [1]; see the error there"
    )


def test_needs_an_initialized_process_group():
    with pytest.raises(RuntimeError, match="initialized torch.distributed process group"):
        retrieve_sharded(torch.randn(1, 2, 4), torch.randn(3, 2, 4), 1)


def test_torchrun_launcher_matches_single_process(tmp_path):
    """`torchrun -m lik retrieve` on 2 ranks writes what retrieve returns in one process."""
    generator = torch.Generator().manual_seed(11)
    Q = torch.randint(-1, 2, (2, 3, 8), generator=generator).float()
    D = torch.randint(-1, 2, (11, 4, 8), generator=generator).float()
    D[9] = D[2].clone()  # a tie across the two ranks' shares (6 and 5 docs)
    torch.save(Q, tmp_path / "q.pt")
    torch.save({"embeddings": D}, tmp_path / "d.pt")
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    launch += [f"--nproc-per-node={WORLD_SIZE}", "-m", "lik", "retrieve", "--no-normalize"]
    launch += ["--queries", "q.pt", "--corpus", "d.pt", "--top-k", "4", "--chunk", "2"]
    launch += ["--device", "cpu"]  # gloo: one GPU per rank is not promised here
    done = subprocess.run(
        [*launch, "--out", "sharded.pt"],
        cwd=tmp_path, env=_children_use_the_reference_path(), capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{WORLD_SIZE} ranks" in done.stdout
    got = torch.load(Path(tmp_path, "sharded.pt"))
    want_scores, want_ids = retrieve(Q, D, 4, normalize=False)
    assert torch.equal(got["indices"], want_ids)
    assert torch.equal(got["scores"], want_scores)
