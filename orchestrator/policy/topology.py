"""Topology-change policies: given the capacity there is, restart, wait, or give up — with a reason.

| policy       | restarts with                                   | recovery label |
| strict       | the same world size, waiting capacity_timeout_s | exact          |
| elastic      | any allowed size in [min, max] (largest first)  | exact-data     |
|              | and grows back while running when room returns  |                |
| fresh-epoch  | any allowed size; data restarts at next epoch   | fresh-epoch    |

An elastic restart at the world size it had is labelled ``exact``: it computes
exactly what the uninterrupted run would have.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from spotrun.trainer.data.planner import RestoreMode
from spotrun.trainer.job.spec import JobSpec


@dataclass(frozen=True)
class Decision:
    action: Literal["restart", "wait", "raise"]
    world_size: int | None
    reason: str


def decide(spec: JobSpec, available_ranks: int, waited_s: float) -> Decision:
    w = spec.world
    sizes = [n for n in spec.allowed_world_sizes() if n <= available_ranks]
    if sizes:
        n = max(sizes)
        return Decision("restart", n, f"{available_ranks} rank slots available; {w.policy} restarts with {n}")
    need = min(spec.allowed_world_sizes())
    if waited_s < w.capacity_timeout_s:
        return Decision("wait", None, f"{w.policy} needs {need} rank slots, {available_ranks} available; "
                                      f"waiting up to {w.capacity_timeout_s:g}s for capacity")
    allowed = spec.allowed_world_sizes()
    return Decision("raise", None, (
        f"world.policy={w.policy} needs {need if w.policy == 'strict' else f'{allowed[0]}..{allowed[-1]}'} ranks "
        f"of {{CPU: {w.cpus_per_rank:g}{f', GPU: {w.num_gpus_per_rank:g}' if w.num_gpus_per_rank else ''}}} "
        f"but only {available_ranks} fit on the cluster after waiting {waited_s:.0f}s "
        f"(world.capacity_timeout_s={w.capacity_timeout_s:g}); add nodes, raise the timeout, "
        f"or declare world.policy=elastic with a smaller world.min_size"))


def grow(spec: JobSpec, world_size: int, available_ranks: int, updates_left: int,
         interval_updates: int | None = None) -> Decision | None:
    """elastic, while running: restart larger when a larger allowed world fits and enough of the job
    is left to repay the restart (more than one checkpoint interval: ``interval_updates``, by default
    the fixed ``checkpoint.every_updates``; under ``auto`` the caller gives the one it chose). ``None``:
    stay as is."""
    every = interval_updates if interval_updates is not None else spec.checkpoint.fixed_every
    if every is None:
        raise ValueError("policy.grow under checkpoint.every_updates=auto needs interval_updates (the interval "
                         "auto chose, in updates)")
    if spec.world.policy != "elastic" or updates_left <= every:
        return None
    larger = [n for n in spec.allowed_world_sizes() if world_size < n <= available_ranks]
    if not larger:
        return None
    n = max(larger)
    return Decision("restart", n, f"{available_ranks} rank slots available: elastic grows from {world_size} "
                                  f"to {n} ranks with {updates_left} updates left")


def recovery_label(spec: JobSpec, size_before: int | None, size_after: int) -> str:
    """The label of a restore: the world side, then the data side when it is not exact."""
    if spec.world.policy == "fresh-epoch" or spec.data.recovery == "fresh-epoch":
        return "fresh-epoch"
    world = "exact" if size_before in (None, size_after) else "exact-data"
    return world if spec.data.recovery == "exact" else f"{world}+{spec.data.recovery}"


def restore_mode(spec: JobSpec) -> RestoreMode:
    """How the data planner restores: the data side of the contract decides."""
    if spec.world.policy == "fresh-epoch" or spec.data.recovery == "fresh-epoch":
        return "fresh-epoch"
    if spec.data.recovery == "bounded-repetition":
        return "bounded-repetition"
    return spec.checkpoint.restore_mode
