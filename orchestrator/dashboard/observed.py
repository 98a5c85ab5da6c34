"""What the ledger alone cannot say about a restart, observed from the metric points.

When the driver itself is killed nobody records how far the attempt got: the
ledger's restart row then has ``lost_updates: null``. The metric log (the JSONL
sink keeps every write) still holds the last update the killed attempt wrote, so
the dashboard can show the replayed range and what the restart cost in time. Every
observed figure names its source; without a log the figure is ``None``, never a guess.

Definitions (seconds are wall-clock):

- an attempt's **span**: from its ``attempt_started`` event to its last sign of life
  (its last event or its last metric write, whichever is later);
- **gap**: from the previous attempt's last sign of life to this attempt's start;
- **replay**: from this attempt's start until it wrote the update the previous attempt
  had reached (0 when nothing was lost; from update 1 on when nothing was restored).

The time a restart lost is the history's own ``time_lost_seconds`` (from the ledger
alone), so every restart has it, the driver's death and a start from nothing included.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from spotrun.orchestrator.dashboard.points import Points, furthest_by_attempt


def _t(value: str | None) -> datetime | None:
    return datetime.fromisoformat(value) if value else None


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value else None


def _seconds(a: datetime | None, b: datetime | None) -> float | None:
    return round((b - a).total_seconds(), 3) if a and b else None


def spans(hist: dict[str, Any], points: Points) -> list[dict[str, Any]]:
    """One bar per attempt: start, end (last sign of life), world size, how it ended, how far it got."""
    furthest = furthest_by_attempt(points)
    causes = {r["attempt"] - 1: r["cause"] for r in hist["restarts"]}
    attempts = hist["attempts"]
    out = []
    for i, a in enumerate(attempts):
        n = a["attempt"]
        written, last_write = furthest.get(n, (None, None))
        start = _t(a["started_at"]) or _t(a["ended_at"])
        end = max(filter(None, [_t(a["ended_at"]), last_write]), default=start)
        last = i == len(attempts) - 1
        ended = a["ended"] or causes.get(n) or ("running" if last and hist["state"] == "running" else "unknown")
        out.append({
            "attempt": n, "start": _iso(start), "end": _iso(end), "world_size": a["world_size"],
            "ended": ended, "reached_update": max(filter(None, [a["last_update"], written]), default=None),
            "published": a["published"], "lineage_id": a.get("lineage_id"),
            "initialized_from": a.get("initialized_from"),
        })
    return out


def restarts(hist: dict[str, Any], points: Points, attempt_spans: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each restart row of ``history`` with the observed replay, gap and time lost added."""
    by_attempt = {s["attempt"]: s for s in attempt_spans}
    final_at = {(p.attempt, p.update): p.at for p in points.final if p.name == "loss"}
    if points.log is not None:
        final_at.update({(p.attempt, p.update): p.at for p in points.log if p.name == "loss"})
    out = []
    for r in hist["restarts"]:
        prev, this = by_attempt.get(r["attempt"] - 1), by_attempt.get(r["attempt"])
        lost = r["lost_updates"]
        source: str | None = "ledger"
        if lost is None and points.log is not None and prev and prev["reached_update"] is not None:
            lost, source = max(0, prev["reached_update"] - r["restored_update"]), "metrics log"
        elif lost is None:
            source = None
        start = _t(this["start"]) if this else None
        gap = _seconds(_t(prev["end"]), start) if prev else None
        replay = None
        if lost == 0:
            replay = 0.0
        elif lost is not None:
            replay = _seconds(start, final_at.get((r["attempt"], r["restored_update"] + lost)))
        out.append({
            **r,
            "lost_updates_seen": lost,
            "lost_updates_source": source,
            "replayed_updates": [r["restored_update"] + 1, r["restored_update"] + lost] if lost else [],
            "previous_last_seen_at": prev["end"] if prev else None,
            "gap_seconds": gap,
            "replay_seconds": replay,
        })
    return out
