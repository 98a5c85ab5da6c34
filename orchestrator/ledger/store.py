"""The event ledger: an append-only, create-only record of what happened to a job.

Each event is one JSON file ``<job_id>/events/<seq:012d>.json`` written with
create-only semantics, so two writers never overwrite each other: a writer that
loses the race for a sequence number takes the next one. A later process (the
``history`` command, the dashboard) rebuilds the whole story from these files.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from spotrun.orchestrator.ledger.folding import (
    DEFAULT_FOLD,
    SEGMENTS,
    FoldPolicy,
    Listing,
    Span,
    body,
    foldable,
    line,
    lines_of,
    plan,
    segment_key,
    single_key,
    single_line,
)
from spotrun.trainer.state.counters import Counters
from spotrun.trainer.storage import Storage, StorageError, list_versions

log = logging.getLogger(__name__)


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


RecoveryPath = Literal["cold", "warm-spare", "warm-replace", "warm-shrink"]


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
    # How the ranks got the bundle back: ``cold`` a new group of processes read it from storage;
    # ``warm-spare``/``warm-replace``/``warm-shrink`` the surviving processes put it back from host memory,
    # with a spare in each lost rank's place, a new process placed there, or in a smaller world
    # (orchestrator/workers/raygroup.py, trainer/run/warm.py).
    recovery_path: RecoveryPath = "cold"
    cold_because: str | None = None  # a restart after a loss that went cold: why not warm


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


class NoticeHandled(_Event):
    """The bundle a notice asked for is published: an emergency one (the ranks have stopped) or, with
    ``early``, an early checkpoint's (training goes on: a later loss costs only the updates since)."""

    kind: Literal["notice_handled"] = "notice_handled"
    source: str
    bundle: str
    update: int
    notice_to_publish_seconds: float
    early: bool = False
    acknowledged: str | None = None  # the cloud's event acknowledged after the publish (Azure's EventId)


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
    """What ``checkpoint.every_updates: auto`` decides from (see orchestrator/policy/interval.py)."""

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


class SparesReady(_Event):
    """The spares (``world.spares``) built and waiting changed in number: a lost rank's place can be
    taken at once by as many ranks as are ready."""

    kind: Literal["spares_ready"] = "spares_ready"
    ready: int
    wanted: int  # world.spares


class JobFailed(_Event):
    kind: Literal["job_failed"] = "job_failed"
    reason: str


# Before anything started (spotrun run): finished, the newest bundle already reached train.updates and
# there is nothing to run (exit 0); incompatible, the newest bundle cannot take this spec or code (exit 2);
# unreadable, the newest manifest's schema is unknown to this spotrun (exit 2). While the run's first
# attempt started: start, a rank or the driver refused bad input (a job that cannot be built, a bundle
# whose data, tokenizer, parameters or runtime differ, storage the ranks do not share; exit 2).
RefusalCheck = Literal["finished", "incompatible", "unreadable", "start"]


class RunRefused(_Event):
    """A run of the job that trained nothing: refused before anything started, from storage and the
    driver's own copy of the job's code (:mod:`spotrun.orchestrator.control.preflight`), or while its first
    attempt started. An event of its own, never a ``job_failed``: a refused run does not change what
    the job's record says it is (a finished job stays finished). ``attempt``: the number of the run's
    first attempt (refused before it started, it is the next run's number too)."""

    kind: Literal["run_refused"] = "run_refused"
    check: RefusalCheck
    bundle: str | None = None  # the bundle the check read (None: not known to the driver)
    reason: str  # the paragraph the command printed


Event = Annotated[
    AttemptStarted | Restored | InitializedFrom | BundleRejected | BundlePublished | WorkerLost | CapacityWait
    | TopologyChanged | Resizing | OffsetsCommitted | NoticeSeen | NoticeHandled | JobFinished | JobFailed
    | IntervalChosen | SparesReady | RunRefused,
    Field(discriminator="kind"),
]
_EVENT = TypeAdapter(Event)


class CorruptEvent(BaseModel):
    """An event file that could not be parsed: shown as such, never a crash."""

    kind: Literal["corrupt"] = "corrupt"
    key: str
    error: str


class _SegmentLine(BaseModel):
    """A line of a ledger segment (:mod:`spotrun.orchestrator.ledger.folding`): a single's event and its number."""

    model_config = ConfigDict(extra="forbid")

    seq: int
    event: Event


_LINE = TypeAdapter(_SegmentLine)
READ_LISTINGS = 5  # listings a read makes while folds remove what the previous one named


@dataclass
class _Segment:
    """A segment, parsed: ``(order, seq, event)`` per line and the sequence numbers its lines hold."""

    entries: list[tuple[int, int | None, _Event | CorruptEvent]]
    held: set[int]


