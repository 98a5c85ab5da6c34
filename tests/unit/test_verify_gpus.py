"""The local Ray cluster verify starts declares this machine's GPUs when the spec's ranks take them
(it declared CPUs only, so a GPU rank never placed), and a job whose GPU ranks cannot be placed here
is refused before any run. The GPU count and Ray's Cluster are faked: nothing here starts Ray."""

from __future__ import annotations

import pytest

from spotrun.orchestrator.control.specfile import SpecError, load_spec
from spotrun.orchestrator.verify import oracle as verify_module
from spotrun.orchestrator.verify.oracle import Verifier, head_node_args
from tests.conftest import ROOT, make_spec


class FakeCluster:
    started: list[dict] = []

    def __init__(self, *, initialize_head: bool, head_node_args: dict) -> None:
        FakeCluster.started.append(head_node_args)


def verifier(tmp_path, monkeypatch, gpus: int, *sets: str, nodes: int = 0) -> Verifier:
    monkeypatch.setattr(verify_module, "local_gpus", lambda: gpus)
    base = [f"storage=file://{tmp_path / 'runs'}", f"data.shards={ROOT / 'configs/data/tiny'}", *sets]
    return Verifier(str(ROOT / "configs/tiny.yaml"), base, kills=1, seed=0, no_ray=False, workdir=tmp_path,
                    load=lambda path, overrides: load_spec(path, overrides, "v"), nodes=nodes)


def test_verify_declares_this_machines_gpus_for_gpu_ranks(tmp_path, monkeypatch):
    import ray.cluster_utils

    monkeypatch.setattr(ray.cluster_utils, "Cluster", FakeCluster)
    FakeCluster.started = []
    verifier(tmp_path, monkeypatch, 2, "world.num_gpus_per_rank=1", "world.size=2")._start_cluster()
    assert FakeCluster.started[-1]["num_gpus"] == 2
    verifier(tmp_path, monkeypatch, 2, "world.num_gpus_per_rank=0", "world.size=2")._start_cluster()
    assert "num_gpus" not in FakeCluster.started[-1]  # CPU ranks: as before


def test_more_gpu_ranks_than_gpus_are_refused_before_any_run_naming_the_fix(tmp_path, monkeypatch):
    with pytest.raises(SpecError) as e:  # the CLI's exit 2
        verifier(tmp_path, monkeypatch, 1, "world.num_gpus_per_rank=1", "world.size=2")
    msg = str(e.value)
    assert "world.size=2" in msg and "2 GPU(s)" in msg and "this machine shows torch 1" in msg
    assert "verify --no-ray" in msg and "world.num_gpus_per_rank=0" in msg
    with pytest.raises(SpecError, match="shows torch 0"):  # a CPU machine
        verifier(tmp_path, monkeypatch, 0, "world.num_gpus_per_rank=1")
    # without Ray, the one rank trains in the verify's own processes: nothing to declare
    monkeypatch.setattr(verify_module, "local_gpus", lambda: 0)
    Verifier(str(ROOT / "configs/tiny.yaml"), ["world.num_gpus_per_rank=1", f"storage=file://{tmp_path}"], kills=1,
             seed=0, no_ray=True, workdir=tmp_path, load=lambda path, overrides: load_spec(path, overrides, "v"))


def test_gpu_ranks_on_simulated_nodes_are_refused(tmp_path):
    with pytest.raises(SpecError, match="verify --nodes 2 simulates nodes"):
        head_node_args(make_spec(tmp_path, "world.num_gpus_per_rank=1"), nodes=2, gpus_here=8)
