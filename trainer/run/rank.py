"""One rank's attempt: updates, the checkpoint barrier, background writes, and reports.

After every update the ranks agree on three flags, *checkpoint here*, *stop after it* and
*abort*, and average the update's loss and metrics, in the gradients' own all-reduce (a small
collective of their own where no gradient sync runs: one rank, or DDP's sync).
A flag is raised by the schedule (``checkpoint.every_updates``, the last update) or by the supervisor
(:meth:`RankRunner.request`: on a preemption notice, or each checkpoint under
``every_updates: auto``), so every rank takes
the same boundary even though a request reaches each rank at a different time.

At an agreed boundary each rank captures its state to host memory (the stall),
hands it to its background writer, and goes on training. Finished writes are
reported through :meth:`poll`; the supervisor alone publishes the manifest once
every rank's files are written. Rank 0 attaches the manifest draft (counters,
cursor, compatibility facts as of the boundary).

Thread safety: ``run`` executes on one thread; ``request`` and ``poll`` may be
called from another (a Ray actor with ``max_concurrency`` > 1).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from spotrun.trainer.bundle.bundles import (
    BundleWriter,
    LoadedBundle,
    WriteResult,
    bundle_dir,
    list_bundles,
    load_bundle,
)
from spotrun.trainer.bundle.compat import check_compatible
from spotrun.trainer.bundle.description import build_manifest
from spotrun.trainer.bundle.manifest import Manifest
from spotrun.trainer.data.feed import TokenFeed
from spotrun.trainer.data.growth import GrowthRecords
from spotrun.trainer.job.spec import JobSpec
from spotrun.trainer.metrics import MetricSink, NullSink, metrics_dir, open_sinks, points_of
from spotrun.trainer.metrics.writer import BackgroundWriter
from spotrun.trainer.observe.faults import FaultLog
from spotrun.trainer.observe.footprint import Footprint, measure
from spotrun.trainer.observe.ranklog import RankLine
from spotrun.trainer.observe.trace import UpdateRecord, pack_stages, unpack_stages
from spotrun.trainer.run.beacon import Phase, Reading
from spotrun.trainer.run.context import AttemptContext, MlflowSend
from spotrun.trainer.run.overlap import WriteOverlap
from spotrun.trainer.run.session import TrainSession
from spotrun.trainer.run.visibility import Probe, RankProbe, answer_probe
from spotrun.trainer.run.warm import REPLICATED, Held, Kept, assemble, ineligible, shipped
from spotrun.trainer.run.write_gate import WriteGate
from spotrun.trainer.runtime.collective import Collective
from spotrun.trainer.state.training import CopiesDone
from spotrun.trainer.storage import StorageError, open_storage
from spotrun.trainer.storage.outage import OutageView


@dataclass
class BundleReport:
    """One rank's finished write of one bundle."""

    rank: int
    attempt: int  # the attempt that wrote it: only that attempt's ranks can complete the bundle
    bundle_key: str
    update: int
    files: list[dict[str, Any]]
    write_seconds: float
    draft: dict[str, Any] | None = None  # rank 0: the manifest without files
    # what the updates this write overlapped took beyond plain ones (trainer/run/overlap.py; None: not measured)
    overlap_seconds: float | None = None
    shipped: dict[str, bytes] = field(default_factory=dict)  # the files the driver keeps (trainer/run/warm.py)


class RankState(StrEnum):
    """Where a rank's run stands, as its reports say (a ``str``: ``"finished"`` compares equal)."""

    RUNNING = "running"  # training, or its run has not returned yet
    FINISHED = "finished"  # trained to the job's last update
    STOPPED = "stopped"  # stopped after the checkpoint a stop request asked for (the job goes on elsewhere)
    ABORTED = "aborted"  # gave the attempt up at a boundary without a checkpoint (abort)


@dataclass
class Report:
    """What a rank did since the last poll."""

    rank: int
    last_update: int
    records: list[UpdateRecord] = field(default_factory=list)  # rank 0 only
    bundles: list[BundleReport] = field(default_factory=list)
    state: RankState = RankState.RUNNING
    storage_retries: int = 0  # transient storage errors this rank retried so far (cumulative)
    # its checkpoints' storage path (trainer/run/write_gate.py): down or not, its refusals so far, and the
    # checkpoints it skipped or abandoned so far (cumulative): what the driver records an outage from
    storage: OutageView | None = None
    checkpoints_skipped: int = 0
    # the lines the rank's code wrote since the last poll (its process or thread fills them in:
    # trainer/observe/ranklog.py)
    output: list[RankLine] = field(default_factory=list)
    # where the training thread was when polled (trainer/run/beacon.py): the driver's progress signal
    reading: Reading | None = None
    # a bundle write abandoned since the last poll because the storage is full (its error, naming
    # ENOSPC or EDQUOT and the path): the driver prunes older bundles so that the next one fits
    full_disk: str | None = None
    # this process's holdings, once per attempt: at the first poll after training began (trainer/observe/footprint.py)
    footprint: Footprint | None = None


