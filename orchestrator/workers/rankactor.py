"""The Ray actor around one rank: it forms the attempt's process group, holds the rank's
:class:`~spotrun.trainer.run.rank.RankRunner` (built once, kept across warm restarts), serves ``poll`` and
``request`` while ``run`` trains (a threaded actor), and carries the rank's output back on its polls.
:mod:`spotrun.orchestrator.workers.raygroup` places and drives these actors."""

from __future__ import annotations

import functools
import logging
import os
import socket
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import ray

from spotrun.orchestrator.notices.clouds import CloudWatcher, watch_clouds
from spotrun.orchestrator.notices.notice import Notice, install_signal_notices
from spotrun.orchestrator.workers.priority import run_at_normal_priority
from spotrun.orchestrator.workers.ray_internals import is_ray_control_line
from spotrun.trainer.bundle.manifest import Manifest
from spotrun.trainer.job.spec import JobSpec
from spotrun.trainer.observe.ranklog import RankLog
from spotrun.trainer.observe.redirect import FdRedirect
from spotrun.trainer.observe.stacks import arm
from spotrun.trainer.run.context import AttemptContext
from spotrun.trainer.run.rank import RankRunner, RankState, Report
from spotrun.trainer.run.session import TrainSession
from spotrun.trainer.run.visibility import (
    Node,
    Probe,
    RankProbe,
    answer_probe,
)
from spotrun.trainer.run.warm import Kept
from spotrun.trainer.runtime.collective import Collective, LocalCollective, TorchCollective
from spotrun.trainer.runtime.device import rank_device
from spotrun.trainer.runtime.memory import release_freed_memory_soon
from spotrun.trainer.storage import open_storage

# A poll waits this long at most for the rank's output to be read (a millisecond, unless the process is starved).
POLL_DRAIN_S = 0.2
STACKS_DIR = "spotrun-stacks"  # under the node's temporary folder: where each rank process's faulthandler writes


def stacks_log(pid: int) -> Path:
    """The local file process ``pid`` on this node writes its stacks to when asked (trainer/observe/stacks.py);
    the driver copies what it took into the attempt's rank logs in storage."""
    return Path(tempfile.gettempdir()) / STACKS_DIR / f"rank-process-{pid}.log"
log = logging.getLogger("spotrun.rankactor")


def this_node() -> Node:
    """The Ray node this process runs on, and its address."""
    return Node(node_id=ray.get_runtime_context().get_node_id(), ip=ray.util.get_node_ip_address(),
                host=socket.gethostname())


