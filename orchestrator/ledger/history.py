"""Views of a job built from its storage: the restart history and the bundles table.

The history is a :class:`~spotrun.orchestrator.ledger.history_model.History` (its JSON dump is what
``spotrun history --json`` prints); the bundles table is plain dicts (what ``spotrun bundles --json``
prints). The CLI renders both as tables.
"""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any

from spotrun.orchestrator.ledger.events import (
    AttemptStarted,
    BundlePublished,
    BundleRejected,
    CorruptEvent,
    Footprints,
    InitializedFrom,
    IntervalChosen,
    JobFailed,
    JobFinished,
    LedgerEvent,
    NoticeHandled,
    NoticeSeen,
    Resizing,
    Restored,
    RunRefused,
    Slowdowns,
    SpacePruned,
    StorageOutage,
    StragglerReplacing,
    TopologyChanged,
    WorkerLost,
)
from spotrun.orchestrator.ledger.goodput import goodput
from spotrun.orchestrator.ledger.history_model import (
    AttemptRow,
    Budgets,
    BudgetUse,
    History,
    IntervalRow,
    JobState,
    NoticeRow,
    OutageRow,
    ProcessRow,
    RankSlowdown,
    RefusalRow,
    RestartRow,
    SpacePrunedRow,
    StragglerRow,
)
from spotrun.orchestrator.ledger.losses import (
    Reach,
    downtime_seconds,
    lost_range,
    lost_updates,
    reaches,
    time_lost_seconds,
    totals,
    updates_at_risk,
)
from spotrun.orchestrator.ledger.store import Ledger
from spotrun.orchestrator.policy.budgets import Budget
from spotrun.trainer.bundle.bundles import BundleRef, list_bundles, read_manifest
from spotrun.trainer.bundle.errors import BundleCorrupt
from spotrun.trainer.bundle.manifest import ManifestError
from spotrun.trainer.storage import Storage

if TYPE_CHECKING:
    from spotrun.orchestrator.ledger.points import Points


