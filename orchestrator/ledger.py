"""The event ledger: an append-only, create-only record of what happened to a job.

Each event is one JSON file ``<job_id>/events/<seq:012d>.json`` written with
create-only semantics, so two writers never overwrite each other: a writer that
loses the race for a sequence number takes the next one. A later process (the
``history`` command, the dashboard) rebuilds the whole story from these files.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from spotrun.trainer.counters import Counters
from spotrun.trainer.storage import Storage


def _now() -> datetime:
    return datetime.now(UTC)


class _Event(BaseModel):
    model_config = ConfigDict(extra="forbid")

    at: datetime = Field(default_factory=_now)
    attempt: int


class Budget(BaseModel):
    """This run's two restart budgets and what it has used of each (see ``policy.loss_class``)."""

    model_config = ConfigDict(extra="forbid")

    failures: int  # losses classed as failures so far
    max_restarts: int  # world.max_restarts: the failures allowed
    preemptions: int
    max_preemptions: int | None  # world.max_preemptions; None: no limit

    def left(self) -> dict[str, int | None]:
        """What is left of each budget (None: no limit)."""
        return {"failures_left": max(0, self.max_restarts - self.failures),
                "preemptions_left": None if self.max_preemptions is None
                else max(0, self.max_preemptions - self.preemptions)}


class AttemptStarted(_Event):
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


class Restored(_Event):
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


class InitializedFrom(_Event):
    """A new lineage started from another bundle (``--init-from``): never a continuation."""

    kind: Literal["initialized_from"] = "initialized_from"
    bundle: str
    reset: list[str]
    recovery_label: Literal["new-experiment"] = "new-experiment"


class WorkerLost(_Event):
    kind: Literal["worker_lost"] = "worker_lost"
    rank: int | None
    node_id: str | None = None
    # node-lost | notice:<source> | process-exit | oom | unresponsive | collective-timeout | collective-error
    # | error (the job's code raised) | start-failed
    cause: str
    loss: Literal["preemption", "failure"] | None = None  # None: recorded before losses were classed
    budget: Budget | None = None  # the budgets with this loss counted
    backoff_seconds: float | None = None  # waited before placing the next attempt (None: the job ended here)
    detail: str = ""
    last_update: int  # the furthest update the attempt is known to have completed
    detected_at: datetime | None = None  # when the supervisor noticed the loss (``at`` is after the teardown)
    teardown_seconds: float | None = None  # stopping the attempt's ranks and releasing their resources


class CapacityWait(_Event):
    kind: Literal["capacity_wait"] = "capacity_wait"
    needed: int
    available: int
    waited_seconds: float
    outcome: str  # placed | timed-out


class TopologyChanged(_Event):
    kind: Literal["topology_changed"] = "topology_changed"
    world_size_before: int
    world_size_after: int
    accum_steps_after: int


class Resizing(_Event):
    """An elastic job found room to grow: it checkpoints at the next boundary and restarts larger."""

    kind: Literal["resizing"] = "resizing"
    world_size_before: int
    world_size_target: int
    reason: str


class NoticeSeen(_Event):
    """A preemption notice and what the supervisor did about it."""

    kind: Literal["notice"] = "notice"
    source: str
    node_id: str | None
    rank: int | None
    deadline: datetime | None
    action: Literal["emergency-checkpoint", "fallback", "ignored"]
    reason: str
    remaining_seconds: float | None = None  # until the deadline, when it arrived
    needed_seconds: float | None = None  # estimated to finish the update in flight and publish


class NoticeHandled(_Event):
    """The emergency bundle a notice asked for is published; the ranks have stopped."""

    kind: Literal["notice_handled"] = "notice_handled"
    source: str
    bundle: str
    update: int
    notice_to_publish_seconds: float


class OffsetsCommitted(_Event):
    kind: Literal["offsets_committed"] = "offsets_committed"
    bundle: str
    update: int
    recommit: bool = False


class BundleRejected(_Event):
    kind: Literal["bundle_rejected"] = "bundle_rejected"
    bundle: str
    reason: str


class BundlePublished(_Event):
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