class RankActor:
    """The Ray actor around one rank (made a Ray actor class by :func:`rank_actor_class`)."""

    def __init__(self) -> None:
        self.runner: RankRunner | None = None  # built by setup()
        self.collective: Collective | None = None
        self.rank: int | None = None
        self.grace_s = 110.0
        self.node_id = ray.get_runtime_context().get_node_id()
        self._notices: list[Notice] = []
        self._lock = threading.Lock()
        self._clouds: CloudWatcher | None = None
        self.session: TrainSession | None = None  # a spare's, built before it has a place (prepare)
        self.device = "cpu"
        self._run_ended = threading.Event()  # clear while run() trains: leave() waits for it
        self._run_ended.set()
        # What this process writes (the job's prints, warnings and logging, C extensions, loader
        # workers) goes to the rank log and, with each poll, to the driver (trainer/observe/ranklog.py)
        self.output = RankLog()
        self._redirect: FdRedirect | None = None
        # __init__ runs on the actor's main thread, the only one that may install signal handlers:
        # a SIGTERM to this process becomes a notice instead of an exit. _on_notice runs on the
        # notices' own thread, never in the handler, so its lock and the runner's wake are safe.
        install_signal_notices(self.node_id, None, self.grace_s, self._on_notice)
        # Armed once for the process's life: a hung rank's stacks can be asked of it (where py-spy is missing)
        self.stacks_log = stacks_log(os.getpid())
        self.stacks_log.parent.mkdir(parents=True, exist_ok=True)
        arm(self.stacks_log)

    def _on_notice(self, notice: Notice) -> None:
        with self._lock:
            if notice.source in ("sigterm", "sigint"):  # the handler was installed before setup
                notice = notice.model_copy(update={"rank": self.rank, "deadline": notice.received_at
                                                   + timedelta(seconds=self.grace_s)})
            self._notices.append(notice)
        if self.runner is not None:
            self.runner.wake()  # the supervisor's wait ends: the notice is in its next poll

    def _log_as(self, spec: JobSpec, attempt: int, label: str, *, write: bool = True) -> None:
        """Label this process's lines ``label`` ("rank 1") from now on, kept in ``attempt``'s rank log
        (``write=False``: not written to storage before the driver's storage probe is answered)."""
        if self._redirect is None:
            self._redirect = FdRedirect(self.output, keep=lambda line: not is_ray_control_line(line))
        else:
            self._redirect.drain()  # what the previous attempt wrote keeps its label
        self.output.begin(open_storage(spec.storage, spec.storage_endpoint_url, check=False), spec.job_id, attempt,
                          label, write=write)

    def where(self) -> dict[str, Any]:
        return {**this_node().model_dump(), "pid": os.getpid(), "stacks_log": str(self.stacks_log)}

    def stacks_then_kill(self, pid: int, armed_log: str | None) -> tuple[str, str, str]:
        """For the driver: a hung or stuck peer's stacks taken on this node, then the peer killed (a thread
        of this live process does it, where a task would first start a worker: watch.condemn)."""
        from spotrun.orchestrator.workers.watch import stacks_then_kill

        return stacks_then_kill(pid, armed_log)

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def setup(self, ctx: AttemptContext, rank: int, probe: RankProbe) -> dict[str, Any]:
        """Serve attempt ``ctx`` as rank ``rank``: pick the device (refusing a GPU this torch cannot see),
        form the process group (at ``ctx.init_method``), answer the driver's storage ``probe``
        (``StorageNotShared`` when this rank cannot see it), build the rank. Returns the device, the
        rank's runtime (device model and library versions), its probe, and where the time went."""
        t0 = time.perf_counter()
        run_at_normal_priority()  # before the process group's threads start: they inherit it
        spec = ctx.spec
        self._log_as(spec, ctx.attempt, f"rank {rank}", write=False)  # the storage probe comes first
        self.rank, self.grace_s = rank, spec.preemption.grace_s
        try:
            assigned = ray.get_runtime_context().get_accelerator_ids().get("GPU", [])
            device = rank_device(spec.world.num_gpus_per_rank, assigned, self.node_id)  # DeviceError: exit 2
            self.device = device
            self._watch(spec, rank)
            collective = self._join(ctx, rank)
            t1 = time.perf_counter()
            self.runner = RankRunner(ctx, rank=rank, collective=collective, device=device, probe=probe)
            self.output.allow_writes()  # the runner answered the probe before it built the job
        except BaseException:
            self.flush_output()  # what the job printed before it failed stays in the rank log
            raise
        return {"process_group_seconds": t1 - t0, "rank_setup_seconds": time.perf_counter() - t1,
                "device": device, "runtime": self.runner.session.desc.runtime, "probe": self.runner.probe}

    def _watch(self, spec: JobSpec, rank: int) -> None:
        """Watch the cloud's metadata endpoint for a notice to this rank (a warm restart may renumber it)."""
        if self._clouds is not None and rank != self.rank:
            self._clouds.stop()
            self._clouds = None
        self.rank = rank
        if self._clouds is None:
            self._clouds = watch_clouds(spec.preemption, self.node_id, rank, self._on_notice)

    def acknowledge(self, notice: Notice) -> None:
        """The bundle this rank's notice asked for is published: tell its cloud (Azure's ``StartRequests``,
        when ``preemption.azure_ack`` is on). Raises ``OSError`` when the endpoint refuses."""
        if self._clouds is not None:
            self._clouds.acknowledge(notice)

    def _join(self, ctx: AttemptContext, rank: int) -> Collective:
        """Form the attempt's process group (gloo on CPU, nccl with GPUs) as ``rank`` of ``ctx.world_size``."""
        collective: Collective
        if ctx.world_size > 1:
            if ctx.init_method is None:
                raise RuntimeError(f"attempt {ctx.attempt} has {ctx.world_size} ranks but no init_method to meet at")
            backend = "gloo" if self.device == "cpu" else "nccl"
            collective = TorchCollective(ctx.init_method, rank, ctx.world_size, backend,
                                         ctx.spec.world.collective_timeout_s, self.device)
        else:
            collective = LocalCollective()
        self.collective = collective
        return collective

    def prepare(self, ctx: AttemptContext, number: int, probe: Probe) -> dict[str, Any]:
        """A spare placed during attempt ``ctx``: pick the device, answer the driver's storage ``probe``
        (as rank ``number``, past the world's), build the job and its state (as rank 0 of
        ``ctx.world_size``, attempt 0; :meth:`rejoin` gives it its place) and wait. Its lines until then
        are ``spare <number>``'s, in that attempt's rank logs."""
        run_at_normal_priority()
        spec = ctx.spec
        self._log_as(spec, ctx.attempt, f"spare {number}", write=False)
        assigned = ray.get_runtime_context().get_accelerator_ids().get("GPU", [])
        self.device = rank_device(spec.world.num_gpus_per_rank, assigned, self.node_id)
        answer = answer_probe(open_storage(spec.storage, spec.storage_endpoint_url),
                              RankProbe(driver=probe, rank=number, node=this_node()))
        self.output.allow_writes()
        self.session = TrainSession(spec, rank=0, world_size=ctx.world_size, attempt=0,
                                    restore_mode=ctx.restore_mode, instrument=ctx.instrument, device=self.device)
        return {"probe": answer, **self.where()}

    def leave(self, timeout: float) -> list[str] | None:
        """Give up the attempt and keep the process: ask the run to stop at the next boundary (a
        collective with a lost peer ends it sooner), wait up to ``timeout`` for it to end and close
        its process group. Returns the bundles this rank holds in host memory (None: the run did
        not end in time)."""
        if self.runner is None:
            return []
        self.runner.abort()
        if not self._run_ended.wait(timeout):
            return None
        return self.runner.held.keys()


    def replica(self, bundle_key: str) -> Kept | None:
        """The replicated model and optimizer of ``bundle_key`` in this rank's memory, for a spare."""
        return self.runner.replica(bundle_key) if self.runner is not None else None

    def rejoin(self, ctx: AttemptContext, rank: int, bundle_key: str, manifest: Manifest,
               shipped_files: dict[str, bytes], replica: Kept | None) -> dict[str, Any]:
        """Serve attempt ``ctx`` as ``rank`` in this process (a survivor, or a spare): form the new
        process group, keep the built job, and restore bundle ``bundle_key`` (its ``manifest``) from
        memory (trainer/run/warm.py; ``NotInMemory`` when a file is held nowhere)."""
        t0 = time.perf_counter()
        spec = ctx.spec
        self._log_as(spec, ctx.attempt, f"rank {rank}")  # a warm restart may renumber this process
        session = self.runner.session if self.runner is not None else self.session
        if session is None:
            raise RuntimeError("rejoin: this process has no built job (neither a rank nor a prepared spare)")
        held = self.runner.held if self.runner is not None else None
        self._watch(spec, rank)
        collective = self._join(ctx, rank)
        t1 = time.perf_counter()
        runner = RankRunner(ctx, rank=rank, collective=collective, device=self.device, session=session, held=held)
        t2 = time.perf_counter()
        seconds, mismatches = runner.restore_from_memory(bundle_key, manifest, shipped_files, replica)
        self.runner, self.session = runner, None
        release_freed_memory_soon()  # what the attempt before freed goes back to the system (#50)
        return {"process_group_seconds": t1 - t0, "rank_setup_seconds": t2 - t1, "restore_seconds": seconds,
                "mismatches": mismatches, "runtime": runner.session.desc.runtime}

    def _runner(self) -> RankRunner:
        if self.runner is None:
            raise RuntimeError("the rank actor is not set up: setup() must succeed first")
        return self.runner

    def restore(self, bundle_key: str, storage_uri: str | None, reset: tuple[str, ...]) -> tuple[float, list[str]]:
        return self._runner().restore(bundle_key, storage_uri=storage_uri, reset=reset)

    def run(self) -> RankState:
        runner = self._runner()
        run_at_normal_priority()  # this thread of the actor's pool too; the loader workers fork from it
        self._run_ended.clear()
        try:
            return runner.run()
        finally:
            if self.collective is not None:  # set with the runner
                self.collective.close()
            self.flush_output()
            self._run_ended.set()

    def flush_output(self) -> None:
        """Every line this process wrote so far into the rank log's queue (the driver's next poll) and
        storage: when a run ends, and before a teardown kills this process."""
        if self._redirect is not None:
            self._redirect.drain()
        self.output.flush()

    def poll(self) -> tuple[Report, list[Notice]]:
        """What the rank did and printed since the last poll, and the notices it saw. A rank whose run
        ended is reported finished (or stopped) only once run() has returned: the driver tears the
        group down when every rank has finished, and by then the rank log is written."""
        if self._redirect is not None:  # the lines written before this poll come with it
            self._redirect.drain(timeout=POLL_DRAIN_S)
        report = self._runner().poll()  # first: it clears the news, and a notice after this wakes again
        if report.state != RankState.RUNNING and not self._run_ended.is_set():
            report.state = RankState.RUNNING
        report.output = self.output.take()
        with self._lock:
            notices, self._notices = self._notices, []
        return report, notices

    def request(self, checkpoint: bool, stop: bool) -> None:
        self._runner().request(checkpoint, stop)

    def wait_for_news(self, timeout: float) -> bool:
        return self._runner().wait_for_news(timeout)


@functools.cache
def rank_actor_class() -> Any:
    """:class:`RankActor` as a Ray actor class, made once per process. Each ``ray.remote`` call makes a new
    class (every method wrapped again, the definition exported to the cluster again) that Ray keeps: made
    per rank, a driver restarting its job hundreds of times kept a few hundred kB per restart."""
    return ray.remote(RankActor)
