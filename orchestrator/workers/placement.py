"""Where a job's ranks fit: one rank's resources, how many ranks the alive nodes hold, and whether Ray's
scheduler can place more beside the running ones. The supervisor's capacity questions and the
:class:`~spotrun.orchestrator.workers.raygroup.RayGroup`'s placement groups both read these."""

from __future__ import annotations

from collections.abc import Set

import ray
from ray.exceptions import GetTimeoutError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from spotrun.trainer.job.spec import JobSpec


def placed(pg: PlacementGroup) -> bool:
    """Whether every bundle of ``pg`` holds its resources now (none waits for a node)."""
    return ray.util.placement_group_table(pg).get("state") == "CREATED"


def bundle_placed(pg: PlacementGroup, index: int, draining: Set[str] = frozenset()) -> bool:
    """Whether bundle ``index`` of ``pg`` holds its resources on a node that is alive now and not in
    ``draining``. Another bundle of the group may wait for a node meanwhile (its node was lost): that makes
    the group not :func:`placed`, and says nothing of this one. A bundle on a draining node holds nothing a
    new process can use: Ray starts no new work there, so the process would wait until the node is gone
    (the whole notice) and its bundle moved."""
    node = ray.util.placement_group_table(pg).get("bundles_to_node_id", {}).get(index)
    return bool(node) and node not in draining and any(n["NodeID"] == node and n.get("Alive") for n in ray.nodes())


def rank_bundle(spec: JobSpec) -> dict[str, float]:
    """One rank's resources, as a placement group bundle (``world.cpus_per_rank``, ``num_gpus_per_rank``)."""
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
