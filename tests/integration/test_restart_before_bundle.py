"""A job that died before its first bundle restarted from nothing: that is a restart too, and it lost
everything since the attempt's start. ``spotrun history`` (table and ``--json``) and the dashboard
(jobs list and job page) show it with its cause and that time.

Two ways to die: the driver itself SIGKILLed (a real ``spotrun run --no-ray`` killed by a fault in
update 3, run again with the same command), and a rank lost under a live supervisor (a scripted
group: the supervisor records the loss and how far the attempt got)."""

from __future__ import annotations

import json
from datetime import datetime

import pytest
from fastapi.testclient import TestClient

from spotrun.orchestrator.cli.main import main
from spotrun.orchestrator.control.platform import Options, Platform
from spotrun.orchestrator.control.supervisor import Supervisor
from spotrun.orchestrator.dashboard import create_app
from spotrun.orchestrator.ledger.events import AttemptStarted
from spotrun.orchestrator.ledger.history import history
from spotrun.orchestrator.ledger.store import Ledger
from spotrun.trainer.metrics import JsonlSink
from spotrun.trainer.run.rank import Report
from spotrun.trainer.storage import open_storage
from tests.conftest import make_spec
from tests.helpers.groups import ScriptedGroup
from tests.helpers.runs import hold, kill_when_held, run_cmd, run_to_end

pytestmark = pytest.mark.slow
JOB = "early"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The job killed in update 3 (its first bundle would come at 10), then finished."""
    tmp = tmp_path_factory.mktemp("early")
    cmd = run_cmd(tmp / "runs", JOB, tmp / "t.jsonl", "train.updates=12", "checkpoint.every_updates=10",
                  "metrics.sinks=[sqlite, jsonl]", f"faults=[{hold(3, site='microstep')}]")
    log = tmp / "runs" / JOB / "metrics.jsonl"

    def logged_update_2() -> bool:
        # the sinks are written off the training thread: a kill as soon as update 3 began could come before
        # update 2's points reached the log, and the restart would then seem to have lost less
        return log.is_file() and any(p.update >= 2 for p in JsonlSink(log).writes(JOB))

    assert kill_when_held(cmd, tmp / "runs", JOB, until=logged_update_2) == -9
    assert run_to_end(cmd).returncode == 0
    return tmp / "runs"


def _started(root) -> dict[int, datetime]:
    return {e.attempt: e.at for e in Ledger(open_storage(f"file://{root}"), JOB).read()
            if isinstance(e, AttemptStarted)}


def test_history_counts_the_restart_and_everything_it_lost(runs, capsys):
    assert main(["history", JOB, "--storage", f"file://{runs}", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    [row] = doc["restarts"]
    assert (row["attempt"], row["cause"], row["restored_from"], row["restored_update"]) == (2, "driver-exit", None, 0)
    assert row["recovery_label"] == "fresh"
    started = _started(runs)
    # nothing was restored: the whole first attempt is lost, from its start to the second's
    assert row["time_lost_seconds"] == round((started[2] - started[1]).total_seconds(), 3) > 0
    assert main(["history", JOB, "--storage", f"file://{runs}"]) == 0
    table = capsys.readouterr().out
    assert "time lost" in table and str(row["time_lost_seconds"]) in table and "driver-exit" in table


def test_the_dashboard_shows_the_restart_and_its_lost_time(runs):
    client = TestClient(create_app(f"file://{runs}"), base_url="http://127.0.0.1")
    [summary] = client.get("/api/jobs").json()
    row = history(open_storage(f"file://{runs}"), JOB).restarts[0]
    assert (summary["attempts"], summary["restarts"]) == (2, 1)
    assert summary["time_lost_seconds"] == row.time_lost_seconds > 0
    job = client.get(f"/api/jobs/{JOB}").json()
    [shown] = job["restarts"]
    assert shown["cause"] == "driver-exit" and shown["time_lost_seconds"] == row.time_lost_seconds
    # the driver died: how far it got is in the metric log, and history says the same
    assert (shown["lost_updates"], shown["lost_updates_source"], shown["lost_range"]) == (2, "metrics log", [1, 2])
    assert (row.lost_updates, row.lost_range) == (2, [1, 2])
    page = client.get(f"/jobs/{JOB}").text
    assert "none: started afresh" in page and "1 restart(s)" in page


def test_a_rank_lost_before_the_first_bundle_is_a_restart_with_its_lost_updates(tmp_path):
    spec = make_spec(tmp_path, "train.updates=4", "world.size=2", "checkpoint.every_updates=10", job_id="s")
    scripts = iter([
        ScriptedGroup(2, [[Report(rank=0, last_update=3), Report(rank=1, last_update=3)], "lost"],
                      salvage=[Report(rank=0, last_update=3)]),
        ScriptedGroup(2, [[Report(rank=r, last_update=4, state="finished") for r in (0, 1)]]),
    ])
    outcome = Supervisor(spec, Platform(lambda *a: next(scripts), capacity=lambda: 2),
                         Options(sleep=lambda s: None)).run()
    assert outcome.state == "finished" and outcome.restarts == 1
    [row] = history(open_storage(spec.storage), "s").restarts
    assert (row.cause, row.restored_from, row.lost_updates) == ("process-exit", None, 3)
    assert row.downtime_seconds is not None and row.time_lost_seconds >= row.downtime_seconds
