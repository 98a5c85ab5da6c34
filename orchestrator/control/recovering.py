"""Recovering from a lost rank: carrying out what the recovery policy decides (runs in the driver).

:func:`~spotrun.orchestrator.policy.recovery.plan_recovery` decides, from the loss, the budgets and
what the group can do: fail the job, restart warm, or restart cold. This module only carries that
out: it records the loss (``worker_lost``), waits the backoff, and either re-forms the group with the
survivors from the newest bundle in memory (:meth:`Recovery.warm`; the path is
:func:`~spotrun.orchestrator.policy.recovery.plan_warm`'s, inside the group) or hands the restart to
placing (cold). A warm restart that cannot be done says why (:class:`GoCold`) and goes cold.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from spotrun.orchestrator.control.context import RunContext
from spotrun.orchestrator.control.placing import Placer, with_budget
from spotrun.orchestrator.control.states import Failed, Placing, Recovering, Running, State
from spotrun.orchestrator.policy import topology as policy
from spotrun.orchestrator.policy.budgets import ErrorAt
from spotrun.orchestrator.policy.recovery import (
    Cold,
    Fail,
    GroupCan,
    Loss,
    LossCause,
    Warm,
    plan_recovery,
    warm_world,
)
from spotrun.orchestrator.workers.groups import RankFailed, RankLost, WarmGroup, WarmUnavailable
from spotrun.trainer.observe.faults import FaultInjector, FaultLog

log = logging.getLogger("spotrun.supervisor")


@dataclass(frozen=True)
class GoCold:
    """A warm restart could not be done; ``reason`` says why (the ledger's ``cold_because``)."""

    reason: str


class Recovery:
    """Carries out ``Recovering``: the job fails, or restarts warm (a new ``Running``) or cold (``Placing``)."""

    def __init__(self, ctx: RunContext, placer: Placer) -> None:
        self.ctx = ctx
        self.placer = placer
        self._spares_ready = 0  # as the ledger last recorded it

    def recover(self, st: Recovering) -> State:
        """Carry out what :func:`~spotrun.orchestrator.policy.recovery.plan_recovery` decides for this loss."""
        ctx, lost = self.ctx, st.lost
        loss = Loss(lost.cause, lost.rank, noticed=lost.node_id in ctx.noticed or lost.rank in ctx.noticed)
        # the job's own error (not a collective's), where the attempt was (the update it raised in)
        error = (ErrorAt(st.last_update + 1, ctx.attempt_bundle)
                 if st.error is not None and loss.kind is LossCause.ERROR and loss.loss_class == "failure" else None)
        verdict = ctx.budgets.count(loss.loss_class, st.last_update, error)
        newest = ctx.publisher.newest[0] if ctx.publisher.newest is not None else None
        decision = plan_recovery(loss, verdict, ctx.spec, newest,
                                 GroupCan(reform=isinstance(st.group, WarmGroup), world_size=st.world_size),
                                 ctx.budgets.losses_in_a_row, ctx.budgets.backoff)
        t0 = ctx.clock()
        if not isinstance(decision, Warm):
            st.group.teardown()
        teardown = ctx.clock() - t0
        backoff = None if isinstance(decision, Fail) else decision.backoff_s
        ctx.record.worker_lost(st, teardown, loss.loss_class, ctx.budgets.record(), backoff)
        ctx.restarts += 1
        log.warning("attempt %d lost rank %s on node %s (%s, a %s) at update %d: %s", st.attempt, lost.rank,
                    lost.node_id, lost.cause, loss.loss_class, st.last_update, lost.detail)
        if isinstance(decision, Fail):
            return Failed(f"{decision.reason}; the last: rank {lost.rank} {lost.cause}: {lost.detail}",
                          None if st.error is None else with_budget(st.error, decision.reason))
        ctx.sleep(decision.backoff_s)
        cold_because = decision.reason if isinstance(decision, Cold) else None
        if isinstance(decision, Warm):
            warm = self.warm(st)
            if isinstance(warm, Running):
                return warm
            cold_because = warm.reason
            log.info("restarting from storage: %s", warm.reason)
            st.group.teardown()
        return Placing(cause=lost.cause, last_update=st.last_update, world_before=st.world_size,
                       cold_because=cold_because)

    def warm(self, st: Recovering) -> Running | GoCold:
        """Restart from the newest published bundle with the surviving processes (and spares), from
        memory: the running attempt, or why it could not be done (the restart goes cold)."""
        ctx = self.ctx
        # plan_recovery saw to these: a bundle this driver published (so a lineage), one rank lost, a group
        # that re-forms
        assert ctx.publisher.newest is not None and st.lost.rank is not None and isinstance(st.group, WarmGroup)
        assert ctx.lineage_id is not None
        key, manifest, shipped_files = ctx.publisher.newest
        group = st.group
        world = warm_world(policy.decide(ctx.spec, ctx.platform.capacity(), 0.0), st.world_size)
        if isinstance(world, str):
            return GoCold(world)
        attempt = ctx.ledger.next_attempt()
        t0 = ctx.clock()
        try:
            done = group.reform({st.lost.rank}, key, manifest, shipped_files, [world], attempt, ctx.lineage_id,
                                lambda size: policy.recovery_label(ctx.spec, st.world_size, size))
        except WarmUnavailable as e:
            return GoCold(str(e))
        except (RankLost, RankFailed) as e:
            return GoCold(f"a rank was lost while restarting warm: {e}")
        if done.mismatches and ctx.options.oracle_acts and ctx.spec.world.policy == "strict":
            return GoCold(f"the restore oracle found {', '.join(done.mismatches)} after restoring {key} from memory")
        ctx.attempts, size = attempt, done.world_size
        ctx.publisher.begin_attempt(attempt, size)
        ctx.faults = FaultInjector(ctx.spec.faults, attempt, rank=0, log=FaultLog(ctx.storage, ctx.spec.job_id))
        ctx.noticed = set()
        self.placer.started(group, size)
        update = self.placer.restored(group, key, manifest, done.restore_seconds, done.mismatches, ctx.clock() - t0,
                                      done.label, st.lost.cause, st.last_update, st.world_size, size, done.path, None)
        log.info("attempt %d restarted warm (%s) from %s in %.3fs", attempt, done.path, key, ctx.clock() - t0)
        group.start()
        return Running(group, attempt, size, update)

    def count_spares(self, st: Running) -> None:
        """Record in the ledger each change in how many spares are ready."""
        if not self.ctx.spec.world.spares or not isinstance(st.group, WarmGroup):
            return
        ready = st.group.spares_ready()
        if ready != self._spares_ready:
            self._spares_ready = ready
            self.ctx.record.spares_ready(st.attempt, ready)
