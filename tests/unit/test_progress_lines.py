"""The restart line of `spotrun run`'s progress, with and without a bundle to restore (no Ray, no clock)."""

from __future__ import annotations

import io
from datetime import UTC, datetime, timedelta

from spotrun.orchestrator.ledger import AttemptStarted, Restored, WorkerLost
from spotrun.orchestrator.progress import PlainProgress

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
