"""Two restart budgets: preemptions never use up the job; failures do, and a crash loop fails fast."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from spotrun.orchestrator.budgets import RestartBudgets, classify
from spotrun.orchestrator.groups import RankFailed
from spotrun.orchestrator.ledger import Ledger, WorkerLost
from spotrun.orchestrator.notices import Notice
from spotrun.orchestrator.supervisor import Supervisor
from spotrun.trainer.rank import Report
from spotrun.trainer.storage import open_storage
from tests.conftest import make_spec
from tests.helpers.groups import ScriptedGroup


@pytest.mark.parametrize(("cause", "noticed", "loss"), [
    ("node-lost", False, "preemption"),
    ("notice:aws", False, "preemption"),
    ("process-exit", True, "preemption"),  # a notice for its node came first: the machine was taken
    ("process-exit", False, "failure"),
    ("oom", False, "failure"),
    ("error", False, "failure"),
    ("collective-error", False, "failure"),
    ("collective-timeout", False, "failure"),
    ("unresponsive", False, "failure"),
    ("start-failed", False, "failure"),
])
def test_each_cause_has_its_class(cause, noticed, loss):
    assert classify(cause, noticed) == loss


def test_preemptions_never_touch_the_failure_budget_and_a_crash_loop_needs_failures_in_a_row(tmp_path):
    spec = make_spec(tmp_path, "world.max_restarts=5", "world.crash_loop_failures=2")
    b = RestartBudgets(spec.world)
    assert all(b.count("preemption") is None for _ in range(100)), "no limit on preemptions by default"
    assert b.count("failure") is None
    b.published()  # progress between the two failures: no crash loop
    assert b.count("failure") is None
    assert "crash loop: 2 failures in a row" in (b.count("failure") or "")
    assert b.record().model_dump() == {"failures": 3, "max_restarts": 5, "preemptions": 100, "max_preemptions": None}
    assert b.record().left() == {"failures_left": 2, "preemptions_left": None}


def test_the_failure_budget_ends_the_job_past_max_restarts(tmp_path):
    b = RestartBudgets(make_spec(tmp_path, "world.max_restarts=1", "world.crash_loop_failures=9").world)
    assert b.count("failure") is None
    b.published()
    assert "2 failures, more than world.max_restarts=1" in (b.count("failure") or "")


def test_the_backoff_starts_again_from_its_base_once_a_bundle_is_published(tmp_path):
    b = RestartBudgets(make_spec(tmp_path, "world.restart_backoff_s=1").world)
    for _ in range(6):
        b.count("preemption")
    assert b.backoff() >= 16, "six losses in a row without progress back off long"
    b.published()
    b.count("preemption")
    assert b.backoff() <= 2, "after a published bundle the next restart waits the base (plus jitter) again"


def _finished(update: int) -> list[Report]:
    return [Report(rank=0, last_update=update, state="finished")]


def test_the_job_s_code_raising_is_a_failure_restarted_within_the_budget(tmp_path):
    spec = make_spec(tmp_path, "train.updates=4", "world.max_restarts=1", job_id="b")
    groups = [ScriptedGroup(1, [RankFailed("rank 0 raised RuntimeError: a flaky read", 0)]),
              ScriptedGroup(1, [_finished(4)])]
    outcome = Supervisor(spec, lambda *a: groups.pop(0), capacity=lambda: 1, sleep=lambda s: None).run()
    assert outcome.state == "finished" and outcome.restarts == 1
    [lost] = [e for e in Ledger(open_storage(spec.storage), "b").read() if isinstance(e, WorkerLost)]
    assert (lost.cause, lost.loss, lost.budget.failures, lost.budget.preemptions) == ("error", "failure", 1, 0)
    assert "flaky read" in lost.detail


def test_a_process_that_dies_after_a_notice_for_its_node_is_a_preemption(tmp_path):
    spec = make_spec(tmp_path, "train.updates=4", "world.max_restarts=0", job_id="n")
    group = ScriptedGroup(2, [[Report(rank=0, last_update=1), Report(rank=1, last_update=1)], "lost"],
                          salvage=[Report(rank=1, last_update=1)])
    groups = [group, ScriptedGroup(2, [_finished(4)])]
    sup = Supervisor(spec, lambda *a: groups.pop(0), capacity=lambda: 2, sleep=lambda s: None)
    sup.notify(Notice(source="aws", node_id="node-0", rank=0, detail="terminate",
                      deadline=datetime.now(UTC) + timedelta(minutes=2)))
    outcome = sup.run()
    assert outcome.state == "finished", "max_restarts=0: had the loss counted as a failure, the job would fail"
    [lost] = [e for e in Ledger(open_storage(spec.storage), "n").read() if isinstance(e, WorkerLost)]
    assert (lost.cause, lost.loss) == ("process-exit", "preemption")


def test_history_and_the_dashboard_show_both_budgets(tmp_path, capsys):
    """One failure, one preemption: history's table and --json and the job page count each class and say
    what is left of each budget."""
    import json

    from fastapi.testclient import TestClient

    from spotrun.orchestrator.cli import main
    from spotrun.orchestrator.dashboard import create_app
    from spotrun.orchestrator.groups import RankLost

    spec = make_spec(tmp_path, "train.updates=4", "world.max_restarts=3", "world.max_preemptions=5", job_id="h")
    groups = [ScriptedGroup(1, [RankFailed("rank 0 raised OSError: disk", 0)]),
              ScriptedGroup(1, [RankLost(0, "node-lost", "reclaimed", "node-0")]),
              ScriptedGroup(1, [_finished(4)])]
    assert Supervisor(spec, lambda *a: groups.pop(0), capacity=lambda: 1, sleep=lambda s: None).run().restarts == 2
    runs = str(tmp_path / "runs")
    assert main(["history", "h", "--storage", f"file://{runs}", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(r["cause"], r["loss"]) for r in doc["restarts"]] == [("error", "failure"), ("node-lost", "preemption")]
    assert doc["budgets"] == {"preemptions": 1, "failures": 1, "unclassified": 0, "this_run": {
        "failures": 1, "max_restarts": 3, "failures_left": 2, "preemptions": 1, "max_preemptions": 5,
        "preemptions_left": 4}}
    assert main(["history", "h", "--storage", f"file://{runs}"]) == 0
    table = capsys.readouterr().out
    assert "restart budgets" in table and "no limit" not in table
    page = TestClient(create_app(f"file://{runs}"), base_url="http://127.0.0.1").get("/jobs/h").text
    assert ("1 preemption(s)" in page and "1 failure(s)" in page and "used 1 of 3 failures" in page
            and "(world.max_restarts, 2 left)" in page and "1 preemption(s) of 5 (4 left)" in page), page
