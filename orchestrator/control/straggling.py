"""Stragglers while an attempt runs: recorded, and with ``world.replace_stragglers`` replaced (runs in the driver).

A straggler keeps answering and progressing, only slower than its peers (orchestrator/policy/health.py:
its median own work per update over the last ``world.straggler_window`` updates is
``world.straggler_ratio`` times its peers'), and stays so at every look for a whole window more
updates. Every rank's figure is recorded (``slowdowns``) when the
attempt's first full window is in, when the set of stragglers changes, and otherwise at most every
:data:`RECORD_EVERY_S` while a figure moves; the dashboard's ``spotrun_rank_slowdown`` reads it.

With ``world.replace_stragglers`` and a ready spare, the slowest straggler is replaced: the ranks
checkpoint at the next boundary and stop (``straggler_replacing``), then the spare takes its place and
every rank restores that bundle from memory: a warm restart that loses nothing. It is chosen, not
suffered: no restart budget is used. Where the warm restart cannot be done, every rank restarts from
that bundle in storage.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

from spotrun.orchestrator.control.context import RunContext
from spotrun.orchestrator.control.recovering import Recovery
from spotrun.orchestrator.control.states import Placing, Recovering, Running, State
from spotrun.orchestrator.policy.health import Bounds, stragglers
from spotrun.orchestrator.policy.recovery import LossCause
from spotrun.orchestrator.workers.groups import RankLost, WarmGroup, WatchedGroup

log = logging.getLogger("spotrun.supervisor")
RECORD_EVERY_S = 300.0  # a week of one job: ~2,000 events at most, beside its ~40,000 others
MOVED = 0.1  # a figure that moved less than this since the last record is not recorded again


@dataclass
class _Recorded:
    """What the ledger last heard of one attempt's slowdowns, and when (the supervisor's clock)."""

    attempt: int
    at: float = 0.0
    slowdown: dict[int, float] = field(default_factory=dict)
    stragglers: list[int] = field(default_factory=list)


class Stragglers:
    """The stragglers of a run's attempts."""

    def __init__(self, ctx: RunContext, recovery: Recovery) -> None:
        self.ctx = ctx
        self.recovery = recovery
        w = ctx.spec.world
        self.bounds = Bounds(straggler_ratio=w.straggler_ratio, window=w.straggler_window)
        self._recorded: _Recorded | None = None
        self._over: tuple[int, dict[int, int]] = (0, {})  # (attempt, rank -> the update it went over the ratio at)
        self._no_spare_said = -1  # the attempt whose wait for a spare was logged

    def look(self, st: Running) -> Running:
        """Record the ranks' slowdowns when due; with ``world.replace_stragglers``, ask for the checkpoint
        after which a ready spare takes the slowest straggler's place (the attempt, now replacing)."""
        group = st.group
        if not isinstance(group, WatchedGroup):
            return st
        pace = group.paces()
        if not pace:
            return st
        slow = self._sustained(st, stragglers(pace, self.bounds))
        slowdown = {r: p.slowdown for r, p in pace.items()}
        self._record(st, slowdown, slow)
        if (not slow or not self.ctx.spec.world.replace_stragglers or st.draining is not None
                or st.growing is not None or st.replacing is not None or not isinstance(group, WarmGroup)):
            return st
        if group.spares_ready() < 1:
            if self._no_spare_said != st.attempt:
                self._no_spare_said = st.attempt
                log.info("rank %d is a straggler (%.2fx its peers); no spare is ready to replace it yet", slow[0],
                         slowdown[slow[0]])
            return st
        rank = slow[0]
        log.warning("rank %d is a straggler (%.2fx its peers over %d updates): a spare replaces it after the next "
                    "boundary", rank, slowdown[rank], self.bounds.window)
        self.ctx.record.straggler_replacing(st, rank, slowdown[rank])
        group.request(checkpoint=True, stop=True)
        return replace(st, replacing=rank)

    def replace(self, st: Running) -> State:
        """The ranks stopped after the bundle the replacement asked for: the spare takes the straggler's
        place from memory; where that cannot be done, every rank restarts from storage."""
        assert st.replacing is not None
        ctx, rank = self.ctx, st.replacing
        node = st.group.node_ids[rank] if rank < len(st.group.node_ids) else None
        newest = ctx.publisher.newest
        detail = f"replaced as a straggler after publishing {newest[0] if newest else 'nothing'}"
        lost = RankLost(rank, LossCause.STRAGGLER, detail, node)
        if newest is not None:
            warm = self.recovery.warm(Recovering(st.group, st.attempt, st.world_size, st.last_update, lost))
            if isinstance(warm, Running):
                return warm
            because = warm.reason
        else:  # the bundle was never published (storage was down): nothing in memory is known to be published
            because = "no bundle published since the driver started: the newest is in storage only"
        log.info("replacing the straggler from storage: %s", because)
        st.group.teardown()
        return Placing(cause=LossCause.STRAGGLER, last_update=st.last_update, world_before=st.world_size,
                       cold_because=because)

    def _sustained(self, st: Running, over: list[int]) -> list[int]:
        """The ranks of ``over`` (over the ratio at this look) that stayed over it at every look for a whole
        window more updates: one window's median swings by half under a loaded host (bench 14), two in a row
        do not."""
        attempt, since = self._over
        if attempt != st.attempt:
            since = {}
        since = {r: since.get(r, st.last_update) for r in over}
        self._over = (st.attempt, since)
        return [r for r in over if st.last_update - since[r] >= self.bounds.window]

    def _record(self, st: Running, slowdown: dict[int, float], slow: list[int]) -> None:
        last, now = self._recorded, self.ctx.clock()
        if last is not None and last.attempt == st.attempt and last.stragglers == slow:
            moved = max(abs(x - last.slowdown.get(r, 0.0)) for r, x in slowdown.items())
            if now - last.at < RECORD_EVERY_S or moved < MOVED:
                return
        self._recorded = _Recorded(st.attempt, now, dict(slowdown), list(slow))
        self.ctx.record.slowdowns(st, slowdown, slow)