def history(storage: Storage, job_id: str, points: Points | None = None,
            metrics_local_dir: str = "./spotrun-metrics", ledger: Ledger | None = None,
            listing: list[BundleRef] | None = None) -> History:
    """Attempts, one row per restart with its cause and what it cost, and the job's goodput; under
    ``checkpoint.every_updates: auto``, every interval it chose (``checkpoint_intervals``, oldest
    first: the decision, why it was taken, and its inputs).

    ``points``: the job's metric points, read from its sinks when not given (beside the bundles
    on file storage, else under ``metrics_local_dir``); goodput is computed from them and the
    ledger alone (see :mod:`spotrun.orchestrator.ledger.goodput`). ``ledger``: the job's ledger, kept by a
    caller that reads it again (the dashboard), so that only new events are fetched; a new one when
    not given. ``listing``: the job's bundles as :func:`~spotrun.trainer.bundle.bundles.list_bundles`
    returns them, when the caller listed them already (a week's job has tens of thousands); listed
    here when not given.

    A restart row joins the loss that ended an attempt (``worker_lost``; absent when
    the driver itself died) with the start of the next one: its restore, or, when no
    bundle was published yet (or none verified), its start from nothing, which loses
    everything the attempt before it did. Its figures (``lost_updates`` with their source and
    ``lost_range``, ``downtime_seconds``, ``time_lost_seconds``) are defined in
    :mod:`spotrun.orchestrator.ledger.losses`; ``totals`` sums them over the restarts.

    ``budgets``: the losses of each class over the whole ledger, and what the newest run of the
    driver has used and has left of each budget (``world.max_restarts`` for failures,
    ``world.max_preemptions`` for preemptions; None: no limit or not recorded).

    ``refusals``: the runs that trained nothing (``run_refused``, oldest first: when, which check, the
    bundle it read, the paragraph printed). They are not attempts and leave ``state`` as it was: a
    finished job run again stays finished.

    Where a loss came from: a restart row names the rank lost, its node and host, and, for a rank found
    hung or stuck, the signal, the phase and update it stopped in and the key of its stacks; a restart
    that replaced a straggler (``cause`` ``straggler``, a planned restart: no loss) names the straggler.
    ``stragglers``: every rank a ``slowdowns`` event flagged, one row per attempt and rank; ``slowdowns``:
    the newest attempt's newest figures, per rank (empty when it recorded none).

    ``outages``: the storage outages the driver recorded (``storage_outage``, oldest first: from, to, how
    long, the first refusal, the paths that met it, the requests refused, the checkpoints skipped, the
    newest bundle while it lasted and the updates at risk, :func:`~.losses.updates_at_risk`);
    ``newest_published_at``: when the newest bundle was published (the ledger's word).
    ``space_pruned``: each time a full disk made the driver remove older bundles so that the next checkpoint
    could fit (oldest first: which bundles, the bytes their manifests recorded, the refusal)."""
    events = (ledger or Ledger(storage, job_id, fold=None)).read()
    if points is None:
        # here, not at the top: the dashboard package imports this module
        from spotrun.orchestrator.ledger.points import LogCache, read_points

        points = read_points(storage, job_id, metrics_local_dir, LogCache())
    reach = reaches(events, points.final, points.log)
    attempts: dict[int, AttemptRow] = {}
    restarts: list[RestartRow] = []
    losses: dict[int, WorkerLost] = {}
    replacing: dict[int, StragglerReplacing] = {}  # by attempt: the straggler its restart replaces
    flagged: dict[tuple[int, int], StragglerRow] = {}  # by (attempt, rank)
    newest: Slowdowns | None = None
    handled: dict[int, NoticeHandled] = {}
    started: dict[int, AttemptStarted] = {}
    published_at: dict[str, datetime] = {}
    resumed: set[int] = set()  # attempts that restored a bundle or began a new lineage
    corrupt: list[CorruptEvent] = []
    topology: list[TopologyChanged] = []
    rejected: list[BundleRejected] = []
    notices: list[NoticeRow] = []
    intervals: list[IntervalRow] = []
    refusals: list[RefusalRow] = []
    outages: list[OutageRow] = []
    pruned: list[SpacePrunedRow] = []
    processes: dict[int, ProcessRow] = {}  # by pid
    classes = {"preemption": 0, "failure": 0, "unclassified": 0}
    budget: Budget | None = None  # the newest record of the budgets
    for e in events:
        if isinstance(e, CorruptEvent):
            corrupt.append(e)
            continue
        if isinstance(e, RunRefused):  # no attempt began, so no attempt row, and the job's state stands
            refusals.append(RefusalRow(**e.model_dump(mode="json", include={"at", "check", "bundle", "reason"})))
            continue
        a = attempts.get(e.attempt)  # a row built once per attempt, not once per event of a week's 40,000
        if a is None:
            a = attempts[e.attempt] = AttemptRow(attempt=e.attempt, started_at=None, ended_at=None, world_size=None,
                                                 node_ids=[], published=0, last_update=None, ended=None)
        a.ended_at = e.at.isoformat()
        if isinstance(e, AttemptStarted | WorkerLost) and e.budget is not None:
            budget = e.budget
        if isinstance(e, AttemptStarted):
            started[e.attempt] = e
            a.started_at, a.world_size, a.node_ids = e.at.isoformat(), e.world_size, e.node_ids
            a.record(lineage_id=e.lineage_id)
        elif isinstance(e, BundlePublished):
            published_at[e.bundle] = e.at
            a.published += 1
            a.last_update = max(a.last_update or 0, e.update)
        elif isinstance(e, NoticeHandled) and not e.early:  # an early checkpoint's is a bundle like any other
            handled[e.attempt] = e
        elif isinstance(e, NoticeSeen):  # acted on or ignored (malformed, an unreachable source): both shown
            notices.append(NoticeRow(**e.model_dump(mode="json", include={"attempt", "at", "source", "node_id", "rank",
                                                                          "deadline", "action", "reason"})))
        elif isinstance(e, WorkerLost):
            losses[e.attempt] = e
            classes[e.loss or "unclassified"] += 1
            a.ended, a.last_update = f"lost: {e.cause}", e.last_update
        elif isinstance(e, Resizing):
            a.ended = f"scale-up to {e.world_size_target}"
        elif isinstance(e, Slowdowns):
            newest = e
            _flag(flagged, e)
        elif isinstance(e, StragglerReplacing):
            replacing[e.attempt] = e
            a.ended = f"straggler rank {e.rank} replaced"
            _replaced(flagged, e)
        elif isinstance(e, Restored):
            resumed.add(e.attempt)
            restarts.append(_restart(e.attempt, losses.get(e.attempt - 1), attempts.get(e.attempt - 1),
                                     started, handled, e, published_at.get(e.bundle), reach.get(e.attempt - 1),
                                     replacing.get(e.attempt - 1)))
        elif isinstance(e, InitializedFrom):
            resumed.add(e.attempt)
            a.record(initialized_from=e.bundle, recovery_label=e.recovery_label, reset=e.reset)
        elif isinstance(e, IntervalChosen):
            intervals.append(IntervalRow(attempt=e.attempt, at=e.at.isoformat(), reason=e.reason,
                                         **e.decision.model_dump(), inputs=e.inputs))
        elif isinstance(e, StorageOutage):
            outages.append(_outage(e))
        elif isinstance(e, TopologyChanged):
            topology.append(e)
        elif isinstance(e, BundleRejected):
            rejected.append(e)
        elif isinstance(e, SpacePruned):
            pruned.append(_space_pruned_row(e))
        elif isinstance(e, Footprints):
            _footprints(processes, e)
        elif isinstance(e, JobFinished):
            a.ended, a.last_update = "finished", e.counters.attempted_updates
        elif isinstance(e, JobFailed):
            a.ended = f"failed: {e.reason}"
    for n in sorted(set(started) - resumed - {min(started, default=0)}):  # restarts from nothing
        restarts.append(_restart(n, losses.get(n - 1), attempts.get(n - 1), started, handled, None, None,
                                 reach.get(n - 1)))
    restarts.sort(key=lambda r: r.attempt)
    for n, a in attempts.items():  # how far each got: the ledger's word, or further by its metric points
        a.last_update = reach[n].update if n in reach else None
        a.last_update_source = reach[n].source if n in reach else None
    return History(job_id=job_id, state=state_of(events), attempts=list(attempts.values()), restarts=restarts,
                   topology_changes=topology, rejected_bundles=rejected, corrupt_events=corrupt, notices=notices,
                   refusals=refusals, budgets=_budgets(classes, budget), checkpoint_intervals=intervals,
                   outages=outages,
                   newest_published_at=max(published_at.values()).isoformat() if published_at else None,
                   stragglers=list(flagged.values()), slowdowns=_newest_slowdowns(newest, max(attempts, default=0)),
                   space_pruned=pruned, processes=list(processes.values()),
                   totals=totals(restarts), goodput=goodput(events, points.final, points.log,
                                                   _rate(storage, job_id, listing)))


