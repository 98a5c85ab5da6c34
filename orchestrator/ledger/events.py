"""The ledger's events: what happened to a job, one pydantic model per kind (written by the driver).

Every event names its ``attempt`` and the time it was recorded; :data:`Event` is the union the ledger
parses (by ``kind``), and :class:`CorruptEvent` what a file that does not parse is read as.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from spotrun.orchestrator.policy.budgets import Budget
from spotrun.orchestrator.policy.interval import IntervalDecision, IntervalInputs
from spotrun.orchestrator.policy.recovery import RecoveryPath
from spotrun.trainer.observe.footprint import Footprint
from spotrun.trainer.state.counters import Counters


def _now() -> datetime:
    return datetime.now(UTC)


class LedgerEvent(BaseModel):
    """What every event has: the attempt it belongs to and when it was recorded."""

    model_config = ConfigDict(extra="forbid")

    at: datetime = Field(default_factory=_now)
    attempt: int



class AttemptStarted(LedgerEvent):
    kind: Literal["attempt_started"] = "attempt_started"
    world_size: int
    node_ids: list[str] = []  # per rank
    rank_pids: list[int] = []  # per rank: the process a preemption would take
    pid: int  # the supervisor's
    lineage_id: str
    # Where the start-up time went (None where the worker group does not measure it).
    placement_seconds: float | None = None  # reserving the ranks' resources and starting their processes
    process_group_seconds: float | None = None  # the ranks forming their torch.distributed group (slowest rank)
    rank_setup_seconds: float | None = None  # each rank building its state, data pipeline and sinks (slowest)
    budget: Budget | None = None  # the budgets as this attempt starts (None: written before budgets were recorded)




class Restored(LedgerEvent):
    kind: Literal["restored"] = "restored"
    bundle: str
    update: int
    recovery_label: str
    policy: str
    restore_mode: str
    restore_seconds: float
    # Asking the ranks to restore until every rank is done: bundle read, verify, load, restore oracle.
    restore_wall_seconds: float | None = None
    lost_updates: int | None = None  # None: the previous attempt died without reporting its progress
    cause: str | None = None
    world_size_before: int | None = None
    world_size_after: int | None = None
    # The restore oracle: state categories that differed from the bundle right after the
    # restore ("rank r: category"); empty when the restore was faithful.
    roundtrip_mismatches: list[str] = []
    repeated_occurrences: int = 0  # bounded-repetition: occurrences this restore delivers again (<= max_repeat)
    # How the ranks got the bundle back: ``cold`` a new group of processes read it from storage;
    # ``warm-spare``/``warm-replace``/``warm-shrink`` the surviving processes put it back from host memory,
    # with a spare in each lost rank's place, a new process placed there, or in a smaller world
    # (orchestrator/workers/raygroup.py, trainer/run/warm.py).
    recovery_path: RecoveryPath = "cold"
    cold_because: str | None = None  # a restart after a loss that went cold: why not warm


class InitializedFrom(LedgerEvent):
    """A new lineage started from another bundle (``--init-from``): never a continuation."""

    kind: Literal["initialized_from"] = "initialized_from"
    bundle: str
    reset: list[str]
    recovery_label: Literal["new-experiment"] = "new-experiment"


class WorkerLost(LedgerEvent):
    kind: Literal["worker_lost"] = "worker_lost"
    rank: int | None
    node_id: str | None = None
    host: str | None = None  # the lost rank's machine (its hostname; None: not recorded)
    # node-lost | notice:<source> | process-exit | oom | unresponsive | hang | stuck | collective-timeout
    # | collective-error
    # | error (the job's code raised) | start-failed
    cause: str
    loss: Literal["preemption", "failure"] | None = None  # None: recorded before losses were classed
    budget: Budget | None = None  # the budgets with this loss counted
    backoff_seconds: float | None = None  # waited before placing the next attempt (None: the job ended here)
    detail: str = ""
    last_update: int  # the furthest update the attempt is known to have completed
    detected_at: datetime | None = None  # when the supervisor noticed the loss (``at`` is after the teardown)
    teardown_seconds: float | None = None  # stopping the attempt's ranks and releasing their resources
    # a rank found hung (silent) or stuck (no progress while its peers waited): the signal, the phase and
    # update of its last answer (a hung rank may have gone on a little after it; its stacks say where it
    # stopped; None: it never answered), and the storage key of the stacks taken before it was killed
    signal: Literal["hang", "stuck"] | None = None
    stopped_phase: str | None = None
    stopped_update: int | None = None
    stacks: str | None = None


class CapacityWait(LedgerEvent):
    kind: Literal["capacity_wait"] = "capacity_wait"
    needed: int
    available: int
    waited_seconds: float
    outcome: str  # placed | timed-out


class TopologyChanged(LedgerEvent):
    kind: Literal["topology_changed"] = "topology_changed"
    world_size_before: int
    world_size_after: int
    accum_steps_after: int


class Resizing(LedgerEvent):
    """An elastic job found room to grow: it checkpoints at the next boundary and restarts larger."""

    kind: Literal["resizing"] = "resizing"
    world_size_before: int
    world_size_target: int
    reason: str


class NoticeSeen(LedgerEvent):
    """A preemption notice and what the supervisor did about it: an emergency checkpoint (publish, then
    stop), a fallback to the newest published bundle (the deadline leaves no time to publish), an early
    checkpoint (publish at the next boundary and keep training: AWS's rebalance recommendation), or
    nothing (a duplicate, a malformed answer, an unreachable source)."""

    kind: Literal["notice"] = "notice"
    source: str
    node_id: str | None
    rank: int | None
    deadline: datetime | None
    action: Literal["emergency-checkpoint", "fallback", "early-checkpoint", "ignored"]
    reason: str
    remaining_seconds: float | None = None  # until the deadline, when it arrived
    needed_seconds: float | None = None  # estimated to finish the update in flight and publish


class NoticeHandled(LedgerEvent):
    """The bundle a notice asked for is published: an emergency one (the ranks have stopped) or, with
    ``early``, an early checkpoint's (training goes on: a later loss costs only the updates since)."""

    kind: Literal["notice_handled"] = "notice_handled"
    source: str
    bundle: str
    update: int
    notice_to_publish_seconds: float
    early: bool = False
    acknowledged: str | None = None  # the cloud's event acknowledged after the publish (Azure's EventId)


class OffsetsCommitted(LedgerEvent):
    kind: Literal["offsets_committed"] = "offsets_committed"
    bundle: str
    update: int
    recommit: bool = False


class BundleRejected(LedgerEvent):
    kind: Literal["bundle_rejected"] = "bundle_rejected"
    bundle: str
    reason: str


class BundlePublished(LedgerEvent):
    kind: Literal["bundle_published"] = "bundle_published"
    bundle: str
    update: int
    bytes: int
    stall_seconds: float  # all rank 0's loop waited for at the boundary (see Manifest.stall_seconds)
    write_seconds: float
    capture_seconds: float | None = None  # of the stall: the copy to host memory (None: not recorded)
    write_wait_seconds: float | None = None  # of the stall: the previous write finishing
    # what the updates the background write overlapped took beyond plain ones (rank 0's loop; None: not measured)
    overlap_seconds: float | None = None
    storage_retries: int = 0  # transient storage errors retried by the job so far, all processes




class IntervalChosen(LedgerEvent):
    """``checkpoint.every_updates: auto`` chose an interval: at an attempt's start (after a loss or
    not), once the first bundle measured the checkpoint cost, or periodically when it moved."""

    kind: Literal["interval_chosen"] = "interval_chosen"
    reason: Literal["start", "loss", "measured", "periodic"]
    inputs: IntervalInputs
    decision: IntervalDecision


class JobFinished(LedgerEvent):
    kind: Literal["job_finished"] = "job_finished"
    counters: Counters
    storage_retries: int = 0


class SparesReady(LedgerEvent):
    """The spares (``world.spares``) built and waiting changed in number: a lost rank's place can be
    taken at once by as many ranks as are ready."""

    kind: Literal["spares_ready"] = "spares_ready"
    ready: int
    wanted: int  # world.spares


class Slowdowns(LedgerEvent):
    """How much slower each rank ran than its peers over the attempt's last ``window`` updates
    (orchestrator/policy/health.py): its median own-work time (everything but waiting for peers at a
    collective) over the median of its peers'. Recorded once the attempt's first full window is in,
    whenever the set of stragglers changes, and otherwise at most every few minutes while a rank's
    figure moves."""

    kind: Literal["slowdowns"] = "slowdowns"
    update: int  # the update the attempt had reached
    window: int  # world.straggler_window: the updates each figure is the median of
    ratio: float  # world.straggler_ratio: a rank at or over it is a straggler
    slowdown: dict[int, float]  # per rank
    stragglers: list[int]  # the ranks at or over ``ratio``, slowest first
    node_ids: list[str] = []  # per rank


class StragglerReplacing(LedgerEvent):
    """``world.replace_stragglers``: rank ``rank`` ran ``slowdown`` times slower than its peers; the
    ranks checkpoint at the next boundary and a ready spare takes its place, from memory (nothing is
    lost: the restart resumes at the bundle just published). The restart's row has cause ``straggler``."""

    kind: Literal["straggler_replacing"] = "straggler_replacing"
    rank: int
    node_id: str | None = None
    slowdown: float
    update: int  # the update the attempt had reached when the replacement was asked for


class StorageOutage(LedgerEvent):
    """Storage refused the job's requests for a while (throttling, 5xx, resets, a full disk): recorded by
    the driver once storage answers again (the ledger lives in storage too). ``attempt``: the attempt
    running when it began."""

    kind: Literal["storage_outage"] = "storage_outage"
    began_at: datetime
    ended_at: datetime
    first_error: str  # the first refusal, as the path that met it said it (names a full disk as such)
    paths: list[str]  # the storage paths that met it: "ledger", "publisher", "placing", "rank R checkpoints"
    requests_refused: int  # refusals counted over those paths
    # checkpoint boundaries whose bundle was not taken or whose write was abandoned: per attempt, the most any
    # one rank skipped (each rank skips on its own view of the storage, so this is a lower bound)
    bundles_skipped: int
    newest_bundle: str | None  # the newest published bundle while it lasted (None: none yet)
    newest_update: int | None  # that bundle's update
    update_at_end: int  # the update the attempt had reached when storage answered: the updates at risk are
    # update_at_end - newest_update (what a loss during the outage would have cost)
    full_disk: bool = False  # ENOSPC or EDQUOT was among the refusals


class SpacePruned(LedgerEvent):
    """A full disk (file storage): older bundles retention would keep were removed to make room for the
    next checkpoint, the newest published bundle never among them."""

    kind: Literal["space_pruned"] = "space_pruned"
    bundles: list[str]  # the keys removed, oldest first
    freed_bytes: int
    reason: str  # what refused the write (ENOSPC, EDQUOT) and where


class JobFailed(LedgerEvent):
    kind: Literal["job_failed"] = "job_failed"
    reason: str


# Before anything started (spotrun run): finished, the newest bundle already reached train.updates and
# there is nothing to run (exit 0); incompatible, the newest bundle cannot take this spec or code (exit 2);
# unreadable, the newest manifest's schema is unknown to this spotrun (exit 2). While the run's first
# attempt started: start, a rank or the driver refused bad input (a job that cannot be built, a bundle
# whose data, tokenizer, parameters or runtime differ, storage the ranks do not share; exit 2).
RefusalCheck = Literal["finished", "incompatible", "unreadable", "start"]


class RunRefused(LedgerEvent):
    """A run of the job that trained nothing: refused before anything started, from storage and the
    driver's own copy of the job's code (:mod:`spotrun.orchestrator.control.preflight`), or while its first
    attempt started. An event of its own, never a ``job_failed``: a refused run does not change what
    the job's record says it is (a finished job stays finished). ``attempt``: the number of the run's
    first attempt (refused before it started, it is the next run's number too)."""

    kind: Literal["run_refused"] = "run_refused"
    check: RefusalCheck
    bundle: str | None = None  # the bundle the check read (None: not known to the driver)
    reason: str  # the paragraph the command printed


class Footprints(LedgerEvent):
    """Every rank process's holdings early in an attempt (trainer/observe/footprint.py): its resident
    memory, open files, threads and process groups, measured at its first poll after training began. A
    ``pid`` seen in several attempts is a process warm recovery kept: what it gains per restart is what
    a week of restarts would pile up."""

    kind: Literal["footprints"] = "footprints"
    ranks: dict[int, Footprint]  # by rank


Event = Annotated[
    AttemptStarted | Restored | InitializedFrom | BundleRejected | BundlePublished | WorkerLost | CapacityWait
    | TopologyChanged | Resizing | OffsetsCommitted | NoticeSeen | NoticeHandled | JobFinished | JobFailed
    | IntervalChosen | SparesReady | RunRefused | Slowdowns | StragglerReplacing | StorageOutage | SpacePruned
    | Footprints,
    Field(discriminator="kind"),
]
EVENT = TypeAdapter(Event)


class CorruptEvent(BaseModel):
    """An event file that could not be parsed: shown as such, never a crash."""

    kind: Literal["corrupt"] = "corrupt"
    key: str
    error: str
