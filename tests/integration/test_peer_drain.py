"""The Ray Train peer (bench/peer_driver.py) on a drained node of a real 3-node local cluster (a soak: ~2 min).

Rank 1's node is DRAINED through Ray's GCS with a 5 s deadline, as a spot reclaim is: Ray Train's watcher
tells the workers, the loop checkpoints at once and again just before the deadline, Ray Train tears the
group down at the deadline (the node still up) and restarts on the two other nodes from that last
checkpoint; then the drained node is removed and the run finishes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.cluster_process import ClusterProcess
from bench.ray_train_side_by_side import PEER, Shape, peer_config
from tests.conftest import ROOT

UPDATES, DRAIN_AT, DEADLINE_S = 1500, 200, 5.0


def _records(out: Path, rank: int) -> list[dict]:
    path = out / f"rank-{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait(proc: subprocess.Popen, reached, what: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not reached():
        assert proc.poll() is None, f"the driver exited ({proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} in {timeout} s"
        time.sleep(0.05)  # polling a condition (the workers' logs)


@pytest.mark.soak
def test_a_drained_node_costs_only_the_margin_before_its_deadline(tmp_path):
    from ray._raylet import GcsClient
    from ray.core.generated import autoscaler_pb2

    out = tmp_path / "peer"
    out.mkdir()
    loop = {**peer_config(out, Shape(UPDATES, 0, (1000,), 1), 1000, False, PEER), "preemption_api": True,
            "preemption_checkpoint": "before_deadline", "preemption_margin_s": 0.4}
    with ClusterProcess(3) as cluster:
        config = tmp_path / "driver.json"
        config.write_text(json.dumps({"address": cluster.address, "storage": str(tmp_path / "storage"),
                                      "name": "drained", "loop": loop, "poll_s": 0.2, "preemption_poll_s": 0.5}))
        proc = subprocess.Popen([sys.executable, "-m", "bench.peer_driver", str(config)], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            _wait(proc, lambda: any(r["event"] == "step" and r["step"] >= DRAIN_AT for r in _records(out, 0)),
                  f"step {DRAIN_AT}")
            drained = _records(out, 1)[0]["node"]
            accepted, why = GcsClient(address=cluster.address).drain_node(
                drained, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
                "spot interruption (test)", int((time.time() + DEADLINE_S) * 1000))
            assert accepted, why
            # the restart needs no removal: Ray Train tears the group down at the deadline by itself
            _wait(proc, lambda: sum(r["event"] == "start" for r in _records(out, 1)) == 2, "restart")
            assert cluster.remove({drained}) == 1
            _, err = proc.communicate(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0, err[-3000:]
    log = _records(out, 0)
    starts = [r for r in log if r["event"] == "start"]
    assert [s["preemption_poll_s"] for s in starts] == ["0.5", "0.5"]  # the watcher's poll reached the group
    assert all(r["node"] != drained for r in _records(out, 1)[1:] if r["event"] == "start")
    preempted = [r for r in log if r["event"] == "preempted"]
    assert [(r["attempt"], r["ranks"]) for r in preempted] == [(1, [1])]
    last_call = [r for r in log if r["event"] == "deadline_checkpoint"]
    assert [r["attempt"] for r in last_call] == [1] and last_call[0]["step"] > preempted[0]["step"]
    steps = [r for r in log if r["event"] == "step"]
    resumed = next(r for r in steps if r["attempt"] == 2)
    assert resumed["step"] == last_call[0]["step"] + 1  # the checkpoint just before the deadline, none older
    assert steps[-1]["step"] == UPDATES and steps[-1]["attempt"] == 2
