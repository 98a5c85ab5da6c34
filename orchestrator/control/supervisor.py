"""The supervisor: the driver of one job, as an explicit state machine (runs in the driver).

    Pending -> Placing -> Running -> Finished
                  ^          |
                  |          v
                  +---- Recovering              (any state) -> Failed | Stopped

Each state is a small frozen class carrying its payload (orchestrator/control/states.py);
:meth:`Supervisor.step` maps one state to the next, so a test can drive it one transition at a time.
This module owns the loop and the ``Running`` state's look at the ranks; the other transitions are
carried out by their own parts: placing and restoring (placing.py), notices (noticing.py), the
checkpoint clock and growth (cadence.py), stragglers (straggling.py) and recovery (recovering.py).
The policies decide (orchestrator/policy/); every event the driver records goes through one
:class:`Recorder`.

Checkpoints happen inside the ranks (trainer/run/rank.py); the supervisor only publishes: it merges
the ranks' write reports into a manifest, creates it (the commit point), commits offsets, then runs
retention. Under ``checkpoint.every_updates: auto`` it also chooses the interval
(orchestrator/policy/interval.py) and asks the ranks for each checkpoint.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import replace

from spotrun.orchestrator.control.cadence import Cadence
from spotrun.orchestrator.control.context import RunContext
from spotrun.orchestrator.control.noticing import NoticeDesk
from spotrun.orchestrator.control.outages import Outages
from spotrun.orchestrator.control.placing import UNVERIFIED, OracleMismatch, Placer
from spotrun.orchestrator.control.platform import GroupFactory, Options, Platform, Scaler
from spotrun.orchestrator.control.progress import NullProgress
from spotrun.orchestrator.control.recorder import Recorder
from spotrun.orchestrator.control.recovering import Recovery
from spotrun.orchestrator.control.states import (
    Failed,
    Finished,
    JobFailedError,
    Outcome,
    Pending,
    Placing,
    Recovering,
    Running,
    State,
    Stopped,
)
from spotrun.orchestrator.control.straggling import Stragglers
from spotrun.orchestrator.ledger.history import history
from spotrun.orchestrator.ledger.history_model import RestartRow
from spotrun.orchestrator.ledger.store import Ledger
from spotrun.orchestrator.notices.clouds import CloudWatcher
from spotrun.orchestrator.notices.notice import Notice, install_signal_notices
from spotrun.orchestrator.policy.budgets import RestartBudgets
from spotrun.orchestrator.policy.recovery import LossCause
from spotrun.orchestrator.publish.metric_commit import MetricCommitter
from spotrun.orchestrator.publish.offsets import OffsetsStore
from spotrun.orchestrator.publish.publisher import Publisher, PublishError
from spotrun.orchestrator.workers.groups import RankFailed, RankLost, WorkerGroup
from spotrun.trainer.data.listing import open_source
from spotrun.trainer.job.spec import JobSpec
from spotrun.trainer.observe.footprint import Footprint
from spotrun.trainer.observe.trace import TraceWriter
from spotrun.trainer.run.rank import RankState, Report
from spotrun.trainer.state.counters import Counters
from spotrun.trainer.storage import Storage, StorageError, StoragePermanentError, open_storage

__all__ = ["UNVERIFIED", "Failed", "Finished", "GroupFactory", "JobFailedError", "OracleMismatch", "Options",
           "Outcome", "Pending", "Placing", "Platform", "Recovering", "Running", "Scaler", "State", "Stopped",
           "Supervisor"]

log = logging.getLogger("spotrun.supervisor")


class Supervisor:
    """Drives one job from ``spec`` on ``platform`` (where its ranks run) with ``options``."""

    def __init__(self, spec: JobSpec, platform: Platform, options: Options | None = None) -> None:
        options = options or Options()
        self.spec = spec
        storage = open_storage(spec.storage, spec.storage_endpoint_url)
        progress = options.progress or NullProgress()  # what the terminal shows (spotrun run)
        ledger = Ledger(storage, spec.job_id, on_append=progress.event, outage_s=spec.storage_outage_s)
        self.trace = TraceWriter(options.trace_path, options.record_ids) if options.trace_path else None
        self._rank_retries: dict[tuple[int, int], int] = {}  # (attempt, rank) -> storage retries
        self._footprints: dict[int, dict[int, Footprint]] = {}  # attempt -> rank -> footprint, until all are in
        self._rows: list[RestartRow] = []
        self._rows_at = -1  # the attempt count _rows were read at
        source = None
        if spec.data.order == "sequential":  # a streaming reader: its offsets also go under the source
            source = OffsetsStore(open_source(spec.data.shards, spec.storage_endpoint_url), spec.job_id,
                                  under_source=True)
        points = None
        if "mlflow" in spec.metrics.sinks and options.send_at_publish:
            points = MetricCommitter(storage, spec, restarts=self._restart_rows)
        publisher = Publisher(storage, ledger, spec.job_id, spec.checkpoint.keep_last,
                              after_publish=self._after_publish, source_offsets=source, points=points,
                              outage_s=spec.storage_outage_s)
        # (the placer's: a restart waiting for storage; it is made below, and read only once the run goes)
        progress.watch_storage(lambda: max(ledger.outage.down_s(), publisher.outage.down_s(),
                                           self.placer.outage.down_s()))
        self.ctx = RunContext(spec, platform, options, storage, ledger, Recorder(ledger, spec), publisher,
                              RestartBudgets(spec.world), progress)
        self.placer = Placer(self.ctx)
        self.notices = NoticeDesk(self.ctx)
        self.cadence = Cadence(self.ctx)
        self.recovery = Recovery(self.ctx, self.placer)
        self.stragglers = Stragglers(self.ctx, self.recovery)
        self.outages = Outages(self.ctx, self.placer.outage)

    @property
    def storage(self) -> Storage:
        return self.ctx.storage

    @property
    def restarts(self) -> int:
        return self.ctx.restarts

    @property
    def driver_watchers(self) -> list[CloudWatcher]:
        """Cloud watchers of the driver's own machine (--no-ray): a notice to the driver is acknowledged there."""
        return self.notices.driver_watchers

    def _restart_rows(self) -> list[RestartRow]:
        """History's restart rows (the MLflow run's restart tags), read again only once another attempt
        began: history reads the whole ledger and metric log, and a send comes at every publish."""
        if self._rows_at != self.ctx.attempts:
            self._rows = history(self.ctx.storage, self.spec.job_id,
                                 metrics_local_dir=self.spec.metrics.local_dir).restarts
            self._rows_at = self.ctx.attempts
        return self._rows

    def _after_publish(self, update: int) -> None:
        """The after_publish fault site: the current attempt's injector, once there is one."""
        if self.ctx.faults is not None:
            self.ctx.faults.hit("after_publish", update)

    # -- driving --------------------------------------------------------------------------

    def run(self) -> Outcome:
        """Drive the job to its end. A failure is recorded in the ledger, then raised: the
        original typed error (``BundleIncompatible``, ...) or :class:`JobFailedError`."""
        ctx = self.ctx
        state: State = Pending()
        restore_signals = self._watch_driver_signals()
        try:
            while not isinstance(state, Finished | Stopped | Failed):
                try:
                    state = self.step(state)
                except StoragePermanentError as e:  # a refusal that persisted storage_outage_s: the job ends
                    if isinstance(state, Running | Recovering):
                        abandon(state.group)
                    state = self._refused_for_good(e)
        finally:
            if isinstance(state, Running | Recovering):  # left by an exception (a bug, KeyboardInterrupt)
                abandon(state.group)
            restore_signals()
            ctx.publisher.close(finished=isinstance(state, Finished))
            ctx.progress.close()
            ctx.platform.request_capacity(0)
            if self.trace:
                self.trace.close()
        try:
            ctx.record.ended(state, ctx.attempts, ctx.began, ctx.publisher.storage_retries)
        except StoragePermanentError as e:
            if not (isinstance(state, Failed) and isinstance(state.error, StorageError)):
                raise
            # the ledger is often the very storage that refuses: the failure is still raised, with its own cause
            log.warning("the job's failure could not be recorded in its ledger: %s", e)
        if isinstance(state, Stopped):
            return Outcome("stopped", (ctx.published.newest.counters if ctx.published.newest else None), ctx.attempts,
                           ctx.restarts, state.reason, self._keys(), ctx.restored_from)
        if isinstance(state, Failed):
            raise state.error if state.error is not None else JobFailedError(state.reason)
        return Outcome("finished", state.counters, ctx.attempts, ctx.restarts, published=self._keys(),
                       restored_from=ctx.restored_from)

    def notify(self, notice: Notice) -> None:
        """Hand the supervisor a notice, from any thread (its signal notices' thread and tests call
        this); never from a signal handler: the queue and the wake event take locks."""
        self.notices.notify(notice)

    def _watch_driver_signals(self) -> Callable[[], None]:
        """SIGTERM/SIGINT to the driver become notices; returns a function that restores the old handlers
        (and ends the thread that hands the notices on)."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        return install_signal_notices(None, None, self.spec.preemption.grace_s, self.notify).close

    def _refused_for_good(self, error: StoragePermanentError, who: str = "the driver") -> Failed:
        """The end of a job whose storage refused a request (a denial, a missing bucket) for longer than
        ``storage_outage_s``: not a restart, which would meet the same storage; ``run`` records it (where the
        ledger still takes it: a run_refused before this run trained, as any refusal then) and raises ``error``."""
        return Failed(f"the storage refused {who} for longer than storage_outage_s ({self.spec.storage_outage_s:g} s): "
                      f"{error}", error=error, refused=not self.ctx.began)

    def _keys(self) -> list[str]:
        return list(self.ctx.published.keys)

    def step(self, state: State) -> State:
        """One transition; an end state (Finished, Stopped, Failed) has none (KeyError). What the
        transition itself says (a restart into another world size) is recorded once it is made."""
        if type(state) is Pending:
            nxt: State = Placing()
        elif type(state) is Placing:
            nxt = self.placer.place(state)
        elif type(state) is Running:
            nxt = self._running(state)
        elif type(state) is Recovering:
            nxt = self.recovery.recover(state)
        else:
            raise KeyError(type(state))
        self.ctx.record.transition(state, nxt)
        return nxt

    # -- running ----------------------------------------------------------------------------

    def _running(self, st: Running) -> State:
        """One look at the running attempt. A rank may die at any call to it (a poll, or a request
        to checkpoint for a notice or to grow): each of them is a loss to recover from, from as far as
        the look got (``seen``: the attempt once the poll's reports were absorbed)."""
        seen = [st]
        try:
            return self._look(st, seen)
        except RankLost as e:
            st = self._absorb(seen[-1], st.group.salvage())  # the survivors know how far the attempt got
            return Recovering(st.group, st.attempt, st.world_size, st.last_update, e)
        except RankFailed as e:
            if e.refusal:  # bad input: the same input fails the same way on every attempt
                st.group.teardown()
                return Failed(str(e), e)
            if isinstance(e.raised, StoragePermanentError):  # a restart meets the same storage: no restart
                st.group.teardown()
                return self._refused_for_good(e.raised, f"rank {e.rank}")
            st = self._absorb(seen[-1], st.group.salvage())
            node = st.group.node_ids[e.rank] if e.rank is not None and e.rank < len(st.group.node_ids) else None
            lost = RankLost(e.rank, LossCause.COLLECTIVE_ERROR if e.collective else LossCause.ERROR, str(e), node)
            return Recovering(st.group, st.attempt, st.world_size, st.last_update, lost, error=e)
        except PublishError as e:
            st.group.teardown()
            return Failed(str(e), e)

    def _look(self, st: Running, seen: list[Running]) -> State:
        reports = st.group.poll()
        st = self._absorb(st, reports)
        seen.append(st)
        finished = all(r.state == RankState.FINISHED for r in reports)
        # after the publishes: an outage ends once storage answers them (or with the job)
        self.outages.look(st, reports, final=finished)
        if finished:
            st.group.teardown()
            return Finished(self.ctx.published.newest.counters if self.ctx.published.newest else Counters())
        for notice in self.notices.take(st):
            nxt = self.notices.on_notice(st, notice)
            if not isinstance(nxt, Running):
                return nxt
            st = nxt
        st = self.notices.early_published(st)
        stopped = all(r.state in (RankState.STOPPED, RankState.FINISHED) for r in reports)
        if st.draining is not None and stopped:
            return self.notices.drained(st, st.draining)
        if st.growing is not None and stopped:
            st.group.teardown()
            return Placing(cause="scale-up", last_update=st.last_update, world_before=st.world_size)
        if st.replacing is not None and stopped:
            return self.stragglers.replace(st)
        st = self.stragglers.look(st)
        st = self.cadence.consider_growing(st)
        self.cadence.tick(st)
        self.recovery.count_spares(st)
        st.group.wait(self.notices.until_next_look(st), self.notices.woken)
        return st

    def _absorb(self, st: Running, reports: list[Report]) -> Running:
        """The ranks' output, progress and trace lines from rank reports; publish every bundle all ranks
        have written. Returns the attempt as far as the reports say it got."""
        ctx = self.ctx
        output = [line for r in reports for line in r.output]
        if output:
            ctx.options.echo(output)
        progressed = max((r.last_update for r in reports), default=st.last_update)
        now = ctx.clock()
        if progressed > st.last_update and st.progress_at is not None:
            per_update = (now - st.progress_at) / (progressed - st.last_update)
            ctx.sec_per_update = per_update if ctx.sec_per_update is None else (
                0.8 * ctx.sec_per_update + 0.2 * per_update)
        if progressed > st.last_update or st.progress_at is None:
            st = replace(st, progress_at=now)
        for r in reports:
            self._rank_retries[(st.attempt, r.rank)] = r.storage_retries
            st = replace(st, last_update=max(st.last_update, r.last_update))
            ctx.progress.updates(r.records, st.world_size)
            for record in r.records:
                if self.trace:
                    self.trace.write(record)
        ctx.publisher.retries_elsewhere = sum(self._rank_retries.values())
        self._footprint(st, reports)
        full = next((r.full_disk for r in reports if r.full_disk is not None), None)
        if full is not None:  # first: the manifests waiting to be written may need the room too
            self._make_room(st.attempt, full)
        new = ctx.publisher.collect([b for r in reports for b in r.bundles],  # finished: the last bundle waits
                                    wait=all(r.state == RankState.FINISHED for r in reports))
        if (full := ctx.publisher.take_full()) is not None:
            self._make_room(st.attempt, full)
        if new:
            ctx.budgets.published()
        ctx.published.extend(new)
        return st

    def _footprint(self, st: Running, reports: list[Report]) -> None:
        """Gather the attempt's rank footprints (each rank sends its once); record them once all are in."""
        got = {r.rank: r.footprint for r in reports if r.footprint is not None}
        if not got:
            return
        # only the running attempt's: one lost before all its ranks sent theirs is never recorded, and kept
        # it would be kept for the rest of the run
        ranks = {**self._footprints.get(st.attempt, {}), **got}
        self._footprints = {st.attempt: ranks}
        if len(ranks) == st.world_size:
            self.ctx.record.footprints(st.attempt, self._footprints.pop(st.attempt))

    def _make_room(self, attempt: int, reason: str) -> None:
        """A write was refused for want of room (``reason``): prune older bundles so that the next
        checkpoint fits, and record what went. Training goes on whatever this finds."""
        pruned = self.ctx.publisher.make_room(reason)
        if pruned is not None:
            self.ctx.record.space_pruned(attempt, pruned, reason)


def abandon(group: WorkerGroup) -> None:
    """Tear down the group of a run an exception is ending (a bug, ``KeyboardInterrupt``, a test's
    stop): its ranks must not train on, nor hold the cluster's CPUs, with no supervisor left to
    end them. Never raises over the exception in flight: a failed teardown is logged."""
    try:
        group.teardown()
    except Exception:
        log.exception("tearing down the ranks of an interrupted run failed; they may still hold their resources")
