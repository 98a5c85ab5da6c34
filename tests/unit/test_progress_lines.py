"""The restart line of `spotrun run`'s progress, with and without a bundle to restore (no Ray, no clock)."""

from __future__ import annotations

import io
import math
import re
from datetime import UTC, datetime, timedelta

from spotrun.orchestrator.control.progress import PlainProgress
from spotrun.orchestrator.ledger.events import AttemptStarted, Restored, Slowdowns, StragglerReplacing, WorkerLost
from spotrun.trainer.observe.trace import UpdateRecord

T0 = datetime(2026, 12, 1, tzinfo=UTC)


def _events(restored: bool) -> list:
    # detected at 0, torn down at 1, started at 2.5, restored at 3.25: history's downtime is 3.25 (or 2.5)
    lost = WorkerLost(attempt=1, rank=0, cause="process-exit", last_update=10, at=T0 + timedelta(seconds=1),
                      detected_at=T0)
    start = AttemptStarted(attempt=2, world_size=1, pid=1, lineage_id="L", at=T0 + timedelta(seconds=2.5))
    bundle = Restored(attempt=2, bundle="j/bundles/u0000000008-a1", update=8, recovery_label="exact",
                      policy="strict", restore_mode="snapshot", restore_seconds=0.1, lost_updates=2,
                      cause="process-exit", at=T0 + timedelta(seconds=3.25))
    return [lost, start, bundle] if restored else [lost, start]


def _lines(restored: bool) -> list[str]:
    out = io.StringIO()
    progress = PlainProgress(total=16, samples_per_update=4, out=out, every=100)
    for e in _events(restored):
        progress.event(e)
    progress.updates([], world_size=1)  # the new attempt's first report
    return [line for line in out.getvalue().splitlines() if line.startswith("restart:")]


def test_a_restart_that_restores_a_bundle_names_it_once():
    [line] = _lines(restored=True)
    assert line.startswith("restart: attempt 2 restored u0000000008-a1 (update 8, exact); cause process-exit; "
                           "lost updates 2; downtime 3.2s")


def test_a_restart_with_no_bundle_published_yet_is_told_too():
    [line] = _lines(restored=False)
    assert line.startswith("restart: attempt 2 started from the beginning (no bundle was published before the "
                           "loss); cause process-exit; lost updates 10; downtime 2.5s")


class Clock:
    """The progress's clock, moved by the test (no sleeps)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _record(update: int) -> UpdateRecord:
    return UpdateRecord(update=update, attempt=1, occurrences_sha256="", n_occurrences=0, params_sha256="",
                        loss=1.0, lr=0.1, applied=True)


def _rates(text: str) -> list[float]:
    return [float(m) for m in re.findall(r"  ([0-9.]+) upd/s", text)]


def test_the_rate_holds_when_a_poll_follows_the_last_by_a_few_milliseconds():
    """Updates complete at 45/s (update k at k/45 s); the supervisor polls every second, each time just
    before an update completes, and at every fifth a bundle written wakes it again 3 ms later, with the
    one update finished since. Every rate shown stays within a tenth of 45 (one update over 3 ms read as
    a spike of over 100 upd/s before)."""
    out, clock = io.StringIO(), Clock()
    start = clock.now
    progress = PlainProgress(total=10_000, samples_per_update=4, out=out, every=1, clock=clock)
    progress.event(AttemptStarted(attempt=1, world_size=2, pid=1, lineage_id="L"))
    polls = sorted([k + 0.02 for k in range(1, 60)] + [k + 0.023 for k in range(5, 60, 5)])
    reported = 0
    for t in polls:
        clock.now = start + t
        done = math.floor(45 * t)
        progress.updates([_record(u) for u in range(reported + 1, done + 1)], world_size=2)
        reported = done
    rates = _rates(out.getvalue())
    assert len(rates) > 50 and all(40.5 <= r <= 49.5 for r in rates), rates


def test_a_restart_is_never_counted_as_progress():
    """Attempt 1 runs at 20 updates/s to update 100 and is lost; attempt 2 restores update 60 after 30 s
    and replays at 20 updates/s: no rate shown mixes the attempts (the restore's jump back to 60, or the
    restart's downtime)."""
    out, clock = io.StringIO(), Clock()
    progress = PlainProgress(total=1000, samples_per_update=4, out=out, every=1, clock=clock)
    progress.event(AttemptStarted(attempt=1, world_size=1, pid=1, lineage_id="L"))
    for update in range(10, 101, 10):
        clock.now += 0.5
        progress.updates([_record(u) for u in range(update - 9, update + 1)], world_size=1)
    clock.now += 30.0  # the loss, the teardown, the new attempt's start and restore
    progress.event(WorkerLost(attempt=1, rank=0, cause="process-exit", last_update=100))
    progress.event(AttemptStarted(attempt=2, world_size=1, pid=1, lineage_id="L"))
    progress.event(Restored(attempt=2, bundle="j/bundles/u0000000060-a1", update=60, recovery_label="exact",
                            policy="strict", restore_mode="snapshot", restore_seconds=0.1, lost_updates=40,
                            cause="process-exit"))
    for update in range(70, 141, 10):
        clock.now += 0.5
        progress.updates([_record(u) for u in range(update - 9, update + 1)], world_size=1)
    text = out.getvalue()
    assert _rates(text.split("restart: attempt 2")[1]), "attempt 2 shows a rate"
    assert all(19.9 <= r <= 20.1 for r in _rates(text)), _rates(text)


def test_the_progress_line_says_how_long_storage_has_been_unavailable_and_the_last_bundle():
    from spotrun.orchestrator.ledger.events import BundlePublished
    from spotrun.trainer.storage import Outage, StorageUnavailableError

    out, clock = io.StringIO(), Clock()
    outage = Outage("the ledger", clock=clock)
    progress = PlainProgress(total=100, samples_per_update=4, out=out, every=1, clock=clock)
    progress.watch_storage(outage.down_s)
    progress.event(BundlePublished(attempt=1, bundle="j/bundles/u0000000008-a1", update=8, bytes=1,
                                   stall_seconds=0.1, write_seconds=0.1))
    progress.updates([_record(9)], world_size=1)
    outage.failed(StorageUnavailableError("503 SlowDown"))
    clock.now += 42.0
    progress.updates([_record(10)], world_size=1)
    outage.recovered()
    progress.updates([_record(11)], world_size=1)
    lines = out.getvalue().splitlines()
    assert "storage unavailable" not in lines[0]
    assert lines[1].endswith("storage unavailable for 42 s, last bundle at update 8")
    assert "storage unavailable" not in lines[2]


def test_a_straggler_is_told_when_flagged_and_when_replaced_and_even_figures_are_not():
    out = io.StringIO()
    progress = PlainProgress(total=16, samples_per_update=4, out=out, every=100)
    for stragglers in ([], [1]):
        progress.event(Slowdowns(attempt=1, update=20, window=20, ratio=1.5, slowdown={0: 0.5, 1: 2.0},
                                 stragglers=stragglers))
    progress.event(StragglerReplacing(attempt=1, rank=1, slowdown=2.0, update=21))
    assert out.getvalue().splitlines() == [
        "straggler: rank 1 (2.00x) its peers' own work over 20 updates",
        "replacing straggler rank 1 by a spare after the next boundary"]
