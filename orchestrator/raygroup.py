"""The ranks of one attempt as Ray actors in one placement group.

Each actor holds a :class:`spotrun.trainer.rank.RankRunner`; it is a threaded actor so
that ``poll`` and ``request`` are served while ``run`` trains. The ranks form a
``torch.distributed`` group (gloo on CPU, nccl with GPUs) rendezvousing at
rank 0's node. A lost actor is noticed from the first failed call: an
``ActorDiedError`` (process killed, node removed gracefully) or the first
``ActorUnavailableError`` (node unreachable), never Ray's ~15 s death timeout.
A survivor whose collective fails because a peer died raises too, often before
Ray reports the peer dead: such an error is blamed on the peer it points to (the
job restarts), a collective that timed out with every peer answering is a
``collective-timeout`` (a restart as well), and only any other error fails the job.
"""

from __future__ import annotations

import os
import re
import socket
import threading
import time
from collections.abc import Set
from datetime import timedelta
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from spotrun.orchestrator.groups import CapacityUnavailable, RankFailed, RankLost, refuses
from spotrun.orchestrator.notices import ImdsWatcher, Notice, install_signal_notices
from spotrun.orchestrator.priority import run_at_normal_priority
from spotrun.trainer.bundle import BundleError
from spotrun.trainer.collective import Collective, LocalCollective, TorchCollective
from spotrun.trainer.data.planner import RestoreMode
from spotrun.trainer.device import rank_device
from spotrun.trainer.manifest import ManifestError
from spotrun.trainer.rank import RankRunner, Report
from spotrun.trainer.spec import JobSpec
from spotrun.trainer.storage import Storage
from spotrun.trainer.visibility import (
    Node,
    Probe,
    RankProbe,
    StorageNotShared,
    check_answers,
    post_driver_probe,
    remove_probes,
)

# What a survivor's collective raises when a peer died or hung (gloo, NCCL, c10d).
COLLECTIVE_ERROR = re.compile(r"gloo|NCCL|c10d|Connection (closed|reset) by peer|[Tt]imed out")
# What Ray says of a worker its memory monitor killed (a kernel OOM kill is a plain SIGKILL: process-exit).
OOM_KILL = re.compile(r"running low on memory|OutOfMemoryError")
PEER_PROBE_S = 5.0  # long enough for Ray to report a SIGKILLed peer dead (well under a second here)
NEWS_WAIT_S = 10.0  # how long a rank's wait_for_news call blocks before it answers no news (and is sent again)
WAKE_CHECK_S = 0.1  # how often a wait looks at the supervisor's wake event (a driver's notice)
POLL_TIMEOUT_S = 10.0  # a poll or request answers at once (threaded actor): longer means it hangs
# Starting a rank (a Python process importing torch, then building the model and the data listing)
# takes seconds, and many more on a loaded machine; a dead actor is reported at once anyway, so this
# only bounds a hung start.
STARTUP_TIMEOUT_S = 300.0