def state_of(events: list[LedgerEvent | CorruptEvent]) -> JobState:
    """The job's recorded state, as history, the dashboard and ``spotrun run`` read it: ``running`` from
    an attempt's start, then ``finished`` or ``failed`` as the newest of those events says. A refused
    run (``run_refused``) is none of them and never changes the state; a job with nothing but refusals
    is ``refused`` (``unknown``: no event at all)."""
    state: JobState = "unknown"
    for e in events:
        if isinstance(e, AttemptStarted):
            state = "running"
        elif isinstance(e, JobFinished):
            state = "finished"
        elif isinstance(e, JobFailed):
            state = "failed"
        elif isinstance(e, RunRefused) and state == "unknown":
            state = "refused"
    return state


def _outage(e: StorageOutage) -> OutageRow:
    return OutageRow(**e.model_dump(exclude={"kind", "at", "began_at", "ended_at"}), began_at=e.began_at.isoformat(),
                     ended_at=e.ended_at.isoformat(), seconds=round((e.ended_at - e.began_at).total_seconds(), 3),
                     updates_at_risk=updates_at_risk(e.update_at_end, e.newest_update))


def _flag(flagged: dict[tuple[int, int], StragglerRow], e: Slowdowns) -> None:
    """Add the ranks ``e`` names as stragglers for the first time in its attempt; keep each flagged rank's
    largest figure."""
    for rank in e.stragglers:
        if (e.attempt, rank) not in flagged:
            flagged[e.attempt, rank] = StragglerRow(
                attempt=e.attempt, rank=rank, node_id=e.node_ids[rank] if rank < len(e.node_ids) else None,
                flagged_at=e.at.isoformat(), flagged_update=e.update, max_slowdown=e.slowdown.get(rank, 0.0),
                replaced=False)
    for (attempt, rank), row in flagged.items():
        if attempt == e.attempt and rank in e.slowdown:
            row.max_slowdown = max(row.max_slowdown, e.slowdown[rank])


