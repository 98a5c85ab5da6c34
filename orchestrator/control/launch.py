"""Starting a supervisor: on Ray (embedded local Ray, or a cluster at ``--address``) or in this process.

``spotrun run`` resumes from the newest published bundle of the job when one
exists and starts fresh otherwise; the same command continues a killed job.
Before anything is placed, the job's entrypoint is imported here, so one that
cannot be imported is refused at once (the ranks import it the same way: the
working directory is on their path).

``drop`` builds a deliberately broken job whose restores lose the named state
categories; only ``spotrun verify --mutate`` asks for one (through
:mod:`spotrun.orchestrator.cli.mutant`), never ``spotrun run``. The trace switches and ``drop`` reach
the ranks as one :class:`~spotrun.trainer.run.context.Instrumentation`, part of each attempt's
:class:`~spotrun.trainer.run.context.AttemptContext`.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from spotrun.orchestrator.control.platform import Options, Platform
from spotrun.orchestrator.control.progress import Progress
from spotrun.orchestrator.control.supervisor import Outcome, Supervisor
from spotrun.orchestrator.notices.clouds import watch_clouds
from spotrun.orchestrator.workers.groups import InProcessGroup
from spotrun.orchestrator.workers.ray_internals import quiet_auth_notice, quiet_worker_deaths, shutdown_without_grace
from spotrun.trainer.job.contract import entrypoint_of, load_entrypoint
from spotrun.trainer.job.spec import JobSpec
from spotrun.trainer.observe.redirect import routed
from spotrun.trainer.run.context import AttemptContext, Instrumentation, MlflowSend
from spotrun.trainer.storage import open_storage

log = logging.getLogger("spotrun")


def check_entrypoint(spec: JobSpec) -> None:
    """Import the job's entrypoint in this process (a :class:`JobError` says why it cannot be). The
    working directory comes first on the path, as for ``python -m``: ranks inherit this path."""
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    load_entrypoint(entrypoint_of(spec))


def run_in_process(spec: JobSpec, *, trace_path: str | None = None, record_ids: bool = False,
                   init_from: tuple[str, str] | None = None, reset: tuple[str, ...] = (),
                   drop: tuple[str, ...] = (), progress: Progress | None = None) -> Outcome:
    """World size 1 without Ray: the rank trains on a thread of this process. The cloud notice sources
    (``preemption.sources``) are watched here as on a Ray node: a notice for this machine drains the
    job like SIGTERM.

    ``sys.stdout`` and ``sys.stderr`` are routed from before the entrypoint is imported, so that a
    library that keeps the stream it finds at import (transformers' logging) keeps the router: what
    the rank's thread writes is then its output, printed ``[rank 0] ...`` and kept in its rank log."""
    with routed():
        sup = in_process_supervisor(spec, trace_path=trace_path, record_ids=record_ids, init_from=init_from,
                                    reset=reset, drop=drop, progress=progress)
        watcher = watch_clouds(spec.preemption, None, None, sup.notify)
        if watcher is not None:
            sup.driver_watchers.append(watcher)
        try:
            return sup.run()
        finally:
            if watcher is not None:
                watcher.stop()


def in_process_supervisor(spec: JobSpec, *, trace_path: str | None = None, record_ids: bool = False,
                          init_from: tuple[str, str] | None = None, reset: tuple[str, ...] = (),
                          drop: tuple[str, ...] = (), progress: Progress | None = None) -> Supervisor:
    if spec.world.size != 1:
        raise ValueError(f"running without Ray needs world.size=1 (the spec asks for {spec.world.size})")
    check_entrypoint(spec)

    instrument = Instrumentation.of(trace=trace_path is not None, record_ids=record_ids, mutate=drop)

    def make_group(size, attempt, lineage, label, mode):  # one rank in this process, whatever the size asked
        return InProcessGroup(AttemptContext(spec=spec, attempt=attempt, world_size=1, lineage_id=lineage,
                                             recovery_label=label, restore_mode=mode, instrument=instrument))

    return Supervisor(spec, Platform(make_group, capacity=lambda: 1),
                      Options(trace_path=trace_path, record_ids=record_ids, init_from=init_from, reset=reset,
                              progress=progress, oracle_acts=not instrument.mutant,
                              send_at_publish=instrument.mlflow_send is MlflowSend.AT_PUBLISH))


def embedded_cpus(spec: JobSpec) -> int:
    """The CPUs a local Ray for this job declares: the largest world's ranks and the spares, whatever the
    machine has."""
    return int(max(1, (max(spec.max_world, spec.world.size) + spec.world.spares) * spec.world.cpus_per_rank))


def ensure_ray(spec: JobSpec, address: str | None) -> None:
    """Connect to ``address``, or start an embedded local Ray sized for the job."""
    import ray

    quiet_auth_notice()  # token authentication stays on (Ray's secure default)
    quiet_worker_deaths()  # each lost rank is told in spotrun's words; the ranks' output comes through polls
    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
        return
    with group_signals_spare_ray():
        ray.init(address="local", num_cpus=embedded_cpus(spec), include_dashboard=False, log_to_driver=False,
                 logging_level=logging.WARNING)
    atexit.register(shutdown_without_grace)  # before Ray's own exit handler (registered earlier, run later)


@contextmanager
def group_signals_spare_ray() -> Iterator[None]:
    """Start the embedded Ray's processes with SIGTERM blocked, so a stop sent to the whole process
    group (``systemctl stop``, ``tini -g``, ``kill -TERM -PGID``) leaves the GCS and raylet up
    while the driver, which gets it too, drains the ranks and publishes the emergency bundle.

    A blocked signal stays blocked across ``fork`` and ``exec``, so every process Ray starts
    (and the workers its raylet starts) inherits it; Ray already starts them with SIGINT
    blocked for the same reason. They still end with the driver: ``ray.shutdown`` kills what
    ignores its SIGTERM, and Ray's fate-sharing (parent-death SIGKILL) covers a killed driver.
    The rank actors unblock SIGTERM for themselves (:func:`~spotrun.orchestrator.notices.notice.
    install_signal_notices`), so SIGTERM to one worker is still that rank's notice."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def run_on_ray(spec: JobSpec, *, address: str | None = None, trace_path: str | None = None,
               record_ids: bool = False, init_from: tuple[str, str] | None = None,
               reset: tuple[str, ...] = (), drop: tuple[str, ...] = (), progress: Progress | None = None) -> Outcome:
    check_entrypoint(spec)
    ensure_ray(spec, address)
    instrument = Instrumentation.of(trace=trace_path is not None, record_ids=record_ids, mutate=drop)
    sup = Supervisor(spec, ray_platform(spec, instrument),
                     Options(trace_path=trace_path, record_ids=record_ids, init_from=init_from, reset=reset,
                             progress=progress, oracle_acts=not instrument.mutant,
                             send_at_publish=instrument.mlflow_send is MlflowSend.AT_PUBLISH))
    return sup.run()


def ray_platform(spec: JobSpec, instrument: Instrumentation) -> Platform:
    """The connected Ray as the job's platform: each attempt a :class:`RayGroup`, the capacity Ray's free
    rank slots (less the nodes it is draining), its autoscaler asked for room. A bench that watches the
    groups themselves wraps ``make_group`` (``dataclasses.replace``)."""
    from spotrun.orchestrator.workers.placement import available_rank_slots, rank_bundle, room_for_more_ranks
    from spotrun.orchestrator.workers.raygroup import RayGroup

    storage = open_storage(spec.storage, spec.storage_endpoint_url, check=False)  # the supervisor checks it

    drain_source = None
    if spec.preemption.watch_ray_drain:
        import ray

        from spotrun.orchestrator.workers.ray_internals import drain_reader

        drain_source = drain_reader(ray.get_runtime_context().gcs_address)

    def make_group(size, attempt, lineage, label, mode):
        return RayGroup(AttemptContext(spec=spec, attempt=attempt, world_size=size, lineage_id=lineage,
                                       recovery_label=label, restore_mode=mode, instrument=instrument),
                        storage=storage, placement_timeout_s=max(5.0, spec.world.capacity_timeout_s),
                        drains=drain_source)
    def capacity() -> int:
        return available_rank_slots(spec, exclude=drain_source() if drain_source else set())

    class RayScaler:
        """Ray's autoscaler: asked for the job's ranks while placing; its scheduler says whether more fit."""

        def request(self, ranks: int) -> None:
            from ray.autoscaler.sdk import request_resources

            request_resources(bundles=[rank_bundle(spec)] * ranks)

        def room_for(self, extra: int) -> bool:
            return room_for_more_ranks(spec, extra)

    return Platform(make_group, capacity, scaler=RayScaler(), drains=drain_source)
