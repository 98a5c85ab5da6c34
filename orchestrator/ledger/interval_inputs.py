"""What ``checkpoint.every_updates: auto`` decides from, read from the job's ledger (runs in the driver).

:func:`observe` turns the events into :class:`~spotrun.orchestrator.policy.interval.IntervalInputs`;
the decision itself is :func:`spotrun.orchestrator.policy.interval.decide`, a pure function of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from spotrun.orchestrator.ledger.events import (
    AttemptStarted,
    BundlePublished,
    CorruptEvent,
    LedgerEvent,
    NoticeHandled,
    WorkerLost,
)
from spotrun.orchestrator.policy.interval import RECENT_BUNDLES, IntervalInputs
from spotrun.trainer.job.sections import CheckpointSpec


def observe(events: Sequence[LedgerEvent | CorruptEvent], checkpoint: CheckpointSpec, sec_per_update: float | None,
            running: int | None, now: datetime) -> IntervalInputs:
    """:func:`decide`'s inputs from a job's ledger. ``running``: the attempt running now (its run time
    counts up to ``now``); every other attempt counts until its loss or its last event."""
    evs = [e for e in events if not isinstance(e, CorruptEvent)]
    covered = {e.attempt for e in evs if isinstance(e, NoticeHandled) and not e.early}
    preempted = [e for e in evs if isinstance(e, WorkerLost) and e.loss == "preemption"]
    costs = [e.stall_seconds + (e.overlap_seconds or 0.0) for e in evs if isinstance(e, BundlePublished)]
    return IntervalInputs(
        checkpoint_costs_s=costs[-RECENT_BUNDLES:], sec_per_update=sec_per_update,
        preemptions=len(preempted), preemptions_losing_work=sum(e.attempt not in covered for e in preempted),
        uptime_s=round(sum(_run_time(evs, s, running, now) for s in evs if isinstance(s, AttemptStarted)), 3),
        prior_interval_s=checkpoint.expected_preemption_interval_s,
        min_interval_s=checkpoint.min_interval_s, max_interval_s=checkpoint.max_interval_s)


def _run_time(evs: list[LedgerEvent], started: AttemptStarted, running: int | None, now: datetime) -> float:
    """Seconds attempt ``started`` ran: to ``now`` while it runs, else to its loss or its last event."""
    if started.attempt == running:
        end = now
    else:
        lost = [e.detected_at or e.at for e in evs if isinstance(e, WorkerLost) and e.attempt == started.attempt]
        end = lost[0] if lost else max(e.at for e in evs if e.attempt == started.attempt)
    return max(0.0, (end - started.at).total_seconds())
