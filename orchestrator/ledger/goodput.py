"""Goodput: how much of a job's wall time became training, from the ledger and the metric points only.

The job's wall time runs from the first attempt's start-up (its placement, or the capacity wait
before it) to the job's last sign of life (its last event or metric point). It is cut into one
window per attempt, back to back, and every second of a window goes to exactly one term:

- **productive**: computing an update for the first time (each update index counts once);
- **replayed**: computing an update again that an earlier attempt had already computed (the work a
  restart redid because it was lost with the attempt that did it). The update counts of both
  terms are :func:`~spotrun.orchestrator.ledger.losses.update_counts` (from each attempt's reach), so the
  job's replayed updates are its restarts' lost updates once it is past them;
- **checkpoint stall**: the training loop waiting at a boundary for its bundle capture
  (``BundlePublished.stall_seconds``, charged to the update after the boundary);
- **capacity wait**: waiting for ranks (``CapacityWait.waited_seconds``);
- **downtime**: the rest: before an attempt's first update (placement, actor start, process group,
  restore), after a loss (detection, teardown) and after the last update (the last write, shutdown).

goodput = productive / wall. An update's time is the time between its metric point and the one
before it from the same attempt (the first from the attempt's start). An attempt that was lost
computed updates after its last surviving point: their time counts as productive, measured from
the JSONL write log when there is one, else estimated as that many of the attempt's median update
time (never more than the time before the loss was detected).

With ``usd_per_rank_hour`` each window also costs world size × its length × the rate; the badput
(the window less its productive time) at the same rate is the money lost.
"""

from __future__ import annotations

import bisect
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict

from spotrun.orchestrator.ledger.columns import Floats, Ints, PointColumns, from_us, to_us
from spotrun.orchestrator.ledger.events import (
    AttemptStarted,
    BundlePublished,
    CapacityWait,
    CorruptEvent,
    LedgerEvent,
    Restored,
    WorkerLost,
)
from spotrun.orchestrator.ledger.losses import reaches, resumed_from, update_counts
from spotrun.trainer.metrics import MetricPoint

TERMS = ("productive_seconds", "replayed_seconds", "checkpoint_stall_seconds", "capacity_wait_seconds",
         "downtime_seconds")


class GoodputAttempt(BaseModel):
    """One attempt's window: its terms (seconds; they add up to ``wall_seconds``) and goodput."""

    model_config = ConfigDict(extra="forbid")

    attempt: int
    world_size: int
    start: str  # ISO-8601
    end: str
    wall_seconds: float
    productive_seconds: float
    replayed_seconds: float
    checkpoint_stall_seconds: float
    capacity_wait_seconds: float
    downtime_seconds: float
    goodput: float | None  # productive / wall (None: no wall time)
    productive_updates: int
    replayed_updates: int
    cost_usd: float | None  # None: the spec names no cost.usd_per_rank_hour
    badput_usd: float | None


class Goodput(BaseModel):
    """The job's goodput: its terms over the whole wall time, and each attempt's (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")

    wall_seconds: float
    productive_seconds: float
    replayed_seconds: float
    checkpoint_stall_seconds: float
    capacity_wait_seconds: float
    downtime_seconds: float
    goodput: float | None
    cost_usd: float | None
    badput_usd: float | None
    productive_updates: int
    replayed_updates: int
    attempts: list[GoodputAttempt]


@dataclass
class _Window:
    """One attempt's share of the wall time, term by term."""

    attempt: int
    world_size: int
    begin: datetime
    ready: datetime  # AttemptStarted: the ranks are placed and restored
    end: datetime
    terms: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TERMS, 0.0))
    productive_updates: int = 0
    replayed_updates: int = 0

    @property
    def wall(self) -> float:
        return (self.end - self.begin).total_seconds()

    def add(self, term: str, seconds: float) -> None:
        self.terms[term] += max(0.0, seconds)

    def doc(self, rate: float | None) -> GoodputAttempt:
        return GoodputAttempt(attempt=self.attempt, world_size=self.world_size, start=self.begin.isoformat(),
                              end=self.end.isoformat(), **_totals(self.wall, self.terms),
                              productive_updates=self.productive_updates, replayed_updates=self.replayed_updates,
                              **_cost(rate, [(self.world_size, self.wall, self.terms["productive_seconds"])]))


