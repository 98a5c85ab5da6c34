"""Two restart budgets: preemptions never use up the job; failures do, and a crash loop fails fast."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from spotrun.orchestrator.control.platform import Options, Platform
from spotrun.orchestrator.control.supervisor import Supervisor
from spotrun.orchestrator.ledger.events import JobFailed, WorkerLost
from spotrun.orchestrator.ledger.store import Ledger
from spotrun.orchestrator.notices.notice import Notice
from spotrun.orchestrator.policy.budgets import ErrorAt, RestartBudgets, repeated
from spotrun.orchestrator.workers.groups import RankFailed
from spotrun.trainer.run.rank import Report
from spotrun.trainer.storage import open_storage
from tests.conftest import make_spec
from tests.helpers.groups import ScriptedGroup


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


B = "j/bundles/u0000000010-a1"


@pytest.mark.parametrize(("previous", "reached", "now", "fails"), [
    (None, 0, ErrorAt(12, B), False),  # the job's first error: restarted
    (ErrorAt(12, B), 11, ErrorAt(12, B), True),  # the same update from the same bundle: deterministic
    (ErrorAt(12, None), 11, ErrorAt(12, None), True),  # the same, with no bundle: both started from scratch
    (ErrorAt(12, B), 11, ErrorAt(12, "j/bundles/u0000000011-a2"), True),  # a replay published a later bundle
    (ErrorAt(12, B), 11, ErrorAt(14, B), False),  # it got further this time: not the same error
    (ErrorAt(12, B), 11, ErrorAt(11, B), False),  # an earlier update: not the same place
    (ErrorAt(12, B), 15, ErrorAt(12, B), False),  # an attempt in between completed update 12: not deterministic
])
def test_the_job_s_error_repeated_at_the_same_update_with_no_progress_is_deterministic(previous, reached, now,
                                                                                       fails):
    why = repeated(previous, reached, now)
    assert (why is not None) == fails
    if fails:
        assert why is not None and f"raised at update {now.update} again after a restart from " in why
        assert (now.bundle or "the beginning") in why and "deterministic" in why


def test_a_repeated_error_ends_the_job_whatever_is_left_of_the_budget_and_progress_clears_it(tmp_path):
    b = RestartBudgets(make_spec(tmp_path, "world.max_restarts=9", "world.crash_loop_failures=9").world)
    assert b.count("failure", 11, ErrorAt(12, B)) is None
    b.published()  # the replay published bundles: no crash loop, and no help either
    assert "raised at update 12 again after a restart from bundle" in (b.count("failure", 11, ErrorAt(12, B)) or "")
    b = RestartBudgets(make_spec(tmp_path, "world.max_restarts=9", "world.crash_loop_failures=9").world)
    assert b.count("failure", 11, ErrorAt(12, B)) is None
    assert b.count("preemption", 20) is None  # an attempt got past update 12 before it was preempted
    assert b.count("failure", 11, ErrorAt(12, B)) is None, "update 12 was completed in between: not deterministic"
    assert b.count("failure", 3) is None  # a failure of another kind (an OOM kill, say) changes nothing
    assert b.count("failure", 11, ErrorAt(12, B)) is not None


def _finished(update: int) -> list[Report]:
    return [Report(rank=0, last_update=update, state="finished")]


def test_the_job_s_code_raising_is_a_failure_restarted_within_the_budget(tmp_path):
    spec = make_spec(tmp_path, "train.updates=4", "world.max_restarts=1", job_id="b")
    groups = [ScriptedGroup(1, [RankFailed("rank 0 raised RuntimeError: a flaky read", 0)]),
              ScriptedGroup(1, [_finished(4)])]
    outcome = Supervisor(spec, Platform(lambda *a: groups.pop(0), capacity=lambda: 1),
                         Options(sleep=lambda s: None)).run()
    assert outcome.state == "finished" and outcome.restarts == 1
    [lost] = [e for e in Ledger(open_storage(spec.storage), "b").read() if isinstance(e, WorkerLost)]
    assert (lost.cause, lost.loss, lost.budget.failures, lost.budget.preemptions) == ("error", "failure", 1, 0)
    assert "flaky read" in lost.detail


def _raises_after(update: int, detail: str) -> list:
    return [[Report(rank=0, last_update=update)], RankFailed(f"rank 0 raised ValueError: {detail}", 0)]


@pytest.mark.parametrize("second", [3, 5])
def test_the_job_s_error_at_the_same_update_again_fails_the_job_at_once(tmp_path, second):
    """Both attempts start from the beginning (nothing published); the first raises in update 4. When the
    second raises in update 4 too, the job fails at once with that error, recorded as failures are (the
    loss, then job_failed); when it gets further, it is restarted as any failure within the budget is."""
    spec = make_spec(tmp_path, "train.updates=8", "world.max_restarts=5", "world.crash_loop_failures=5",
                     job_id="d")
    groups = [ScriptedGroup(1, _raises_after(3, "bad record")), ScriptedGroup(1, _raises_after(second, "bad record")),
              ScriptedGroup(1, [_finished(8)])]
    sup = Supervisor(spec, Platform(lambda *a: groups.pop(0), capacity=lambda: 1), Options(sleep=lambda s: None))
    events = Ledger(open_storage(spec.storage), "d").read
    if second == 5:
        assert sup.run().state == "finished" and sup.restarts == 2
        assert not [e for e in events() if isinstance(e, JobFailed)]
        return
    with pytest.raises(RankFailed, match=r"bad record \(not restarted: the job's code raised at update 4 again "
                                         r"after a restart from the beginning .*deterministic"):
        sup.run()
    losses = [e for e in events() if isinstance(e, WorkerLost)]
    assert [(e.cause, e.last_update, e.budget.failures) for e in losses] == [("error", 3, 1), ("error", 3, 2)]
    assert losses[0].backoff_seconds is not None and losses[1].backoff_seconds is None, "the job ended there"
    [failed] = [e for e in events() if isinstance(e, JobFailed)]
    assert "raised at update 4 again" in failed.reason and "bad record" in failed.reason


def test_a_process_that_dies_after_a_notice_for_its_node_is_a_preemption(tmp_path):
    spec = make_spec(tmp_path, "train.updates=4", "world.max_restarts=0", job_id="n")
    group = ScriptedGroup(2, [[Report(rank=0, last_update=1), Report(rank=1, last_update=1)], "lost"],
                          salvage=[Report(rank=1, last_update=1)])
    groups = [group, ScriptedGroup(2, [_finished(4)])]
    sup = Supervisor(spec, Platform(lambda *a: groups.pop(0), capacity=lambda: 2), Options(sleep=lambda s: None))
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

    from spotrun.orchestrator.cli.main import main
    from spotrun.orchestrator.dashboard import create_app
    from spotrun.orchestrator.workers.groups import RankLost

    spec = make_spec(tmp_path, "train.updates=4", "world.max_restarts=3", "world.max_preemptions=5", job_id="h")
    groups = [ScriptedGroup(1, [RankFailed("rank 0 raised OSError: disk", 0)]),
              ScriptedGroup(1, [RankLost(0, "node-lost", "reclaimed", "node-0")]),
              ScriptedGroup(1, [_finished(4)])]
    assert Supervisor(spec, Platform(lambda *a: groups.pop(0), capacity=lambda: 1),
                         Options(sleep=lambda s: None)).run().restarts == 2
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


def test_an_error_that_comes_back_after_a_restore_fails_the_job_naming_the_bundle(tmp_path):
    """In this process, no Ray: the step raises in update 8 (its fifteenth call, two per update) after bundles
    were published; the restart restores one, and the step raises in update 8 again: the job fails there,
    naming the bundle the second attempt restored."""
    from spotrun.orchestrator.control.launch import run_in_process
    from spotrun.orchestrator.ledger.events import Restored

    spec = make_spec(tmp_path, "train.updates=10", "checkpoint.every_updates=2", "data.workers=0",
                     "world.max_restarts=5", "world.crash_loop_failures=5", "world.restart_backoff_s=0",
                     "job.entrypoint=tests.helpers.jobs:raises_at_a_call", "job.config={at_call: 15}", job_id="r")
    with pytest.raises(RankFailed, match=r"call 15\) \(not restarted: the job's code raised at update 8 again after "
                                         r"a restart from bundle r/bundles/u") as raised:
        run_in_process(spec)
    events = Ledger(open_storage(spec.storage), "r").read()
    assert [(e.attempt, e.cause, e.last_update) for e in events if isinstance(e, WorkerLost)] == [
        (1, "error", 7), (2, "error", 7)]
    [restored] = [e for e in events if isinstance(e, Restored)]
    assert restored.attempt == 2 and f"from bundle {restored.bundle}," in str(raised.value)
    [failed] = [e for e in events if isinstance(e, JobFailed)]
    assert "deterministic" in failed.reason and "a record the step cannot take" in failed.reason