def _replaced(flagged: dict[tuple[int, int], StragglerRow], e: StragglerReplacing) -> None:
    """Mark the straggler ``e`` replaces; one no ``slowdowns`` event flagged first is flagged by it."""
    row = flagged.setdefault((e.attempt, e.rank), StragglerRow(
        attempt=e.attempt, rank=e.rank, node_id=e.node_id, flagged_at=e.at.isoformat(), flagged_update=e.update,
        max_slowdown=e.slowdown, replaced=True))
    row.replaced, row.max_slowdown = True, max(row.max_slowdown, e.slowdown)
    row.node_id = row.node_id or e.node_id


def _footprints(processes: dict[int, ProcessRow], e: Footprints) -> None:
    """Fold an attempt's footprints into each process's row (a pid seen before is a process kept)."""
    for rank, f in e.ranks.items():
        row = processes.get(f.pid)
        if row is None:
            processes[f.pid] = ProcessRow(
                pid=f.pid, rank=rank, first_attempt=e.attempt, last_attempt=e.attempt, attempts=1,
                rss_first_bytes=f.rss_bytes, rss_last_bytes=f.rss_bytes, fds_first=f.fds, fds_last=f.fds,
                threads_first=f.threads, threads_last=f.threads, process_groups_max=f.process_groups)
            continue
        row.rank, row.last_attempt, row.attempts = rank, e.attempt, row.attempts + 1
        row.rss_last_bytes, row.fds_last, row.threads_last = f.rss_bytes, f.fds, f.threads
        row.process_groups_max = max(row.process_groups_max, f.process_groups)


def _space_pruned_row(e: SpacePruned) -> SpacePrunedRow:
    return SpacePrunedRow(**e.model_dump(mode="json", include={"attempt", "at", "bundles", "freed_bytes", "reason"}))


def _newest_slowdowns(e: Slowdowns | None, newest_attempt: int) -> list[RankSlowdown]:
    """Per rank, the figures of ``e`` (the ledger's newest ``slowdowns``) if the newest attempt recorded it."""
    if e is None or e.attempt != newest_attempt:
        return []  # an older attempt's figures describe processes that are gone
    return [RankSlowdown(attempt=e.attempt, update=e.update, rank=rank,
                         node_id=e.node_ids[rank] if rank < len(e.node_ids) else None, slowdown=value,
                         straggler=rank in e.stragglers) for rank, value in sorted(e.slowdown.items())]


def _budgets(classes: dict[str, int], budget: Budget | None) -> Budgets:
    """Losses by class over the whole ledger; the newest run's use of each budget and what is left."""
    run = BudgetUse(failures=None, max_restarts=None, failures_left=None, preemptions=None, max_preemptions=None,
                    preemptions_left=None)
    if budget is not None:
        run = BudgetUse(**budget.model_dump(), **budget.left())
    return Budgets(preemptions=classes["preemption"], failures=classes["failure"],
                   unclassified=classes["unclassified"], this_run=run)


def _rate(storage: Storage, job_id: str, listing: list[BundleRef] | None) -> float | None:
    """``cost.usd_per_rank_hour`` of the spec that wrote the newest readable manifest."""
    for ref in list_bundles(storage, job_id) if listing is None else listing:
        if ref.published:
            try:
                rate = read_manifest(storage, ref.key).spec.get("cost", {}).get("usd_per_rank_hour")
            except (ManifestError, BundleCorrupt, OSError):
                continue  # damaged or collected meanwhile: an older one names the same rate
            return float(rate) if rate is not None else None
    return None


