"""What restarts cost, each figure defined once, from the ledger and the metric points.

history, the dashboard, goodput, Prometheus and verify all read these definitions, so one job
shows one value of each figure wherever it is shown:

- an attempt's **reach**: the furthest update it is known to have completed: the most of the
  ledger's word (the updates of the bundles it published, the ``last_update`` of the loss that
  ended it, the job's finish) and of its metric points (each point is written after its update
  completed). The supervisor learns an attempt's progress by polling, so a loss's ``last_update``
  can trail what the ranks did; the JSONL metric log keeps every write, even those a replay
  overwrote, and is read when it is there. The reach is *known* when the ledger recorded how the
  attempt ended (a loss, a finish, a resize, a straggler's replacement) or a metric log was kept;
  otherwise (a driver killed with no log) it is a lower bound, and the figures built on it are
  unknown (``None``), never a guess.
- a restart's **lost updates**: the updates the attempt before it completed after the bundle the
  restart resumed from (all of them after a start from nothing): the work thrown away, which the
  job computes again.
- an attempt's **replayed updates**: the updates it computed that an earlier attempt had already
  completed. Once the job has gone past every lost update (a finished job has), the replayed
  updates of the job equal its restarts' lost updates.
- a restart's **downtime**: from the loss (its detection; when the driver died, the lost attempt's
  last event, a lower bound on its death) to the restore: no rank training.
- a restart's **time lost**: from the moment the state it resumed from was current (the restored
  bundle's publication, or the previous attempt's start when that is later or nothing was
  restored) to the restore: the work thrown away plus the downtime. A job's time lost is the sum
  over its restarts.
- a storage outage's **updates at risk**: the updates the attempt had completed when storage answered
  again after the newest bundle published while it lasted (all of them when none was): what a loss
  at its end would have thrown away.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from pydantic import BaseModel, ConfigDict

from spotrun.orchestrator.ledger.columns import PointColumns
from spotrun.orchestrator.ledger.events import (
    BundlePublished,
    CorruptEvent,
    JobFinished,
    LedgerEvent,
    Resizing,
    Restored,
    StragglerReplacing,
    WorkerLost,
)
from spotrun.trainer.metrics import MetricPoint


@dataclass(frozen=True)
class Reach:
    """How far one attempt got: ``update``, and ``source``: ``ledger`` (the supervisor recorded how the
    attempt ended), ``metrics log`` (a kept write log went further or was all there was) or ``lower
    bound`` (neither: published bundles and the points no replay overwrote)."""

    update: int
    source: str

    @property
    def known(self) -> bool:
        return self.source != "lower bound"


def reaches(events: Sequence[LedgerEvent | CorruptEvent], final: Sequence[MetricPoint],
            log: Sequence[MetricPoint] | None) -> dict[int, Reach]:
    """Every attempt's reach (see the module docstring), by attempt number."""
    ledger: dict[int, int] = {}
    ended: set[int] = set()  # attempts whose end the ledger recorded
    for e in events:
        if isinstance(e, BundlePublished):
            ledger[e.attempt] = max(ledger.get(e.attempt, 0), e.update)
        elif isinstance(e, WorkerLost | JobFinished):
            update = e.last_update if isinstance(e, WorkerLost) else e.counters.attempted_updates
            ledger[e.attempt] = max(ledger.get(e.attempt, 0), update)
            ended.add(e.attempt)
        elif isinstance(e, Resizing | StragglerReplacing):  # it stops at the boundary its bundle is taken at
            ended.add(e.attempt)
    written = PointColumns.of(log if log is not None else final).max_update_by_attempt()
    out = {}
    for attempt in sorted(set(ledger) | set(written)):
        by_ledger, by_points = ledger.get(attempt, 0), written.get(attempt, 0)
        if log is not None and (by_points > by_ledger or attempt not in ended):
            source = "metrics log"
        elif attempt in ended:
            source = "ledger"
        else:
            source = "lower bound"
        out[attempt] = Reach(max(by_ledger, by_points), source)
    return out


def resumed_from(events: Sequence[LedgerEvent | CorruptEvent]) -> dict[int, int]:
    """The update each attempt that restored a bundle resumed from (an attempt not listed began at 0)."""
    return {e.attempt: e.update for e in events if isinstance(e, Restored)}


def lost_updates(reach: Reach | None, restored_update: int) -> int | None:
    """A restart's lost updates: how far the attempt before it got past the update it resumed from;
    ``None`` when that reach is not known."""
    if reach is None or not reach.known:
        return None
    return max(0, reach.update - restored_update)


def lost_range(lost: int | None, restored_update: int) -> list[int]:
    """The first and last update a restart lost (and the job computes again); empty when none."""
    return [restored_update + 1, restored_update + lost] if lost else []


def update_counts(attempts: Sequence[int], reach: dict[int, Reach],
                  resumed: dict[int, int]) -> dict[int, tuple[int, int]]:
    """Per attempt, in order: (productive, replayed) updates. An attempt computed the updates after the one
    it resumed from up to its reach; those an earlier attempt had completed are replayed, the rest
    productive (each update index is productive once)."""
    out, furthest = {}, 0  # the furthest update any earlier attempt completed
    for attempt in attempts:
        start, end = resumed.get(attempt, 0), reach[attempt].update if attempt in reach else 0
        replayed = max(0, min(end, furthest) - start)
        out[attempt] = (max(0, end - max(start, furthest)), replayed)
        furthest = max(furthest, end)
    return out


def downtime_seconds(lost_at: datetime | None, begun: datetime) -> float | None:
    """A restart's downtime: from the loss to the restore (``None``: nothing was down, a finished job
    run again)."""
    return round((begun - lost_at).total_seconds(), 3) if lost_at else None


def time_lost_seconds(current_since: datetime | None, begun: datetime) -> float | None:
    """A restart's time lost: from the moment the state it resumed from was current to the restore."""
    return round((begun - current_since).total_seconds(), 3) if current_since else None


class RestartFigures(Protocol):
    """What :func:`totals` reads of a restart row (history's ``RestartRow``)."""

    lost_updates: int | None
    time_lost_seconds: float | None
    downtime_seconds: float | None


class Totals(BaseModel):
    """A job's figures over its restarts (see :func:`totals`)."""

    model_config = ConfigDict(extra="forbid")

    restarts: int
    lost_updates: int | None  # None when some restart's is unknown: a sum of the known ones would look whole
    lost_updates_known: int  # the sum of the known ones
    # the known ones; an int 0 when none is, as ``--json`` has always printed it (hence the union)
    time_lost_seconds: float | int
    downtime_seconds: list[float]  # each restart's that has one


def updates_at_risk(update_at_end: int, newest_update: int | None) -> int:
    """A storage outage's updates at risk (see the module docstring)."""
    return max(0, update_at_end - (newest_update or 0))


def totals(restarts: Sequence[RestartFigures]) -> Totals:
    """A job's figures over its restart rows (history's): how many restarts, the updates they lost
    (``None`` when some restart's is unknown: a sum of the known ones would look whole), the time
    they lost (the known ones), and each restart's downtime."""
    lost = [r.lost_updates for r in restarts]
    known = [x for x in lost if x is not None]
    seconds = [r.time_lost_seconds for r in restarts if r.time_lost_seconds is not None]
    return Totals(
        restarts=len(restarts),
        lost_updates=None if len(known) < len(lost) else sum(known),
        lost_updates_known=sum(known),
        time_lost_seconds=round(sum(seconds), 3),
        downtime_seconds=[r.downtime_seconds for r in restarts if r.downtime_seconds is not None],
    )
