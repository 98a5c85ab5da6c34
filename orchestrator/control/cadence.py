"""When a running attempt checkpoints and when it grows (runs in the driver).

Under ``checkpoint.every_updates: auto`` the driver chooses the interval (orchestrator/policy/interval.py)
from what the ledger has seen, and asks the ranks for each checkpoint once the interval has passed.
An elastic job below its largest world looks for room every ``world.grow_check_s``; when a larger
world fits, the ranks checkpoint at the next boundary and the job restarts with it (nothing is lost).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from datetime import UTC, datetime

from spotrun.orchestrator.control.context import RunContext
from spotrun.orchestrator.control.states import Running
from spotrun.orchestrator.ledger import interval_inputs
from spotrun.orchestrator.ledger.events import WorkerLost
from spotrun.orchestrator.policy import interval
from spotrun.orchestrator.policy import topology as policy
from spotrun.orchestrator.policy.interval import IntervalDecision
from spotrun.trainer.storage import StorageUnavailableError

log = logging.getLogger("spotrun.supervisor")
REDECIDE_AFTER_OUTAGE_S = 30.0  # a decision the ledger's outage prevented is tried again this soon


@dataclass
class CheckpointClock:
    """``checkpoint.every_updates: auto``: the interval in force, and when the next checkpoint is due."""

    attempt: int | None = None  # the attempt the clock runs for (a new one restarts it)
    decision: IntervalDecision | None = None
    decided_at: float = 0.0  # supervisor clock
    since: float = 0.0  # the attempt's start or the latest publication: the interval counts from there
    published: int = 0  # bundles published when the clock last looked
    requested: bool = False  # a checkpoint was asked for and is not published yet
    requested_at: float = 0.0  # supervisor clock


class Cadence:
    """The checkpoint clock under ``auto`` and the elastic job's look for room to grow."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.auto = CheckpointClock()
        self._grow_checked = ctx.clock()  # the first look for room comes world.grow_check_s after the start

    def consider_growing(self, st: Running) -> Running:
        """elastic below its largest size: every world.grow_check_s, look for room; when a larger
        world fits, checkpoint at the next boundary and restart with it (the attempt, now growing)."""
        ctx, spec = self.ctx, self.ctx.spec
        every = spec.world.grow_check_s
        if (spec.world.policy != "elastic" or not every or st.draining is not None or st.growing is not None
                or st.replacing is not None or ctx.clock() - self._grow_checked < every):
            return st
        self._grow_checked = ctx.clock()
        decision = policy.grow(spec, st.world_size, ctx.platform.capacity(), spec.train.updates - st.last_update,
                               self.interval_updates())
        if decision is None:
            return st
        target = decision.world_size
        if target is None:  # policy.grow gives a world size with every restart
            raise RuntimeError(f"the growth policy restarts without a world size: {decision}")
        if not ctx.platform.room_for(target - st.world_size):
            log.info("not growing: %s, but the scheduler cannot place %d more ranks now", decision.reason,
                     target - st.world_size)
            return st
        log.info("growing: %s", decision.reason)
        ctx.record.resizing(st, target, decision.reason)
        st.group.request(checkpoint=True, stop=True)
        return replace(st, growing=target)

    def tick(self, st: Running) -> None:
        """Under ``auto``: decide the interval when an attempt starts, once the first bundle measured
        the checkpoint cost, and every :data:`interval.REDECIDE_S`; ask the ranks for a checkpoint once
        the interval has passed since the attempt's start or the latest publication (one at a time)."""
        ctx = self.ctx
        if (ctx.spec.checkpoint.fixed_every is not None or st.draining is not None or st.growing is not None
                or st.replacing is not None):
            return
        c, now = self.auto, ctx.clock()
        if c.attempt != st.attempt:
            c.attempt, c.since, c.published, c.requested = st.attempt, now, len(ctx.published), False
            self._redecide(st, "start")
        if len(ctx.published) > c.published:
            c.since, c.published, c.requested = now, len(ctx.published), False
            if c.decision is not None and c.decision.checkpoint_cost_s is None:
                self._redecide(st, "measured")
        if now - c.decided_at >= interval.REDECIDE_S:
            self._redecide(st, "periodic")
        if c.requested and c.decision is not None and now - c.requested_at >= c.decision.interval_s:
            # asked an interval ago and nothing published: the ranks skipped it (storage was down, or the
            # write was abandoned) — ask again rather than go without a checkpoint until the job's end
            c.requested = False
        if c.decision is not None and not c.requested and now - c.since >= c.decision.interval_s:
            st.group.request(checkpoint=True)
            c.requested, c.requested_at = True, now

    def _redecide(self, st: Running, reason: str) -> None:
        """Choose the interval from the ledger; record it (a periodic one only when it moved)."""
        ctx = self.ctx
        try:
            events = ctx.ledger.read()
        except StorageUnavailableError as e:
            # storage is down: keep the interval in force (none yet: no checkpoint could be written anyway)
            # and decide again soon after it answers
            log.info("checkpoint interval not decided (%s): the ledger cannot be read: %s", reason, e)
            self.auto.decided_at = ctx.clock() - interval.REDECIDE_S + REDECIDE_AFTER_OUTAGE_S
            return
        if reason == "start" and any(isinstance(e, WorkerLost) and e.attempt == st.attempt - 1 for e in events):
            reason = "loss"
        inputs = interval_inputs.observe(events, ctx.spec.checkpoint, ctx.sec_per_update, st.attempt,
                                         datetime.now(UTC))
        decision = interval.decide(inputs)
        c = self.auto
        c.decided_at = ctx.clock()
        if reason == "periodic" and not interval.moved(c.decision, decision):
            return
        c.decision = decision
        ctx.record.interval_chosen(st.attempt, reason, inputs, decision)
        log.info("checkpoint interval %.1fs (%s updates; %s): checkpoint cost %s s, mean time between preemptions "
                 "that lose work %.0fs", decision.interval_s, decision.interval_updates or "?", reason,
                 decision.checkpoint_cost_s, decision.mtbp_losing_work_s)

    def interval_updates(self) -> int:
        """The checkpoint interval in updates: the fixed one, or auto's at the measured speed (1 before that)."""
        fixed = self.ctx.spec.checkpoint.fixed_every
        if fixed is not None:
            return fixed
        decision = self.auto.decision
        return (decision.interval_updates or 1) if decision is not None else 1