def _restart(attempt: int, loss: WorkerLost | None, previous: AttemptRow | None,
             started: dict[int, AttemptStarted], handled: dict[int, NoticeHandled], restored: Restored | None,
             bundle_published_at: datetime | None, reach: Reach | None,
             straggler: StragglerReplacing | None = None) -> RestartRow:
    """One restart row: attempt ``attempt`` began after ``loss`` ended the attempt before it (None: the
    driver died, or the job was run again), from ``restored`` (None: from nothing); ``reach``: how far
    the attempt before it got; ``straggler``: the straggler the attempt before it was stopped to replace.
    Its figures are defined in :mod:`spotrun.orchestrator.ledger.losses`."""
    this, before = started.get(attempt), started.get(attempt - 1)
    if restored is not None:
        begun = restored.at
    elif this is not None:
        begun = this.at
    else:  # history() lists a restart from nothing only for an attempt that started
        raise ValueError(f"attempt {attempt} neither restored a bundle nor started")
    if restored is not None and restored.cause in ("scale-up", "straggler"):  # planned: no loss before it
        cause = restored.cause
    else:
        # no loss recorded: the driver itself died (or an ended job was run again)
        cause = loss.cause if loss else ("resumed" if previous and previous.ended else "driver-exit")
    current_since = max(filter(None, [before.at if before else None, bundle_published_at]), default=None)
    # the loss's moment: detected; when nobody lived to record it (the driver died), the lost attempt's last
    # event (a lower bound on its death: this downtime may be longer than it was, never shorter); a scale-up's
    # resize. None after a finished job (run again: nothing was down)
    finished = previous is not None and previous.ended == "finished"
    lost_at = (loss.detected_at or loss.at) if loss else (datetime.fromisoformat(previous.ended_at)
                                                          if previous and previous.ended_at and not finished else None)
    lost_seconds = 0.0 if finished else time_lost_seconds(current_since, begun)
    restored_update = restored.update if restored else 0
    lost = lost_updates(reach, restored_update)
    replaced = straggler if cause == "straggler" else None
    return RestartRow(
        attempt=attempt,
        cause=cause,
        loss=loss.loss if loss else None,  # preemption | failure (None: not recorded, or no loss)
        rank=loss.rank if loss else (replaced.rank if replaced else None),
        node_id=loss.node_id if loss else (replaced.node_id if replaced else None),
        host=loss.host if loss else None,
        signal=loss.signal if loss else None,
        stopped_phase=loss.stopped_phase if loss else None,
        stopped_update=loss.stopped_update if loss else None,
        stacks=loss.stacks if loss else None,
        detected_at=((loss.detected_at or loss.at) if loss else begun).isoformat(),
        restored_from=restored.bundle if restored else None,
        restored_update=restored_update,
        recovery_label=restored.recovery_label if restored else "fresh",
        # cold: new processes read the bundle from storage; warm-*: the survivors kept theirs and put it
        # back from memory (a spare in the lost rank's place, a new process there, or a smaller world)
        recovery_path=restored.recovery_path if restored else "cold",
        cold_because=restored.cold_because if restored else None,
        policy=restored.policy if restored else None,
        restore_mode=restored.restore_mode if restored else None,
        world_size_before=restored.world_size_before if restored else (before.world_size if before else None),
        world_size_after=restored.world_size_after if restored else (this.world_size if this else None),
        # from nothing, everything the lost attempt completed is redone; None: how far it got is not known
        lost_updates=lost,
        lost_updates_source=reach.source if lost is not None and reach else None,
        lost_range=lost_range(lost, restored_update),
        restore_seconds=round(restored.restore_seconds, 4) if restored else 0.0,
        downtime_seconds=downtime_seconds(lost_at, begun),
        time_lost_seconds=lost_seconds,
        notice_to_publish_seconds=(handled[attempt - 1].notice_to_publish_seconds
                                   if attempt - 1 in handled else None),
    )


def bundles(storage: Storage, job_id: str) -> list[dict[str, Any]]:
    rows = []
    for ref in list_bundles(storage, job_id):
        row: dict[str, Any] = {"bundle": ref.key, "update": ref.update, "attempt": ref.attempt,
                               "published": ref.published}
        if ref.published:
            try:
                m = read_manifest(storage, ref.key)
                row.update(bytes=m.total_bytes, stall_seconds=m.stall_seconds, capture_seconds=m.capture_seconds,
                           write_wait_seconds=m.write_wait_seconds, write_seconds=m.write_seconds,
                           cursor=m.data.cursor.model_dump(), recovery_label=m.recovery_label,
                           created_at=m.created_at.isoformat())
            except (ManifestError, BundleCorrupt, OSError) as e:  # e.g. retention removed it meanwhile
                row["error"] = str(e)
        rows.append(row)
    return rows
