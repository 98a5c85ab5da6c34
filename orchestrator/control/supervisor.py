"""The supervisor: the driver of one job, as an explicit state machine.

    Pending -> Placing -> Running -> Finished
                  ^          |
                  |          v
                  +---- Recovering              (any state) -> Failed

Each state is a small class carrying its payload; :meth:`Supervisor.step`
maps one state to the next, so a test can drive it one transition at a time.
The policy (orchestrator/policy/topology.py) decides what capacity to restart with and
why; every transition is appended to the ledger.

Checkpoints happen inside the ranks (trainer/run/rank.py); the supervisor only
publishes: it merges the ranks' write reports into a manifest, creates it
(the commit point), commits offsets, then runs retention. Under
``checkpoint.every_updates: auto`` it also chooses the interval
(orchestrator/policy/interval.py) and asks the ranks for each checkpoint.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta

from spotrun.orchestrator.control.progress import NullProgress, Progress, echo_rank_output
from spotrun.orchestrator.ledger import interval_inputs
from spotrun.orchestrator.ledger.events import (
    AttemptStarted,
    BundleRejected,
    CapacityWait,
    InitializedFrom,
    IntervalChosen,
    JobFailed,
    JobFinished,
    NoticeHandled,
    NoticeSeen,
    Resizing,
    Restored,
    RunRefused,
    SparesReady,
    TopologyChanged,
    WorkerLost,
)
from spotrun.orchestrator.ledger.history import history
from spotrun.orchestrator.ledger.store import Ledger
from spotrun.orchestrator.notices.clouds import CloudWatcher
from spotrun.orchestrator.notices.notice import Notice, install_signal_notices
from spotrun.orchestrator.policy import interval
from spotrun.orchestrator.policy import topology as policy
from spotrun.orchestrator.policy.budgets import ErrorAt, RestartBudgets
from spotrun.orchestrator.policy.interval import IntervalDecision
from spotrun.orchestrator.policy.recovery import (
    Cold,
    Fail,
    GroupCan,
    Loss,
    LossCause,
    RecoveryPath,
    Warm,
    notice_cause,
    plan_recovery,
)
from spotrun.orchestrator.publish.metric_commit import MetricCommitter
from spotrun.orchestrator.publish.offsets import OffsetsStore
from spotrun.orchestrator.publish.publisher import Publisher, PublishError
from spotrun.orchestrator.workers.groups import (
    CapacityUnavailable,
    RankFailed,
    RankLost,
    WarmGroup,
    WarmUnavailable,
    WorkerGroup,
)
from spotrun.trainer.bundle.bundles import (
    BundleCorrupt,
    BundleIncompatible,
    first_that_loads,
    list_bundles,
    read_manifest,
)
from spotrun.trainer.bundle.manifest import Manifest, UnknownSchemaError, runtime_differences
from spotrun.trainer.data.listing import open_source
from spotrun.trainer.data.planner import RestoreMode
from spotrun.trainer.job.spec import JobSpec
from spotrun.trainer.observe.faults import FaultInjector, FaultLog
from spotrun.trainer.observe.ranklog import RankLine
from spotrun.trainer.observe.trace import TraceWriter
from spotrun.trainer.run.rank import RankState
from spotrun.trainer.state.counters import Counters
from spotrun.trainer.storage import open_storage

log = logging.getLogger("spotrun.supervisor")
CAPACITY_POLL_S = 0.25

# make_group(world_size, attempt, lineage_id, recovery_label, restore_mode) -> a started-to-be group
GroupFactory = Callable[[int, int, str, str, RestoreMode], WorkerGroup]


class JobFailedError(RuntimeError):
    """The job cannot go on; the message says why and what to do."""


class OracleMismatch(BundleCorrupt):
    """Right after a restore, the state differed from the bundle (strict refuses it; older ones may serve)."""


# The label of a restore whose state the restore oracle found different from its bundle (not strict).
UNVERIFIED = "unverified"


# -- states ---------------------------------------------------------------------------------


@dataclass
class Pending:
    pass


@dataclass(frozen=True)
class Placing:
    cause: str | None = None  # why the previous attempt ended (None on the first)
    last_update: int | None = None  # the furthest update the previous attempt completed
    world_before: int | None = None
    waited_s: float = 0.0
    # the largest world to try: one below a size the scheduler just failed to place (resource
    # counts cannot see what other jobs hold); cleared once something is placed or waited for
    below: int | None = None
    cold_because: str | None = None  # after a loss: why the restart is not warm


@dataclass
class Running:
    group: WorkerGroup
    attempt: int
    world_size: int
    last_update: int
    draining: Notice | None = None  # a notice being acted on: checkpoint at the next boundary, then stop
    early: tuple[Notice, int] | None = None  # an early checkpoint asked for, and the update it was asked at
    growing: int | None = None  # elastic: the larger world to restart with after the next boundary
    progress_at: float | None = None  # clock when last_update last advanced


@dataclass
class Recovering:
    group: WorkerGroup
    attempt: int
    world_size: int
    last_update: int
    lost: RankLost
    detected_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    error: RankFailed | None = None  # the job's code raised (the loss is a failure): the job's last error


@dataclass
class Finished:
    counters: Counters


@dataclass
class Stopped:
    """The driver itself was told to go (SIGTERM): an emergency bundle is published, nothing restarts."""

    reason: str


@dataclass
class Failed:
    reason: str
    error: BaseException | None = None  # re-raised by run() after the ledger records the failure
    # bad input a rank or the driver refused while starting an attempt (a job that cannot be built, a
    # bundle it cannot take, storage the ranks cannot share): before this run trained, run() records a
    # run_refused, never a job_failed, so the job's recorded state stays what it was
    refused: bool = False


State = Pending | Placing | Running | Recovering | Finished | Stopped | Failed


@dataclass
class CheckpointClock:
    """``checkpoint.every_updates: auto``: the interval in force, and when the next checkpoint is due."""

    attempt: int | None = None  # the attempt the clock runs for (a new one restarts it)
    decision: IntervalDecision | None = None
    decided_at: float = 0.0  # supervisor clock
    since: float = 0.0  # the attempt's start or the latest publication: the interval counts from there
    published: int = 0  # bundles published when the clock last looked
    requested: bool = False  # a checkpoint was asked for and is not published yet


@dataclass
class Outcome:
    state: str
    counters: Counters | None
    attempts: int
    restarts: int
    reason: str = ""
    published: list[str] = field(default_factory=list)  # bundle keys, oldest first
    restored_from: str | None = None  # the bundle this run's first attempt resumed from


class Supervisor:
    def __init__(self, spec: JobSpec, make_group: GroupFactory, capacity: Callable[[], int], *,
                 trace_path: str | None = None, record_ids: bool = False,
                 init_from: tuple[str, str] | None = None, reset: tuple[str, ...] = (),
                 drain_source: Callable[[], set[str]] | None = None,
                 request_capacity: Callable[[int], None] = lambda ranks: None,
                 room_for: Callable[[int], bool] = lambda extra: True,
                 sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic,
                 progress: Progress | None = None, oracle_acts: bool = True,
                 echo: Callable[[list[RankLine]], None] = echo_rank_output, send_at_publish: bool = True) -> None:
        """``send_at_publish``: False only for verify --mutate's build that sends MLflow points as they are
        written (trainer/metrics/mlflow_sink.py)."""
        self.spec = spec
        self.echo = echo  # the lines the ranks' code wrote, each poll's (progress.echo_rank_output prints them)
        self.oracle_acts = oracle_acts  # False only for verify --mutate's deliberately broken build
        self.progress = progress or NullProgress()  # what the terminal shows (spotrun run)
        self.make_group = make_group
        self.capacity = capacity
        self.storage = open_storage(spec.storage, spec.storage_endpoint_url)
        self.ledger = Ledger(self.storage, spec.job_id, on_append=self.progress.event)
        self.trace = TraceWriter(trace_path, record_ids) if trace_path else None
        self.init_from = init_from  # (storage uri, bundle key) of another job's bundle
        self.reset = reset
        self.sleep = sleep
        self.clock = clock
        self.restarts = 0
        self.budgets = RestartBudgets(spec.world)
        self._noticed: set[str | int] = set()  # node ids and ranks of this attempt a notice was seen for
        self.attempts = 0
        self._began = False  # an attempt of this run has started (its state loaded): a refusal now is a failure
        self.lineage_id: str | None = None
        self.published: list[Manifest] = []
        self.restored_from: str | None = None
        self.attempt_bundle: str | None = None  # the bundle the current attempt started from (None: fresh)
        self._faults: FaultInjector | None = None
        self.notices: queue.Queue[Notice] = queue.Queue()  # the driver's own watchers and tests feed it
        self._woken = threading.Event()  # set with each notice: ends the wait between two polls
        self.drain_source = drain_source  # node ids Ray reports as draining
        # Ask an autoscaler for the largest allowed world while placing (a waiting supervisor that
        # asks for nothing would never see a scaled-to-zero spot pool grow); cleared at the end.
        self.request_capacity = request_capacity
        # Before an elastic job stops to grow: can this many more ranks really be placed now?
        self.room_for = room_for
        self._drain_checked = float("-inf")
        self._grow_checked = clock()  # the first look for room comes world.grow_check_s after the start
        self._seen_notices: set[tuple] = set()
        # cloud watchers of the driver's own machine (--no-ray): a notice to the driver is acknowledged there
        self.driver_watchers: list[CloudWatcher] = []
        self.sec_per_update: float | None = None  # measured, to judge whether a deadline leaves time
        self._rank_retries: dict[tuple[int, int], int] = {}  # (attempt, rank) -> storage retries
        self._auto = CheckpointClock()
        self._spares_ready = 0  # as the ledger last recorded it
        source = None
        if spec.data.order == "sequential":  # a streaming reader: its offsets also go under the source
            source = OffsetsStore(open_source(spec.data.shards, spec.storage_endpoint_url), spec.job_id,
                                  under_source=True)
        self._rows: list[dict] = []
        self._rows_at = -1  # the attempt count _rows were read at
        points = None
        if "mlflow" in spec.metrics.sinks and send_at_publish:
            points = MetricCommitter(self.storage, spec, restarts=self._restart_rows)
        self.publisher = Publisher(self.storage, self.ledger, spec.job_id, spec.checkpoint.keep_last,
                                   after_publish=self._after_publish,
                                   source_offsets=source, points=points)

    def _restart_rows(self) -> list[dict]:
        """History's restart rows (the MLflow run's restart tags), read again only once another attempt
        began: history reads the whole ledger and metric log, and a send comes at every publish."""
        if self._rows_at != self.attempts:
            self._rows = history(self.storage, self.spec.job_id,
                                 metrics_local_dir=self.spec.metrics.local_dir)["restarts"]
            self._rows_at = self.attempts
        return self._rows

    def _after_publish(self, update: int) -> None:
        """The after_publish fault site: the current attempt's injector, once there is one."""
        if self._faults is not None:
            self._faults.hit("after_publish", update)

    # -- driving --------------------------------------------------------------------------

    def run(self) -> Outcome:
        """Drive the job to its end. A failure is recorded in the ledger, then raised: the
        original typed error (``BundleIncompatible``, ...) or :class:`JobFailedError`."""
        state: State = Pending()
        restore_signals = self._watch_driver_signals()
        try:
            while not isinstance(state, Finished | Stopped | Failed):
                state = self.step(state)
        finally:
            restore_signals()
            self.publisher.close(finished=isinstance(state, Finished))
            self.progress.close()
            self.request_capacity(0)
            if self.trace:
                self.trace.close()
        if isinstance(state, Stopped):
            return Outcome("stopped", self.published[-1].counters if self.published else None, self.attempts,
                           self.restarts, state.reason, self._keys(), self.restored_from)
        if isinstance(state, Failed):
            if state.refused and not self._began:
                self.ledger.append(RunRefused(attempt=max(self.attempts, 1), check="start", reason=state.reason))
            else:
                self.ledger.append(JobFailed(attempt=max(self.attempts, 1), reason=state.reason))
            raise state.error if state.error is not None else JobFailedError(state.reason)
        self.ledger.append(JobFinished(attempt=self.attempts, counters=state.counters,
                                       storage_retries=self.publisher.storage_retries))
        return Outcome("finished", state.counters, self.attempts, self.restarts, published=self._keys(),
                       restored_from=self.restored_from)

    def notify(self, notice: Notice) -> None:
        """Hand the supervisor a notice, from any thread (its signal notices' thread and tests call
        this); never from a signal handler: the queue and the wake event take locks."""
        self.notices.put(notice)
        self._woken.set()

    def _watch_driver_signals(self) -> Callable[[], None]:
        """SIGTERM/SIGINT to the driver become notices; returns a function that restores the old handlers
        (and ends the thread that hands the notices on)."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        return install_signal_notices(None, None, self.spec.preemption.grace_s, self.notify).close

    def _keys(self) -> list[str]:
        return [f"{self.spec.job_id}/bundles/{m.bundle_id}" for m in self.published]

    def step(self, state: State) -> State:
        """One transition; an end state (Finished, Stopped, Failed) has none (KeyError)."""
        if type(state) is Pending:
            return self._pending(state)
        if type(state) is Placing:
            return self._placing(state)
        if type(state) is Running:
            return self._running(state)
        if type(state) is Recovering:
            return self._recovering(state)
        raise KeyError(type(state))

    # -- states -----------------------------------------------------------------------------

    def _pending(self, _: Pending) -> State:
        return Placing()

    def _candidates(self) -> list[str]:
        return [r.key for r in list_bundles(self.storage, self.spec.job_id) if r.published]

    def _placing(self, st: Placing) -> State:
        self.request_capacity(self.spec.max_world)
        available = self.capacity() if st.below is None else min(self.capacity(), st.below)
        decision = policy.decide(self.spec, available, st.waited_s)
        if decision.action == "raise":
            self._capacity_event(st, decision.world_size or 0, "timed-out")
            return Failed(decision.reason)
        if decision.action == "wait":
            log.info("waiting for capacity: %s", decision.reason)
            t0 = self.clock()
            self.sleep(CAPACITY_POLL_S)
            return replace(st, waited_s=st.waited_s + self.clock() - t0, below=None)
        size = decision.world_size
        if size is None:  # policy.decide gives a world size with every restart
            raise RuntimeError(f"the placement policy restarts without a world size: {decision}")
        if st.waited_s:
            self._capacity_event(st, size, "placed")
        self.attempts = self.ledger.next_attempt()
        self.publisher.begin_attempt(self.attempts, size)
        self._faults = FaultInjector(self.spec.faults, self.attempts, rank=0,
                                     log=FaultLog(self.storage, self.spec.job_id))
        candidates = self._candidates()
        resuming = bool(candidates)
        label = policy.recovery_label(self.spec, st.world_before, size) if resuming else (
            "new-experiment" if self.init_from else "fresh")
        lineage = read_manifest(self.storage, candidates[0]).lineage_id if resuming else uuid.uuid4().hex[:12]
        self.lineage_id = lineage
        t0 = self.clock()
        try:
            group = self.make_group(size, self.attempts, lineage, label, policy.restore_mode(self.spec))
        except CapacityUnavailable as e:
            # The time spent trying counts toward world.capacity_timeout_s; the next try is smaller
            # where the policy allows one (strict allows none: it waits, then fails).
            log.info("placement failed: %s", e)
            return replace(st, waited_s=st.waited_s + max(self.clock() - t0, CAPACITY_POLL_S), below=size - 1)
        except ValueError as e:  # bad input refused in this process (JobError, DeviceError, ...)
            return Failed(str(e), e, refused=True)
        except RankFailed as e:  # a rank could not be built
            return self._start_failed(st, e)
        except RankLost as e:
            return self._start_lost(st, e)
        self._noticed = set()
        try:
            restored = self._restore(group, candidates, st, size, label)
        except (BundleIncompatible, UnknownSchemaError, BundleCorrupt, ValueError) as e:
            group.teardown()
            return Failed(str(e), e, refused=True)
        except RankFailed as e:  # the job's load_state_dict raised
            group.teardown()
            return self._start_failed(st, e)
        except RankLost as e:
            return Recovering(group, self.attempts, size, st.last_update or 0, e)
        if st.world_before is not None and st.world_before != size:
            self.ledger.append(TopologyChanged(attempt=self.attempts, world_size_before=st.world_before,
                                               world_size_after=size,
                                               accum_steps_after=self.spec.accum_steps_for(size)))
        group.start()
        return Running(group, self.attempts, size, restored)

    def _start_failed(self, st: Placing, e: RankFailed) -> State:
        """A rank raised before the attempt trained: bad input fails the job now, anything else is a
        failure placed again within the budgets (:meth:`_start_lost`)."""
        if e.refusal:
            return Failed(str(e), e, refused=True)
        return self._start_lost(st, RankLost(e.rank, LossCause.START_FAILED, str(e)), e)

    def _start_lost(self, st: Placing, lost: RankLost, error: RankFailed | None = None) -> State:
        """A rank was lost, or could not start, before the attempt trained: nothing ran, so the attempt
        is placed again under the same number, within the restart budgets (a node that keeps dying,
        or an import that keeps failing, must not loop forever). No ``worker_lost`` is recorded (the
        ledger has no attempt it ended); the next attempt's ``budget`` counts it."""
        log.warning("a rank was lost while starting attempt %d (%s): %s", self.attempts, lost.cause, lost.detail)
        verdict = self.budgets.count(Loss(lost.cause, lost.rank).loss_class)
        if verdict is not None:
            return Failed(f"{verdict}; the last, while starting attempt {self.attempts}: {lost.detail}",
                          None if error is None else _with_budget(error, verdict))
        self.sleep(self.budgets.backoff())
        return replace(st, below=None)

    def _restore(self, group: WorkerGroup, candidates: list[str], st: Placing, size: int, label: str) -> int:
        """Start the attempt from the newest bundle that verifies; returns its update (0 when fresh).

        The attempt is recorded as started only once its state is loaded: a refused restore
        leaves the job as it was, with the refusal (and any rejected bundle) in the ledger."""

        self.attempt_bundle = None
        if not candidates and self.init_from:
            uri, init_key = self.init_from
            self.attempt_bundle = f"{uri}/{init_key}"
            seconds, _ = group.restore(init_key, storage_uri=uri, reset=self.reset)
            self._started(group, size)
            self.ledger.append(InitializedFrom(attempt=self.attempts, bundle=f"{uri}/{init_key}",
                                               reset=list(self.reset)))
            log.info("new lineage %s from %s in %.3fs", self.lineage_id, init_key, seconds)
            return 0
        t0 = self.clock()
        key, result, _ = first_that_loads(candidates, lambda key: self._checked_restore(group, key),
                                          on_reject=lambda r: self.ledger.append(
                                              BundleRejected(attempt=self.attempts, bundle=r.bundle_key,
                                                             reason=r.reason)))
        restore_wall = self.clock() - t0
        self._started(group, size)
        if key is None or result is None:  # result is None only when key is: nothing to restore
            return 0
        seconds, mismatches = result
        return self._restored(group, key, read_manifest(self.storage, key), seconds, mismatches, restore_wall,
                              label, st.cause, st.last_update, st.world_before, size, "cold", st.cold_because)

    def _started(self, group: WorkerGroup, size: int) -> None:
        self._began = True
        self.ledger.append(AttemptStarted(attempt=self.attempts, world_size=size, node_ids=group.node_ids,
                                          rank_pids=group.pids(), pid=os.getpid(), lineage_id=self.lineage_id,
                                          budget=self.budgets.record(), **group.timings))

    def _restored(self, group: WorkerGroup, key: str, manifest: Manifest, seconds: float, mismatches: list[str],
                  wall: float, label: str, cause: str | None, last_update: int | None, world_before: int | None,
                  size: int, path: RecoveryPath, cold_because: str | None) -> int:
        """Record the attempt's restore of bundle ``key`` (the ``Restored`` event) and recommit its
        offsets; returns the bundle's update."""
        update = manifest.counters.attempted_updates
        lost = None if last_update is None else max(0, last_update - update)
        if label == "exact" and any(runtime_differences(manifest.versions, r) for r in group.runtimes):
            # elastic on another device model or library build (strict ranks refuse that restore)
            label = "exact-data"
        if mismatches:  # not strict (strict refused the bundle), or a deliberately broken build
            log.warning("restore oracle: state differs from bundle %s right after restore: %s", key, mismatches)
            label = UNVERIFIED
        self.ledger.append(Restored(
            attempt=self.attempts, bundle=key, update=update, recovery_label=label,
            policy=self.spec.world.policy, restore_mode=policy.restore_mode(self.spec),
            restore_seconds=seconds, lost_updates=lost, cause=cause or "resumed", roundtrip_mismatches=mismatches,
            repeated_occurrences=(manifest.data.repeats_on_restore
                                  if self.spec.data.recovery == "bounded-repetition" else 0),
            restore_wall_seconds=round(wall, 4),
            world_size_before=world_before if world_before is not None else manifest.world.size,
            world_size_after=size, recovery_path=path, cold_because=cold_because))
        self.restored_from = self.restored_from or key
        self.attempt_bundle = key
        self.publisher.commit_offsets(manifest, key, self.attempts, recommit=True)
        self.publisher.commit_points(manifest, key)
        return update

    def _checked_restore(self, group: WorkerGroup, key: str) -> tuple[float, list[str]]:
        """``group.restore(key)``, then the restore oracle acts on what it found: under ``strict`` a
        difference refuses the bundle (:class:`OracleMismatch`: the next older one is tried); otherwise
        the restore goes on and is labelled ``unverified``. A deliberately broken build (``verify
        --mutate``) only records the findings, so that its run goes on and verify's comparison of the
        whole run is proven as well."""
        seconds, mismatches = group.restore(key)
        if mismatches and self.oracle_acts and self.spec.world.policy == "strict":
            raise OracleMismatch(
                f"bundle {key}: right after the restore, the state differs from the bundle in {', '.join(mismatches)} "
                "(the restore oracle); world.policy=strict restores only a state that equals its bundle, so this "
                "bundle is refused. The job's code does not put that state back as it saved it: check the "
                "load_state_dict of what the categories name (spotrun verify CONFIG shows where a run diverges)")
        return seconds, mismatches

    def _running(self, st: Running) -> State:
        """One look at the running attempt. A rank may die at any call to it (a poll, or a request
        to checkpoint for a notice or to grow): each of them is a loss to recover from."""
        try:
            return self._look(st)
        except RankLost as e:
            self._absorb(st, st.group.salvage())  # the survivors know how far the attempt got
            return Recovering(st.group, st.attempt, st.world_size, st.last_update, e)
        except RankFailed as e:
            if e.refusal:  # bad input: the same input fails the same way on every attempt
                st.group.teardown()
                return Failed(str(e), e)
            self._absorb(st, st.group.salvage())
            node = st.group.node_ids[e.rank] if e.rank is not None and e.rank < len(st.group.node_ids) else None
            lost = RankLost(e.rank, LossCause.COLLECTIVE_ERROR if e.collective else LossCause.ERROR, str(e), node)
            return Recovering(st.group, st.attempt, st.world_size, st.last_update, lost, error=e)
        except PublishError as e:
            st.group.teardown()
            return Failed(str(e), e)

    def _look(self, st: Running) -> State:
        reports = st.group.poll()
        self._absorb(st, reports)
        if all(r.state == RankState.FINISHED for r in reports):
            st.group.teardown()
            return Finished(self.published[-1].counters if self.published else Counters())
        for notice in self._new_notices(st):
            nxt = self._on_notice(st, notice)
            if nxt is not None:
                return nxt
        self._early_published(st)
        stopped = all(r.state in (RankState.STOPPED, RankState.FINISHED) for r in reports)
        if st.draining is not None and stopped:
            return self._drained(st, st.draining)
        if st.growing is not None and stopped:
            st.group.teardown()
            return Placing(cause="scale-up", last_update=st.last_update, world_before=st.world_size)
        self._consider_growing(st)
        self._checkpoint_clock(st)
        self._count_spares(st)
        st.group.wait(self._until_next_look(st), self._woken)
        return st

    def _until_next_look(self, st: Running) -> float:
        """How long to wait before the next poll: the group's interval, or less when Ray's drain state
        is due to be read sooner (``preemption.drain_poll_s``). The drain state is read only after a
        wait, so an interval longer than the drain poll would otherwise hold a notice back."""
        seconds = st.group.poll_interval_s
        if self.drain_source is not None:
            seconds = min(seconds, max(0.0, self._drain_due_in()))
        return seconds

    def _drain_due_in(self) -> float:
        """Seconds until Ray's drain state is to be read again (zero or less: now)."""
        return self._drain_checked + self.spec.preemption.drain_poll_s - self.clock()

    def _consider_growing(self, st: Running) -> None:
        """elastic below its largest size: every world.grow_check_s, look for room; when a larger
        world fits, checkpoint at the next boundary and restart with it (nothing is lost)."""
        every = self.spec.world.grow_check_s
        if (self.spec.world.policy != "elastic" or not every or st.draining is not None
                or st.growing is not None or self.clock() - self._grow_checked < every):
            return
        self._grow_checked = self.clock()
        decision = policy.grow(self.spec, st.world_size, self.capacity(), self.spec.train.updates - st.last_update,
                               self._interval_updates())
        if decision is None:
            return
        target = decision.world_size
        if target is None:  # policy.grow gives a world size with every restart
            raise RuntimeError(f"the growth policy restarts without a world size: {decision}")
        if not self.room_for(target - st.world_size):
            log.info("not growing: %s, but the scheduler cannot place %d more ranks now", decision.reason,
                     target - st.world_size)
            return
        log.info("growing: %s", decision.reason)
        self.ledger.append(Resizing(attempt=st.attempt, world_size_before=st.world_size,
                                    world_size_target=target, reason=decision.reason))
        st.group.request(checkpoint=True, stop=True)
        st.growing = target

    # -- checkpoint.every_updates: auto ----------------------------------------------------

    def _checkpoint_clock(self, st: Running) -> None:
        """Under ``auto``: decide the interval when an attempt starts, once the first bundle measured
        the checkpoint cost, and every :data:`interval.REDECIDE_S`; ask the ranks for a checkpoint once
        the interval has passed since the attempt's start or the latest publication (one at a time)."""
        if self.spec.checkpoint.fixed_every is not None or st.draining is not None or st.growing is not None:
            return
        c, now = self._auto, self.clock()
        if c.attempt != st.attempt:
            c.attempt, c.since, c.published, c.requested = st.attempt, now, len(self.published), False
            self._redecide(st, "start")
        if len(self.published) > c.published:
            c.since, c.published, c.requested = now, len(self.published), False
            if c.decision is not None and c.decision.checkpoint_cost_s is None:
                self._redecide(st, "measured")
        if now - c.decided_at >= interval.REDECIDE_S:
            self._redecide(st, "periodic")
        if c.decision is not None and not c.requested and now - c.since >= c.decision.interval_s:
            st.group.request(checkpoint=True)
            c.requested = True

    def _redecide(self, st: Running, reason: str) -> None:
        """Choose the interval from the ledger; record it (a periodic one only when it moved)."""
        events = self.ledger.read()
        if reason == "start" and any(isinstance(e, WorkerLost) and e.attempt == st.attempt - 1 for e in events):
            reason = "loss"
        inputs = interval_inputs.observe(events, self.spec.checkpoint, self.sec_per_update, st.attempt,
                                         datetime.now(UTC))
        decision = interval.decide(inputs)
        c = self._auto
        c.decided_at = self.clock()
        if reason == "periodic" and not interval.moved(c.decision, decision):
            return
        c.decision = decision
        self.ledger.append(IntervalChosen(attempt=st.attempt, reason=reason, inputs=inputs, decision=decision))
        log.info("checkpoint interval %.1fs (%s updates; %s): checkpoint cost %s s, mean time between preemptions "
                 "that lose work %.0fs", decision.interval_s, decision.interval_updates or "?", reason,
                 decision.checkpoint_cost_s, decision.mtbp_losing_work_s)

    def _interval_updates(self) -> int:
        """The checkpoint interval in updates: the fixed one, or auto's at the measured speed (1 before that)."""
        fixed = self.spec.checkpoint.fixed_every
        if fixed is not None:
            return fixed
        decision = self._auto.decision
        return (decision.interval_updates or 1) if decision is not None else 1

    # -- preemption notices ---------------------------------------------------------------

    def _new_notices(self, st: Running) -> list[Notice]:
        out = st.group.take_notices()
        self._woken.clear()  # before the queue is read: a notice put after this wakes the next wait
        while not self.notices.empty():
            out.append(self.notices.get_nowait())
        if self.drain_source is not None and self._drain_due_in() <= 0:
            self._drain_checked = self.clock()
            for node in self.drain_source() & set(st.group.node_ids):
                out.append(Notice(source="ray-drain", node_id=node, rank=st.group.node_ids.index(node),
                                  deadline=None, detail="Ray reports the node DRAINING"))
        return out

    def _on_notice(self, st: Running, n: Notice) -> State | None:
        """Decide what a notice means: emergency checkpoint, fallback to the last bundle, or nothing."""
        def record(action: str, reason: str, remaining=None, needed=None) -> None:
            self.ledger.append(NoticeSeen(attempt=st.attempt, source=n.source, node_id=n.node_id, rank=n.rank,
                                          deadline=n.deadline, action=action, reason=reason,
                                          remaining_seconds=remaining, needed_seconds=needed))

        if n.malformed or n.unreachable:  # each rank's watcher may say so: one record per node
            key = ("malformed", n.source, n.node_id, n.malformed) if n.malformed else ("unreachable", n.source,
                                                                                     n.node_id)
            if key not in self._seen_notices:
                self._seen_notices.add(key)
                log.warning("ignoring a %s %s notice: %s", key[0], n.source, n.malformed or n.unreachable)
                record("ignored", f"malformed: {n.malformed}" if n.malformed else f"unreachable: {n.unreachable}")
            return None
        identity = n.identity if n.source != "ray-drain" else (n.source, n.node_id)
        if identity in self._seen_notices:
            log.info("ignoring a duplicate %s notice for node %s", n.source, n.node_id)
            return None
        self._seen_notices.add(identity)
        if n.node_id is not None and n.node_id not in st.group.node_ids:
            record("ignored", f"node {n.node_id} hosts no rank of this attempt")
            return None
        if n.early:
            self._early(st, n, record)
            return None
        # whatever is done about it, a loss of this node or rank from now on was a preemption
        self._noticed.update(x for x in (n.node_id, n.rank) if x is not None)
        if st.draining is not None:
            if n.node_id is None and st.draining.node_id is not None:
                # a stop to the whole process group reaches a rank and the driver, in either order: the
                # driver's wins, or the job would restart after the bundle instead of stopping
                st.draining = n
                record("emergency-checkpoint", "the driver is stopping too: stop after the bundle already asked for")
                return None
            record("ignored", f"already draining for a {st.draining.source} notice")
            return None
        deadline = n.deadline or (n.received_at + timedelta(seconds=self.spec.preemption.grace_s))
        remaining = (deadline - datetime.now(UTC)).total_seconds()
        needed = self._time_to_publish(st.group.poll_interval_s)
        if remaining <= needed:
            reason = (f"deadline in {remaining:.1f}s, finishing the update in flight and publishing needs "
                      f"~{needed:.1f}s: falling back to the newest published bundle")
            record("fallback", reason, remaining, needed)
            return Recovering(st.group, st.attempt, st.world_size, st.last_update,
                              RankLost(n.rank, notice_cause(n.source), reason, n.node_id))
        record("emergency-checkpoint", f"checkpoint at the next boundary, then stop ({remaining:.1f}s left)",
               remaining, needed)
        st.group.request(checkpoint=True, stop=True)
        st.draining = n
        return None

    def _early(self, st: Running, n: Notice, record: Callable[[str, str], None]) -> None:
        """An early checkpoint (AWS's rebalance recommendation): a bundle at the next boundary, and training
        goes on. Not a reason to class a later loss of the node as a preemption: no deadline was given."""
        if st.draining is not None or st.early is not None:
            why = "draining" if st.draining is not None else "an early checkpoint is already asked for"
            record("ignored", f"{why}: that bundle covers it")
            return
        record("early-checkpoint", "checkpoint at the next boundary and keep training")
        st.group.request(checkpoint=True)
        st.early = (n, st.last_update)

    def _early_published(self, st: Running) -> None:
        """Record the bundle an early checkpoint asked for once it is published (the first one past the
        update the request found the ranks at)."""
        if st.early is None:
            return
        n, asked_at = st.early
        bundle = next((m for m in self.published if m.counters.attempted_updates > asked_at), None)
        if bundle is None:
            return
        st.early = None
        self.ledger.append(NoticeHandled(
            attempt=st.attempt, source=n.source, bundle=f"{self.spec.job_id}/bundles/{bundle.bundle_id}",
            update=bundle.counters.attempted_updates, early=True,
            notice_to_publish_seconds=round((datetime.now(UTC) - n.received_at).total_seconds(), 3)))

    def _acknowledge(self, st: Running, n: Notice) -> str | None:
        """Tell the cloud the bundle ``n`` asked for is published (Azure's ``StartRequests``, only when
        ``preemption.azure_ack`` put an event on the notice), through the watcher that saw it. Returns
        the event acknowledged; a refusal is logged, never a failure: the bundle is published either way."""
        if n.ack is None:
            return None
        try:
            if n.node_id is None:
                for w in self.driver_watchers:
                    w.acknowledge(n)
            else:
                st.group.acknowledge(n)
        except (OSError, RankLost, RankFailed) as e:
            log.warning("could not acknowledge %s event %s: %s", n.source, n.ack, e)
            return None
        return n.ack

    def _time_to_publish(self, poll_interval_s: float) -> float:
        """Estimated seconds to finish the update in flight, capture, write and publish, with margin
        (and one poll interval more: the stop and the bundles are seen at once, the interval is slack)."""
        per_update = self.sec_per_update if self.sec_per_update is not None else 1.0
        save = max((m.stall_seconds + m.write_seconds for m in self.published[-3:]), default=1.0)
        return self.spec.preemption.safety_factor * (per_update + save) + poll_interval_s

    def _drained(self, st: Running, n: Notice) -> State:
        """The ranks stopped after the bundle ``n`` (the notice being drained for) asked for. A stop
        ends the job here; a node's notice is a loss (the restart may keep the other ranks: warm)."""
        last = self.published[-1]
        key = f"{self.spec.job_id}/bundles/{last.bundle_id}"
        seconds = (datetime.now(UTC) - n.received_at).total_seconds()
        acknowledged = self._acknowledge(st, n)
        self.ledger.append(NoticeHandled(attempt=st.attempt, source=n.source, bundle=key,
                                         update=last.counters.attempted_updates,
                                         notice_to_publish_seconds=round(seconds, 3), acknowledged=acknowledged))
        if n.node_id is None:
            st.group.teardown()
            return Stopped(f"stopped by {n.source} after publishing {key}; run the same command to resume")
        return Recovering(st.group, st.attempt, st.world_size, st.last_update,
                          RankLost(n.rank, notice_cause(n.source), f"drained after publishing {key}", n.node_id))

    def _absorb(self, st: Running, reports: list) -> None:
        """The ranks' output, progress and trace lines from rank reports; publish every bundle all ranks
        have written."""
        output = [line for r in reports for line in r.output]
        if output:
            self.echo(output)
        progressed = max((r.last_update for r in reports), default=st.last_update)
        now = self.clock()
        if progressed > st.last_update and st.progress_at is not None:
            per_update = (now - st.progress_at) / (progressed - st.last_update)
            self.sec_per_update = per_update if self.sec_per_update is None else (
                0.8 * self.sec_per_update + 0.2 * per_update)
        if progressed > st.last_update or st.progress_at is None:
            st.progress_at = now
        for r in reports:
            self._rank_retries[(st.attempt, r.rank)] = r.storage_retries
            st.last_update = max(st.last_update, r.last_update)
            self.progress.updates(r.records, st.world_size)
            for record in r.records:
                if self.trace:
                    self.trace.write(record)
        self.publisher.retries_elsewhere = sum(self._rank_retries.values())
        new = self.publisher.collect([b for r in reports for b in r.bundles])
        if new:
            self.budgets.published()
        self.published += new

    def _recovering(self, st: Recovering) -> State:
        """Carry out what :func:`~spotrun.orchestrator.policy.recovery.plan_recovery` decides for this loss."""
        lost = st.lost
        loss = Loss(lost.cause, lost.rank, noticed=lost.node_id in self._noticed or lost.rank in self._noticed)
        # the job's own error (not a collective's), where the attempt was (the update it raised in)
        error = (ErrorAt(st.last_update + 1, self.attempt_bundle)
                 if st.error is not None and loss.kind is LossCause.ERROR and loss.loss_class == "failure" else None)
        verdict = self.budgets.count(loss.loss_class, st.last_update, error)
        newest = self.publisher.newest[0] if self.publisher.newest is not None else None
        decision = plan_recovery(loss, verdict, self.spec, newest,
                                 GroupCan(reform=isinstance(st.group, WarmGroup), world_size=st.world_size),
                                 self.budgets.losses_in_a_row, self.budgets.backoff)
        t0 = self.clock()
        if not isinstance(decision, Warm):
            st.group.teardown()
        teardown = self.clock() - t0
        backoff = None if isinstance(decision, Fail) else decision.backoff_s
        self.ledger.append(WorkerLost(attempt=st.attempt, rank=lost.rank, node_id=lost.node_id, cause=lost.cause,
                                      detail=lost.detail, last_update=st.last_update, detected_at=st.detected_at,
                                      teardown_seconds=round(teardown, 4), loss=loss.loss_class,
                                      budget=self.budgets.record(),
                                      backoff_seconds=None if backoff is None else round(backoff, 4)))
        self.restarts += 1
        log.warning("attempt %d lost rank %s on node %s (%s, a %s) at update %d: %s", st.attempt, lost.rank,
                    lost.node_id, lost.cause, loss.loss_class, st.last_update, lost.detail)
        if isinstance(decision, Fail):
            return Failed(f"{decision.reason}; the last: rank {lost.rank} {lost.cause}: {lost.detail}",
                          None if st.error is None else _with_budget(st.error, decision.reason))
        self.sleep(decision.backoff_s)
        cold_because = decision.reason if isinstance(decision, Cold) else None
        if isinstance(decision, Warm):
            warm = self._warm(st)
            if not isinstance(warm, str):
                return warm
            cold_because = warm
            log.info("restarting from storage: %s", warm)
            st.group.teardown()
        return Placing(cause=lost.cause, last_update=st.last_update, world_before=st.world_size,
                       cold_because=cold_because)

    # -- warm recovery ----------------------------------------------------------------------

    def _count_spares(self, st: Running) -> None:
        """Record in the ledger each change in how many spares are ready."""
        if not self.spec.world.spares or not isinstance(st.group, WarmGroup):
            return
        ready = st.group.spares_ready()
        if ready != self._spares_ready:
            self._spares_ready = ready
            self.ledger.append(SparesReady(attempt=st.attempt, ready=ready, wanted=self.spec.world.spares))

    def _warm(self, st: Recovering) -> State | str:
        """Restart from the newest published bundle with the surviving processes (and spares), from
        memory. Returns the running attempt, or why it could not be done (the restart goes cold)."""
        # plan_recovery saw to these: a bundle this driver published (so a lineage), one rank lost, a group
        # that re-forms
        assert self.publisher.newest is not None and st.lost.rank is not None and isinstance(st.group, WarmGroup)
        assert self.lineage_id is not None
        key, manifest, shipped_files = self.publisher.newest
        group = st.group
        # The policy chooses the world as for any restart (the largest the capacity holds); warm is how,
        # never what: a spare (or a new process) keeps the size, the survivors alone are the world only
        # when that is it.
        decision = policy.decide(self.spec, self.capacity(), 0.0)
        if decision.action != "restart" or decision.world_size not in (st.world_size, st.world_size - 1):
            return f"the policy restarts with {decision.world_size or 'no'} ranks: {decision.reason}"
        sizes = [decision.world_size]
        attempt = self.ledger.next_attempt()
        t0 = self.clock()
        try:
            done = group.reform({st.lost.rank}, key, manifest, shipped_files, sizes, attempt, self.lineage_id,
                                lambda size: policy.recovery_label(self.spec, st.world_size, size))
        except WarmUnavailable as e:
            return str(e)
        except (RankLost, RankFailed) as e:
            return f"a rank was lost while restarting warm: {e}"
        if done.mismatches and self.oracle_acts and self.spec.world.policy == "strict":
            return f"the restore oracle found {', '.join(done.mismatches)} after restoring {key} from memory"
        self.attempts, size = attempt, done.world_size
        self.publisher.begin_attempt(attempt, size)
        self._faults = FaultInjector(self.spec.faults, attempt, rank=0, log=FaultLog(self.storage, self.spec.job_id))
        self._noticed = set()
        self._started(group, size)
        update = self._restored(group, key, manifest, done.restore_seconds, done.mismatches, self.clock() - t0,
                                done.label, st.lost.cause, st.last_update, st.world_size, size, done.path, None)
        if size != st.world_size:
            self.ledger.append(TopologyChanged(attempt=attempt, world_size_before=st.world_size, world_size_after=size,
                                               accum_steps_after=self.spec.accum_steps_for(size)))
        log.info("attempt %d restarted warm (%s) from %s in %.3fs", attempt, done.path, key, self.clock() - t0)
        group.start()
        return Running(group, attempt, size, update)

    def _capacity_event(self, st: Placing, size: int, outcome: str) -> None:
        self.ledger.append(CapacityWait(attempt=max(self.attempts, 1), needed=size or min(
            self.spec.allowed_world_sizes()), available=self.capacity(), waited_seconds=st.waited_s, outcome=outcome))


def _with_budget(error: RankFailed, verdict: str) -> RankFailed:
    """The job's last error, saying why it was not restarted again (raised by ``run()``)."""
    out = RankFailed(f"{error} (not restarted: {verdict})", error.rank, error.collective, error.refusal)
    out.__cause__ = error
    return out