def _totals(wall: float, terms: dict[str, float]) -> dict[str, Any]:
    return {"wall_seconds": round(wall, 3), **{k: round(v, 3) for k, v in terms.items()},
            "goodput": round(terms["productive_seconds"] / wall, 4) if wall > 0 else None}


def _cost(rate: float | None, windows: list[tuple[int, float, float]]) -> dict[str, Any]:
    """``windows``: (world size, wall seconds, productive seconds) each."""
    if rate is None:
        return {"cost_usd": None, "badput_usd": None}
    per_second = rate / 3600
    return {"cost_usd": round(sum(n * wall for n, wall, _ in windows) * per_second, 4),
            "badput_usd": round(sum(n * (wall - good) for n, wall, good in windows) * per_second, 4)}


Times = dict[int, tuple[Ints, Ints]]  # per attempt: its updates, ascending, and when each was written (µs)


def _update_times(points: Sequence[MetricPoint]) -> Times:
    """Per attempt, per update: when its points were written (the latest of the update's points)."""
    return PointColumns.of(points).by_attempt()


def _stall_caps(updates: Ints, stalls: dict[int, float]) -> Floats:
    """Per update of ``updates`` (ascending): the stall of the bundle taken at the boundary before it
    (``stalls`` by the bundle's update; 0 where none)."""
    caps = np.zeros(len(updates), dtype=np.float64)
    if stalls and len(updates):
        after = np.fromiter(stalls, np.int64, len(stalls)) + 1
        at = np.minimum(np.searchsorted(updates, after), len(updates) - 1)
        hit = updates[at] == after
        caps[at[hit]] = np.fromiter(stalls.values(), np.float64, len(stalls))[hit]
    return caps


def _sum(values: Floats) -> float:
    """``values`` added one after the other, as a Python loop would (cumsum is sequential; sum is not):
    the figures stay the same to the last bit whichever way they are computed."""
    return float(np.cumsum(values)[-1]) if len(values) else 0.0


def goodput(events: Sequence[LedgerEvent | CorruptEvent], final: Sequence[MetricPoint],
            log: Sequence[MetricPoint] | None = None, usd_per_rank_hour: float | None = None) -> Goodput:
    """The job's goodput and its terms, in total and per attempt (see the module docstring).

    ``final``: the sinks' upserted view (one point per update and name); ``log``: every write, when
    a JSONL sink kept them. The terms of each attempt, and of the job, add up to its wall time."""
    evs = [e for e in events if not isinstance(e, CorruptEvent)]
    started = sorted((e for e in evs if isinstance(e, AttemptStarted)), key=lambda e: e.at)
    if not started:
        return Goodput(**_totals(0.0, dict.fromkeys(TERMS, 0.0)), **_cost(usd_per_rank_hour, []),
                       productive_updates=0, replayed_updates=0, attempts=[])
    kept = _update_times(final)
    logged = _update_times(log) if log is not None else {}
    # indexed once, so that the job costs O(events), not O(attempts x events)
    own: dict[int, list[LedgerEvent]] = defaultdict(list)
    for e in evs:
        own[e.attempt].append(e)
    waits = sorted((e.at, e.waited_seconds) for e in evs if isinstance(e, CapacityWait))
    wait_times = [at for at, _ in waits]
    windows = _windows(evs, own, started, kept, logged)
    reach = reaches(evs, final, log)
    counts = update_counts([w.attempt for w in windows], reach, resumed_from(evs))
    reached = 0  # the furthest update any earlier attempt computed
    for w in windows:
        w.productive_updates, w.replayed_updates = counts[w.attempt]
        stalls = {e.update: e.stall_seconds for e in own[w.attempt] if isinstance(e, BundlePublished)}
        # the capacity waits recorded in (begin, ready]
        lo, hi = bisect.bisect_right(wait_times, w.begin), bisect.bisect_right(wait_times, w.ready)
        w.add("capacity_wait_seconds", min((w.ready - w.begin).total_seconds(), sum(x for _, x in waits[lo:hi])))
        w.add("downtime_seconds", (w.ready - w.begin).total_seconds() - w.terms["capacity_wait_seconds"])
        updates, at = kept.get(w.attempt, (np.zeros(0, np.int64), np.zeros(0, np.int64)))
        # each update's time runs from the point before it (the first from the attempt's start); a
        # difference in microseconds over 10^6 is exactly timedelta.total_seconds()
        seconds = np.diff(at, prepend=to_us(w.ready)) / 1e6
        stalled = np.minimum(np.maximum(0.0, seconds), _stall_caps(updates, stalls))
        # not clamped: a point stamped before the one before it gives back the time the one before took, so
        # that an attempt's terms add up to its window whatever order its points were stamped in
        work = seconds - stalled
        replay = updates <= reached
        w.add("checkpoint_stall_seconds", _sum(stalled))
        w.add("replayed_seconds", _sum(np.where(replay, work, 0.0)))
        w.add("productive_seconds", _sum(np.where(replay, 0.0, work)))
        intervals = (seconds - stalled).tolist()
        previous = from_us(int(at[-1])) if len(at) else w.ready
        last = int(updates[-1]) if len(updates) else 0
        furthest = max(last, reach[w.attempt].update if w.attempt in reach else 0)
        tail = (w.end - previous).total_seconds()
        stall = min(max(0.0, tail), stalls.get(last, 0.0)) if last else 0.0
        w.add("checkpoint_stall_seconds", stall)
        lost_work = _lost_work(w, own[w.attempt], previous, last, furthest, logged, intervals)
        w.add("productive_seconds", lost_work)
        w.add("downtime_seconds", tail - stall - lost_work)
        reached = max(reached, furthest)
    terms = {k: sum(w.terms[k] for w in windows) for k in TERMS}
    wall = (windows[-1].end - windows[0].begin).total_seconds()
    return Goodput(**_totals(wall, terms), **_cost(usd_per_rank_hour, [(w.world_size, w.wall,
                                                                        w.terms["productive_seconds"])
                                                                       for w in windows]),
                   productive_updates=sum(w.productive_updates for w in windows),
                   replayed_updates=sum(w.replayed_updates for w in windows),
                   attempts=[w.doc(usd_per_rank_hour) for w in windows])


