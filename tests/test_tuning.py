"""Tuning tables: every benchmark shape's key has a committed Hopper entry (no call-time
sweep), configs that do not fit are shrunk instead of failing."""

from __future__ import annotations

import pytest

from lik.runtime import dispatch, tune
from lik.runtime.tuning import LaunchConfig, load_table


@pytest.mark.parametrize("shape", tune.SHAPES, ids=[s[0] for s in tune.SHAPES])
def test_benchmark_shapes_resolve_to_hopper_entries(shape):
    key = tune.key_for(shape, "hopper")
    entry = load_table("hopper").get(key.table_key())
    assert entry is not None, f"{key.table_key()} has no entry: run make tune on a Hopper GPU"
    assert {"block_l", "num_warps", "num_stages", "query_group"} <= set(entry)


def test_out_of_resources_shrinks_the_config_step_by_step():
    class OutOfResources(Exception):
        pass

    tried = []

    def launch(*, config):
        tried.append(config)
        if config.query_group > 1 or config.num_stages > 2:
            raise OutOfResources("shared memory")
        return "ok"

    start = LaunchConfig(32, 64, 128, 8, 3, query_group=4)
    result, fitted = dispatch._launch(launch, start)
    assert result == "ok"
    assert [(c.query_group, c.num_stages) for c in tried] == [(4, 3), (2, 3), (1, 3), (1, 2)]
    assert fitted == LaunchConfig(32, 64, 128, 8, 2, query_group=1)


def test_other_launch_errors_are_not_swallowed():
    def launch(*, config):
        raise ValueError("bad argument")

    with pytest.raises(ValueError, match="bad argument"):
        dispatch._launch(launch, LaunchConfig(32, 64, 128, 8, 3))
