"""The restart line of `spotrun run`'s progress, with and without a bundle to restore (no Ray, no clock)."""

from __future__ import annotations

import io

from spotrun.orchestrator.ledger import AttemptStarted, Restored, WorkerLost
from spotrun.orchestrator.progress import PlainProgress


def _events(restored: bool) -> list:
    lost = WorkerLost(attempt=1, rank=0, cause="process-exit", last_update=10)
    start = AttemptStarted(attempt=2, world_size=1, pid=1, lineage_id="L")
    bundle = Restored(attempt=2, bundle="j/bundles/u0000000008-a1", update=8, recovery_label="exact",
                      policy="strict", restore_mode="snapshot", restore_seconds=0.1, lost_updates=2,
                      cause="process-exit")
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
                           "lost updates 2; downtime ")


def test_a_restart_with_no_bundle_published_yet_is_told_too():
    [line] = _lines(restored=False)
    assert line.startswith("restart: attempt 2 started from the beginning (no bundle was published before the "
                           "loss); cause process-exit; lost updates 10; downtime ")