class RankActor:
    """The Ray actor around one rank (created through :func:`ray.remote` below)."""

    def __init__(self) -> None:
        self.runner: RankRunner | None = None  # built by setup()
        self.collective: Collective | None = None
        self.rank: int | None = None
        self.grace_s = 110.0
        self.node_id = ray.get_runtime_context().get_node_id()
        self._notices: list[Notice] = []
        self._lock = threading.Lock()
        self._imds: ImdsWatcher | None = None
        # __init__ runs on the actor's main thread, the only one that may install signal handlers:
        # a SIGTERM to this process becomes a notice instead of an exit. _on_notice runs on the
        # notices' own thread, never in the handler, so its lock and the runner's wake are safe.
        install_signal_notices(self.node_id, None, self.grace_s, self._on_notice)

    def _on_notice(self, notice: Notice) -> None:
        with self._lock:
            if notice.source in ("sigterm", "sigint"):  # the handler was installed before setup
                notice = notice.model_copy(update={"rank": self.rank, "deadline": notice.received_at
                                                   + timedelta(seconds=self.grace_s)})
            self._notices.append(notice)
        if self.runner is not None:
            self.runner.wake()  # the supervisor's wait ends: the notice is in its next poll

    def where(self) -> dict[str, Any]:
        return {**this_node().model_dump(), "pid": os.getpid()}

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def setup(self, spec_json: str, rank: int, world_size: int, init_method: str, attempt: int,
              lineage_id: str, recovery_label: str, restore_mode: RestoreMode | None, drop: tuple[str, ...],
              record_ids: bool, trace: bool, probe_json: str) -> dict[str, Any]:
        """Pick the device (refusing a GPU this torch cannot see), form the process group, answer the
        driver's storage probe (``StorageNotShared`` when this rank cannot see it), build the rank.
        Returns the device, the rank's runtime (device model and library versions), its probe, and
        where the time went."""
        t0 = time.perf_counter()
        run_at_normal_priority()  # before the process group's threads start: they inherit it
        spec = JobSpec.model_validate_json(spec_json)
        self.rank, self.grace_s = rank, spec.preemption.grace_s
        assigned = ray.get_runtime_context().get_accelerator_ids().get("GPU", [])
        device = rank_device(spec.world.num_gpus_per_rank, assigned, self.node_id)  # DeviceError: exit 2
        if spec.preemption.imds_url:
            self._imds = ImdsWatcher(spec.preemption.imds_url, spec.preemption.imds_poll_s, self.node_id, rank,
                                     self._on_notice).start()
        collective: Collective
        if world_size > 1:
            backend = "gloo" if device == "cpu" else "nccl"
            collective = TorchCollective(init_method, rank, world_size, backend, spec.world.collective_timeout_s,
                                         device)
        else:
            collective = LocalCollective()
        self.collective = collective
        t1 = time.perf_counter()
        self.runner = RankRunner(spec, rank=rank, world_size=world_size, attempt=attempt, lineage_id=lineage_id,
                                 recovery_label=recovery_label, collective=collective,
                                 restore_mode=restore_mode, drop=drop, record_ids=record_ids, trace=trace,
                                 device=device, probe=RankProbe.model_validate_json(probe_json))
        return {"process_group_seconds": t1 - t0, "rank_setup_seconds": time.perf_counter() - t1,
                "device": device, "runtime": self.runner.session.desc.runtime, "probe": self.runner.probe}

    def _runner(self) -> RankRunner:
        if self.runner is None:
            raise RuntimeError("the rank actor is not set up: setup() must succeed first")
        return self.runner

    def restore(self, bundle_key: str, storage_uri: str | None, reset: tuple[str, ...]) -> tuple[float, list[str]]:
        return self._runner().restore(bundle_key, storage_uri=storage_uri, reset=reset)

    def run(self) -> str:
        runner = self._runner()
        run_at_normal_priority()  # this thread of the actor's pool too; the loader workers fork from it
        try:
            return runner.run()
        finally:
            if self._imds is not None:
                self._imds.stop()
            if self.collective is not None:  # set with the runner
                self.collective.close()

    def poll(self) -> tuple[Report, list[Notice]]:
        report = self._runner().poll()  # first: it clears the news, and a notice after this wakes again
        with self._lock:
            notices, self._notices = self._notices, []
        return report, notices

    def request(self, checkpoint: bool, stop: bool) -> None:
        self._runner().request(checkpoint, stop)

    def wait_for_news(self, timeout: float) -> bool:
        return self._runner().wait_for_news(timeout)


def this_node() -> Node:
    """The Ray node this process runs on, and its address."""
    return Node(node_id=ray.get_runtime_context().get_node_id(), ip=ray.util.get_node_ip_address(),
                host=socket.gethostname())


def rank_bundle(spec: JobSpec) -> dict[str, float]:
    w = spec.world
    return {"CPU": w.cpus_per_rank, **({"GPU": w.num_gpus_per_rank} if w.num_gpus_per_rank else {})}


