"""One value per figure: a ledger with every kind of restart, read by history, the dashboard, goodput,
Prometheus and verify (and the command line), each showing the same lost updates, replayed updates,
downtime and time lost, computed once (spotrun.orchestrator.ledger.losses), and equal to what the figures'
definitions give by hand for this ledger."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

import pytest
from fastapi.testclient import TestClient

from spotrun.orchestrator.cli.main import main
from spotrun.orchestrator.dashboard import create_app
from spotrun.orchestrator.ledger.events import (
    AttemptStarted,
    BundlePublished,
    JobFinished,
    NoticeHandled,
    NoticeSeen,
    Restored,
    WorkerLost,
)
from spotrun.orchestrator.ledger.history import history
from spotrun.orchestrator.ledger.store import Ledger
from spotrun.orchestrator.verify.verdict import restart_figures
from spotrun.trainer.metrics import JsonlSink, MetricPoint, SqliteSink
from spotrun.trainer.storage import open_storage

JOB = "agree"
T0 = datetime(2026, 12, 1, tzinfo=UTC)
BASE = "http://127.0.0.1"


def t(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def bundle(update: int, attempt: int) -> str:
    return f"{JOB}/bundles/u{update:010d}-a{attempt}"


def restored(attempt: int, update: int, from_attempt: int, at: float, path: str = "cold", cause: str = "resumed",
             world: tuple[int, int] = (2, 2)) -> Restored:
    return Restored(at=t(at), attempt=attempt, bundle=bundle(update, from_attempt), update=update,
                    recovery_label="exact" if world[0] == world[1] else "exact-data", policy="elastic",
                    restore_mode="snapshot", restore_seconds=0.1, cause=cause, world_size_before=world[0],
                    world_size_after=world[1], recovery_path=path)


# (attempt, first update, last update, start second): each update's point is written one second after the one before
WRITES = [(1, 1, 3, 0), (2, 1, 12, 5), (3, 11, 17, 19), (4, 16, 22, 40), (5, 23, 27, 50), (6, 26, 40, 57)]


def build(tmp_path) -> None:
    """Six attempts, five restarts, one of each kind:

    1. rank lost at update 3, before the first bundle: attempt 2 starts from nothing (3 lost);
    2. a rank killed after update 12, the supervisor's last poll saw 11 (the metric log says 12): warm from
       bundle 10 (2 lost, from the metric log);
    3. the driver killed after update 17, nothing recorded: cold from bundle 15 (2 lost, metric log only);
    4. a spot notice: emergency bundle 22, the ranks stop (0 lost);
    5. a node lost after update 27: the survivors shrink to 1 rank from bundle 25 (2 lost);
    then attempt 6 finishes at 40."""
    storage = open_storage(f"file://{tmp_path}")
    ledger = Ledger(storage, JOB)
    events = [
        AttemptStarted(at=t(0), attempt=1, world_size=2, pid=1, lineage_id="L"),
        WorkerLost(at=t(4), attempt=1, rank=1, cause="process-exit", loss="failure", last_update=3,
                   detected_at=t(3.5)),
        AttemptStarted(at=t(5), attempt=2, world_size=2, pid=1, lineage_id="L"),
        BundlePublished(at=t(10.2), attempt=2, bundle=bundle(5, 2), update=5, bytes=1, stall_seconds=0.1,
                        write_seconds=0.1),
        BundlePublished(at=t(15.2), attempt=2, bundle=bundle(10, 2), update=10, bytes=1, stall_seconds=0.1,
                        write_seconds=0.1),
        WorkerLost(at=t(18), attempt=2, rank=1, cause="process-exit", loss="failure", last_update=11,
                   detected_at=t(17.5)),
        restored(3, 10, 2, 19, path="warm-replace", cause="process-exit"),
        AttemptStarted(at=t(19), attempt=3, world_size=2, pid=1, lineage_id="L"),
        BundlePublished(at=t(24.2), attempt=3, bundle=bundle(15, 3), update=15, bytes=1, stall_seconds=0.1,
                        write_seconds=0.1),
        # the driver is SIGKILLed after update 17: nobody records it
        restored(4, 15, 3, 40),
        AttemptStarted(at=t(40), attempt=4, world_size=2, pid=2, lineage_id="L"),
        BundlePublished(at=t(45.2), attempt=4, bundle=bundle(20, 4), update=20, bytes=1, stall_seconds=0.1,
                        write_seconds=0.1),
        NoticeSeen(at=t(47.1), attempt=4, source="aws", node_id="n1", rank=1, deadline=t(167),
                   action="emergency-checkpoint", reason="spot interruption"),
        BundlePublished(at=t(47.5), attempt=4, bundle=bundle(22, 4), update=22, bytes=1, stall_seconds=0.1,
                        write_seconds=0.1),
        NoticeHandled(at=t(47.6), attempt=4, source="aws", bundle=bundle(22, 4), update=22,
                      notice_to_publish_seconds=0.5),
        WorkerLost(at=t(48), attempt=4, rank=1, cause="notice:aws", loss="preemption", last_update=22,
                   detected_at=t(47.6)),
        restored(5, 22, 4, 50, cause="notice:aws"),
        AttemptStarted(at=t(50), attempt=5, world_size=2, pid=2, lineage_id="L"),
        BundlePublished(at=t(54.2), attempt=5, bundle=bundle(25, 5), update=25, bytes=1, stall_seconds=0.1,
                        write_seconds=0.1),
        WorkerLost(at=t(56), attempt=5, rank=1, cause="node-lost", loss="preemption", last_update=27,
                   detected_at=t(55.5)),
        restored(6, 25, 5, 57, path="warm-shrink", cause="node-lost", world=(2, 1)),
        AttemptStarted(at=t(57), attempt=6, world_size=1, pid=2, lineage_id="L"),
        *(BundlePublished(at=t(57 + u - 25 + 0.2), attempt=6, bundle=bundle(u, 6), update=u, bytes=1,
                          stall_seconds=0.1, write_seconds=0.1) for u in (30, 35, 40)),
        JobFinished(at=t(73), attempt=6, counters={"attempted_updates": 40}),
    ]
    for e in events:
        ledger.append(e)
    sinks = [SqliteSink(tmp_path / JOB / "metrics.sqlite"), JsonlSink(tmp_path / JOB / "metrics.jsonl")]
    for attempt, first, last, start in WRITES:
        for u in range(first, last + 1):
            p = MetricPoint(job_id=JOB, update=u, name="loss", value=1.0 / u, attempt=attempt, lineage_id="L",
                            at=t(start + u - first + 1))
            for sink in sinks:
                sink.write([p])
    for sink in sinks:
        sink.close()


# By hand, from the definitions (README: What a restart cost), per restart of attempts 2..6
LOST = [3, 2, 2, 0, 2]
SOURCES = ["ledger", "metrics log", "metrics log", "ledger", "ledger"]
RANGES = [[1, 3], [11, 12], [16, 17], [], [26, 27]]
DOWNTIME = [1.5, 1.5, 15.8, 2.4, 1.5]  # detection (or, the driver dead, its attempt's last event) to restore
TIME_LOST = [5.0, 3.8, 15.8, 2.5, 2.8]  # the restored state's moment (publication, or start) to restore


def prometheus(text: str, name: str) -> float | None:
    found = re.search(rf'^{name}{{job="{JOB}"}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else None


@pytest.fixture
def job(tmp_path):
    build(tmp_path)
    return tmp_path


def test_every_reader_shows_the_same_figures(job, capsys):
    hist = history(open_storage(f"file://{job}"), JOB)
    rows = hist.restarts
    assert [r.cause for r in rows] == ["process-exit", "process-exit", "driver-exit", "notice:aws", "node-lost"]
    assert [r.lost_updates for r in rows] == LOST
    assert [r.lost_updates_source for r in rows] == SOURCES
    assert [r.lost_range for r in rows] == RANGES
    assert [r.downtime_seconds for r in rows] == DOWNTIME
    assert [r.time_lost_seconds for r in rows] == TIME_LOST
    assert [a.last_update for a in hist.attempts] == [3, 12, 17, 22, 27, 40]
    totals = hist.totals
    assert (totals.restarts, totals.lost_updates, totals.time_lost_seconds) == (5, 9, round(sum(TIME_LOST), 3))

    # goodput: the job is past every lost update, so its replayed updates are the restarts' lost ones
    g = hist.goodput
    assert (g.productive_updates, g.replayed_updates) == (40, sum(LOST))
    assert [a.replayed_updates for a in g.attempts] == [0, *LOST]

    client = TestClient(create_app(f"file://{job}"), base_url=BASE)
    page = client.get(f"/api/jobs/{JOB}").json()
    dumped = [r.model_dump(mode="json") for r in rows]
    assert page["history"]["restarts"] == dumped
    assert client.get(f"/api/jobs/{JOB}/history").json()["restarts"] == dumped
    shown = page["restarts"]
    for key in ("lost_updates", "lost_range", "downtime_seconds", "time_lost_seconds"):
        assert [r[key] for r in shown] == [getattr(r, key) for r in rows], key
    summary = client.get("/api/jobs").json()[0]
    assert (summary["lost_updates"], summary["replayed_updates"], summary["time_lost_seconds"]) == (
        9, 9, totals.time_lost_seconds)
    assert page["summary"] | {"quiet_seconds": None} == summary | {"quiet_seconds": None}  # (read at another now)
    html = client.get(f"/jobs/{JOB}").text
    cells = re.findall(r'data-field="lost_updates">([^<]*)<', html)
    assert cells == ["3 (u1–3, ledger)", "2 (u11–12, metrics log)", "2 (u16–17, metrics log)", "0",
                     "2 (u26–27, ledger)"]

    metrics = client.get("/metrics").text
    assert prometheus(metrics, "spotrun_lost_updates") == 9
    assert prometheus(metrics, "spotrun_replayed_updates") == 9
    assert prometheus(metrics, "spotrun_time_lost_seconds") == totals.time_lost_seconds
    assert prometheus(metrics, "spotrun_restarts_total") == 5

    figures = restart_figures(history(open_storage(f"file://{job}"), JOB))
    assert (figures["restarts"], figures["lost_updates"], figures["restart_seconds"]) == (5, 9, DOWNTIME)
    assert figures["recovery_paths"] == {"cold": 2, "warm-replace": 1, "warm-shrink": 1}

    assert main(["history", JOB, "--storage", f"file://{job}"]) == 0
    out = capsys.readouterr().out
    assert f"restarts: 5, updates lost 9, time lost {totals.time_lost_seconds:.4g} s" in out


def test_without_a_metric_log_a_dead_drivers_loss_is_not_known_anywhere(job):
    """The JSONL log gone (SQLite keeps the final points only): the ledger still counts the restarts it
    recorded; the driver's death lost an unknown number of updates, and no reader sums what it knows as if
    it were all."""
    (job / JOB / "metrics.jsonl").unlink()
    hist = history(open_storage(f"file://{job}"), JOB)
    rows = hist.restarts
    assert [r.lost_updates for r in rows] == [3, 1, None, 0, 2]  # the ledger's 11 for attempt 2, the poll's
    assert rows[2].lost_updates_source is None and rows[2].lost_range == []
    assert (hist.totals.lost_updates, hist.totals.lost_updates_known) == (None, 6)
    client = TestClient(create_app(f"file://{job}"), base_url=BASE)
    assert client.get("/api/jobs").json()[0]["lost_updates"] is None
    assert prometheus(client.get("/metrics").text, "spotrun_lost_updates") is None
    assert re.findall(r'data-field="lost_updates">([^<]*)<', client.get(f"/jobs/{JOB}").text)[2] == "not known"
    assert restart_figures(hist)["lost_updates"] is None


def test_an_attempt_lost_while_replaying_counts_its_replay(tmp_path):
    """Attempt 2 replays updates 6-7 and is lost; attempt 3 overwrites their points and replays 6-10. Both
    replays were computed: the job replayed 7 updates, what its two restarts lost (5 + 2), though the final
    points show attempt 2's work nowhere."""
    storage = open_storage(f"file://{tmp_path}")
    ledger = Ledger(storage, JOB)
    for e in [
        AttemptStarted(at=t(0), attempt=1, world_size=1, pid=1, lineage_id="L"),
        BundlePublished(at=t(5.2), attempt=1, bundle=bundle(5, 1), update=5, bytes=1, stall_seconds=0.1,
                        write_seconds=0.1),
        WorkerLost(at=t(11), attempt=1, rank=0, cause="process-exit", loss="failure", last_update=10),
        restored(2, 5, 1, 12),
        AttemptStarted(at=t(12), attempt=2, world_size=1, pid=2, lineage_id="L"),
        WorkerLost(at=t(15), attempt=2, rank=0, cause="process-exit", loss="failure", last_update=7),
        restored(3, 5, 1, 16),
        AttemptStarted(at=t(16), attempt=3, world_size=1, pid=3, lineage_id="L"),
        JobFinished(at=t(24), attempt=3, counters={"attempted_updates": 12}),
    ]:
        ledger.append(e)
    sink = SqliteSink(tmp_path / JOB / "metrics.sqlite")
    for attempt, first, last, start in [(1, 1, 10, 0), (2, 6, 7, 12), (3, 6, 12, 16)]:
        sink.write([MetricPoint(job_id=JOB, update=u, name="loss", value=1.0, attempt=attempt, lineage_id="L",
                                at=t(start + u - first + 1)) for u in range(first, last + 1)])
    sink.close()
    hist = history(storage, JOB)
    assert [r.lost_updates for r in hist.restarts] == [5, 2]
    g = hist.goodput
    assert (g.productive_updates, g.replayed_updates) == (12, 7)
    assert [a.replayed_updates for a in g.attempts] == [0, 2, 5]
