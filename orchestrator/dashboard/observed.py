"""The dashboard's view of each attempt and restart: what history says, with times observed.

How far an attempt got and what a restart lost are history's figures (one definition, in
:mod:`spotrun.orchestrator.ledger.losses`, read from the ledger and the metric log), shown as they are.
What this adds are wall-clock readings from the metric points (seconds):

- an attempt's **span**: from its ``attempt_started`` event to its last sign of life
  (its last event or its last metric write, whichever is later);
- **gap**: from the previous attempt's last sign of life to this attempt's start;
- **replay**: from this attempt's start until it wrote the last update the restart lost (0 when
  nothing was lost; ``None`` when how far the lost attempt got is not known).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import numpy as np

from spotrun.orchestrator.ledger.columns import PointColumns, from_us
from spotrun.orchestrator.ledger.history_model import History
from spotrun.orchestrator.ledger.points import Points, last_write_by_attempt


def _t(value: str | None) -> datetime | None:
    return datetime.fromisoformat(value) if value else None


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value else None


def _seconds(a: datetime | None, b: datetime | None) -> float | None:
    return round((b - a).total_seconds(), 3) if a and b else None


def _written_at(rows: PointColumns, wanted: set[int]) -> dict[tuple[int, int], datetime]:
    """When each row of an update in ``wanted`` was written, by (attempt, update); a later row wins."""
    hits = np.flatnonzero(np.isin(rows.update, np.fromiter(wanted, np.int64, len(wanted))))
    return {(int(rows.attempt[i]), int(rows.update[i])): from_us(int(rows.at_us[i])) for i in hits}


def spans(hist: History, points: Points) -> list[dict[str, Any]]:
    """One bar per attempt: start, end (last sign of life), world size, how it ended, how far it got."""
    last_writes = last_write_by_attempt(points)
    causes = {r.attempt - 1: r.cause for r in hist.restarts}
    attempts = hist.attempts
    out = []
    for i, a in enumerate(attempts):
        n = a.attempt
        last_write = last_writes.get(n)
        start = _t(a.started_at) or _t(a.ended_at)
        end = max(filter(None, [_t(a.ended_at), last_write]), default=start)
        last = i == len(attempts) - 1
        ended = a.ended or causes.get(n) or ("running" if last and hist.state == "running" else "unknown")
        out.append({
            "attempt": n, "start": _iso(start), "end": _iso(end), "world_size": a.world_size,
            "ended": ended, "reached_update": a.last_update,
            "published": a.published, "lineage_id": a.lineage_id,
            "initialized_from": a.initialized_from,
        })
    return out


def restarts(hist: History, points: Points, attempt_spans: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each restart row of ``history`` with the observed gap and replay time added."""
    by_attempt = {s["attempt"]: s for s in attempt_spans}
    # only the last lost update of each restart is looked up: a week's job has 500 restarts and 10^6 points
    wanted = {r.lost_range[1] for r in hist.restarts if r.lost_range}
    final_at: dict[tuple[int, int], datetime] = {}
    for rows in (points.final, points.log):  # the log's writes last: they win
        if rows is not None:
            final_at.update(_written_at(rows.named("loss"), wanted))
    out = []
    for r in hist.restarts:
        prev, this = by_attempt.get(r.attempt - 1), by_attempt.get(r.attempt)
        start = _t(this["start"]) if this else None
        replay = None
        if r.lost_updates == 0:
            replay = 0.0
        elif r.lost_range:
            replay = _seconds(start, final_at.get((r.attempt, r.lost_range[1])))
        out.append({
            **r.model_dump(mode="json"),
            "previous_last_seen_at": prev["end"] if prev else None,
            "gap_seconds": _seconds(_t(prev["end"]), start) if prev else None,
            "replay_seconds": replay,
        })
    return out
