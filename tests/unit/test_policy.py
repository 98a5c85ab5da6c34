"""Topology policies: the restart decision, and when a running elastic job grows back."""

from __future__ import annotations

from tests.conftest import make_spec

from orchestrator import policy


def test_elastic_grows_to_the_largest_allowed_world_that_fits(tmp_path):
    spec = make_spec(tmp_path, "world.policy=elastic", "world.size=4", "world.min_size=1", "train.updates=100",
                     "checkpoint.every_updates=10", "train.micro_batch=1", "train.accum_steps=12")
    assert spec.allowed_world_sizes() == [1, 2, 3, 4]
    d = policy.grow(spec, world_size=1, available_ranks=3, updates_left=50)
    assert d is not None and d.world_size == 3 and "grows from 1 to 3" in d.reason
    assert policy.grow(spec, 1, 5, 50).world_size == 4
    assert policy.grow(spec, 3, 3, 50) is None  # no larger allowed size fits
    assert policy.grow(spec, 4, 8, 50) is None  # already at max_size
    assert policy.grow(spec, 1, 4, 10) is None  # one interval left: a restart would not pay off


def test_only_elastic_grows(tmp_path):
    for name in ("strict", "fresh-epoch"):
        spec = make_spec(tmp_path, f"world.policy={name}", "world.size=2", "train.updates=100")
        assert policy.grow(spec, 1, 2, 50) is None, name
