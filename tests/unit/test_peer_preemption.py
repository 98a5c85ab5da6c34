"""The Ray Train peer's preemption settings reach Ray Train, and its driver refuses a bad config (no Ray started).

What reaches the controller is what Ray Train's own ``get_env_vars_to_propagate`` reads from the
driver's environment while ``trainer.fit()`` runs: the controller actor is started with exactly those
variables and builds its drain watcher's poll from them. The end-to-end check (a drained node on a
real multi-node cluster) is a bench probe, too slow for CI.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace
from typing import Any

import pytest
from ray.train.v2._internal.constants import get_env_vars_to_propagate
from ray.train.v2.api.preemption import PreemptionInfo

from bench import peer_driver, peer_loop


def _capture_fit(monkeypatch) -> list[dict[str, Any]]:
    """TorchTrainer.fit replaced: it records what Ray Train would hand its controller, and starts nothing."""
    from ray.train.torch import TorchTrainer

    seen: list[dict[str, Any]] = []

    def fit(self):
        seen.append({"env": get_env_vars_to_propagate(), "failure": self.run_config.failure_config})
        return SimpleNamespace(error=None)

    monkeypatch.setattr(TorchTrainer, "fit", fit)
    return seen


def test_fit_hands_both_polls_and_unlimited_budgets_to_the_controller_then_restores_the_environment(
        monkeypatch, tmp_path):
    seen = _capture_fit(monkeypatch)
    monkeypatch.setenv(peer_loop.PREEMPTION_POLL_ENV, "7")  # the caller's own value: put back afterwards
    monkeypatch.delenv(peer_loop.POLL_ENV, raising=False)
    peer_loop.fit({"world_size": 2}, tmp_path, "run", 0.2, max_failures=-1, preemption_poll_s=0.5)
    env, failure = seen[0]["env"], seen[0]["failure"]
    assert env[peer_loop.PREEMPTION_POLL_ENV] == "0.5" and env[peer_loop.POLL_ENV] == "0.2"
    assert (failure.max_failures, failure.max_preemption_failures) == (-1, -1)
    # the defaults this module's docstring argues for, not Ray Train's relaxations
    assert (failure.relax_collectives_on_preemption, failure.preemption_grace_s) == (False, 0.0)
    assert os.environ[peer_loop.PREEMPTION_POLL_ENV] == "7" and peer_loop.POLL_ENV not in os.environ


def test_fit_without_a_drain_poll_leaves_ray_trains_default(monkeypatch, tmp_path):
    seen = _capture_fit(monkeypatch)
    monkeypatch.setenv(peer_loop.PREEMPTION_POLL_ENV, "7")
    peer_loop.fit({"world_size": 2}, tmp_path, "run", None)  # bench 4's call
    assert peer_loop.PREEMPTION_POLL_ENV not in seen[0]["env"] and peer_loop.POLL_ENV not in seen[0]["env"]
    assert seen[0]["failure"].max_failures == 3


def _worker(tmp_path) -> peer_loop.Worker:
    """A Worker with only what ``preemption_notice`` uses (building a real one needs a Ray Train worker)."""
    worker = object.__new__(peer_loop.Worker)
    worker.log, worker.step, worker.attempt = tmp_path / "rank-0.jsonl", 12, 2
    worker.preemptions_seen, worker.deadline, worker.c, worker.rank = set(), None, {}, 0
    return worker


def test_a_preemption_asks_for_one_checkpoint_and_a_new_one_for_another(monkeypatch, tmp_path):
    import ray.train

    answers: list[PreemptionInfo | None] = [
        None,
        PreemptionInfo(deadline_ms=1000, preempted_node_to_ranks={"n1": [1]}),
        PreemptionInfo(deadline_ms=1000, preempted_node_to_ranks={"n1": [1]}),  # the same drain, asked again
        PreemptionInfo(deadline_ms=900, preempted_node_to_ranks={"n1": [1], "n2": [0]}),  # a second node
    ]
    monkeypatch.setattr(ray.train, "get_preemption_info", lambda: answers.pop(0))
    worker = _worker(tmp_path)
    assert [worker.preemption_notice() for _ in range(4)] == [False, True, False, True]
    events = [json.loads(line) for line in worker.log.read_text().splitlines()]
    assert [(e["event"], e["step"], e["attempt"], e["deadline_ms"], e["ranks"]) for e in events] == [
        ("preempted", 12, 2, 1000, [1]), ("preempted", 12, 2, 900, [0, 1])]


def test_before_deadline_checkpoints_once_more_at_the_last_step_that_ends_the_margin_before_it(
        monkeypatch, tmp_path):
    import time

    import ray.train
    import ray.train.collective

    deadline = time.time() + 3.0
    monkeypatch.setattr(ray.train, "get_preemption_info", lambda: PreemptionInfo(
        deadline_ms=int(deadline * 1000), preempted_node_to_ranks={"n1": [1]}))
    monkeypatch.setattr(ray.train.collective, "broadcast_from_rank_zero", lambda data: data)  # one rank: rank 0
    worker = _worker(tmp_path)
    worker.c = {"preemption_checkpoint": "before_deadline", "preemption_margin_s": 1.0}
    worker.step_s = 0.5
    assert worker.preemption_notice() and not worker.deadline_near()  # 1.5 s of margin and step left: not yet
    worker.step_s = 2.5  # the next step would end inside the margin: this is the last boundary
    assert worker.deadline_near() and not worker.deadline_near()  # once per preemption
    assert [json.loads(line)["event"] for line in worker.log.read_text().splitlines()] == [
        "preempted", "deadline_checkpoint"]


@pytest.mark.parametrize("change, named", [
    ({"storage": "runs"}, "relative"),
    ({"max_failure": 3}, "max_failure"),
    ({"name": ""}, "name"),
])
def test_the_driver_refuses_a_bad_config_naming_the_key(monkeypatch, tmp_path, capsys, change, named):
    monkeypatch.setattr(peer_driver, "run", lambda config: 0)  # accepted: would connect to a cluster
    config = {"address": "127.0.0.1:6379", "storage": str(tmp_path / "s"), "name": "peer", "loop": {}, **change}
    path = tmp_path / "driver.json"
    path.write_text(json.dumps(config))
    assert peer_driver.main([str(path)]) == 2
    assert named in capsys.readouterr().err


def test_the_driver_refuses_a_file_that_is_not_json(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(peer_driver, "run", lambda config: 0)
    path = tmp_path / "driver.json"
    path.write_text("address: x")
    assert peer_driver.main([str(path)]) == 2
    assert "JSON" in capsys.readouterr().err
