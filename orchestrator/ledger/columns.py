"""A job's metric points as columns: what history, goodput and the dashboard read a week's million of.

A week's job writes a million points per metric, twice over (the SQLite sink's final view and the
JSONL write log). As :class:`~spotrun.trainer.metrics.MetricPoint` models they cost seconds to build
and to walk; as numpy columns the readers in :mod:`.points` fill them in a C pass, and the figures
(how far each attempt got, when it wrote each update, which writes a replay replaced) are array
operations. :class:`PointColumns` is still a ``Sequence[MetricPoint]``: indexing or iterating it
builds the models one at a time, for the callers that want them (the metrics API, tests).

Times are integer microseconds since the Unix epoch, UTC (a time written without a zone is read as
UTC); a difference divided by 10^6 is the same float ``timedelta.total_seconds()`` gives.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import cached_property
from typing import overload

import numpy as np
import numpy.typing as npt

from spotrun.trainer.metrics import MetricPoint

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
Ints = npt.NDArray[np.int64]
Floats = npt.NDArray[np.float64]


def to_us(at: datetime) -> int:
    """``at`` as microseconds since the epoch (naive: read as UTC), exactly."""
    at = at if at.tzinfo is not None else at.replace(tzinfo=UTC)
    return (at - EPOCH) // timedelta(microseconds=1)


def from_us(us: int) -> datetime:
    """The UTC time ``us`` microseconds after the epoch."""
    return EPOCH + timedelta(microseconds=int(us))


@dataclass(frozen=True, eq=False)
class PointColumns(Sequence[MetricPoint]):
    """One job's points, row ``i`` across the columns: ``update``, ``value``, ``attempt``, ``at_us``
    (microseconds, UTC), ``name`` and ``lineage`` (codes into ``names`` and ``lineages``). The row
    order is the caller's (the final view: by update, then name; the log: as written). Read-only."""

    job_id: str
    update: Ints
    value: Floats
    attempt: Ints
    at_us: Ints
    name: Ints
    names: tuple[str, ...]
    lineage: Ints
    lineages: tuple[str, ...]

    @classmethod
    def empty(cls, job_id: str) -> PointColumns:
        z = np.zeros(0, dtype=np.int64)
        return cls(job_id, z, np.zeros(0, dtype=np.float64), z, z, z, (), z, ())

    @classmethod
    def of(cls, points: Sequence[MetricPoint], job_id: str | None = None) -> PointColumns:
        """``points`` (models, in their order) as columns; ``job_id`` when there are none to name it."""
        if isinstance(points, PointColumns):
            return points
        if not points:
            return cls.empty(job_id or "")
        names: dict[str, int] = {}
        lineages: dict[str, int] = {}
        n = len(points)
        return cls(
            job_id or points[0].job_id,
            np.fromiter((p.update for p in points), np.int64, n),
            np.fromiter((p.value for p in points), np.float64, n),
            np.fromiter((p.attempt for p in points), np.int64, n),
            np.fromiter((to_us(p.at) for p in points), np.int64, n),
            np.fromiter((names.setdefault(p.name, len(names)) for p in points), np.int64, n),
            tuple(names),
            np.fromiter((lineages.setdefault(p.lineage_id, len(lineages)) for p in points), np.int64, n),
            tuple(lineages))

    def __len__(self) -> int:
        return len(self.update)

    @overload
    def __getitem__(self, i: int) -> MetricPoint: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[MetricPoint]: ...

    def __getitem__(self, i: int | slice) -> MetricPoint | Sequence[MetricPoint]:
        if isinstance(i, slice):
            return self.take(np.arange(len(self))[i])
        return MetricPoint(job_id=self.job_id, update=int(self.update[i]), name=self.names[self.name[i]],
                           value=float(self.value[i]), attempt=int(self.attempt[i]),
                           lineage_id=self.lineages[self.lineage[i]], at=from_us(self.at_us[i]))

    def __iter__(self) -> Iterator[MetricPoint]:
        return (self[i] for i in range(len(self)))

    def __eq__(self, other: object) -> bool:
        """Equal to any sequence of the same points in the same order (a list of models included)."""
        if not isinstance(other, Sequence) or isinstance(other, str | bytes):
            return NotImplemented
        return len(self) == len(other) and list(self) == list(other)

    def take(self, rows: npt.NDArray[np.intp] | npt.NDArray[np.bool_]) -> PointColumns:
        """The rows ``rows`` (indices or a mask), in that order."""
        return PointColumns(self.job_id, self.update[rows], self.value[rows], self.attempt[rows], self.at_us[rows],
                            self.name[rows], self.names, self.lineage[rows], self.lineages)

    def named(self, name: str) -> PointColumns:
        """The rows of metric ``name``, in order (none when it was never written)."""
        if name not in self.names:
            return self.take(np.zeros(0, dtype=np.intp))
        if self.names == (name,):  # every row is of the one metric: no copy of a million rows
            return self
        return self.take(self.name == self.names.index(name))

    def max_update(self) -> int:
        """The furthest update of any row (0: none)."""
        return int(self.update.max()) if len(self) else 0

    def by_attempt(self) -> dict[int, tuple[Ints, Ints]]:
        """Per attempt: its updates, ascending and once each, and when each was written (the latest of
        the update's rows). What goodput and the views read of a week's million points; computed once
        (the columns never change). Updates must be below 2^40 and not negative."""
        return self._by_attempt

    @cached_property
    def _by_attempt(self) -> dict[int, tuple[Ints, Ints]]:
        if not len(self):
            return {}
        # one int64 key per row, sorted stably: rows come in update or write order, nearly sorted already
        key = self.attempt * (1 << 40) + self.update
        order = np.argsort(key, kind="stable")
        key, at = key[order], self.at_us[order]
        starts = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
        latest = np.maximum.reduceat(at, starts)
        keys = key[starts]
        attempts, updates = keys >> 40, keys & ((1 << 40) - 1)
        bounds = np.flatnonzero(np.r_[True, attempts[1:] != attempts[:-1], True])
        return {int(attempts[a]): (updates[a:b], latest[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)}

    def last_write_by_attempt(self) -> dict[int, int]:
        """Per attempt: the latest time (microseconds) any of its rows was written."""
        return {a: int(at.max()) for a, (_, at) in self.by_attempt().items()}

    def max_update_by_attempt(self) -> dict[int, int]:
        """Per attempt: the furthest update any of its rows reached."""
        return {a: int(u[-1]) for a, (u, _) in self.by_attempt().items()}


def concat(parts: Sequence[PointColumns], job_id: str) -> PointColumns:
    """``parts`` one after the other (their name and lineage codes mapped onto one table each)."""
    parts = [p for p in parts if len(p)]
    if not parts:
        return PointColumns.empty(job_id)
    if len(parts) == 1:
        return parts[0]
    names = tuple(dict.fromkeys(n for p in parts for n in p.names))
    lineages = tuple(dict.fromkeys(n for p in parts for n in p.lineages))

    def recode(codes: Ints, own: tuple[str, ...], table: tuple[str, ...]) -> Ints:
        return np.array([table.index(x) for x in own], dtype=np.int64)[codes] if own else codes

    return PointColumns(job_id, np.concatenate([p.update for p in parts]), np.concatenate([p.value for p in parts]),
                        np.concatenate([p.attempt for p in parts]), np.concatenate([p.at_us for p in parts]),
                        np.concatenate([recode(p.name, p.names, names) for p in parts]), names,
                        np.concatenate([recode(p.lineage, p.lineages, lineages) for p in parts]), lineages)
