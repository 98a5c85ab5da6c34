"""The supervisor's ledger writer: every event the driver's state machine records (runs in the driver).

The transitions never build a ledger event: they tell this one listener what happened, and it writes
the event. What a transition implies by itself is derived here from the pair of states
(:meth:`Recorder.transition`: a restart into another world size is a ``topology_changed``; an end
state is a ``job_finished``, ``job_failed`` or ``run_refused``); what happens inside a transition
(a rank's restore, a notice weighed) is told through one method per event, at the moment it happens,
so the ledger's order is the order of the facts. Bundles and offsets are the publisher's to record.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from spotrun.orchestrator.control.states import End, Failed, Finished, Placing, Recovering, Running, State
from spotrun.orchestrator.ledger.events import (
    AttemptStarted,
    BundleRejected,
    CapacityWait,
    Footprints,
    InitializedFrom,
    IntervalChosen,
    JobFailed,
    JobFinished,
    NoticeHandled,
    NoticeSeen,
    Resizing,
    Restored,
    RunRefused,
    Slowdowns,
    SpacePruned,
    SparesReady,
    StorageOutage,
    StragglerReplacing,
    TopologyChanged,
    WorkerLost,
)
from spotrun.orchestrator.ledger.store import Ledger
from spotrun.orchestrator.notices.notice import Notice
from spotrun.orchestrator.policy import topology as policy
from spotrun.orchestrator.policy.budgets import Budget
from spotrun.orchestrator.policy.interval import IntervalDecision, IntervalInputs
from spotrun.orchestrator.policy.recovery import LossClass, RecoveryPath
from spotrun.orchestrator.publish.publisher import Pruned
from spotrun.orchestrator.workers.groups import RankLost, WorkerGroup
from spotrun.trainer.bundle.manifest import Manifest
from spotrun.trainer.job.spec import JobSpec
from spotrun.trainer.observe.footprint import Footprint


@dataclass(frozen=True)
class OutageSeen:
    """An outage that ended, as the driver saw it: what its ``storage_outage`` event says (see
    :class:`~spotrun.orchestrator.ledger.events.StorageOutage` for each field)."""

    attempt: int
    began_at: datetime
    ended_at: datetime
    first_error: str
    paths: list[str]
    requests_refused: int
    bundles_skipped: int
    newest_bundle: str | None
    newest_update: int | None
    update_at_end: int
    full_disk: bool


class Recorder:
    """Turns the supervisor's transitions and the facts inside them into ledger events."""

    def __init__(self, ledger: Ledger, spec: JobSpec) -> None:
        self.ledger = ledger
        self.spec = spec

    # -- derived from a transition ------------------------------------------------------------

    def transition(self, before: State, after: State) -> None:
        """What a step from ``before`` to ``after`` records by itself: a restart (cold or warm) into a
        world of another size than the lost attempt's."""
        if isinstance(after, Running) and isinstance(before, Placing | Recovering):
            world_before = before.world_before if isinstance(before, Placing) else before.world_size
            if world_before is not None and world_before != after.world_size:
                self.ledger.append(TopologyChanged(attempt=after.attempt, world_size_before=world_before,
                                                   world_size_after=after.world_size,
                                                   accum_steps_after=self.spec.accum_steps_for(after.world_size)))

    def ended(self, end: End, attempts: int, began: bool, storage_retries: int) -> None:
        """The run's last event: finished, failed, or refused (bad input before this run trained)."""
        if isinstance(end, Failed):
            if end.refused and not began:
                self.ledger.append(RunRefused(attempt=max(attempts, 1), check="start", reason=end.reason))
            else:
                self.ledger.append(JobFailed(attempt=max(attempts, 1), reason=end.reason))
        elif isinstance(end, Finished):
            self.ledger.append(JobFinished(attempt=attempts, counters=end.counters, storage_retries=storage_retries))

    # -- placing and restoring ----------------------------------------------------------------

    def capacity_wait(self, attempt: int, needed: int, available: int, waited_s: float, outcome: str) -> None:
        self.ledger.append(CapacityWait(attempt=attempt, needed=needed, available=available, waited_seconds=waited_s,
                                        outcome=outcome))

    def attempt_started(self, attempt: int, size: int, group: WorkerGroup, lineage_id: str | None,
                        budget: Budget) -> None:
        self.ledger.append(AttemptStarted(attempt=attempt, world_size=size, node_ids=group.node_ids,
                                          rank_pids=group.pids(), pid=os.getpid(), lineage_id=lineage_id,
                                          budget=budget, **group.timings))

    def initialized_from(self, attempt: int, bundle: str, reset: tuple[str, ...]) -> None:
        self.ledger.append(InitializedFrom(attempt=attempt, bundle=bundle, reset=list(reset)))

    def bundle_rejected(self, attempt: int, bundle: str, reason: str) -> None:
        self.ledger.append(BundleRejected(attempt=attempt, bundle=bundle, reason=reason))

    def restored(self, attempt: int, key: str, manifest: Manifest, label: str, seconds: float, mismatches: list[str],
                 wall: float, cause: str | None, last_update: int | None, world_before: int | None, size: int,
                 path: RecoveryPath, cold_because: str | None) -> None:
        update = manifest.counters.attempted_updates
        self.ledger.append(Restored(
            attempt=attempt, bundle=key, update=update, recovery_label=label,
            policy=self.spec.world.policy, restore_mode=policy.restore_mode(self.spec),
            restore_seconds=seconds, lost_updates=None if last_update is None else max(0, last_update - update),
            cause=cause or "resumed", roundtrip_mismatches=mismatches,
            repeated_occurrences=(manifest.data.repeats_on_restore
                                  if self.spec.data.recovery == "bounded-repetition" else 0),
            restore_wall_seconds=round(wall, 4),
            world_size_before=world_before if world_before is not None else manifest.world.size,
            world_size_after=size, recovery_path=path, cold_because=cold_because))

    # -- running ------------------------------------------------------------------------------

    def resizing(self, st: Running, target: int, reason: str) -> None:
        self.ledger.append(Resizing(attempt=st.attempt, world_size_before=st.world_size, world_size_target=target,
                                    reason=reason))

    def interval_chosen(self, attempt: int, reason: str, inputs: IntervalInputs, decision: IntervalDecision) -> None:
        self.ledger.append(IntervalChosen(attempt=attempt, reason=reason, inputs=inputs, decision=decision))

    def spares_ready(self, attempt: int, ready: int) -> None:
        self.ledger.append(SparesReady(attempt=attempt, ready=ready, wanted=self.spec.world.spares))

    def footprints(self, attempt: int, ranks: dict[int, Footprint]) -> None:
        self.ledger.append(Footprints(attempt=attempt, ranks=dict(sorted(ranks.items()))))

    def slowdowns(self, st: Running, slowdown: dict[int, float], stragglers: list[int]) -> None:
        w = self.spec.world
        self.ledger.append(Slowdowns(attempt=st.attempt, update=st.last_update, window=w.straggler_window,
                                     ratio=w.straggler_ratio, slowdown={r: round(x, 4) for r, x in slowdown.items()},
                                     stragglers=stragglers, node_ids=list(st.group.node_ids)))

    def straggler_replacing(self, st: Running, rank: int, slowdown: float) -> None:
        node_ids = st.group.node_ids
        self.ledger.append(StragglerReplacing(attempt=st.attempt, rank=rank, slowdown=round(slowdown, 4),
                                              node_id=node_ids[rank] if rank < len(node_ids) else None,
                                              update=st.last_update))

    def space_pruned(self, attempt: int, pruned: Pruned, reason: str) -> None:
        self.ledger.append(SpacePruned(attempt=attempt, bundles=pruned.bundles, freed_bytes=pruned.freed_bytes,
                                       reason=reason))

    def notice_seen(self, attempt: int, n: Notice, action: str, reason: str, remaining: float | None = None,
                    needed: float | None = None) -> None:
        self.ledger.append(NoticeSeen(attempt=attempt, source=n.source, node_id=n.node_id, rank=n.rank,
                                      deadline=n.deadline, action=action, reason=reason,
                                      remaining_seconds=remaining, needed_seconds=needed))

    def notice_handled(self, attempt: int, n: Notice, bundle: Manifest, seconds: float, early: bool = False,
                       acknowledged: str | None = None) -> None:
        self.ledger.append(NoticeHandled(attempt=attempt, source=n.source,
                                         bundle=f"{self.spec.job_id}/bundles/{bundle.bundle_id}",
                                         update=bundle.counters.attempted_updates,
                                         notice_to_publish_seconds=round(seconds, 3), early=early,
                                         acknowledged=acknowledged))

    def storage_outage(self, seen: OutageSeen) -> None:
        """An outage the driver saw end (orchestrator/control/outages.py): recorded once storage answers."""
        self.ledger.append(StorageOutage(**asdict(seen)))

    # -- recovering ---------------------------------------------------------------------------

    def worker_lost(self, st: Recovering, teardown_s: float, loss_class: LossClass, budget: Budget,
                    backoff_s: float | None) -> None:
        lost: RankLost = st.lost
        self.ledger.append(WorkerLost(attempt=st.attempt, rank=lost.rank, node_id=lost.node_id, cause=lost.cause,
                                      detail=lost.detail, last_update=st.last_update, detected_at=st.detected_at,
                                      teardown_seconds=round(teardown_s, 4), loss=loss_class, budget=budget,
                                      backoff_seconds=None if backoff_s is None else round(backoff_s, 4),
                                      **_evidence(lost)))


def _evidence(lost: RankLost) -> dict[str, Any]:
    """The ledger's fields for a hung or stuck rank's loss (none for any other)."""
    ev = lost.evidence
    if ev is None:
        return {}
    return {"signal": ev.signal, "stopped_phase": ev.phase, "stopped_update": ev.update, "stacks": ev.stacks_key,
            "host": ev.host}
