"""A metric's curve at a size a page can carry: a range of updates, downsampled, restarts kept exact.

A week's job writes a million points per metric; a chart 900 pixels wide shows at most a few
thousand of them. :func:`curve` keeps the shape (tsdownsample's MinMaxLTTB: the min and max of
each stretch, then the largest-triangle-three-buckets pick among them, so a spike is never
averaged away) and never drops what a restart is about: the point at each restored update, the
first and last of each restart's lost range, and any non-finite value. The writes a restart
replaced are never downsampled: every one in the range is returned as it is.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from tsdownsample import MinMaxLTTBDownsampler

from spotrun.orchestrator.dashboard.queries import BadQuery

PAGE_POINTS = 2_000  # the job page's chart (and /api/jobs/{id}): about two points per pixel column
MIN_POINTS, MAX_POINTS = 3, 100_000  # what ?points= may ask for (MinMaxLTTB needs 3)


def check_range(lo: int | None, hi: int | None, points: int | None) -> None:
    """Refuse a range or a size no chart can use, naming the fix (:class:`BadQuery`)."""
    if lo is not None and hi is not None and lo > hi:
        raise BadQuery(f"from={lo} is after to={hi}: ask for from <= to (both are update numbers, inclusive)")
    if points is not None and not MIN_POINTS <= points <= MAX_POINTS:
        raise BadQuery(f"points={points} is out of range: ask for {MIN_POINTS} to {MAX_POINTS:,} points "
                       f"(omit points= for every point of the range)")


def restart_edges(restarts: Iterable[dict[str, Any]]) -> set[int]:
    """The updates a chart must show at any size: each restored update and its lost range's two ends."""
    out: set[int] = set()
    for r in restarts:
        if r.get("restored_update") is not None:
            out.add(r["restored_update"])
        out.update(r.get("lost_range") or ())
    return out


def within(rows: Sequence[dict[str, Any]], lo: int | None, hi: int | None) -> list[dict[str, Any]]:
    """The rows whose ``update`` is in ``[lo, hi]`` (an absent bound is open)."""
    return [r for r in rows if (lo is None or r["update"] >= lo) and (hi is None or r["update"] <= hi)]


def downsample(points: Sequence[dict[str, Any]], n_out: int, keep: set[int]) -> list[dict[str, Any]]:
    """``points`` (one per update, ascending) cut to about ``n_out``, plus every point whose update is in
    ``keep`` and every non-finite value; fewer than ``n_out`` points come back as they are."""
    if len(points) <= n_out:
        return list(points)
    x = np.fromiter((p["update"] for p in points), dtype=np.int64, count=len(points))
    y = np.fromiter((p["value"] for p in points), dtype=np.float64, count=len(points))
    finite = np.isfinite(y)
    chosen = set(np.flatnonzero(~finite).tolist())  # a diverged loss is news: never sampled away
    idx = np.flatnonzero(finite)
    if len(idx) > n_out:
        picked = MinMaxLTTBDownsampler().downsample(x[idx], y[idx], n_out=n_out)
        chosen.update(idx[picked].tolist())
    else:
        chosen.update(idx.tolist())
    chosen.update(np.flatnonzero(np.isin(x, np.fromiter(keep, dtype=np.int64, count=len(keep)))).tolist())
    return [points[i] for i in sorted(chosen)]


def curve(points: Sequence[dict[str, Any]], replaced: Sequence[dict[str, Any]], restarts: Sequence[dict[str, Any]],
          *, lo: int | None = None, hi: int | None = None, n_out: int | None = PAGE_POINTS) -> dict[str, Any]:
    """One metric's chart data over ``[lo, hi]``: ``points`` downsampled to ``n_out`` (``None``: all),
    ``replaced`` exact, and ``range`` saying what was asked, how many points it holds and how many are
    shown. ``points`` must be ascending by update."""
    check_range(lo, hi, n_out)
    inside = within(points, lo, hi)
    shown = inside if n_out is None else downsample(inside, n_out, restart_edges(restarts))
    return {"points": shown, "replaced": within(replaced, lo, hi),
            "range": {"from": lo, "to": hi, "points": n_out, "total": len(inside), "shown": len(shown)}}