class IntervalInputs(BaseModel):
    """What ``checkpoint.every_updates: auto`` decides from (see orchestrator/interval.py)."""

    model_config = ConfigDict(extra="forbid")

    checkpoint_costs_s: list[float]  # the newest bundles' stall plus overlap, oldest first
    sec_per_update: float | None  # measured by the supervisor (None: no update seen yet)
    preemptions: int  # losses classed as preemptions in the job's ledger
    preemptions_losing_work: int  # of them, those no notice-driven bundle covered
    uptime_s: float  # the attempts' run time so far
    prior_interval_s: float  # checkpoint.expected_preemption_interval_s
    min_interval_s: float
    max_interval_s: float


class IntervalDecision(BaseModel):
    """The interval ``auto`` chose and what it expects that interval to cost."""

    model_config = ConfigDict(extra="forbid")

    interval_s: float  # run time from one bundle's publication (or the attempt's start) to the next request
    interval_updates: int | None  # the same in updates at the measured speed (None: speed not measured yet)
    checkpoint_cost_s: float | None  # the estimate used (None: no bundle measured yet)
    mtbp_s: float  # mean run time between preemptions, the prior included
    mtbp_losing_work_s: float  # the same for preemptions that lose work (the ones the interval is for)
    expected_lost_work_s: float  # work one preemption that loses work is expected to throw away
    expected_overhead: float  # fraction of run time expected to go to checkpoints and to redoing lost work
    bound: Literal["min", "max"] | None = None  # the bound that clamped the interval, if one did


class IntervalChosen(_Event):
    """``checkpoint.every_updates: auto`` chose an interval: at an attempt's start (after a loss or
    not), once the first bundle measured the checkpoint cost, or periodically when it moved."""

    kind: Literal["interval_chosen"] = "interval_chosen"
    reason: Literal["start", "loss", "measured", "periodic"]
    inputs: IntervalInputs
    decision: IntervalDecision


class JobFinished(_Event):
    kind: Literal["job_finished"] = "job_finished"
    counters: Counters
    storage_retries: int = 0


class JobFailed(_Event):
    kind: Literal["job_failed"] = "job_failed"
    reason: str


Event = Annotated[
    AttemptStarted | Restored | InitializedFrom | BundleRejected | BundlePublished | WorkerLost | CapacityWait
    | TopologyChanged | Resizing | OffsetsCommitted | NoticeSeen | NoticeHandled | JobFinished | JobFailed
    | IntervalChosen,
    Field(discriminator="kind"),
]
_EVENT = TypeAdapter(Event)


class CorruptEvent(BaseModel):
    """An event file that could not be parsed: shown as such, never a crash."""

    kind: Literal["corrupt"] = "corrupt"
    key: str
    error: str


class Ledger:
    """A job's events, each its own create-only object under ``<job>/events/``. An instance keeps
    the events it parsed: use a new one after the job's events are deleted."""

    def __init__(self, storage: Storage, job_id: str, on_append: Callable[[_Event], None] | None = None) -> None:
        """``on_append``: told of every event once it is written (``spotrun run``'s progress display)."""
        self.storage = storage
        self.on_append = on_append
        self.prefix = f"{job_id}/events/"
        self._next: int | None = None  # the next sequence number to try (None: not looked up yet)
        # key -> its event: an event is written once, whole (create-only), and never changes, so a
        # ledger read again (a supervisor at every placement, a harness polling) parses only new keys
        self._parsed: dict[str, _Event] = {}

    def _keys(self) -> list[str]:
        return [k for k in self.storage.list(self.prefix) if k.endswith(".json")]

    def append(self, event: _Event) -> str:
        """Write ``event`` under the next free sequence number; returns its key."""
        if self._next is None:
            keys = self._keys()
            self._next = int(keys[-1][len(self.prefix):-5]) + 1 if keys else 0
        blob = event.model_dump_json().encode()
        while True:
            key = f"{self.prefix}{self._next:012d}.json"
            self._next += 1
            if self.storage.put_new(key, blob):
                if self.on_append is not None:
                    self.on_append(event)
                return key

    def read(self) -> list[_Event | CorruptEvent]:
        """Every event in order; one that does not parse is a :class:`CorruptEvent` (read again next time)."""
        out: list[_Event | CorruptEvent] = []
        for key in self._keys():
            event = self._parsed.get(key)
            if event is None:
                try:
                    event = self._parsed[key] = _EVENT.validate_json(self.storage.get(key))
                except (ValidationError, ValueError) as e:
                    out.append(CorruptEvent(key=key, error=str(e).splitlines()[0]))
                    continue
            out.append(event)
        return out

    def next_attempt(self) -> int:
        return 1 + sum(1 for e in self.read() if isinstance(e, AttemptStarted))
