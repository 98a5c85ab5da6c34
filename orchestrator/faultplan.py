"""verify's fault plan: which faults the interrupted run gets, where, and in which attempt.

:func:`plan_faults` cycles through the fault sites, one fault per attempt, at updates where each
is sure to be reachable; :func:`sure_restore` names a plan whose restart is sure to restore a
published bundle. verify's own generator (seeded by ``--seed``) draws every choice, never the
job's streams.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from spotrun.orchestrator.comparison import NODE_SITE, WARM_SITE
from spotrun.orchestrator.specfile import SpecError
from spotrun.trainer.spec import FaultSpec, JobSpec
from spotrun.trainer.warm import ineligible

SITES = ("mid-accumulation", "mid-microstep", "bundle-write", "publish-to-offsets", "notice")


def restarts_warm(spec: JobSpec) -> bool:
    """Whether a rank killed on Ray restarts warm (trainer/warm.py): the survivors keep their processes
    (a spare or a new process takes its place, or the policy goes on without it)."""
    return ineligible(spec) is None and spec.world.size >= 2


@dataclass(frozen=True)
class NodeRemoval:
    """Remove the node hosting ``rank`` once ``attempt`` has completed ``update`` (verify does it)."""

    attempt: int
    update: int
    rank: int


def fixed_interval(spec: JobSpec) -> int:
    """``checkpoint.every_updates``, which verify plans its faults by; refuses ``auto``, whose
    checkpoints come when the measured timing says so (no fault could be planned at one)."""
    every = spec.checkpoint.fixed_every
    if every is None:
        raise SpecError("spotrun verify plans its faults at fixed checkpoint boundaries, and checkpoint.every_updates"
                        "=auto takes its checkpoints when the measured timing says so; run verify with a fixed "
                        "interval, e.g. --set checkpoint.every_updates=3 (the interval is not part of the trajectory: "
                        "what verify proves with a fixed interval holds under auto too)")
    return every


def plan_faults(spec: JobSpec, kills: int, seed: int, nodes: bool = False,
                warm: bool = False) -> tuple[list[FaultSpec], list[NodeRemoval]]:
    """``kills`` faults at increasing updates, one per attempt, cycling through the fault sites
    (with node removals among them when the job runs on several nodes, and a kill as a warm restart
    re-forms the group when ``warm``: on Ray, where :func:`restarts_warm`), as many as fit before
    ``train.updates``.

    The plan starts after the second checkpoint boundary, so that the first bundle is published
    before any fault. When the interval is too long for that (no fault would fit), it starts
    instead with a kill right after the first bundle is published (the publish-to-offsets site),
    which the next attempt is sure to restore. With ``checkpoint.every_updates >= train.updates``
    no bundle comes before the end and nothing is planned (:func:`proof_failures` says so)."""
    sites = (*SITES, NODE_SITE) if nodes else SITES
    if warm and restarts_warm(spec):  # after the second kill: its restart is from a bundle this driver published
        sites = (*sites[:2], WARM_SITE, *sites[2:])
    every, last = fixed_interval(spec), spec.train.updates
    # From one interval after the first bundle on: it is written in the background and published by
    # the supervisor's next poll, and a fault an update after its boundary often came first (under
    # load, every fault of a short plan did), so that no restart restored a bundle at all.
    faults, removals = _plan(spec, kills, random.Random(seed), sites, start=2 * every)
    if faults or removals or every >= last:
        return faults, removals
    first = ("publish-to-offsets", *(s for s in sites if s != "publish-to-offsets"))
    return _plan(spec, kills, random.Random(seed), first, start=0)


def _plan(spec: JobSpec, kills: int, rng: random.Random, sites: Sequence[str],
          start: int) -> tuple[list[FaultSpec], list[NodeRemoval]]:
    """:func:`plan_faults`' plan through ``sites`` in turn, the first fault after update ``start``
    (a boundary site: at the first boundary after it). ``rng`` is verify's own generator, never the
    job's streams."""
    every, last = fixed_interval(spec), spec.train.updates
    accum = spec.train.accum_steps
    faults: list[FaultSpec] = []
    removals: list[NodeRemoval] = []
    update, attempt = start, 0
    for i in range(kills):
        site = sites[i % len(sites)]
        if site == WARM_SITE:
            # the restart after the previous fault re-forms the group warm (attempt + 1), resuming at or
            # before that fault's update: a kill there sends it cold, within the same attempt
            faults.append(FaultSpec(site="rejoin", update=update, attempt=attempt + 1,
                                    rank=rng.randrange(spec.world.size) if spec.world.spares else 0))
            continue
        if site in ("bundle-write", "publish-to-offsets"):
            u = (update // every + 1) * every  # the next checkpoint boundary
        else:
            u = update + 1 + rng.randrange(2)
        if u >= last:
            break
        attempt, rank = attempt + 1, rng.randrange(spec.world.size)
        if site == NODE_SITE:
            removals.append(NodeRemoval(attempt, u, rank))
            # the removal is triggered from the trace, which lags the ranks: they may publish the
            # next bundle first, and a fault planned before it would never be reached
            update = u + every
            continue
        by_site: dict[str, dict[str, object]] = {
            "mid-accumulation": dict(site="microstep", microstep=rng.randrange(1, accum) if accum > 1 else 0),
            "mid-microstep": dict(site="backward", microstep=rng.randrange(accum)),
            "bundle-write": dict(site="bundle_write"),
            "publish-to-offsets": dict(site="after_publish", rank=0),
            "notice": dict(site="microstep", microstep=rng.randrange(accum), signal="SIGTERM"),
        }
        fault = by_site[site]
        faults.append(FaultSpec.model_validate({"update": u, "attempt": attempt, "rank": rank, **fault}))
        # a notice's emergency bundle is taken at the boundary the ranks reach when the request
        # arrives, which may be an update or two later: the next fault goes past it
        update = u + every if site == "notice" else u
    return faults, removals


def sure_restore(spec: JobSpec, kills: int, seed: int, nodes: bool, warm: bool) -> str:
    """How to plan a fault whose restart restores a bundle whatever the timing: the publish-to-offsets
    site kills right after a publish (the other sites race the supervisor's publish of the bundle)."""
    # the plan's positions do not depend on train.updates, which only cuts it short: plan as if unbounded
    unbounded = spec.model_copy(update={"train": spec.train.model_copy(update={"updates": 2**62})})
    n = len(SITES) + int(nodes) + int(warm)  # one cycle through the sites reaches publish-to-offsets
    faults, _ = plan_faults(unbounded, max(kills, n), seed, nodes, warm)
    sure = next(f for f in faults if f.site == "after_publish")
    # its place in the plan: its attempt (node removals included) and the warm-rejoin kills before it,
    # which take no attempt of their own
    at = sure.attempt + sum(f.site == "rejoin" for f in faults[:faults.index(sure)])
    u = sure.update
    room = f" and train.updates to >= {u + 1} (now {spec.train.updates})" if u >= spec.train.updates else ""
    return (f"run verify with --kills {max(kills, at)}{room}: fault {at} of that plan kills right after the bundle "
            f"of update {u} is published, and its restart always restores it")
