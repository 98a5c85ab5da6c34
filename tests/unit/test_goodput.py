"""Goodput from a ledger and metric points written by hand, with times chosen so every term is known."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from spotrun.orchestrator.control.launch import run_in_process
from spotrun.orchestrator.ledger.events import (
    AttemptStarted,
    BundlePublished,
    CapacityWait,
    JobFinished,
    Restored,
    WorkerLost,
)
from spotrun.orchestrator.ledger.goodput import TERMS, goodput
from spotrun.orchestrator.ledger.history import history
from spotrun.trainer.metrics import MetricPoint
from spotrun.trainer.storage import LocalStorage

T0 = datetime(2026, 12, 1, tzinfo=UTC)


def t(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def point(update: int, attempt: int, at: float) -> MetricPoint:
    return MetricPoint(job_id="g", update=update, name="loss", value=1.0, attempt=attempt, lineage_id="x", at=t(at))


def killed_job() -> tuple[list, list[MetricPoint], list[MetricPoint]]:
    """Attempt 1 (2 s placement, 1 s rank setup) does updates 1-4 at 1 s each, publishes bundle 2
    (0.25 s stall) and dies; the loss is detected at 8.5 and torn down at 9. After a 1 s capacity wait
    attempt 2 restores bundle 2 at 12.5, redoes 3 and 4, does 5 and 6, publishes 6 (0.1 s stall)
    and finishes at 17."""
    events = [
        AttemptStarted(at=t(3), attempt=1, world_size=2, pid=1, lineage_id="x", placement_seconds=2.0,
                       rank_setup_seconds=1.0),
        BundlePublished(at=t(6.5), attempt=1, bundle="g/bundles/u0000000002-a1", update=2, bytes=1,
                        stall_seconds=0.25, write_seconds=0.1),
        WorkerLost(at=t(9), attempt=1, rank=0, cause="process-exit", last_update=4, detected_at=t(8.5)),
        CapacityWait(at=t(11), attempt=1, needed=2, available=2, waited_seconds=1.0, outcome="placed"),
        Restored(at=t(12.5), attempt=2, bundle="g/bundles/u0000000002-a1", update=2, recovery_label="exact",
                 policy="strict", restore_mode="snapshot", restore_seconds=0.5, lost_updates=2),
        AttemptStarted(at=t(12.5), attempt=2, world_size=2, pid=1, lineage_id="x"),
        BundlePublished(at=t(16.9), attempt=2, bundle="g/bundles/u0000000006-a2", update=6, bytes=1,
                        stall_seconds=0.1, write_seconds=0.1),
        JobFinished(at=t(17), attempt=2, counters={"attempted_updates": 6}),
    ]
    final = [point(1, 1, 4), point(2, 1, 5), *(point(u, 2, 10.5 + u) for u in (3, 4, 5, 6))]
    log = [*final[:2], point(3, 1, 6.2), point(4, 1, 7.4), *final[2:]]  # what attempt 1 really reached
    return events, final, log


def test_terms_add_up_to_the_wall_time_and_each_is_what_happened():
    events, final, _ = killed_job()
    g = goodput(events, final, usd_per_rank_hour=3.6)
    assert g.wall_seconds == 17.0  # from attempt 1's placement to the job's end
    assert sum(getattr(g, k) for k in TERMS) == pytest.approx(g.wall_seconds)
    # updates 1, 2 and, lost with attempt 1 (no write log: 2 x its median update), 3 and 4; then 5, 6
    assert g.productive_seconds == pytest.approx(6.0)
    assert g.replayed_seconds == pytest.approx(2.0)  # attempt 2 redoing 3 and 4
    assert g.checkpoint_stall_seconds == pytest.approx(0.35)
    assert g.capacity_wait_seconds == pytest.approx(1.0)
    assert g.downtime_seconds == pytest.approx(7.65)
    assert g.goodput == pytest.approx(6 / 17, abs=1e-4)
    assert (g.productive_updates, g.replayed_updates) == (6, 2)
    a1, a2 = g.attempts
    assert (a1.wall_seconds, a2.wall_seconds) == (9.0, 8.0)
    for a in (a1, a2):
        assert sum(getattr(a, k) for k in TERMS) == pytest.approx(a.wall_seconds)
    assert a2.replayed_seconds == pytest.approx(2.0) and a1.replayed_seconds == 0
    # 2 ranks x 17 s at $3.60 per rank-hour; the badput is everything but the 6 productive seconds
    assert g.cost_usd == pytest.approx(2 * 17 * 0.001)
    assert g.badput_usd == pytest.approx(2 * 11 * 0.001)


def test_the_write_log_measures_the_lost_work_instead_of_estimating_it():
    events, final, log = killed_job()
    g = goodput(events, final, log)
    assert g.attempts[0].productive_seconds == pytest.approx(2 + 2.4)  # its points for 3, 4 at 6.2, 7.4
    assert sum(getattr(g, k) for k in TERMS) == pytest.approx(17.0)
    assert g.cost_usd is None


def test_an_update_ends_at_the_latest_of_its_points():
    """Two metrics of one update, written in either order: the later one times the update."""
    events, final, _ = killed_job()
    lr = [p.model_copy(update={"name": "lr", "at": p.at - timedelta(seconds=0.5)}) for p in final]
    for points in ([p for pair in zip(final, lr, strict=True) for p in pair],
                   [p for pair in zip(lr, final, strict=True) for p in pair]):
        g = goodput(events, points)
        assert g.productive_seconds == pytest.approx(6.0) and g.replayed_seconds == pytest.approx(2.0)


def test_an_uninterrupted_job_is_almost_all_productive():
    events = [AttemptStarted(at=t(0), attempt=1, world_size=1, pid=1, lineage_id="x"),
              JobFinished(at=t(10.05), attempt=1, counters={"attempted_updates": 10})]
    g = goodput(events, [point(u, 1, u) for u in range(1, 11)])
    assert g.goodput == pytest.approx(10 / 10.05, abs=1e-4)
    assert g.replayed_seconds == 0 and g.downtime_seconds == pytest.approx(0.05)


def test_a_job_that_never_started_has_no_goodput():
    g = goodput([], [])
    assert g.wall_seconds == 0 and g.goodput is None and g.attempts == []


def test_history_reports_goodput_from_the_jobs_own_ledger_and_points(spec_factory):
    spec = spec_factory("train.updates=6", "checkpoint.every_updates=3", "model.kind=mlp", "data.workers=0",
                        "cost.usd_per_rank_hour=3600", job_id="gp")  # $1 a second: cents in a second-long job
    run_in_process(spec)
    g = history(LocalStorage(spec.storage[len("file://"):]), "gp").goodput
    assert g.productive_updates == 6 and g.replayed_updates == 0
    assert sum(getattr(g, k) for k in TERMS) == pytest.approx(g.wall_seconds, abs=0.01)
    assert 0 < g.goodput <= 1 and g.cost_usd > 0


def test_a_bundle_stall_is_charged_to_the_update_after_its_boundary():
    """Bundle 2's 0.25 s stall is inside update 3's 1.25 s: 1 s of it computed, the rest the stall."""
    events = [AttemptStarted(at=t(1), attempt=1, world_size=1, pid=1, lineage_id="x"),
              BundlePublished(at=t(3.1), attempt=1, bundle="g/bundles/u0000000002-a1", update=2, bytes=1,
                              stall_seconds=0.25, write_seconds=0.1),
              JobFinished(at=t(5.25), attempt=1, counters={"attempted_updates": 4})]
    g = goodput(events, [point(1, 1, 2), point(2, 1, 3), point(3, 1, 4.25), point(4, 1, 5.25)])
    assert (g.wall_seconds, g.productive_seconds, g.checkpoint_stall_seconds, g.downtime_seconds) == (4.25, 4.0,
                                                                                                    0.25, 0.0)


def test_terms_add_up_when_a_point_is_stamped_before_the_one_before_it():
    """A rank stamps its points as it writes them, the driver its events: under load the first point can be
    stamped before the attempt's recorded start, and an update's point before its predecessor's. The
    terms must still add up to the wall time: an update that seems to take negative time gives back
    what its predecessor seemed to take (seen as terms 0.03 s over the wall of a killed job on a
    loaded machine when that time was dropped instead)."""
    events = [AttemptStarted(at=t(1), attempt=1, world_size=1, pid=1, lineage_id="x"),
              JobFinished(at=t(5), attempt=1, counters={"attempted_updates": 4})]
    g = goodput(events, [point(1, 1, 0.9), point(2, 1, 3), point(3, 1, 2.8), point(4, 1, 5)])
    assert sum(getattr(g, k) for k in TERMS) == pytest.approx(g.wall_seconds, abs=1e-9)
    assert g.productive_seconds == pytest.approx(4.0)
