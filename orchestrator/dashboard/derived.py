"""What a job's page derives from its ledger, metric points and bundles, kept while they are unchanged.

A week's job has a million points: its history (goodput and each attempt's reach read every point),
the attempts' observed spans and restarts and the downsampled loss curve (per range asked, the newest
few ranges) cost seconds to derive, and a page refreshes every few seconds. :class:`DerivedCache` keeps
them per job and derives them again only when an input changed:

- the ledger's events, compared by identity (the ledger hands back the same parsed event objects
  until it reads a new one; a corrupt file is parsed anew each read, so it never hits);
- the metric points, compared by identity (the sink caches hand back the same lists until a sink's
  file changes);
- the newest published bundle (its manifest names the cost rate goodput uses).

What it hands back is shared between requests: callers read it and never change it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from spotrun.orchestrator.dashboard import observed
from spotrun.orchestrator.dashboard.curve import curve
from spotrun.orchestrator.ledger.columns import PointColumns
from spotrun.orchestrator.ledger.events import CorruptEvent, LedgerEvent
from spotrun.orchestrator.ledger.history_model import History
from spotrun.orchestrator.ledger.points import Points, replaced
from spotrun.trainer.bundle.bundles import BundleRef

Events = Sequence[LedgerEvent | CorruptEvent]
CURVES = 8  # ranges of the loss kept per job (the whole run, and the few a reader zoomed into)


@dataclass
class Derived:
    """One job's derived figures (read-only once built). ``history`` is the model, ``history_doc`` its
    JSON dump; ``spans`` and ``restarts`` are :mod:`.observed`'s; ``points`` are what they were derived
    from, ``loss_replaced`` the loss writes a restart replaced; ``max_update`` is the furthest update any
    final point reached (0: none)."""

    history: History
    history_doc: dict[str, Any]
    spans: list[dict[str, Any]]
    restarts: list[dict[str, Any]]
    points: Points
    loss_replaced: list[dict[str, Any]]
    max_update: int
    curves: dict[tuple[int | None, int | None, int], dict[str, Any]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def curve(self, lo: int | None, hi: int | None, n_out: int) -> dict[str, Any]:
        """:func:`~.curve.curve` of the loss over ``[lo, hi]`` cut to ``n_out``; the newest few ranges kept."""
        key = (lo, hi, n_out)
        with self._lock:
            hit = self.curves.get(key)
        if hit is not None:
            return hit
        # from the columns: a row is built only for each point shown
        made = curve(self.points.final.named("loss"), self.loss_replaced, self.restarts, lo=lo, hi=hi, n_out=n_out)
        with self._lock:
            while len(self.curves) >= CURVES:  # a reader zooming around: memory stays bounded
                self.curves.pop(next(iter(self.curves)))
            self.curves[key] = made
        return made


def derive(history: History, points: Points, stacks_url: Callable[[dict[str, Any]], str | None]) -> Derived:
    """Everything :class:`Derived` holds, from a job's history and points. ``stacks_url`` gives a restart
    row's link to the stacks of the rank it lost (``None``: none kept)."""
    spans = observed.spans(history, points)
    restarts = observed.restarts(history, points, spans)
    for r in restarts:
        r["stacks_url"] = stacks_url(r)
    return Derived(history=history, history_doc=history.model_dump(mode="json"), spans=spans, restarts=restarts,
                   points=points, loss_replaced=replaced(points, "loss"),
                   max_update=points.final.max_update())


@dataclass
class _Entry:
    events: Events
    final: PointColumns
    log: PointColumns | None
    newest: str | None
    derived: Derived


class DerivedCache:
    """Per job, the newest :class:`Derived` and the inputs it was derived from."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}

    def get(self, job_id: str, events: Events, points: Points, listing: list[BundleRef],
            build: Callable[[], Derived]) -> Derived:
        """The job's :class:`Derived`: the kept one when ``events``, ``points`` and ``listing`` are what it
        was derived from, else ``build()``'s (then kept)."""
        newest = next((r.key for r in listing if r.published), None)
        with self._lock:
            entry = self._entries.get(job_id)
        if entry is not None and _same(entry, events, points, newest):
            return entry.derived
        derived = build()
        with self._lock:
            self._entries[job_id] = _Entry(list(events), points.final, points.log, newest, derived)
        return derived


def _same(entry: _Entry, events: Events, points: Points, newest: str | None) -> bool:
    return (entry.final is points.final and entry.log is points.log and entry.newest == newest
            and len(entry.events) == len(events) and all(a is b for a, b in zip(entry.events, events, strict=True)))