class RankRunner:
    def __init__(self, ctx: AttemptContext, *, rank: int, collective: Collective, device: str = "cpu",
                 probe: RankProbe | None = None, session: TrainSession | None = None,
                 held: Held | None = None) -> None:
        """Serve attempt ``ctx`` as rank ``rank`` of ``ctx.world_size``, in ``collective``'s process group.

        ``probe``: the driver's storage probe (:mod:`~spotrun.trainer.run.visibility`), read back and
        answered before anything is built; ``StorageNotShared`` when this rank cannot see it. None
        where the driver shares this process (nothing to prove).

        ``session`` and ``held``: a warm restart (trainer/run/warm.py) serves this attempt with the
        session an earlier attempt of this process built, and the captures its host memory holds."""
        spec, world_size = ctx.spec, ctx.world_size
        self.ctx = ctx
        self.spec = spec
        self.rank = rank
        self.attempt = ctx.attempt
        self.lineage_id = ctx.lineage_id
        self.recovery_label = ctx.recovery_label
        self.collective = collective
        self.storage = open_storage(spec.storage, spec.storage_endpoint_url)
        # first: a rank on storage the driver cannot see fails before it builds the job (seconds) or writes to it
        self.probe: Probe | None = answer_probe(self.storage, probe) if probe is not None else None
        instrument = ctx.instrument
        self.trace = instrument.trace  # every rank's stage digests reach rank 0's record
        grad_sync = _grad_sync(spec, collective, world_size)
        if session is not None:
            session.rejoin(rank=rank, world_size=world_size, attempt=ctx.attempt, grad_sync=grad_sync,
                           instrument=instrument)
            self.session = session
        else:
            self.session = TrainSession(spec, rank=rank, world_size=world_size, attempt=ctx.attempt,
                                        restore_mode=ctx.restore_mode, grad_sync=grad_sync, instrument=instrument,
                                        device=device)
        # Warm recovery: every rank holds the newest bundle it wrote (a replicated model and
        # optimizer on every rank), and sends the driver its own small files with each write.
        self.warm = ineligible(spec) is None and world_size > 1
        self.held = held or Held()
        if isinstance(self.session.feed, TokenFeed):  # a growing source's rescans, agreed across ranks
            self.session.feed.growth = GrowthRecords(self.storage, spec.job_id, ctx.lineage_id)
        self.session.faults.record_to(FaultLog(self.storage, spec.job_id))  # verify counts what fired
        self._asked = threading.Event()  # set by request() and abort(): ends a HOLD fault's wait
        self.session.faults.hold_with(self._hold)
        self.session.faults.published_with(self._published)
        self.writer = BundleWriter(self.storage, self.session.faults, ship=shipped if self.warm else None)
        # an outage skips checkpoints, never ends the job; a full disk is reported (the driver makes room)
        self.gate = WriteGate(rank, spec.storage_outage_s, on_full=self._full_disk)
        self.overlap = WriteOverlap()  # the write's cost beyond the stall, for checkpoint.every_updates=auto
        # Rank 0 writes the metric points, off the training thread; each upserts by <job>/<update>/<name>.
        self.metrics: MetricSink = NullSink()
        if rank == 0 and spec.metrics.sinks:
            at_write = instrument.mlflow_send is MlflowSend.AT_WRITE
            sinks = open_sinks(
                spec.metrics.sinks, metrics_dir(spec.storage, spec.job_id, spec.metrics.local_dir), self.storage,
                mlflow=spec.metrics.mlflow, job_id=spec.job_id, at_write=at_write)
            # verify's broken build sends on the training thread, as a tracker callback does: a point is in
            # MLflow once its update ends, so a kill in the next update always leaves it there to be replayed
            # (from the writer's thread, a kill could beat the send and hide the defect verify must catch)
            self.metrics = sinks if at_write else BackgroundWriter(sinks)
        self._lock = threading.Lock()
        # The write path: the writer, the drafts, the write-overlap meter, the held captures and the gate
        # change under this lock, taken by the training thread (at a checkpoint, after each update) and
        # by the poll thread, which reports a finished write while the training thread is blocked in a
        # collective (a peer held up would otherwise sit on its written bundle, unpublished). Taken before
        # ``_lock``, never after it.
        self._writing = threading.Lock()
        self._looping = False  # the poll thread collects only while the loop runs (a restore reads ``held``)
        self._measured = False  # this attempt's footprint went with a report
        self._news = threading.Event()  # set: the next poll holds what the supervisor acts on at once
        self._checkpoint_requested = False
        self._stop_requested = False
        self._abort_requested = False
        self._report = Report(rank=rank, last_update=self.session.counters.attempted_updates)
        self._drafts: dict[str, tuple[dict[str, Any], Any]] = {}  # bundle key -> (draft, its capture's copies)

    # -- called by the supervisor ---------------------------------------------------------

    def restore(self, bundle_key: str, *, storage_uri: str | None = None,
                reset: tuple[str, ...] = ()) -> tuple[float, list[str]]:
        """Verify and load a published bundle; raises a ``BundleError`` naming why not.
        Returns the seconds it took and the state categories the restore oracle found
        different from the bundle (empty when faithful; see TrainSession.roundtrip).

        ``storage_uri`` names another job's storage (``--init-from``): the bundle may then
        belong to another job, and ``reset`` lists what the new lineage starts afresh."""
        # Another job's storage is assumed to sit behind the same endpoint as this job's.
        storage = open_storage(storage_uri, self.spec.storage_endpoint_url) if storage_uri else self.storage
        bundle = load_bundle(storage, bundle_key, self.session.desc, same_job=storage_uri is None,
                             want=self.session.wants, reset=reset)
        seconds = self.session.restore(bundle)
        if storage_uri is not None:
            self.session.start_new_lineage(reset)
            mismatches: list[str] = []
        else:
            mismatches = self._checked(bundle)
        self._report.last_update = self.session.counters.attempted_updates
        return seconds, mismatches

    def restore_from_memory(self, key: str, manifest: Manifest, shipped_files: dict[str, bytes],
                            replica: Kept | None = None) -> tuple[float, list[str]]:
        """Restore published bundle ``key`` (its ``manifest``) from memory (trainer/run/warm.py): the files
        the driver kept (``shipped_files``), this rank's own kept capture, a survivor's ``replica``.
        The same restore and restore oracle as :meth:`restore` (and, as there, the seconds returned are
        the state load's); raises ``NotInMemory`` (restart from storage) when a file this rank reads is
        held nowhere."""
        self.session.faults.hit("rejoin", manifest.counters.attempted_updates + 1)
        check_compatible(manifest, self.session.desc, f"bundle {key}", root=self.storage.uri)
        kept = [*self.held.by_generation.values(), *([replica] if replica is not None else [])]
        bundle = LoadedBundle(key, manifest, assemble(key, manifest, self.session.wants(manifest),
                                                      shipped_files, kept))
        seconds = self.session.restore(bundle)
        mismatches = self._checked(bundle)
        self._report.last_update = self.session.counters.attempted_updates
        return seconds, mismatches

    def _checked(self, bundle: LoadedBundle) -> list[str]:
        """The restore oracle on ``bundle`` just restored; where it finds nothing, the capture it took
        holds the bundle: this rank keeps it (a loss before the next bundle restarts warm from it)."""
        generation = self.held.next_generation(avoid=bundle.key)  # the restore may have read those buffers
        mismatches, capture = self.session.roundtrip_capture(bundle, keep_replica=self.warm, generation=generation)
        if not mismatches:
            self.held.add(generation, Kept(bundle.key, capture.files()))
        return mismatches

    def replica(self, bundle_key: str) -> Kept | None:
        """The replicated model and optimizer of ``bundle_key`` this rank holds (for a spare), or None."""
        kept = self.held.get(bundle_key)
        if kept is None:
            return None
        return Kept(bundle_key, {p: v for p, v in kept.files.items() if p.startswith(REPLICATED)})


    def request(self, checkpoint: bool = True, stop: bool = False) -> None:
        """Ask for a checkpoint at the next boundary (and to stop after publishing it)."""
        with self._lock:
            self._checkpoint_requested |= checkpoint or stop
            self._stop_requested |= stop
        self._asked.set()

    def abort(self) -> None:
        """Stop at the next boundary without a checkpoint (the supervisor gave this attempt up)."""
        with self._lock:
            self._abort_requested = True
        self._asked.set()

    def wake(self) -> None:
        """Something the supervisor must see at once arrived (a preemption notice, say): end
        :meth:`wait_for_news`."""
        self._news.set()

    def wait_for_news(self, timeout: float) -> bool:
        """Block until the next poll holds news (a written bundle, a :meth:`wake`) or ``timeout``
        passes. The supervisor waits on this between polls, so that a bundle is published as soon as
        every rank wrote it, however long its poll interval."""
        return self._news.wait(timeout)

    def poll(self) -> Report:
        """What happened since the last poll. A finished bundle write is collected here too, unless the
        training thread is on the write path itself (it then collects the write) or the write failed
        (the training thread's to handle: the gate, an outage)."""
        if self._looping and self._writing.acquire(blocking=False):
            try:
                if self._looping:
                    self._collect(self.writer.poll(failed=False))
            finally:
                self._writing.release()
        with self._lock:
            self._news.clear()  # under the lock: news reported after this swap sets it again
            report, self._report = self._report, Report(rank=self.rank, last_update=self._report.last_update,
                                                        state=self._report.state)
        report.storage_retries = getattr(self.storage, "retries", 0)  # the S3 metric sink shares this storage
        report.storage, report.checkpoints_skipped = self.gate.outage.view(), self.gate.skipped
        report.reading = self.session.beacon.read()
        if self._looping and not self._measured:
            report.footprint, self._measured = measure(), True
        return report

    # -- the loop -----------------------------------------------------------------------

    def run(self) -> RankState:
        """Train to the end of the job (or a requested stop); returns the final state."""
        s = self.session
        s.start()
        state = RankState.FINISHED
        self._looping = True
        try:
            while not s.done:
                t0 = time.perf_counter()
                record = s.run_update(self._flags)
                if self.trace:
                    self._gather_stages(record)
                names = sorted(record.metrics)
                agreed = s.agreed_flags  # the flags, loss and metrics rode with the gradients
                if agreed is None:  # no gradient sync (one rank, or DDP's own): a collective of their own
                    s.beacon.enter(Phase.BARRIER)
                    (record.loss, *values), agreed = self.collective.mean_and_agree(
                        [record.loss, *(record.metrics[n] for n in names)], self._flags(record.update))
                    record.metrics = dict(zip(names, values, strict=True))
                checkpoint, stop, abort = agreed
                with self._writing:
                    self.overlap.update(time.perf_counter() - t0)
                self.metrics.write(points_of(self.spec.job_id, record.update, self.attempt, self.lineage_id,
                                             {"loss": record.loss, "lr": record.lr, "applied": record.applied,
                                              **record.metrics}))
                with self._lock:
                    if self.rank == 0:
                        self._report.records.append(record)
                    self._report.last_update = record.update
                if abort:
                    state = RankState.ABORTED
                    break
                if checkpoint:
                    with self._lock:
                        self._checkpoint_requested = False
                        if not (self._stop_requested or self._abort_requested):
                            # a HOLD after this boundary waits for the next request: under auto the
                            # supervisor asks again and again, and one it made long ago holds nothing
                            self._asked.clear()
                    with self._writing:
                        self._checkpoint(record.update)
                with self._writing:
                    self._collect(self.gate.finished(self.writer.poll))
                if stop and not s.done:
                    state = RankState.STOPPED
                    break
            with self._writing:
                self._collect(self.gate.finished(self.writer.wait))
            s.beacon.enter(Phase.DONE)
        finally:
            with self._writing:
                self._looping = False
            self.writer.close()
            self.metrics.close()
            s.close()
        with self._lock:
            self._report.state = state
        return state

    def _hold(self) -> None:
        """A HOLD fault, on the training thread: report the bundle write in flight once it is done (at
        once, not at the next poll), then wait until asked to checkpoint, stop or abort (a checkpoint
        request the rank already took at an earlier boundary does not count)."""
        with self._writing:
            self._collect(self.writer.wait())
        self._asked.wait()

    def _published(self, update: int) -> bool:
        """Whether a bundle of ``update`` is published (a fault's ``after_bundle``); a storage error is a no."""
        try:
            return any(r.published and r.update == update for r in list_bundles(self.storage, self.spec.job_id))
        except StorageError:
            return False

    def _full_disk(self, reason: str) -> None:
        """A write abandoned for want of room (the gate's ``on_full``): news for the driver, which makes room."""
        with self._lock:
            self._report.full_disk = reason
            self._news.set()

    def _flags(self, update: int) -> list[bool]:
        """This rank's boundary flags for ``update``: checkpoint (asked for, or scheduled), stop, abort."""
        with self._lock:
            wanted = [self._checkpoint_requested, self._stop_requested, self._abort_requested]
        return [wanted[0] or self.spec.checkpoint.scheduled(update, self.spec.train.updates), wanted[1], wanted[2]]

    def _gather_stages(self, record: UpdateRecord) -> None:
        """Every rank's stage digests into ``record`` (one all-gather; only rank 0's is reported)."""
        payloads = self.collective.gather_bytes(pack_stages(record.blocks or [], record.ranks or []))
        record.blocks, record.ranks = unpack_stages(payloads, self.session.accum_steps)

    def _checkpoint(self, update: int) -> None:
        """Capture the state at this boundary and hand it to the background writer (under ``_writing``).

        The stall is everything the loop waits for here, from the first line to the hand-off:
        the metric points reaching their sinks, the previous write finishing (the capture reuses
        the host buffers it reads), the capture, rank 0's manifest draft. Rank 0's figures go into the manifest."""
        s = self.session
        key = bundle_dir(self.spec.job_id, update, self.attempt)
        final = update >= self.spec.train.updates
        if not self.gate.opens(update, final):
            return
        # the whole boundary stall (the metric sinks, the previous write, the capture) reads as capture: its
        # length follows storage, not the update time, so a peer waiting through it is no sign of a stuck rank
        s.beacon.enter(Phase.CAPTURE)
        prefetched = s.prefetched_ahead
        t0 = time.perf_counter()
        # Every point up to this update is in the sink before this bundle can be published (a kill
        # loses only points the restart replays). The loop waits for it because of the checkpoint,
        # so it is stall: the background writer's last batch and the s3 sink's one request per interval.
        if not self.gate.attempt(update, self.metrics.flush, final):
            return
        t1 = time.perf_counter()
        self._collect(self.gate.finished(self.writer.wait))
        self._drafts.clear()  # nothing is in flight now: a draft left is an abandoned write's
        waited = time.perf_counter() - t1
        capture = s.capture(keep_replica=self.warm, generation=self.held.next_generation() if self.warm else 0)
        draft = None
        if self.rank == 0:
            shards = s.known_shards()
            draft = build_manifest(
                s.desc, s.state, bundle_key=key, lineage_id=self.lineage_id, attempt=self.attempt,
                recovery_label=self.recovery_label, accum_steps=s.accum_steps,
                prefetched_ahead=prefetched, stall_seconds=0.0, shards=shards,  # known once handed off
                source_offsets=s.source_offsets(shards),
            ).model_dump(mode="json")
        self._collect(self.writer.submit(capture, key, self.gate.outage if final else None))
        self.overlap.began(key)
        if draft is not None:
            # read when this bundle's write is collected: later, under the same lock
            self._drafts[key] = ({**draft, "stall_seconds": time.perf_counter() - t0,
                                  "write_wait_seconds": waited, "capture_seconds": capture.stall_seconds},
                                 capture.ready)

    def _collect(self, result: WriteResult | None) -> None:
        """Report a finished write (under ``_writing``): its draft, overlap and capture kept for warm recovery."""
        if result is None:
            return
        draft = _with_copy_wait(*self._drafts.pop(result.bundle_key, (None, None)))
        report = BundleReport(
            rank=self.rank, attempt=self.attempt, bundle_key=result.bundle_key, update=result.update,
            files=[f.model_dump() for f in result.files], write_seconds=result.write_seconds, draft=draft,
            overlap_seconds=self.overlap.ended(result.bundle_key, draft["copy_wait_seconds"] if draft else 0.0),
            shipped=result.shipped,
        )
        if self.warm and result.capture is not None:
            self.held.add(result.capture.generation, Kept(result.bundle_key, result.capture.files()))
        with self._lock:
            self._report.bundles.append(report)
            self._news.set()



def _grad_sync(spec: JobSpec, collective: Collective, world_size: int) -> Any:
    """The loop's gradient sync, which also carries the update's riders: the flat all-reduce, or for a
    sharded model (whose gradients FSDP reduced in backward) the riders alone; none for one rank or
    DDP (its hooks sync, and the riders take a collective of their own)."""
    if world_size == 1:
        return None
    if spec.train.parallelism == "fsdp":
        return collective.sync_sharded
    return collective.sync_gradients if spec.train.grad_sync == "allreduce" else None


def _with_copy_wait(draft: dict[str, Any] | None, copies: Any) -> dict[str, Any] | None:
    """The draft with the time the loop blocked, at its next optimizer step, on the capture's deferred
    copies (CPU): part of the stall. A write is collected only after those copies landed, so the wait
    is either over or, where the loop has not reached that step yet, will find them done."""
    if draft is None:
        return None
    wait = copies.loop_wait_seconds if isinstance(copies, CopiesDone) else 0.0
    return {**draft, "copy_wait_seconds": wait, "stall_seconds": draft["stall_seconds"] + wait}
