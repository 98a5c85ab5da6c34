"""Starting a supervisor: on Ray (embedded local Ray, or a cluster at ``--address``) or in this process.

``spotrun run`` resumes from the newest published bundle of the job when one
exists and starts fresh otherwise; the same command continues a killed job.
"""

from __future__ import annotations

import logging
import os

from spotrun.trainer.spec import JobSpec

from spotrun.orchestrator.groups import InProcessGroup
from spotrun.orchestrator.supervisor import Outcome, Supervisor

log = logging.getLogger("spotrun")
MUTANT_ENV = "SPOTRUN_DROP_STATE"


def mutant_drop() -> tuple[str, ...]:
    """A deliberately broken build, for proving that ``spotrun verify`` catches one: the state
    categories named in $SPOTRUN_DROP_STATE (comma-separated) are dropped after every restore."""
    drop = tuple(d for d in os.environ.get(MUTANT_ENV, "").split(",") if d)
    if drop:
        log.warning("%s=%s: restores will drop these state categories on purpose", MUTANT_ENV, ",".join(drop))
    return drop


def run_in_process(spec: JobSpec, *, trace_path: str | None = None, record_ids: bool = False,
                   init_from: tuple[str, str] | None = None, reset: tuple[str, ...] = ()) -> Outcome:
    """World size 1 without Ray: the rank trains on a thread of this process."""
    return in_process_supervisor(spec, trace_path=trace_path, record_ids=record_ids, init_from=init_from,
                                 reset=reset).run()


def in_process_supervisor(spec: JobSpec, *, trace_path: str | None = None, record_ids: bool = False,
                          init_from: tuple[str, str] | None = None, reset: tuple[str, ...] = ()) -> Supervisor:
    if spec.world.size != 1:
        raise ValueError(f"running without Ray needs world.size=1 (the spec asks for {spec.world.size})")

    drop = mutant_drop()

    def make_group(size, attempt, lineage, label, mode):
        return InProcessGroup(spec, attempt=attempt, lineage_id=lineage, recovery_label=label,
                              restore_mode=mode, drop=drop, record_ids=record_ids, trace=trace_path is not None)

    return Supervisor(spec, make_group, capacity=lambda: 1, trace_path=trace_path, record_ids=record_ids,
                      init_from=init_from, reset=reset)


def ensure_ray(spec: JobSpec, address: str | None) -> None:
    """Connect to ``address``, or start an embedded local Ray sized for the job."""
    import ray

    # Token authentication stays on (Ray's secure default); its start-up notice is not news.
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
        return
    cpus = max(spec.max_world, spec.world.size) * spec.world.cpus_per_rank
    ray.init(address="local", num_cpus=int(max(1, cpus)), include_dashboard=False, log_to_driver=False,
             logging_level=logging.WARNING)


def run_on_ray(spec: JobSpec, *, address: str | None = None, trace_path: str | None = None,
               record_ids: bool = False, init_from: tuple[str, str] | None = None,
               reset: tuple[str, ...] = ()) -> Outcome:
    from spotrun.orchestrator.raygroup import RayGroup, rank_bundle, available_rank_slots, room_for_more_ranks

    ensure_ray(spec, address)

    drop = mutant_drop()

    def make_group(size, attempt, lineage, label, mode):
        return RayGroup(spec, size, attempt=attempt, lineage_id=lineage, recovery_label=label, restore_mode=mode,
                        drop=drop, record_ids=record_ids, trace=trace_path is not None,
                        placement_timeout_s=max(5.0, spec.world.capacity_timeout_s))

    drain_source = None
    if spec.preemption.watch_ray_drain:
        import ray

        from spotrun.orchestrator.notices import draining_nodes

        gcs = ray.get_runtime_context().gcs_address
        drain_source = lambda: draining_nodes(gcs)  # noqa: E731
    def capacity() -> int:
        return available_rank_slots(spec, exclude=drain_source() if drain_source else set())

    def request_capacity(ranks: int) -> None:
        from ray.autoscaler.sdk import request_resources

        request_resources(bundles=[rank_bundle(spec)] * ranks)

    sup = Supervisor(spec, make_group, capacity=capacity, trace_path=trace_path, record_ids=record_ids,
                     init_from=init_from, reset=reset, drain_source=drain_source, request_capacity=request_capacity,
                     room_for=lambda extra: room_for_more_ranks(spec, extra))
    return sup.run()
