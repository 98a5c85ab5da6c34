"""Storage outages as the driver saw them: one ``storage_outage`` event per outage (runs in the driver).

Every storage path rides an outage out on its own (:mod:`spotrun.trainer.storage.outage`): the driver's
ledger, publisher and placer (a cold restart waiting for storage), and each rank's checkpoint writes,
which every rank's poll report carries. At each
look at the running attempt the supervisor hands :class:`Outages` the reports; :class:`OutageTracker`
folds what the paths say into one outage: open from the first look at which a path is down or refused
since the look before, over at the first look at which every path answers. Only then is it recorded:
the ledger lives in the same storage, and what it could not write would wait in memory anyway.

Its span is as the paths saw it: it began when the first of them went down and ended when the last
answered again (each path says how long ago; one that cannot, at the look before and at the look). A
path answers again only once it tries (the publisher tries when a bundle is complete, the ledger when
an event is appended), so the end is its first try that succeeded. An outage that ends the job (a permanent refusal that
persisted ``storage_outage_s``) raises before any look sees it end: it is never recorded as ended.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from spotrun.orchestrator.control.context import RunContext
from spotrun.orchestrator.control.recorder import OutageSeen
from spotrun.orchestrator.control.states import Running
from spotrun.trainer.bundle.bundles import BUNDLE_DIR
from spotrun.trainer.run.rank import Report
from spotrun.trainer.storage.outage import Outage, OutageView


@dataclass(frozen=True)
class PathSeen:
    """One storage path at a look: its name in the event, what its cumulative counts are kept by (a
    rank's per attempt: a new attempt's rank counts from zero), its state, and (a rank's) the checkpoints
    it has skipped so far."""

    name: str
    key: str
    view: OutageView
    attempt: int = 0  # a rank's attempt (0: a driver path)
    skipped: int = 0


@dataclass
class _Open:
    """The outage being seen: everything its event will say but its end."""

    began: datetime
    attempt: int
    first_error: str
    newest: tuple[str, int] | None
    paths: list[str] = field(default_factory=list)  # in the order they met it
    refused: int = 0
    skipped: dict[tuple[int, str], int] = field(default_factory=lambda: defaultdict(int))  # (attempt, rank key)
    full_disk: bool = False


class OutageTracker:
    """Folds the paths' states at successive looks into outages (see the module docstring). Plain values
    in, an :class:`OutageSeen` out once one ended: no storage, no clock of its own."""

    def __init__(self) -> None:
        self._counts: dict[str, tuple[int, int]] = {}  # path key -> (refused_total, skipped) at the last look
        self._last_look: datetime | None = None
        self._open: _Open | None = None

    @property
    def open(self) -> bool:
        """Whether an outage is being seen (begun, not yet over)."""
        return self._open is not None

    def look(self, now: datetime, attempt: int, update: int, newest: tuple[str, int] | None,
             paths: list[PathSeen], final: bool = False) -> OutageSeen | None:
        """Take the paths' states at ``now`` (the attempt running, the update it reached, the newest
        published bundle and its update); the outage once every path answers again, else None. ``final``:
        the job's last look (every rank finished, its last bundle published): an outage still open ends
        here, a path still marked down counted as answering now. Such a path has not tried since (the
        ledger tries only when an event is appended) and, the job over, never would: without this the
        outage would go unrecorded."""
        before, self._last_look = self._last_look, now
        for p in paths:
            refused0, skipped0 = self._counts.get(p.key, (0, 0))
            self._counts[p.key] = (p.view.refused_total, p.skipped)
            refused, skipped = p.view.refused_total - refused0, p.skipped - skipped0
            if p.view.down_s is None and refused <= 0:
                continue
            began = _began(p.view, now, before)
            o = self._open
            if o is None:
                o = self._open = _Open(began, attempt, p.view.first_error or "", newest)
            elif began < o.began:  # a path seen later that went down earlier: the outage began then
                o.began, o.first_error = began, p.view.first_error or o.first_error
            if p.name not in o.paths:
                o.paths.append(p.name)
            o.refused += max(refused, 0)
            if p.attempt:
                o.skipped[(p.attempt, p.key)] += max(skipped, 0)
            o.full_disk = o.full_disk or p.view.full_disk
        o = self._open
        if o is None:
            return None
        if any(p.view.down_s is not None for p in paths) and not final:
            o.newest = newest  # the newest published while it lasts
            return None
        self._open = None
        # when the last of its paths answered (each says how long ago; this look where one cannot say)
        ended = max((now if p.view.ended_s is None else now - timedelta(seconds=p.view.ended_s)
                     for p in paths if p.name in o.paths), default=now)
        return OutageSeen(attempt=o.attempt, began_at=o.began, ended_at=max(ended, o.began),
                          first_error=o.first_error, paths=o.paths, requests_refused=o.refused,
                          bundles_skipped=_skipped(o.skipped), newest_bundle=o.newest[0] if o.newest else None,
                          newest_update=o.newest[1] if o.newest else None, update_at_end=update,
                          full_disk=o.full_disk)


def _began(view: OutageView, now: datetime, before: datetime | None) -> datetime:
    """When a path's outage began: it says so while down, and of its last outage once it answers again;
    else (a path that cannot say) at the look before, the latest moment it was not yet known."""
    if view.down_s is not None:
        return now - timedelta(seconds=view.down_s)
    if view.ended_s is not None and view.lasted_s is not None:
        return now - timedelta(seconds=view.ended_s + view.lasted_s)
    return before or now


def _skipped(per_rank: dict[tuple[int, str], int]) -> int:
    """Checkpoints skipped: per attempt, the most any one rank skipped (each rank skips on its own view of
    the storage, so a boundary one rank skipped is lost even if its peers wrote: a lower bound), summed."""
    most: dict[int, int] = defaultdict(int)
    for (attempt, _), n in per_rank.items():
        most[attempt] = max(most[attempt], n)
    return sum(most.values())


class Outages:
    """The supervisor's part that records storage outages: called at every look at the running attempt."""

    def __init__(self, ctx: RunContext, placing: Outage | None = None,
                 now: Callable[[], datetime] = lambda: datetime.now(UTC)) -> None:
        """``placing``: the placer's path (a cold restart waiting for storage): seen at the next look."""
        self.ctx = ctx
        self.placing = placing
        self.now = now
        self.tracker = OutageTracker()

    def look(self, st: Running, reports: list[Report], final: bool = False) -> None:
        """Fold what the driver's paths and the ranks' ``reports`` say; record an outage that ended (at the
        job's ``final`` look, one still open: :meth:`OutageTracker.look`)."""
        ctx = self.ctx
        paths = [PathSeen("ledger", "ledger", ctx.ledger.outage.view()),
                 PathSeen("publisher", "publisher", ctx.publisher.outage.view())]
        if self.placing is not None:
            paths.append(PathSeen("placing", "placing", self.placing.view()))
        paths += [PathSeen(f"rank {r.rank} checkpoints", f"a{st.attempt}/rank {r.rank}", r.storage, st.attempt,
                           r.checkpoints_skipped) for r in reports if r.storage is not None]
        ended = self.tracker.look(self.now(), st.attempt, st.last_update, self._newest(), paths, final)
        if ended is not None:
            ctx.record.storage_outage(ended)

    def _newest(self) -> tuple[str, int] | None:
        """The newest published bundle and its update: this run's, else the one its attempt restored."""
        ctx = self.ctx
        m = ctx.published.newest
        if m is not None:
            return ctx.bundle_key(m), m.counters.attempted_updates
        key = ctx.attempt_bundle
        if key is None or not key.startswith(f"{ctx.spec.job_id}/bundles/"):  # fresh, or another job's (init-from)
            return None
        found = BUNDLE_DIR.match(key.rsplit("/", 1)[-1])
        return (key, int(found.group(1))) if found else None
