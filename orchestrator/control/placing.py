"""Placing an attempt and restoring its state: the ``Placing`` transition (runs in the driver).

Placing asks the topology policy (orchestrator/policy/topology.py) what world to start with, waits
for capacity or fails when it does not come, builds the attempt's worker group, and restores the
newest bundle that verifies (or another job's bundle for ``--init-from``; or nothing: a fresh start).
A rank lost or failing before the attempt trained places the attempt again within the restart budgets;
bad input fails the job at once. Also here: recording a restore (:meth:`Placer.restored`), which a
warm restart shares.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import replace

from spotrun.orchestrator.control.context import RunContext
from spotrun.orchestrator.control.states import Failed, Placing, Recovering, Running, State
from spotrun.orchestrator.policy import topology as policy
from spotrun.orchestrator.policy.recovery import Loss, LossCause, RecoveryPath
from spotrun.orchestrator.workers.groups import CapacityUnavailable, RankFailed, RankLost, WorkerGroup
from spotrun.trainer.bundle.bundles import first_that_loads, list_bundles, read_manifest
from spotrun.trainer.bundle.errors import BundleCorrupt, BundleIncompatible
from spotrun.trainer.bundle.manifest import Manifest, UnknownSchemaError, runtime_differences
from spotrun.trainer.observe.faults import FaultInjector, FaultLog
from spotrun.trainer.storage import StoragePermanentError, StorageUnavailableError
from spotrun.trainer.storage.outage import Outage

log = logging.getLogger("spotrun.supervisor")
CAPACITY_POLL_S = 0.25

# The label of a restore whose state the restore oracle found different from its bundle (not strict).
UNVERIFIED = "unverified"


class OracleMismatch(BundleCorrupt):
    """Right after a restore, the state differed from the bundle (strict refuses it; older ones may serve)."""


def with_budget(error: RankFailed, verdict: str) -> RankFailed:
    """The job's last error, saying why it was not restarted again (raised by ``run()``)."""
    out = RankFailed(f"{error} (not restarted: {verdict})", error.rank, error.collective, error.refusal,
                     error.raised)
    out.__cause__ = error
    return out


REFUSED = (StorageUnavailableError, StoragePermanentError)  # a request refused: an outage until proven otherwise