def available_rank_slots(spec: JobSpec, exclude: Set[str] = frozenset()) -> int:
    """How many ranks the alive nodes can hold (resources per rank from the spec; one per node under
    STRICT_SPREAD), not counting ``exclude`` (nodes that are draining: they take no new work and
    are about to go)."""
    cpus, gpus = spec.world.cpus_per_rank, spec.world.num_gpus_per_rank
    slots = 0
    for node in ray.nodes():
        if not node.get("Alive") or node["NodeID"] in exclude:
            continue
        res = node.get("Resources", {})
        fit = int(res.get("CPU", 0) // cpus)
        if gpus:
            fit = min(fit, int(res.get("GPU", 0) // gpus))
        slots += min(fit, 1) if spec.world.placement == "STRICT_SPREAD" else fit
    return slots


def room_for_more_ranks(spec: JobSpec, extra: int, timeout_s: float = 2.0) -> bool:
    """Can ``extra`` more ranks be placed now, beside the running ones? Asks Ray's scheduler the only
    way it answers: reserves them in a placement group for a moment, then lets go. (Counting node
    resources cannot tell what other jobs hold.)"""
    pg = placement_group([rank_bundle(spec)] * extra, strategy=spec.world.placement)
    try:
        ray.get(pg.ready(), timeout=timeout_s)
        return True
    except GetTimeoutError:
        return False
    finally:
        remove_placement_group(pg)


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

    def __init__(self, spec: JobSpec, world_size: int, *, attempt: int, lineage_id: str, recovery_label: str,
                 storage: Storage, restore_mode: RestoreMode | None = None, drop: tuple[str, ...] = (),
                 record_ids: bool = False, trace: bool = True, placement_timeout_s: float = 60.0) -> None:
        """Place and start the ranks of one attempt. ``storage`` is the job's storage as the driver
        opened it: every rank must see it too (:mod:`~spotrun.trainer.visibility`), or
        ``StorageNotShared`` is raised before any rank restores or trains."""
        t0 = time.perf_counter()
        self.world_size = world_size
        self.storage = storage
        if trace:
            self.poll_interval_s = min(self.poll_interval_s, self.traced_poll_interval_s)
        w = spec.world
        bundle = rank_bundle(spec)
        self.pg: PlacementGroup | None = placement_group([bundle] * world_size, strategy=w.placement)
        self.actors: list[Any] = []
        self._runs: list[Any] = []
        self._ended: set[Any] = set()  # runs wait() saw end (poll() reads their outcome)
        self._news: dict[int, Any] = {}  # rank -> its wait_for_news call in flight
        self.notices: list[Notice] = []
        try:
            ray.get(self.pg.ready(), timeout=placement_timeout_s)
        except GetTimeoutError as e:
            self.teardown()
            raise CapacityUnavailable(f"{world_size} ranks of {bundle} could not be placed in "
                                      f"{placement_timeout_s:g}s") from e
        try:
            self._start(spec, world_size, attempt, lineage_id, recovery_label, restore_mode, drop, record_ids,
                        trace, t0)
        except BaseException:
            self.teardown()  # a rank lost or failed while starting: release what was placed
            raise

    def _start(self, spec: JobSpec, world_size: int, attempt: int, lineage_id: str, recovery_label: str,
               restore_mode: RestoreMode | None, drop: tuple[str, ...], record_ids: bool, trace: bool,
               t0: float) -> None:
        """Create one actor per bundle of the placement group, form the process group, prove every rank
        sees the driver's storage, build the ranks."""
        w = spec.world
        pg = self.pg
        if pg is None:
            raise RuntimeError("the attempt's placement group was removed before its ranks started")
        actor_cls = ray.remote(RankActor)
        self.actors = [
            actor_cls.options(
                num_cpus=w.cpus_per_rank, num_gpus=w.num_gpus_per_rank, max_concurrency=5, max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=r),
            ).remote()
            for r in range(world_size)
        ]
        self.where = self._call([a.where.remote() for a in self.actors], timeout=STARTUP_TIMEOUT_S)
        self.node_ids = [w_["node_id"] for w_ in self.where]
        placement = time.perf_counter() - t0
        port = self._call([self.actors[0].free_port.remote()])[0]
        init_method = f"tcp://{self.where[0]['ip']}:{port}"
        spec_json = spec.model_dump_json()
        probe = post_driver_probe(self.storage, spec.job_id, attempt, this_node())
        try:
            setups = self._call([a.setup.remote(spec_json, r, world_size, init_method, attempt, lineage_id,
                                                recovery_label, restore_mode, drop, record_ids, trace,
                                                self._probe_for(probe, r).model_dump_json())
                                 for r, a in enumerate(self.actors)], timeout=STARTUP_TIMEOUT_S)
            check_answers(self.storage, probe, [s_["probe"] for s_ in setups])
        finally:
            remove_probes(self.storage, probe)
        self.runtimes = [s_["runtime"] for s_ in setups]  # each rank's device model and library versions
        # Recorded in AttemptStarted: where this attempt's start-up time went (slowest rank for each part).
        self.timings = {"placement_seconds": round(placement, 4)}
        for k in ("process_group_seconds", "rank_setup_seconds"):
            self.timings[k] = round(max(s[k] for s in setups), 4)

    def _probe_for(self, driver: Probe, rank: int) -> RankProbe:
        w_ = self.where[rank]
        return RankProbe(driver=driver, rank=rank, node=Node(node_id=w_["node_id"], ip=w_["ip"], host=w_["host"]))

    def _call(self, refs: list[Any], timeout: float | None = POLL_TIMEOUT_S) -> list[Any]:
        """``ray.get`` each rank's ref (``refs[r]`` belongs to rank r), turning a lost actor into
        :class:`RankLost` and an error raised by training code into :class:`RankFailed`."""
        return [self._get(rank, ref, timeout) for rank, ref in enumerate(refs)]

    def _get(self, rank: int, ref: Any, timeout: float | None = POLL_TIMEOUT_S) -> Any:
        try:
            return ray.get(ref, timeout=timeout)
        except RayTaskError as e:
            cause = e.cause if getattr(e, "cause", None) is not None else e
            if isinstance(cause, (BundleError, ManifestError, StorageNotShared)):
                raise cause from e  # the supervisor decides: fall back, or refuse the job
            raise RankFailed(f"rank {rank} raised {type(cause).__name__}: {cause}", rank,
                             collective=bool(COLLECTIVE_ERROR.search(str(cause))), refusal=refuses(cause)) from e
        except (RayActorError, GetTimeoutError) as e:
            # its creation task raised: a bug or bad input (an import that fails), not a lost machine
            if isinstance(e, RayActorError) and e.actor_init_failed:
                raise RankFailed(f"rank {rank} could not start: {str(e).strip()[-1500:]}") from e
            raise self._lost(rank, e) from e

    def _lost(self, rank: int, e: BaseException) -> RankLost:
        node = self.node_ids[rank] if rank < len(getattr(self, "node_ids", [])) else None
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        if (isinstance(e, ActorUnavailableError) or (node is not None and node not in alive)
                or (isinstance(e, RayActorError) and e.preempted)):  # preempted: Ray drained the node for it
            cause = "node-lost"
        elif isinstance(e, GetTimeoutError):
            cause = "unresponsive"
        elif OOM_KILL.search(str(e)):
            cause = "oom"
        else:
            cause = "process-exit"
        return RankLost(rank, cause, str(e).splitlines()[0] if str(e) else type(e).__name__, node)

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
            raise self._cause_of(failure)
        reports = []
        for report, notices in self._call([a.poll.remote() for a in self.actors]):
            reports.append(report)
            self.notices += notices
        return reports

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

    def _cause_of(self, failure: RankFailed) -> RankFailed | RankLost:
        """A rank whose collective failed did so because a peer died or hung: find that peer (the
        job restarts); a collective that timed out with every peer answering is a collective-timeout
        (a restart too). Any other error is the job's own and fails it."""
        if not failure.collective:
            return failure
        for rank, actor in enumerate(self.actors):
            if rank == failure.rank:
                continue
            try:
                ray.get(actor.poll.remote(), timeout=PEER_PROBE_S)
            except (RayActorError, GetTimeoutError) as e:
                return self._lost(rank, e)
            except RayTaskError:
                continue
        if re.search(r"[Tt]imed out", str(failure)):
            node = self.node_ids[failure.rank] if failure.rank is not None else None
            return RankLost(failure.rank, "collective-timeout", str(failure).splitlines()[0], node)
        return failure

    def take_notices(self) -> list[Notice]:
        notices, self.notices = self.notices, []
        return notices

    def request(self, checkpoint: bool = True, stop: bool = False) -> None:
        self._call([a.request.remote(checkpoint, stop) for a in self.actors])

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
        for a in self.actors:
            ray.kill(a, no_restart=True)
        self.actors = []
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None