class Ledger:
    """A job's events: create-only singles under ``<job>/events/``, folded by the writer into
    create-only segments (:mod:`spotrun.orchestrator.ledger.folding`) so that a reader pays one request per
    segment, not per event. An instance keeps what it parsed (by key, and by ETag where the storage
    lists one) and parses only new objects when read again: a supervisor at every placement, the
    dashboard at every refresh. Reads and appends of one instance are serialised."""

    def __init__(self, storage: Storage, job_id: str, on_append: Callable[[_Event], None] | None = None, *,
                 fold: FoldPolicy | None = DEFAULT_FOLD) -> None:
        """``on_append``: told of every event once it is written (``spotrun run``'s progress display).
        ``fold``: the segment sizes this instance folds to when it appends; None: it never folds and
        writes as the ledger did before segments (a reader's choice, or a benchmark's baseline; a writer
        racing a folding one needs the check a folding writer makes after each write)."""
        self.storage = storage
        self.on_append = on_append
        self.fold = fold
        self.prefix = f"{job_id}/events/"
        self._next: int | None = None  # the next sequence number to try (None: not looked up yet)
        self._lock = threading.RLock()
        # key -> (its version, what it parsed to): singles and segments are written once, whole
        # (create-only), and never change, so a ledger read again parses only new keys
        self._parsed: dict[str, tuple[str | None, _Event | _Segment]] = {}
        self._raw: dict[str, bytes] = {}  # unfolded singles' bytes (a folding writer's): what a fold copies
        self._due = True  # a fold may be due: checked at the first append, then at block boundaries

    def _list(self) -> Listing:
        """List the events, forgetting what is gone (folded away, or the job deleted)."""
        listing = Listing(self.prefix, list_versions(self.storage, self.prefix))
        for cache in (self._parsed, self._raw):
            for key in [k for k in cache if k not in listing.versions]:
                del cache[key]
        return listing

    def append(self, event: _Event) -> str:
        """Write ``event`` under the next free sequence number; returns its key. A folding instance
        first makes sure the event will be read (see :mod:`~spotrun.orchestrator.ledger.folding`), then folds
        when a block may have closed: at its first append, at each block boundary, and after a fold
        that found work (one fold per append, so an append never waits for a long catch-up)."""
        blob = event.model_dump_json().encode()
        with self._lock:
            seq = self._write(blob)
            if self.on_append is not None:
                self.on_append(event)
            if self.fold is not None and (self._due or seq % self.fold.block == 0):
                self._due = self._fold(self._list(), self.fold)
            return single_key(self.prefix, seq)

    def _write(self, blob: bytes) -> int:
        """Create the next free single holding ``blob`` that readers will see; its sequence number."""
        while True:
            if self._next is None:
                self._next = self._list().top + 1
            seq, self._next = self._next, self._next + 1
            key = single_key(self.prefix, seq)
            if not self.storage.put_new(key, blob):
                continue
            if self.fold is None:
                return seq
            if self._visible(seq, blob):
                self._raw[key] = blob
                return seq
            # a segment holds another event under this number: ours would never be read
            self.storage.delete([key])
            self._next, self._due = max(self._next, self._list().top + 1), True

    def _visible(self, seq: int, blob: bytes) -> bool:
        """False if a segment holds another event under ``seq``, just written with ``blob``: the slot was
        free because its single had been folded and removed (this writer is behind another one)."""
        mine = line(seq, blob)
        for _ in range(READ_LISTINGS):
            segments = Listing(self.prefix, list_versions(self.storage, self.prefix + SEGMENTS)).segments
            try:
                held = [x.text for key, span in segments.items() if seq in span
                        for x in lines_of(self.storage.get(key), span) if x.seq == seq]
            except FileNotFoundError:
                continue  # merged into a larger segment since the listing
            return all(text == mine for text in held)
        raise self._unsettled()

    def _fold(self, listing: Listing, policy: FoldPolicy) -> bool:
        """Remove what segments replaced (left by a crash), then fold the next closed block; whether
        there was work (so more may be due). A failure here loses nothing (every event is written): it
        is logged, and the next append tries again."""
        try:
            removed = self._remove_replaced(listing)
            block = plan(listing, policy)
            if block is not None:
                self._fold_block(listing, block)
            return removed or block is not None
        except FileNotFoundError as e:  # another writer folded it meanwhile: nothing is lost, nothing to say
            log.info("ledger %s/%s: an object to fold is gone (%s); folding again at the next append",
                     self.storage.uri, self.prefix, e)
            return True
        except (StorageError, OSError) as e:
            log.warning("ledger %s/%s: folding stopped (%s); every event is written, the next append "
                        "folds again", self.storage.uri, self.prefix, e)
            return True

    def _remove_replaced(self, listing: Listing) -> bool:
        """Delete the singles and smaller segments inside a segment whose lines hold all their events;
        whether there were any."""
        doomed: list[str] = []
        for key, span in listing.segments.items():
            segments, singles = listing.inside(span)
            if not (segments or singles):
                continue
            held = self._segment(listing, key).held
            doomed += [listing.singles[n] for n in singles if n in held]
            doomed += [k for k in segments if self._segment(listing, k).held <= held]
        if doomed:
            self.storage.delete(sorted(set(doomed)))
        return bool(doomed)

    def _fold_block(self, listing: Listing, block: Span) -> None:
        """Write ``block``'s segment from the segments and singles inside it; remove those once it exists."""
        segments, singles = listing.inside(block)
        lines = [x for k in segments for x in lines_of(self.storage.get(k), listing.segments[k])]
        held = {x.seq for x in lines}
        folded = []
        for n in singles:
            key = listing.singles[n]
            raw = None if n in held else self._raw.get(key) or self.storage.get(key)
            if raw is None or foldable(raw):  # None: already in a segment here (left by a crash)
                folded.append(key)
                if raw is not None:
                    lines.append(single_line(n, raw))
        if self.storage.put_new(segment_key(self.prefix, block), body(lines)):
            self.storage.delete(segments + folded)
        # else another writer folded this block: it removes what it folded, or a later _remove_replaced does

    def read(self) -> list[_Event | CorruptEvent]:
        """Every event in sequence order, each once; one that does not parse is a :class:`CorruptEvent`
        (read again next time)."""
        with self._lock:
            for _ in range(READ_LISTINGS):
                listing = self._list()
                try:
                    return self._assemble(listing)
                except FileNotFoundError:
                    continue  # folded away since the listing: the next one names the segment that holds it
            raise self._unsettled()

    def _unsettled(self) -> StorageError:
        return StorageError(f"the ledger under {self.storage.uri}/{self.prefix} changed under each of "
                            f"{READ_LISTINGS} listings in a row; read it again (is a writer folding in a loop?)")

    def _assemble(self, listing: Listing) -> list[_Event | CorruptEvent]:
        """The segments' events, then every single no segment holds, by sequence number."""
        ordered: list[tuple[int, _Event | CorruptEvent]] = []
        seen: set[int] = set()
        for key, _ in sorted(listing.segments.items(), key=lambda kv: (kv[1].first, -kv[1].last)):
            for order, seq, event in self._segment(listing, key).entries:
                if seq is None or seq not in seen:
                    ordered.append((order, event))
                if seq is not None:
                    seen.add(seq)
        ordered += [(n, self._single(listing, key)) for n, key in listing.singles.items() if n not in seen]
        ordered.sort(key=lambda x: x[0])  # stable: a damaged line stays after the line before it
        return [e for _, e in ordered] + [
            CorruptEvent(key=k, error="not a ledger object name (NNNNNNNNNNNN.json or segments/FIRST-LAST.jsonl)")
            for k in listing.strays]

    def _single(self, listing: Listing, key: str) -> _Event | CorruptEvent:
        version = listing.versions[key]
        hit = self._parsed.get(key)
        if hit is not None and hit[0] == version and not isinstance(hit[1], _Segment):
            return hit[1]
        raw = self.storage.get(key)
        try:
            event = _EVENT.validate_json(raw)
        except (ValidationError, ValueError) as e:
            return CorruptEvent(key=key, error=str(e).splitlines()[0])
        self._parsed[key] = (version, event)
        if self.fold is not None:
            self._raw[key] = raw
        return event

    def _segment(self, listing: Listing, key: str) -> _Segment:
        version = listing.versions[key]
        hit = self._parsed.get(key)
        if hit is not None and hit[0] == version and isinstance(hit[1], _Segment):
            return hit[1]
        entries: list[tuple[int, int | None, _Event | CorruptEvent]] = []
        for i, x in enumerate(lines_of(self.storage.get(key), listing.segments[key]), 1):
            if x.seq is None:
                entries.append((x.order, None, CorruptEvent(key=key, error=f"line {i}: no sequence number "
                                                                           "of this segment's range")))
                continue
            try:
                entries.append((x.order, x.seq, _LINE.validate_json(x.text).event))
            except (ValidationError, ValueError) as e:
                entries.append((x.order, x.seq, CorruptEvent(key=single_key(self.prefix, x.seq),
                                                             error=f"in {key}: {str(e).splitlines()[0]}")))
        segment = _Segment(entries, {x[1] for x in entries if x[1] is not None})
        if not any(isinstance(e, CorruptEvent) for _, _, e in entries):  # a corrupt event is never kept
            self._parsed[key] = (version, segment)
        return segment

    def next_attempt(self) -> int:
        return 1 + sum(1 for e in self.read() if isinstance(e, AttemptStarted))