class Placer:
    """Carries out ``Placing``: a new attempt, placed and restored, or a wait, or the end of the job."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.outage = Outage("placing an attempt", ctx.spec.storage_outage_s, clock=ctx.clock)

    def place(self, st: Placing) -> State:
        """Place and restore the next attempt (or wait for room, or fail). A restart during a storage outage
        (a listing, the visibility probe or a rank's read refused) waits for storage with capped backoff and
        places again: it never fails for it, unless a permanent-looking refusal lasts ``storage_outage_s``."""
        try:
            nxt = self._place(st)
        except REFUSED as e:
            return self._storage_down(st, e)
        self.outage.recovered()
        return nxt

    def _storage_down(self, st: Placing, e: StorageUnavailableError | StoragePermanentError) -> Placing:
        """Storage refused a request while placing: wait the outage's backoff, then place again."""
        self.outage.failed(e)  # a permanent refusal that has persisted past storage_outage_s is raised here
        wait = self.outage.until_due_s()
        log.warning("storage unavailable while placing attempt %d (%s): trying again in %.1f s (down %.0f s)",
                    self.ctx.attempts, e, wait, self.outage.down_s())
        self.ctx.sleep(wait)
        return st

    def _place(self, st: Placing) -> State:
        ctx, spec = self.ctx, self.ctx.spec
        ctx.platform.request_capacity(spec.max_world)
        available = ctx.platform.capacity() if st.below is None else min(ctx.platform.capacity(), st.below)
        decision = policy.decide(spec, available, st.waited_s)
        if decision.action == "raise":
            self._capacity_event(st, decision.world_size or 0, "timed-out")
            return Failed(decision.reason)
        if decision.action == "wait":
            log.info("waiting for capacity: %s", decision.reason)
            t0 = ctx.clock()
            ctx.sleep(CAPACITY_POLL_S)
            return replace(st, waited_s=st.waited_s + ctx.clock() - t0, below=None)
        size = decision.world_size
        if size is None:  # policy.decide gives a world size with every restart
            raise RuntimeError(f"the placement policy restarts without a world size: {decision}")
        if st.waited_s:
            self._capacity_event(st, size, "placed")
        ctx.attempts = ctx.ledger.next_attempt()
        ctx.publisher.begin_attempt(ctx.attempts, size)
        ctx.faults = FaultInjector(spec.faults, ctx.attempts, rank=0, log=FaultLog(ctx.storage, spec.job_id))
        candidates = [r.key for r in list_bundles(ctx.storage, spec.job_id) if r.published]
        resuming = bool(candidates)
        label = policy.recovery_label(spec, st.world_before, size) if resuming else (
            "new-experiment" if ctx.options.init_from else "fresh")
        ctx.lineage_id = read_manifest(ctx.storage, candidates[0]).lineage_id if resuming else uuid.uuid4().hex[:12]
        t0 = ctx.clock()
        try:
            group = ctx.platform.make_group(size, ctx.attempts, ctx.lineage_id, label, policy.restore_mode(spec))
        except CapacityUnavailable as e:
            # The time spent trying counts toward world.capacity_timeout_s; the next try is smaller
            # where the policy allows one (strict allows none: it waits, then fails).
            log.info("placement failed: %s", e)
            return replace(st, waited_s=st.waited_s + max(ctx.clock() - t0, CAPACITY_POLL_S), below=size - 1)
        except ValueError as e:  # bad input refused in this process (JobError, DeviceError, ...)
            return Failed(str(e), e, refused=True)
        except RankFailed as e:  # a rank could not be built
            return self._start_failed(st, e)
        except RankLost as e:
            return self._start_lost(st, e)
        ctx.noticed = set()
        try:
            restored = self._restore(group, candidates, st, size, label)
        except REFUSED:
            group.teardown()  # placed again once storage answers (place)
            raise
        except (BundleIncompatible, UnknownSchemaError, BundleCorrupt, ValueError) as e:
            group.teardown()
            return Failed(str(e), e, refused=True)
        except RankFailed as e:  # the job's load_state_dict raised
            group.teardown()
            return self._start_failed(st, e)
        except RankLost as e:
            return Recovering(group, ctx.attempts, size, st.last_update or 0, e)
        group.start()
        return Running(group, ctx.attempts, size, restored)

    def _start_failed(self, st: Placing, e: RankFailed) -> State:
        """A rank raised before the attempt trained: bad input fails the job now, storage refusing it waits
        for storage (:meth:`_storage_down`), anything else is a failure placed again within the budgets
        (:meth:`_start_lost`)."""
        if e.refusal:
            return Failed(str(e), e, refused=True)
        if isinstance(e.raised, REFUSED):  # the rank met an outage (its probe or restore read): wait for it
            return self._storage_down(st, e.raised)
        return self._start_lost(st, RankLost(e.rank, LossCause.START_FAILED, str(e)), e)

    def _start_lost(self, st: Placing, lost: RankLost, error: RankFailed | None = None) -> State:
        """A rank was lost, or could not start, before the attempt trained: nothing ran, so the attempt
        is placed again under the same number, within the restart budgets (a node that keeps dying,
        or an import that keeps failing, must not loop forever). No ``worker_lost`` is recorded (the
        ledger has no attempt it ended); the next attempt's ``budget`` counts it."""
        ctx = self.ctx
        log.warning("a rank was lost while starting attempt %d (%s): %s", ctx.attempts, lost.cause, lost.detail)
        verdict = ctx.budgets.count(Loss(lost.cause, lost.rank).loss_class)
        if verdict is not None:
            return Failed(f"{verdict}; the last, while starting attempt {ctx.attempts}: {lost.detail}",
                          None if error is None else with_budget(error, verdict))
        ctx.sleep(ctx.budgets.backoff())
        return replace(st, below=None)

    def _restore(self, group: WorkerGroup, candidates: list[str], st: Placing, size: int, label: str) -> int:
        """Start the attempt from the newest bundle that verifies; returns its update (0 when fresh).

        The attempt is recorded as started only once its state is loaded: a refused restore
        leaves the job as it was, with the refusal (and any rejected bundle) in the ledger."""
        ctx = self.ctx
        ctx.attempt_bundle = None
        if not candidates and ctx.options.init_from:
            uri, init_key = ctx.options.init_from
            ctx.attempt_bundle = f"{uri}/{init_key}"
            seconds, _ = group.restore(init_key, storage_uri=uri, reset=ctx.options.reset)
            self.started(group, size)
            ctx.record.initialized_from(ctx.attempts, f"{uri}/{init_key}", ctx.options.reset)
            log.info("new lineage %s from %s in %.3fs", ctx.lineage_id, init_key, seconds)
            return 0
        t0 = ctx.clock()
        key, result, _ = first_that_loads(candidates, lambda key: self._checked_restore(group, key),
                                          on_reject=lambda r: ctx.record.bundle_rejected(ctx.attempts, r.bundle_key,
                                                                                         r.reason))
        restore_wall = ctx.clock() - t0
        self.started(group, size)
        if key is None or result is None:  # result is None only when key is: nothing to restore
            return 0
        seconds, mismatches = result
        return self.restored(group, key, read_manifest(ctx.storage, key), seconds, mismatches, restore_wall,
                             label, st.cause, st.last_update, st.world_before, size, "cold", st.cold_because)

    def started(self, group: WorkerGroup, size: int) -> None:
        """The attempt's state is loaded: from now on, a refusal is a failure of this run."""
        ctx = self.ctx
        ctx.began = True
        ctx.record.attempt_started(ctx.attempts, size, group, ctx.lineage_id, ctx.budgets.record())

    def restored(self, group: WorkerGroup, key: str, manifest: Manifest, seconds: float, mismatches: list[str],
                 wall: float, label: str, cause: str | None, last_update: int | None, world_before: int | None,
                 size: int, path: RecoveryPath, cold_because: str | None) -> int:
        """Record the attempt's restore of bundle ``key`` (the ``Restored`` event) and recommit its
        offsets; returns the bundle's update."""
        ctx = self.ctx
        if label == "exact" and any(runtime_differences(manifest.versions, r) for r in group.runtimes):
            # elastic on another device model or library build (strict ranks refuse that restore)
            label = "exact-data"
        if mismatches:  # not strict (strict refused the bundle), or a deliberately broken build
            log.warning("restore oracle: state differs from bundle %s right after restore: %s", key, mismatches)
            label = UNVERIFIED
        ctx.record.restored(ctx.attempts, key, manifest, label, seconds, mismatches, wall, cause, last_update,
                            world_before, size, path, cold_because)
        ctx.restored_from = ctx.restored_from or key
        ctx.attempt_bundle = key
        ctx.publisher.commit_offsets(manifest, key, ctx.attempts, recommit=True)
        ctx.publisher.commit_points(manifest, key)
        return manifest.counters.attempted_updates

    def _checked_restore(self, group: WorkerGroup, key: str) -> tuple[float, list[str]]:
        """``group.restore(key)``, then the restore oracle acts on what it found: under ``strict`` a
        difference refuses the bundle (:class:`OracleMismatch`: the next older one is tried); otherwise
        the restore goes on and is labelled ``unverified``. A deliberately broken build (``verify
        --mutate``) only records the findings, so that its run goes on and verify's comparison of the
        whole run is proven as well."""
        seconds, mismatches = group.restore(key)
        if mismatches and self.ctx.options.oracle_acts and self.ctx.spec.world.policy == "strict":
            raise OracleMismatch(
                f"bundle {key}: right after the restore, the state differs from the bundle in {', '.join(mismatches)} "
                "(the restore oracle); world.policy=strict restores only a state that equals its bundle, so this "
                "bundle is refused. The job's code does not put that state back as it saved it: check the "
                "load_state_dict of what the categories name (spotrun verify CONFIG shows where a run diverges)")
        return seconds, mismatches

    def _capacity_event(self, st: Placing, size: int, outcome: str) -> None:
        ctx = self.ctx
        ctx.record.capacity_wait(max(ctx.attempts, 1), size or min(ctx.spec.allowed_world_sizes()),
                                 ctx.platform.capacity(), st.waited_s, outcome)
