"""The driver records each storage outage once, when storage answers again: its span, the paths that met
it, the requests they had refused, the checkpoints the ranks skipped and the newest bundle while it
lasted. The tracker is driven with hand-made path states and times; the supervisor's look with scripted
rank reports (no Ray, no sleeps)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from spotrun.orchestrator.control.outages import OutageTracker, PathSeen
from spotrun.orchestrator.control.supervisor import Running
from spotrun.orchestrator.ledger.events import StorageOutage
from spotrun.trainer.run.rank import Report
from spotrun.trainer.storage.outage import OutageView
from tests.conftest import make_spec
from tests.unit.test_supervisor_steps import StepGroup, events, running, supervisor

T0 = datetime(2026, 1, 1, tzinfo=UTC)
UP = OutageView(None, 0, None, False)


def at(s: float) -> datetime:
    return T0 + timedelta(seconds=s)


def path(name: str, down_s: float | None, refused: int, error: str = "503 SlowDown", attempt: int = 0,
         skipped: int = 0, full: bool = False, ended: float | None = None, lasted: float | None = None) -> PathSeen:
    return PathSeen(name, name, OutageView(down_s, refused, error, full, ended, lasted), attempt, skipped)


def test_an_outage_is_recorded_once_every_path_answers_and_never_before():
    t = OutageTracker()
    b4 = ("j/bundles/u0000000004-a1", 4)
    assert t.look(at(0), 1, 4, b4, [path("ledger", None, 0), path("rank 0", None, 0, attempt=1)]) is None
    # the ledger went down 2 s before this look; rank 0 meets it later
    assert t.look(at(10), 1, 6, b4, [path("ledger", 2.0, 3), path("rank 0", None, 0, attempt=1)]) is None
    assert t.look(at(20), 1, 9, ("j/bundles/u0000000008-a1", 8),
                  [path("ledger", 12.0, 5), path("rank 0", 7.0, 4, "reset", attempt=1, skipped=1)]) is None
    assert t.open
    # the ledger answers; rank 0 still refused: not over
    assert t.look(at(30), 1, 12, ("j/bundles/u0000000008-a1", 8),
                  [path("ledger", None, 5), path("rank 0", 17.0, 6, "reset", attempt=1, skipped=2)]) is None
    seen = t.look(at(40), 1, 14, ("j/bundles/u0000000012-a1", 12),
                  [path("ledger", None, 5, ended=15.0),
                   path("rank 0", None, 6, "reset", attempt=1, skipped=2, ended=4.0)])
    assert seen is not None and not t.open
    assert (seen.began_at, seen.ended_at) == (at(8), at(36))  # the last path answered 4 s before the look
    assert seen.paths == ["ledger", "rank 0"] and seen.first_error == "503 SlowDown"
    assert seen.requests_refused == 5 + 6  # each refusal once, however many looks reported it
    assert seen.bundles_skipped == 2
    # the newest published while it lasted (the one storage answered with came after)
    assert (seen.newest_bundle, seen.newest_update, seen.update_at_end) == ("j/bundles/u0000000008-a1", 8, 14)
    assert t.look(at(50), 1, 16, None, [path("ledger", None, 5), path("rank 0", None, 6, attempt=1, skipped=2)]) is None


def test_a_refusal_answered_between_two_looks_is_an_outage_since_the_look_before():
    t = OutageTracker()
    t.look(at(0), 1, 1, None, [path("publisher", None, 2)])  # refusals before the first look: a baseline
    assert t.look(at(5), 1, 2, None, [path("publisher", None, 2)]) is None
    seen = t.look(at(10), 1, 3, None, [path("publisher", None, 4, full=True)])
    assert seen is not None
    assert (seen.began_at, seen.ended_at, seen.requests_refused, seen.full_disk) == (at(5), at(10), 2, True)
    assert (seen.newest_bundle, seen.newest_update) == (None, None)
    # a path that says when its outage ended and how long it lasted gives its own span
    seen = t.look(at(20), 1, 4, None, [path("publisher", None, 5, ended=3.0, lasted=4.0)])
    assert seen is not None and (seen.began_at, seen.ended_at, seen.requests_refused) == (at(13), at(17), 1)


def test_ranks_skip_on_their_own_a_new_attempt_counts_afresh():
    t = OutageTracker()
    paths = [PathSeen("rank 0", "a1/rank 0", OutageView(3.0, 2, "x", False), 1, 1),
             PathSeen("rank 1", "a1/rank 1", OutageView(3.0, 5, "x", False), 1, 3)]
    assert t.look(at(10), 1, 8, None, paths) is None
    paths = [PathSeen("rank 0", "a2/rank 0", OutageView(None, 1, "x", False), 2, 1),
             PathSeen("rank 1", "a2/rank 1", OutageView(None, 0, None, False), 2, 0)]
    seen = t.look(at(20), 2, 9, None, paths)
    assert seen is not None and seen.attempt == 1
    assert seen.requests_refused == 2 + 5 + 1
    assert seen.bundles_skipped == 3 + 1  # per attempt, the most any one rank skipped


def rank(r: int, update: int, view: OutageView, skipped: int = 0) -> Report:
    return Report(rank=r, last_update=update, storage=view, checkpoints_skipped=skipped)


def test_the_running_look_records_the_outage_the_ranks_report_once_it_ends(tmp_path):
    sup = supervisor(make_spec(tmp_path, "world.size=2", job_id="o"), StepGroup(2, []), capacity=2)
    st = running(sup)
    down = OutageView(4.0, 3, "PutObject: 503 SlowDown", False)
    st.group.polls += [[rank(0, 3, UP), rank(1, 3, down, skipped=1)],
                       [rank(0, 5, UP), rank(1, 5, OutageView(9.0, 7, down.first_error, False), skipped=2)],
                       [rank(0, 6, UP), rank(1, 6, OutageView(None, 7, down.first_error, False), skipped=2)],
                       [rank(0, 7, UP), rank(1, 7, OutageView(None, 7, down.first_error, False), skipped=2)]]
    for _ in range(2):
        st = sup.step(st)
        assert isinstance(st, Running)
    assert events(sup, StorageOutage) == []  # storage has not answered yet
    st = sup.step(sup.step(st))
    [e] = events(sup, StorageOutage)
    assert (e.attempt, e.paths, e.first_error) == (1, ["rank 1 checkpoints"], "PutObject: 503 SlowDown")
    assert (e.requests_refused, e.bundles_skipped, e.update_at_end) == (7, 2, 6)
    assert (e.newest_bundle, e.newest_update) == (None, None)  # nothing published yet
    assert e.began_at < e.ended_at


def test_a_restart_that_waited_for_storage_is_recorded_at_the_next_look(tmp_path):
    from spotrun.trainer.storage import StorageUnavailableError

    sup = supervisor(make_spec(tmp_path, job_id="p"), StepGroup(1, []))
    st = running(sup)
    sup.placer.outage.failed(StorageUnavailableError("ListObjectsV2: 503 SlowDown"))  # as a cold restart meets it
    sup.placer.outage.recovered()
    st.group.polls.append([rank(0, 1, UP)])
    sup.step(st)
    [e] = events(sup, StorageOutage)
    assert (e.paths, e.requests_refused, e.first_error) == (["placing"], 1, "ListObjectsV2: 503 SlowDown")


def test_an_outage_still_open_when_the_job_finishes_is_recorded_then():
    """The job's last look: its last bundle is published, but the ledger (which tries only when an event is
    appended) still says it is down. The outage ends at that look, before the job's end is recorded; without
    the final look it was never recorded (seen once in CI)."""
    t = OutageTracker()
    assert t.look(at(10), 1, 6, None, [path("ledger", 2.0, 3), path("rank 0", 1.0, 2, attempt=1)]) is None
    assert t.look(at(20), 1, 9, None, [path("ledger", 12.0, 3), path("rank 0", None, 2, attempt=1, ended=3.0)]) is None
    seen = t.look(at(30), 1, 12, ("j/bundles/u0000000012-a1", 12),
                  [path("ledger", 22.0, 3), path("rank 0", None, 2, attempt=1)], final=True)
    assert seen is not None and not t.open
    assert (seen.began_at, seen.ended_at, seen.requests_refused) == (at(8), at(30), 5)
    assert seen.paths == ["ledger", "rank 0"]


def test_the_finishing_look_records_the_open_outage_before_the_job_ends(tmp_path):
    sup = supervisor(make_spec(tmp_path, "world.size=2", job_id="f"), StepGroup(2, []), capacity=2)
    st = running(sup)
    down = OutageView(4.0, 3, "PutObject: 503 SlowDown", False)
    st.group.polls += [[rank(0, 3, UP), rank(1, 3, down)],
                       [Report(rank=0, last_update=4, state="finished", storage=UP),
                        Report(rank=1, last_update=4, state="finished", storage=OutageView(6.0, 3,
                                                                                           down.first_error, False))]]
    st = sup.step(st)
    assert events(sup, StorageOutage) == []
    sup.step(st)
    [e] = events(sup, StorageOutage)
    assert e.paths == ["rank 1 checkpoints"] and e.requests_refused == 3 and e.began_at < e.ended_at
