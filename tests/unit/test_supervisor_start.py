"""An attempt whose rank is lost while it starts is placed again; one that cannot start fails."""

from __future__ import annotations

import pytest

from spotrun.orchestrator.control.platform import Options, Platform
from spotrun.orchestrator.control.supervisor import JobFailedError, Supervisor
from spotrun.orchestrator.ledger.events import AttemptStarted
from spotrun.orchestrator.ledger.store import Ledger
from spotrun.orchestrator.workers.groups import RankFailed, RankLost
from spotrun.trainer.run.rank import Report
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

    outcome = Supervisor(spec, Platform(make_group, capacity=lambda: 1), Options(sleep=lambda s: None)).run()
    assert outcome.state == "finished"
    assert tries == [1, 1], "nothing ran in the lost start: the attempt number is used again"
    started = [e.attempt for e in Ledger(open_storage(spec.storage), "s").read() if isinstance(e, AttemptStarted)]
    assert started == [1]


def test_nodes_lost_at_every_start_use_up_the_preemption_budget_not_the_failure_budget(tmp_path):
    spec = make_spec(tmp_path, "train.updates=4", "world.max_restarts=0", "world.max_preemptions=2", job_id="s")
    calls = []

    def make_group(*args):
        calls.append(1)
        raise RankLost(0, "node-lost", "gone")

    with pytest.raises(JobFailedError, match="3 preemptions, more than world.max_preemptions=2"):
        Supervisor(spec, Platform(make_group, capacity=lambda: 1), Options(sleep=lambda s: None)).run()
    assert len(calls) == 3, "max_restarts=0 allows no failure, yet both preemptions were restarted"


def test_a_rank_that_cannot_start_is_a_failure_retried_until_the_crash_loop(tmp_path):
    """An import that fails may be one node's fault (retried); every attempt failing with no bundle
    between them is a crash loop: the job fails with the last error after world.crash_loop_failures."""
    spec = make_spec(tmp_path, "train.updates=4", job_id="s")
    calls, waits = [], []

    def make_group(*args):
        calls.append(1)
        raise RankFailed("rank 0 could not start: ModuleNotFoundError: No module named 'mine'")

    with pytest.raises(RankFailed, match=r"No module named 'mine' \(not restarted: a crash loop: 3 failures in a row"):
        Supervisor(spec, Platform(make_group, capacity=lambda: 1), Options(sleep=waits.append)).run()
    assert len(calls) == 3
    assert len(waits) == 2, "a backoff before each restart, none after the last failure"


def test_bad_input_a_rank_refused_fails_the_job_at_once(tmp_path):
    from spotrun.orchestrator.workers.groups import refuses
    from spotrun.trainer.job.contract import JobError

    spec = make_spec(tmp_path, "train.updates=4", job_id="s")
    calls = []

    def make_group(*args):
        calls.append(1)
        raise RankFailed("rank 0 raised JobError: build() returned no model", refusal=refuses(JobError("x")))

    with pytest.raises(RankFailed, match="no model"):
        Supervisor(spec, Platform(make_group, capacity=lambda: 1), Options(sleep=lambda s: None)).run()
    assert calls == [1]
    assert not refuses(RuntimeError("CUDA error")) and not refuses(ValueError("a user's own"))


def test_an_elastic_restore_on_another_device_model_is_labelled_exact_data(tmp_path):
    """The ranks report their GPU model; a bundle written on CPUs restored by GPU ranks (which only
    elastic allows: strict ranks refuse it) is not an exact continuation."""
    from spotrun.orchestrator.control.launch import run_in_process
    from spotrun.orchestrator.ledger.events import Restored
    from spotrun.trainer.bundle.description import versions

    spec = make_spec(tmp_path, "train.updates=4", "checkpoint.every_updates=2", "world.policy=elastic", job_id="g")
    run_in_process(spec.model_copy(update={"train": spec.train.model_copy(update={"updates": 2})}))
    group = ScriptedGroup(1, [[Report(rank=0, last_update=4, state="finished")]])
    group.runtimes = [versions().model_copy(update={"gpu": "NVIDIA H200"})]
    Supervisor(spec, Platform(lambda *args: group, capacity=lambda: 1), Options(sleep=lambda s: None)).run()
    restored = [e for e in Ledger(open_storage(spec.storage), "g").read() if isinstance(e, Restored)]
    assert [(e.update, e.recovery_label) for e in restored] == [(2, "exact-data")]


def test_the_in_process_rank_s_end_is_seen_without_waiting_out_the_poll_interval(tmp_path, monkeypatch):
    """The in-process group's wait joins the rank's thread: with a poll interval of a minute the job
    still ends when its rank does (a wait that slept the interval out would take a minute or more)."""
    import time

    from spotrun.orchestrator.control.launch import run_in_process
    from spotrun.orchestrator.workers.groups import InProcessGroup

    monkeypatch.setattr(InProcessGroup, "poll_interval_s", 60.0)
    spec = make_spec(tmp_path, "train.updates=3", job_id="joins")
    t0 = time.monotonic()
    assert run_in_process(spec).state == "finished"
    assert time.monotonic() - t0 < 60, "the supervisor slept out its poll interval"
