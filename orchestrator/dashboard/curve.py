"""A metric's curve at a size a page can carry: a range of updates, downsampled, restarts kept exact.

A week's job writes a million points per metric; a chart 900 pixels wide shows at most a few
thousand of them. :func:`curve` keeps the shape (tsdownsample's MinMaxLTTB: the min and max of
each stretch, then the largest-triangle-three-buckets pick among them, so a spike is never
averaged away) and never drops what a restart is about: the point at each restored update, the
first and last of each restart's lost range, and any non-finite value. The writes a restart
replaced are never downsampled: every one in the range is returned as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
from tsdownsample import MinMaxLTTBDownsampler

from spotrun.orchestrator.dashboard.queries import BadQuery
from spotrun.orchestrator.ledger.columns import PointColumns

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


def downsample(x: npt.NDArray[np.int64], y: npt.NDArray[np.float64], n_out: int,
               keep: set[int]) -> npt.NDArray[np.intp]:
    """Which of the points ``(x, y)`` (one per update ``x``, ascending) to show, ascending: about ``n_out``,
    plus every point whose update is in ``keep`` and every non-finite value; all of them when there are
    no more than ``n_out``."""
    if len(x) <= n_out:
        return np.arange(len(x))
    finite = np.isfinite(y)
    chosen = ~finite  # a diverged loss is news: never sampled away
    idx = np.flatnonzero(finite)
    chosen[idx[MinMaxLTTBDownsampler().downsample(x[idx], y[idx], n_out=n_out)] if len(idx) > n_out else idx] = True
    chosen |= np.isin(x, np.fromiter(keep, dtype=np.int64, count=len(keep)))
    return np.flatnonzero(chosen)


def page_row(points: PointColumns, i: int) -> dict[str, Any]:
    """A point as the job page's chart carries it."""
    return {"update": int(points.update[i]), "value": float(points.value[i]), "attempt": int(points.attempt[i])}


def curve(points: PointColumns, replaced: Sequence[dict[str, Any]], restarts: Sequence[dict[str, Any]],
          *, lo: int | None = None, hi: int | None = None, n_out: int | None = PAGE_POINTS,
          row: Callable[[PointColumns, int], dict[str, Any]] = page_row) -> dict[str, Any]:
    """One metric's chart data over ``[lo, hi]``: ``points`` (one metric's, ascending by update) downsampled
    to ``n_out`` (``None``: all), each shown point as ``row`` builds it; ``replaced`` exact; ``range``
    saying what was asked, how many points it holds and how many are shown."""
    check_range(lo, hi, n_out)
    inside = np.flatnonzero((points.update >= (lo if lo is not None else np.iinfo(np.int64).min))
                            & (points.update <= (hi if hi is not None else np.iinfo(np.int64).max)))
    shown = inside if n_out is None else inside[downsample(points.update[inside], points.value[inside], n_out,
                                                           restart_edges(restarts))]
    return {"points": [row(points, int(i)) for i in shown], "replaced": within(replaced, lo, hi),
            "range": {"from": lo, "to": hi, "points": n_out, "total": len(inside), "shown": len(shown)}}
