"""The restart history as typed models: what :func:`~spotrun.orchestrator.ledger.history.history` returns.

Built in the driver (the MLflow restart tags), the CLI (``spotrun history``), verify and the
dashboard, each from the job's storage. ``History.model_dump(mode="json")`` is the document
``spotrun history --json`` prints and the dashboard's ``/api/jobs/{job_id}/history`` answers: the
fields below, in this order (an attempt's optional fields in the order the ledger set them).
Timestamps are ISO-8601 text, as that document prints them: ``+00:00`` in the rows history
builds, pydantic's ``Z`` in those copied from an event (notices, refusals, topology changes).
The figures are defined once, in :mod:`spotrun.orchestrator.ledger.losses` and
:mod:`spotrun.orchestrator.ledger.goodput`; these models only carry them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, PrivateAttr, SerializerFunctionWrapHandler, model_serializer

from spotrun.orchestrator.ledger.events import BundleRejected, CorruptEvent, TopologyChanged
from spotrun.orchestrator.ledger.goodput import Goodput
from spotrun.orchestrator.ledger.losses import Totals
from spotrun.orchestrator.policy.interval import IntervalInputs

JobState = Literal["unknown", "running", "finished", "failed", "refused"]


class _Row(BaseModel):
    model_config = ConfigDict(extra="forbid")


class AttemptRow(_Row):
    """One attempt: when it ran, on how many ranks, what it published, how far it got, how it ended."""

    attempt: int
    started_at: str | None  # its attempt_started (None: never recorded)
    ended_at: str | None  # its last event
    world_size: int | None
    node_ids: list[str]  # per rank
    published: int  # bundles it published
    last_update: int | None  # its reach (losses.reaches; None: nothing known)
    ended: str | None  # "finished", "lost: <cause>", "failed: <reason>", "scale-up to <n>",
    # "straggler rank <r> replaced"; None: not recorded
    # set only by the event that carries it: absent from the document otherwise (see _keys)
    lineage_id: str | None = None  # from attempt_started
    initialized_from: str | None = None  # from initialized_from (a new lineage): the bundle it began from
    recovery_label: str | None = None
    reset: list[str] | None = None  # the state initialized_from left fresh
    last_update_source: str | None = None  # losses.Reach.source
    _recorded: list[str] = PrivateAttr(default_factory=list)  # the optional fields set, in that order

    def record(self, **values: Any) -> None:
        """Set optional fields (``lineage_id``, ``initialized_from``, ...), keeping the order they came in."""
        for name, value in values.items():
            setattr(self, name, value)
            if name not in self._recorded:
                self._recorded.append(name)

    @model_serializer(mode="wrap")
    def _keys(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """The fixed fields, then the optional ones the ledger set (in its order), then the reach's source."""
        doc: dict[str, Any] = handler(self)
        out = {k: doc[k] for k in ("attempt", "started_at", "ended_at", "world_size", "node_ids", "published",
                                   "last_update", "ended")}
        out.update({k: doc[k] for k in self._recorded})
        out["last_update_source"] = doc["last_update_source"]
        return out


class RestartRow(_Row):
    """One restart: its cause, what it resumed from and how, and what it cost (figures: ``losses``)."""

    attempt: int  # the attempt the restart began
    cause: str  # the loss's cause, "scale-up", "straggler", "resumed" (an ended job run again) or "driver-exit"
    loss: Literal["preemption", "failure"] | None  # None: not recorded, or no loss
    # where it came from: the rank lost (or the straggler replaced), its node and machine (None: not recorded,
    # or not one rank's loss: a driver's death, a scale-up)
    rank: int | None
    node_id: str | None
    host: str | None
    # a rank found hung or stuck (None otherwise): which signal found it, the phase and update of its last
    # answer, and the storage key of the stacks taken before it was killed (None: they could not be kept)
    signal: Literal["hang", "stuck"] | None
    stopped_phase: str | None
    stopped_update: int | None
    stacks: str | None
    detected_at: str
    restored_from: str | None  # the bundle (None: from nothing)
    restored_update: int
    recovery_label: str  # "fresh" from nothing
    recovery_path: str  # cold | warm-*: see policy.recovery
    cold_because: str | None
    policy: str | None
    restore_mode: str | None
    world_size_before: int | None
    world_size_after: int | None
    lost_updates: int | None  # losses.lost_updates (None: not known)
    lost_updates_source: str | None
    lost_range: list[int]  # losses.lost_range: [first, last], empty when none
    restore_seconds: float
    downtime_seconds: float | None  # losses.downtime_seconds
    time_lost_seconds: float | None  # losses.time_lost_seconds
    notice_to_publish_seconds: float | None  # the notice before it, when one was handled


class StragglerRow(_Row):
    """A rank flagged as a straggler in one attempt (``slowdowns``): when first, how slow at most, and
    whether a spare took its place (``straggler_replacing``)."""

    attempt: int
    rank: int
    node_id: str | None  # None: not recorded
    flagged_at: str  # the first slowdowns event that named it
    flagged_update: int  # the update the attempt had reached then
    max_slowdown: float  # the largest of its figures in the attempt: its own work over its peers' median
    replaced: bool


