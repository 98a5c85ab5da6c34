"""An attempt whose rank is lost while it starts is placed again; one that cannot start fails."""

from __future__ import annotations

import pytest

from spotrun.orchestrator.groups import RankFailed, RankLost
from spotrun.orchestrator.ledger import AttemptStarted, Ledger
from spotrun.orchestrator.supervisor import JobFailedError, Supervisor
from spotrun.trainer.rank import Report
from spotrun.trainer.storage import open_storage
from tests.conftest import make_spec
from tests.helpers.groups import ScriptedGroup


def test_a_rank_lost_while_starting_is_placed_again(tmp_path):
    spec = make_spec(tmp_path, "train.updates=4", job_id="s")
    tries = []

    def make_group(size, attempt, *rest):
        tries.append(attempt)
        if len(tries) == 1:
            raise RankLost(0, "unresponsive", "setup timed out")
        return ScriptedGroup(1, [[Report(rank=0, last_update=4, state="finished")]])

    outcome = Supervisor(spec, make_group, capacity=lambda: 1, sleep=lambda s: None).run()
    assert outcome.state == "finished"
    assert tries == [1, 1], "nothing ran in the lost start: the attempt number is used again"
    started = [e.attempt for e in Ledger(open_storage(spec.storage), "s").read() if isinstance(e, AttemptStarted)]
    assert started == [1]


def test_ranks_lost_at_every_start_exhaust_the_restart_budget(tmp_path):
    spec = make_spec(tmp_path, "train.updates=4", "world.max_restarts=2", job_id="s")

    def make_group(*args):
        raise RankLost(0, "node-lost", "gone")

    with pytest.raises(JobFailedError, match="lost while starting 3 times"):
        Supervisor(spec, make_group, capacity=lambda: 1, sleep=lambda s: None).run()


def test_a_rank_that_cannot_start_fails_the_job_at_once(tmp_path):
    spec = make_spec(tmp_path, "train.updates=4", job_id="s")
    calls = []

    def make_group(*args):
        calls.append(1)
        raise RankFailed("rank 0 could not start: ModuleNotFoundError: No module named 'mine'")

    with pytest.raises(RankFailed, match="No module named 'mine'"):
        Supervisor(spec, make_group, capacity=lambda: 1, sleep=lambda s: None).run()
    assert calls == [1]


def test_an_elastic_restore_on_another_device_model_is_labelled_exact_data(tmp_path):
    """The ranks report their GPU model; a bundle written on CPUs restored by GPU ranks (which only
    elastic allows: strict ranks refuse it) is not an exact continuation."""
    from spotrun.orchestrator.launch import run_in_process
    from spotrun.orchestrator.ledger import Restored
    from spotrun.trainer.bundle import versions

    spec = make_spec(tmp_path, "train.updates=4", "checkpoint.every_updates=2", "world.policy=elastic", job_id="g")
    run_in_process(spec.model_copy(update={"train": spec.train.model_copy(update={"updates": 2})}))
    group = ScriptedGroup(1, [[Report(rank=0, last_update=4, state="finished")]])
    group.runtimes = [versions().model_copy(update={"gpu": "NVIDIA H200"})]
    Supervisor(spec, lambda *args: group, capacity=lambda: 1, sleep=lambda s: None).run()
    restored = [e for e in Ledger(open_storage(spec.storage), "g").read() if isinstance(e, Restored)]
    assert [(e.update, e.recovery_label) for e in restored] == [(2, "exact-data")]


def test_the_in_process_rank_s_end_is_seen_without_waiting_out_the_poll_interval(tmp_path, monkeypatch):
    """The in-process group's wait joins the rank's thread: with a poll interval of a minute the job
    still ends when its rank does (a wait that slept the interval out would take a minute or more)."""
    import time

    from spotrun.orchestrator.groups import InProcessGroup
    from spotrun.orchestrator.launch import run_in_process

    monkeypatch.setattr(InProcessGroup, "poll_interval_s", 60.0)
    spec = make_spec(tmp_path, "train.updates=3", job_id="joins")
    t0 = time.monotonic()
    assert run_in_process(spec).state == "finished"
    assert time.monotonic() - t0 < 60, "the supervisor slept out its poll interval"
