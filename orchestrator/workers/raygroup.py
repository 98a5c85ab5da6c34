"""The ranks of one attempt as Ray actors in one placement group.

Each actor holds a :class:`spotrun.trainer.run.rank.RankRunner`; it is a threaded actor so
that ``poll`` and ``request`` are served while ``run`` trains. The ranks form a
``torch.distributed`` group (gloo on CPU, nccl with GPUs) rendezvousing at
rank 0's node. What a rank's failed call means (a lost rank, a peer blamed for a
survivor's collective error, the job's own failure) is
:mod:`~spotrun.orchestrator.workers.rankcalls`'s to say; where ranks fit,
:mod:`~spotrun.orchestrator.workers.placement`'s.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Set
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from spotrun.orchestrator.notices.notice import Notice
from spotrun.orchestrator.policy.health import Hung, Pace, Verdict
from spotrun.orchestrator.policy.recovery import LossCause, RecoveryPath, WarmPlan, plan_warm
from spotrun.orchestrator.workers.groups import (
    CapacityUnavailable,
    RankFailed,
    RankLost,
    Reformed,
    WarmUnavailable,
)
from spotrun.orchestrator.workers.lastwords import last_words
from spotrun.orchestrator.workers.placement import bundle_placed, rank_bundle
from spotrun.orchestrator.workers.rankactor import rank_actor_class, this_node
from spotrun.orchestrator.workers.rankcalls import answer_of, blame
from spotrun.orchestrator.workers.rankcalls import settle as _settle
from spotrun.orchestrator.workers.watch import Watch, bounds_of, condemn
from spotrun.trainer.bundle.manifest import Manifest
from spotrun.trainer.run.context import AttemptContext
from spotrun.trainer.run.rank import Report
from spotrun.trainer.run.visibility import (
    Node,
    Probe,
    RankProbe,
    StorageNotShared,
    check_answers,
    post_driver_probe,
    remove_probes,
)
from spotrun.trainer.run.warm import NotInMemory, ineligible
from spotrun.trainer.storage import Storage

NEWS_WAIT_S = 10.0  # how long a rank's wait_for_news call blocks before it answers no news (and is sent again)
WAKE_CHECK_S = 0.1  # how often a wait looks at the supervisor's wake event (a driver's notice)
# A poll or request answers at once (threaded actor), and a dead rank's call fails at once: this only
# bounds a hang. A 2-core host under load can keep a rank's answer back for seconds, and a rank taken
# for hung is a restart counted as a failure: the bound is generous.
POLL_TIMEOUT_S = 60.0
# Starting a rank (a Python process importing torch, then building the model and the data listing)
# takes seconds, and many more on a loaded machine; a dead actor is reported at once anyway, so this
# only bounds a hung start.
STARTUP_TIMEOUT_S = 300.0
# How long a survivor's run may take to stop after a loss: it ends at its next boundary or as soon as
# a collective with the lost rank fails; one still running after this is stuck (it is lost as well, and
# the restart is cold). A survivor that answers in time costs nothing of this bound.
LEAVE_TIMEOUT_S = 30.0
# Before a teardown kills the actors, each writes its rank log: a rank still training when a peer failed
# keeps its lines. Bounded, so that an actor on an unreachable node delays a restart by this at most.
FLUSH_BEFORE_KILL_S = 2.0
log = logging.getLogger("spotrun.raygroup")


class RayGroup:
    # A poll is an actor call to every rank, served beside its training thread, and a driver that
    # polls often takes CPU from the ranks: tiny on 2 ranks ran at 39.5 updates/s polled every
    # 0.02 s and 45.6 every 0.2 s (bench 8's run), gpt-char on 2 ranks at 30.0-30.3 every 0.1 s and
    # 31.0-31.7 every 1 s (a per-process split, bench/RESULTS.md section 8). wait() still ends at
    # once when a rank's run ends, a rank wrote a bundle or saw a notice (each rank has a
    # wait_for_news call in flight) or the driver got a notice (the supervisor's wake event); only
    # progress (the progress line, the dashboard's counters) waits for the interval.
    poll_interval_s = 1.0
    # With a trace, polls come often: the trace's lines are written at each poll, and its readers
    # (verify's node removals, the kill tests) time their faults by them.
    traced_poll_interval_s = 0.1

    def __init__(self, ctx: AttemptContext, *, storage: Storage, placement_timeout_s: float = 60.0,
                 drains: Callable[[], set[str]] | None = None) -> None:
        """Place and start the ``ctx.world_size`` ranks of attempt ``ctx`` (its ``init_method`` is chosen
        here, at rank 0's node). ``storage`` is the job's storage as the driver opened it: every rank
        must see it too (:mod:`~spotrun.trainer.run.visibility`), or ``StorageNotShared`` is raised
        before any rank restores or trains. ``drains`` names the nodes Ray is draining (None: not
        watched): a warm restart puts no rank there."""
        t0 = time.perf_counter()
        spec, world_size = ctx.spec, ctx.world_size
        self.ctx = ctx
        self.drains = drains
        self.spec = spec
        self.world_size = world_size
        self.storage = storage
        self.spares: list[Spare] = []
        self._spare_pg: PlacementGroup | None = None
        self._spare_probe: Probe | None = None
        self._spares_placed = 0
        if ctx.instrument.trace:
            self.poll_interval_s = min(self.poll_interval_s, self.traced_poll_interval_s)
        w = spec.world
        bundle = rank_bundle(spec)
        self.pg: PlacementGroup | None = placement_group([bundle] * world_size, strategy=w.placement)
        self.actors: list[Any] = []
        self._runs: list[Any] = []
        self._ended: set[Any] = set()  # runs wait() saw end (poll() reads their outcome)
        self._news: dict[int, Any] = {}  # rank -> its wait_for_news call in flight
        self.watch = Watch(world_size, bounds_of(spec))  # when each rank last answered, what it said
        self.notices: list[Notice] = []
        try:
            ray.get(self.pg.ready(), timeout=placement_timeout_s)
        except GetTimeoutError as e:
            self.teardown()
            raise CapacityUnavailable(f"{world_size} ranks of {bundle} could not be placed in "
                                      f"{placement_timeout_s:g}s") from e
        try:
            self._start(t0)
        except BaseException:
            self.teardown()  # a rank lost or failed while starting: release what was placed
            raise

    def _start(self, t0: float) -> None:
        """Create one actor per bundle of the placement group, form the process group, prove every rank
        sees the driver's storage, build the ranks."""
        spec, world_size, attempt = self.spec, self.world_size, self.ctx.attempt
        w = spec.world
        pg = self.pg
        if pg is None:
            raise RuntimeError("the attempt's placement group was removed before its ranks started")
        self.actors = [self._new_actor(pg, r) for r in range(world_size)]
        self.slots = [(pg, r) for r in range(world_size)]  # each rank's bundle of a placement group
        if w.spares and ineligible(spec) is None:  # they start beside the ranks, and nothing waits for them
            self._spare_pg = placement_group([rank_bundle(spec)] * w.spares, strategy="SPREAD")
            for i in range(w.spares):
                self._add_spare(self._spare_pg, i, attempt)
        self.where = self._call([a.where.remote() for a in self.actors], timeout=STARTUP_TIMEOUT_S)
        self.node_ids = [w_["node_id"] for w_ in self.where]
        placement = time.perf_counter() - t0
        port = self._call([self.actors[0].free_port.remote()])[0]
        self.ctx = ctx = self.ctx.model_copy(update={"init_method": f"tcp://{self.where[0]['ip']}:{port}"})
        probe = post_driver_probe(self.storage, spec.job_id, attempt, this_node())
        try:
            setups = self._call([a.setup.remote(ctx, r, self._probe_for(probe, r)) for r, a in enumerate(self.actors)],
                                timeout=STARTUP_TIMEOUT_S)
            check_answers(self.storage, probe, [s_["probe"] for s_ in setups])
        finally:
            remove_probes(self.storage, probe)
        self.runtimes = [s_["runtime"] for s_ in setups]  # each rank's device model and library versions
        # Recorded in AttemptStarted: where this attempt's start-up time went (slowest rank for each part).
        self.timings = {"placement_seconds": round(placement, 4)}
        for k in ("process_group_seconds", "rank_setup_seconds"):
            self.timings[k] = round(max(s[k] for s in setups), 4)

    def _new_actor(self, pg: PlacementGroup, index: int) -> Any:
        w = self.spec.world
        # no task events: Ray would record each call (a poll every fraction of a second, for days) in the
        # driver and the GCS for its state API, which spotrun never reads
        return rank_actor_class().options(
            num_cpus=w.cpus_per_rank, num_gpus=w.num_gpus_per_rank, max_concurrency=5, max_restarts=0,
            enable_task_events=False,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index),
        ).remote()

    def _add_spare(self, pg: PlacementGroup, index: int, attempt: int) -> None:
        """Place a spare in bundle ``index`` of ``pg`` and have it build the job, in the background: it
        is ready once its ``prepare`` call returned (the bundle may wait for a node to hold it)."""
        if self._spare_probe is None:
            self._spare_probe = post_driver_probe(self.storage, self.spec.job_id, attempt, this_node())
        actor = self._new_actor(pg, index)
        self._spares_placed += 1
        ctx = self.ctx.model_copy(update={"attempt": attempt, "world_size": self.world_size, "init_method": None})
        ready = actor.prepare.remote(ctx, self.world_size + self._spares_placed - 1, self._spare_probe)
        self.spares.append(Spare(actor, ready, (pg, index)))

    def _ready_spares(self, needed: int, among: list[Spare] | None = None,
                      draining: Set[str] = frozenset()) -> list[Spare]:
        """Up to ``needed`` spares (of ``among``; by default all) that have built the job and see the
        storage, none on a ``draining`` node (it would be lost with it). A spare still starting or building
        is waited for where its resources are held (it is ready sooner than a new group would be), not
        where they wait for a node. A spare that failed is dropped."""
        out: list[Spare] = []
        for spare in list(self.spares if among is None else among):
            if len(out) >= needed:
                break
            done, _ = ray.wait([spare.ready], timeout=0)
            # its own bundle, not its group: a spare in a lost rank's old slot shares the ranks' group, which
            # waits for a node whenever another rank's node is lost
            if (not done or draining) and not bundle_placed(*spare.slot, draining):
                continue
            try:
                info = ray.get(spare.ready, timeout=STARTUP_TIMEOUT_S)
                if self._spare_probe is not None:
                    check_answers(self.storage, self._spare_probe, [info["probe"]])
            except (RayActorError, RayTaskError, GetTimeoutError, StorageNotShared) as e:
                log.warning("a spare cannot serve: %s", str(e).splitlines()[0])
                self.spares.remove(spare)
                ray.kill(spare.actor, no_restart=True)
                continue
            spare.where = info
            out.append(spare)
        return out

    def spares_ready(self) -> int:
        """How many spares have built the job and wait (a quick look: nothing is waited for)."""
        done, _ = ray.wait([s.ready for s in self.spares], num_returns=len(self.spares), timeout=0)
        ok = 0
        for ref in done:
            try:
                ray.get(ref, timeout=0)
                ok += 1
            except (RayActorError, RayTaskError, GetTimeoutError):
                continue
        return ok

    def reform(self, lost: Set[int], bundle_key: str, manifest: Manifest, shipped_files: dict[str, bytes],
               sizes: list[int], attempt: int, lineage_id: str, label_for: Callable[[int], str]) -> Reformed:
        """Warm recovery (trainer/run/warm.py): restart from published bundle ``bundle_key`` keeping the
        surviving processes, at the first of ``sizes`` (the world sizes the policy allows) it can. The
        ranks not ``lost`` stop and keep their processes; at the same size each lost rank's place goes
        to a ready spare (``warm-spare``) or, with none, to a new process placed in the lost rank's slot
        where that is still held (``warm-replace``); otherwise the survivors alone form the world
        (``warm-shrink``, ranks renumbered in order; ``label_for(size)`` is the recovery label). Every
        member forms the new process group and restores the bundle from memory: the driver's
        ``shipped_files`` and the survivors' kept captures. Raises :class:`WarmUnavailable` (the caller
        restarts cold: tear this group down) when that cannot be done, or ``RankLost``/``RankFailed``
        for a rank lost or failing meanwhile."""
        t0 = time.perf_counter()
        lost = set(lost)
        if not self.actors:
            raise WarmUnavailable("the group was torn down")
        # every rank stops (a doomed one that still answers too: its peers wait for it at the boundary)
        leaves = {r: a.leave.remote(LEAVE_TIMEOUT_S) for r, a in enumerate(self.actors)}
        held: dict[int, list[str] | None] = {}
        for r, ref in leaves.items():
            if r in lost:
                continue
            try:
                held[r] = ray.get(ref, timeout=LEAVE_TIMEOUT_S + POLL_TIMEOUT_S)
            except (RayActorError, GetTimeoutError, RayTaskError):
                lost.add(r)
        for r in lost:
            ray.kill(self.actors[r], no_restart=True)
        survivors = [r for r in range(self.world_size) if r not in lost]
        # their runs ended (leave saw to it) with the lost peer's collective error: read it, expected here
        _settle([self._runs[r] for r in survivors] if self._runs else [], timeout=LEAVE_TIMEOUT_S)
        stale = [r for r in survivors if bundle_key not in (held.get(r) or [])]
        if stale:
            raise WarmUnavailable(f"ranks {stale} hold no copy of {bundle_key} in memory "
                                  f"(they hold {sorted({str(held.get(r)) for r in stale})})")
        if not survivors:
            raise WarmUnavailable("no rank survived")
        # which path is plan_warm's to say (orchestrator/policy/recovery.py); this only carries it out
        draining = self.drains() if self.drains is not None else set()
        spares = self._ready_spares(len(lost), draining=draining) if self.world_size in sizes else []
        plan = plan_warm(sorted(lost), survivors, len(spares), self.world_size, sizes,
                         {r: bundle_placed(*self.slots[r], draining) for r in lost})
        if isinstance(plan, WarmPlan) and plan.replace:
            # no spare for them: new processes where the lost ranks were (the slot is still held: a process
            # that died on a live node, or a node already replaced), built while nothing else runs
            first_new = len(self.spares)
            for r in plan.replace:
                self._add_spare(*self.slots[r], attempt)
            spares += self._ready_spares(len(plan.replace), among=self.spares[first_new:])
            if len(spares) < len(lost):  # not every new process came up: the survivors alone, if allowed
                plan = plan_warm(sorted(lost), survivors, len(spares), self.world_size, sizes, {})
        if isinstance(plan, str):
            raise WarmUnavailable(plan)
        path: RecoveryPath = plan.path
        replacing = list(plan.replace) if path == "warm-replace" else []
        world_size = plan.world_size
        if path != "warm-shrink":
            filling = dict(zip(sorted(lost), spares, strict=False))
            members = [self.actors[r] if r not in lost else filling[r].actor for r in range(world_size)]
            slots = [self.slots[r] if r not in lost else filling[r].slot for r in range(world_size)]
            wheres = [self.where[r] if r not in lost else filling[r].where for r in range(world_size)]
            for spare in filling.values():
                self.spares.remove(spare)
        else:
            filling = {}
            members = [self.actors[r] for r in survivors]
            slots = [self.slots[r] for r in survivors]
            wheres = [self.where[r] for r in survivors]
        replica = self.actors[survivors[0]].replica.remote(bundle_key) if filling else None
        freed = {r: self.slots[r] for r in lost}
        self.actors, self.slots, self.where = members, slots, wheres
        self.node_ids = [w_["node_id"] for w_ in wheres]
        self.world_size = world_size
        self._runs, self._ended, self._news = [], set(), {}
        self.watch = Watch(world_size, bounds_of(self.spec))
        t1 = time.perf_counter()
        port = self._call([members[0].free_port.remote()])[0]
        self.ctx = ctx = self.ctx.model_copy(update={
            "attempt": attempt, "world_size": world_size, "lineage_id": lineage_id,
            "recovery_label": label_for(world_size), "init_method": f"tcp://{wheres[0]['ip']}:{port}"})
        newcomers = {id(s.actor) for s in filling.values()}
        try:
            results = self._call([a.rejoin.remote(ctx, r, bundle_key, manifest, shipped_files,
                                                  replica if id(a) in newcomers else None)
                                  for r, a in enumerate(members)], timeout=STARTUP_TIMEOUT_S)
        except RankFailed as e:
            if isinstance(e.raised, NotInMemory):  # a file held in no surviving memory: restart from storage
                raise WarmUnavailable(str(e)) from e
            raise
        for r in sorted(set(filling) - set(replacing)):  # a new spare where a lost rank was, for the one it took
            self._add_spare(*freed[r], attempt)
        self.runtimes = [r_["runtime"] for r_ in results]
        self.timings = {"placement_seconds": round(t1 - t0, 4),  # stopping the survivors, choosing (or placing) spares
                        "process_group_seconds": round(max(r_["process_group_seconds"] for r_ in results), 4),
                        "rank_setup_seconds": round(max(r_["rank_setup_seconds"] for r_ in results), 4)}
        mismatches = [f"rank {r}: {m}" for r, r_ in enumerate(results) for m in r_["mismatches"]]
        return Reformed(path, world_size, label_for(world_size), max(r_["restore_seconds"] for r_ in results),
                        mismatches)

    def _probe_for(self, driver: Probe, rank: int) -> RankProbe:
        w_ = self.where[rank]
        return RankProbe(driver=driver, rank=rank, node=Node(node_id=w_["node_id"], ip=w_["ip"], host=w_["host"]))

    def _call(self, refs: list[Any], timeout: float | None = POLL_TIMEOUT_S) -> list[Any]:
        """``ray.get`` each rank's ref (``refs[r]`` belongs to rank r), turning a lost actor into
        :class:`RankLost` and an error raised by training code into :class:`RankFailed`."""
        out = []
        for rank, ref in enumerate(refs):
            try:
                out.append(self._get(rank, ref, timeout))
            except BaseException:
                _settle(refs[rank + 1:])
                raise
        return out

    def _get(self, rank: int, ref: Any, timeout: float | None = POLL_TIMEOUT_S) -> Any:
        node_ids = getattr(self, "node_ids", [])  # none before the ranks said where they are
        try:
            return answer_of(rank, ref, timeout, node_ids[rank] if rank < len(node_ids) else None)
        except RankLost as e:
            raise self._with_last_words(e) from e.__cause__

    def _with_last_words(self, lost: RankLost) -> RankLost:
        """A rank whose process died on this (the driver's) node: its detail quotes the end of its Ray worker
        log, where a native crash (SIGABRT, a segfault) says what it was."""
        where = getattr(self, "where", [])
        if (lost.cause not in (LossCause.PROCESS_EXIT, LossCause.OOM) or lost.rank is None
                or lost.rank >= len(where) or where[lost.rank].get("node_id") != this_node().node_id):
            return lost
        words = last_words(where[lost.rank]["pid"])
        if not words:
            return lost
        return RankLost(lost.rank, lost.cause, f"{lost.detail}; its Ray worker log ends:\n{words}", lost.node_id,
                        lost.evidence)

    def restore(self, bundle_key: str, storage_uri: str | None = None,
                reset: tuple[str, ...] = ()) -> tuple[float, list[str]]:
        results = self._call([a.restore.remote(bundle_key, storage_uri, reset) for a in self.actors], timeout=None)
        mismatches = [f"rank {r}: {m}" for r, (_, ms) in enumerate(results) for m in ms]
        return max(sec for sec, _ in results), mismatches

    def start(self) -> None:
        self._runs = [a.run.remote() for a in self.actors]

    def poll(self) -> list[Report]:
        done, _ = ray.wait(self._runs, num_returns=len(self._runs), timeout=0)
        failure: RankFailed | None = None
        for rank, ref in enumerate(self._runs):
            if ref in done:
                try:
                    self._get(rank, ref)  # raises RankLost if the rank died; returns if it finished
                except RankFailed as e:
                    failure = failure or e  # a later rank's death may be the reason: look at all first
        if failure is not None:
            culprit = blame(failure, self.actors, self.node_ids)
            raise self._with_last_words(culprit) if isinstance(culprit, RankLost) else culprit
        asked_at = time.monotonic()
        refs = [a.poll.remote() for a in self.actors]
        # a live rank answers in about a second at worst under load: waiting world.hang_after_s, not a minute
        answered, _ = ray.wait(refs, num_returns=len(refs), timeout=self.watch.bounds.hang_after_s)
        reports = []
        for rank, ref in enumerate(refs):
            if ref not in answered:
                self.watch.silent(rank, asked_at)
                continue
            try:
                report, notices = self._get(rank, ref)
            except BaseException:
                _settle(refs[rank + 1:])
                raise
            self.watch.answered(rank, report.reading, asked_at)
            reports.append(report)
            self.notices += notices
        verdicts = self.watch.verdicts()
        live = [r for r, ref in enumerate(refs) if ref in answered]
        if verdicts:  # hung first: the first is the one condemned (its loss ends the attempt)
            _settle(refs)
            self._condemn(verdicts[0], live)
        if len(reports) < len(refs):  # silent for the whole wait, judged a hair under the bound: hung all the same
            rank = next(r for r, ref in enumerate(refs) if ref not in answered)
            self._condemn(Hung(rank, time.monotonic() - asked_at, self.watch.last(rank)), live)
        return reports

    def paces(self) -> dict[int, Pace]:
        return self.watch.paces()

    def _condemn(self, verdict: Verdict, live: list[int]) -> None:
        """A rank judged hung or stuck: its stacks into the attempt's logs (taken by a rank of ``live``, those
        that answered this poll, on its node if there is one), its process killed, its loss raised."""
        rank = verdict.rank
        helper = next((self.actors[r] for r in live if r != rank and self.node_ids[r] == self.node_ids[rank]), None)
        evidence = condemn(verdict, self.where[rank], self.storage, self.spec.job_id, self.ctx.attempt, helper)
        ray.kill(self.actors[rank], no_restart=True)
        reading = verdict.reading
        where = f" in update {reading.update}, phase {reading.phase}" if reading is not None else ""
        detail = (f"answered no poll for {verdict.silent_s:.1f} s{where}" if isinstance(verdict, Hung) else
                  f"stood in phase {verdict.reading.phase} of update {verdict.reading.update} for "
                  f"{verdict.reading.age_s:.1f} s (over {verdict.bound_s:.1f} s) while ranks "
                  f"{list(verdict.waiting)} waited")
        log.warning("rank %d %s: %s; stacks %s", rank, verdict.signal, detail,
                    evidence.stacks_key or evidence.stacks_how)
        raise RankLost(rank, LossCause(verdict.signal), detail,
                       self.node_ids[rank] if rank < len(self.node_ids) else None, evidence)

    def wait(self, seconds: float, wake: threading.Event) -> None:
        running = [ref for ref in self._runs if ref not in self._ended]
        if not running:  # every run ended already: a plain interval, not a busy loop
            wake.wait(seconds)
            return
        for rank, actor in enumerate(self.actors):  # one call per rank in flight, sent again once it answered
            if rank not in self._news:
                self._news[rank] = actor.wait_for_news.remote(NEWS_WAIT_S)
        news = {ref: rank for rank, ref in self._news.items()}
        # In slices, to see the wake event: a ray.wait is local to the driver, unlike a poll
        end = time.monotonic() + seconds
        done: list[Any] = []
        while not done and not wake.is_set() and (left := end - time.monotonic()) > 0:
            done, _ = ray.wait([*running, *news], num_returns=1, timeout=min(left, WAKE_CHECK_S))
        for ref in done:
            if ref in news:
                del self._news[news[ref]]  # its outcome (news, a timeout, a lost rank) is the next poll's
            else:
                self._ended.add(ref)

    def take_notices(self) -> list[Notice]:
        notices, self.notices = self.notices, []
        return notices

    def request(self, checkpoint: bool = True, stop: bool = False) -> None:
        self._call([a.request.remote(checkpoint, stop) for a in self.actors])

    def acknowledge(self, notice: Notice) -> None:
        if notice.rank is None or notice.rank >= len(self.actors):
            return
        try:
            self._get(notice.rank, self.actors[notice.rank].acknowledge.remote(notice))
        except RankFailed as e:  # the acknowledgement raised on the rank: the endpoint refused it
            raise OSError(str(e)) from e

    def salvage(self) -> list[Report]:
        """After a loss: the last reports of the ranks still answering (they are blocked in a
        collective with the lost rank, but their poll runs on another thread)."""
        out = []
        for a in self.actors:
            try:
                out.append(ray.get(a.poll.remote(), timeout=2.0)[0])
            except (RayActorError, ActorUnavailableError, GetTimeoutError, RayTaskError):
                continue
        return out

    def pids(self) -> list[int]:
        return [w_["pid"] for w_ in self.where]

    def teardown(self) -> None:
        if self.actors:  # best effort: a dead or unreachable rank's call fails or is not waited for (a spare,
            # which may still be starting, keeps what its log wrote every few seconds)
            flushes = [a.flush_output.remote() for a in self.actors]
            ray.wait(flushes, num_returns=len(flushes), timeout=FLUSH_BEFORE_KILL_S)
        for a in [*self.actors, *(s.actor for s in self.spares)]:
            ray.kill(a, no_restart=True)
        self.actors, self.spares = [], []
        for pg in (self.pg, self._spare_pg):
            if pg is not None:
                remove_placement_group(pg)
        self.pg = self._spare_pg = None
        if self._spare_probe is not None:
            remove_probes(self.storage, self._spare_probe)
            self._spare_probe = None


@dataclass
class Spare:
    """A rank process built and waiting (``world.spares``): ``ready`` is its ``prepare`` call."""

    actor: Any
    ready: Any
    slot: tuple[PlacementGroup, int]
    where: dict[str, Any] = field(default_factory=dict)  # once ready: its node and pid