class RankSlowdown(_Row):
    """One rank's figure in the newest attempt's newest ``slowdowns`` event."""

    attempt: int
    update: int  # the update the attempt had reached when it was recorded
    rank: int
    node_id: str | None  # None: not recorded
    slowdown: float  # its median own-work time over the median of its peers'
    straggler: bool  # at or over world.straggler_ratio


class NoticeRow(_Row):
    """A preemption notice seen, acted on or ignored (the ``notice`` event's fields)."""

    at: str
    attempt: int
    source: str
    node_id: str | None
    rank: int | None
    deadline: str | None
    action: str
    reason: str


class RefusalRow(_Row):
    """A run that trained nothing (``run_refused``): when, which check, the bundle it read, the paragraph."""

    at: str
    check: str
    bundle: str | None
    reason: str


class IntervalRow(_Row):
    """One choice of ``checkpoint.every_updates: auto``: the decision, why it was taken, and its inputs."""

    attempt: int
    at: str
    reason: str
    # the decision (policy.interval.IntervalDecision), flat
    interval_s: float
    interval_updates: int | None
    checkpoint_cost_s: float | None
    mtbp_s: float
    mtbp_losing_work_s: float
    expected_lost_work_s: float
    expected_overhead: float
    bound: Literal["min", "max"] | None
    inputs: IntervalInputs


class OutageRow(_Row):
    """A storage outage the driver recorded once storage answered again (``storage_outage``)."""

    attempt: int  # the attempt running when it began
    began_at: str
    ended_at: str
    seconds: float
    first_error: str  # the first refusal, as the path that met it said it
    paths: list[str]  # the storage paths that met it ("ledger", "publisher", "placing", "rank R checkpoints")
    requests_refused: int
    bundles_skipped: int  # checkpoints not taken or abandoned (per attempt, the most any one rank skipped)
    newest_bundle: str | None  # the newest published bundle while it lasted (None: none yet)
    newest_update: int | None
    update_at_end: int  # the update the attempt had reached when storage answered
    updates_at_risk: int  # losses.updates_at_risk: what a loss at its end would have thrown away
    full_disk: bool


class BudgetUse(_Row):
    """What the newest run of the driver used and has left of each budget (None: no limit or not recorded)."""

    failures: int | None
    max_restarts: int | None
    failures_left: int | None
    preemptions: int | None
    max_preemptions: int | None
    preemptions_left: int | None


class Budgets(_Row):
    """Losses by class over the whole ledger, and the newest run's use of the budgets."""

    preemptions: int
    failures: int
    unclassified: int  # losses recorded before losses were classed
    this_run: BudgetUse


class SpacePrunedRow(_Row):
    """Older bundles removed to make room on a full disk (``space_pruned``): the job kept fewer than
    ``checkpoint.keep_last`` until new bundles were published."""

    attempt: int
    at: str
    bundles: list[str]  # the keys removed, oldest first; never the newest published bundle
    freed_bytes: int  # as the removed bundles' manifests record them
    reason: str  # the refusal that asked for room (ENOSPC or EDQUOT, and where)


class ProcessRow(_Row):
    """One rank process over the attempts it served, from each attempt's ``footprints``: what a process kept
    through warm restarts gained (the first attempt's footprint against the last's)."""

    pid: int
    rank: int  # the rank it served in its last attempt (a warm restart may renumber a process)
    first_attempt: int
    last_attempt: int
    attempts: int  # the attempts it served
    rss_first_bytes: int
    rss_last_bytes: int
    fds_first: int
    fds_last: int
    threads_first: int
    threads_last: int
    process_groups_max: int


class History(_Row):
    """A job's restart history (see :func:`~spotrun.orchestrator.ledger.history.history`)."""

    job_id: str
    state: JobState  # history.state_of
    attempts: list[AttemptRow]  # by attempt number
    restarts: list[RestartRow]  # by attempt number
    topology_changes: list[TopologyChanged]
    rejected_bundles: list[BundleRejected]
    corrupt_events: list[CorruptEvent]  # ledger files that do not parse
    notices: list[NoticeRow]
    refusals: list[RefusalRow]  # oldest first
    budgets: Budgets
    checkpoint_intervals: list[IntervalRow]  # oldest first
    outages: list[OutageRow]  # storage outages, oldest first
    newest_published_at: str | None  # when the newest bundle_published was recorded (None: none)
    stragglers: list[StragglerRow]  # one per attempt and rank ever flagged, by attempt then first flagged
    slowdowns: list[RankSlowdown]  # by rank; empty when the newest attempt has recorded none
    space_pruned: list[SpacePrunedRow] = []  # oldest first: bundles removed to make room on a full disk
    processes: list[ProcessRow] = []  # every rank process by its first attempt, then pid (footprints)
    totals: Totals  # losses.totals over the restarts
    goodput: Goodput