def _windows(evs: list[LedgerEvent], own: dict[int, list[LedgerEvent]], started: list[AttemptStarted],
             kept: Times, logged: Times) -> list[_Window]:
    """The attempts' windows, back to back: each begins where the one before ended (the first at its
    start-up, or at the capacity wait before it) and ends at the attempt's last sign of life."""
    restore = {e.attempt: e.restore_wall_seconds or e.restore_seconds for e in evs if isinstance(e, Restored)}
    first = started[0]
    setup = sum(filter(None, [first.placement_seconds, first.process_group_seconds, first.rank_setup_seconds,
                              restore.get(first.attempt)]))
    # a capacity wait before the first attempt began waited_seconds before its event
    leads = [(first.at - e.at).total_seconds() + e.waited_seconds for e in evs
             if isinstance(e, CapacityWait) and e.at <= first.at]
    begin = first.at - timedelta(seconds=max([setup, *leads]))
    windows = []
    for i, s in enumerate(started):
        nxt = started[i + 1].at if i + 1 < len(started) else None
        # its own events, less the capacity waits its supervisor recorded while placing the next attempt
        signs = [e.at for e in own[s.attempt] if not isinstance(e, CapacityWait)]
        signs += [from_us(int(t[1].max())) for t in (kept.get(s.attempt), logged.get(s.attempt)) if t is not None]
        end = max(signs)
        if nxt is not None:
            end = min(end, nxt)
        begin = min(begin, s.at)
        windows.append(_Window(s.attempt, s.world_size, begin, s.at, max(end, s.at)))
        begin = windows[-1].end
    return windows


def _lost_work(w: _Window, own: list[LedgerEvent], previous: datetime, last: int, furthest: int,
               logged: Times, intervals: list[float]) -> float:
    """The time an attempt spent on updates after its last surviving point (they were lost with it)."""
    if furthest <= last:
        return 0.0
    loss = next((e for e in own if isinstance(e, WorkerLost)), None)
    limit = ((loss.detected_at or loss.at) if loss else w.end) - previous
    updates, at = logged.get(w.attempt, (np.zeros(0, np.int64), np.zeros(0, np.int64)))
    beyond = at[updates > last]
    if len(beyond):
        return min(limit.total_seconds(), (from_us(int(beyond.max())) - previous).total_seconds())
    estimate = (furthest - last) * statistics.median(intervals) if intervals else 0.0
    return max(0.0, min(limit.total_seconds(), estimate))
