"""How the driver recovers from a lost rank, decided in one place (runs in the driver).

Two pure functions decide; the supervisor and the worker group only carry the decision out:

- :func:`plan_recovery`: after a loss, fail the job, restart warm (the survivors keep their
  processes and restore from memory) or restart cold (every rank anew, from storage), with the loss's
  class and the backoff before the restart.
- :func:`warm_world`: for a warm restart, the world it restores into: the size the placement policy
  chooses, as for any restart, when a warm restart can fill it (the lost attempt's size, or one less).
- :func:`plan_warm`: for a warm restart, which path: ``warm-spare`` (a ready spare takes each lost
  rank's place), ``warm-replace`` (a new process in the lost rank's slot, still held), or
  ``warm-shrink`` (the survivors alone, where the policy allows that size).

The vocabulary is typed: :class:`LossCause` says of each cause whether it is a preemption and
whether the survivors may restart warm after it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

from spotrun.orchestrator.policy import topology
from spotrun.trainer.job.spec import JobSpec
from spotrun.trainer.run.warm import ineligible

LossClass = Literal["preemption", "failure"]
WarmPath = Literal["warm-spare", "warm-replace", "warm-shrink"]

# how a lost rank came back, as the ledger records it (Restored.recovery_path)
RecoveryPath = Literal["cold", "warm-spare", "warm-replace", "warm-shrink"]



class LossCause(StrEnum):
    """Why an attempt lost a rank, as the ledger records it (a notice's cause is ``notice:<source>``)."""

    NODE_LOST = "node-lost"  # its node left the cluster (a spot reclaim, Ray's drain)
    NOTICE = "notice"  # a preemption notice acted on (an emergency bundle, or a fallback)
    PROCESS_EXIT = "process-exit"  # the rank's process died on a node that is still alive
    OOM = "oom"  # the rank's process was killed for memory
    UNRESPONSIVE = "unresponsive"  # the rank did not answer a call in time (a start or request that hung)
    HANG = "hang"  # the rank's process answered no poll for world.hang_after_s: stopped, wedged, its node dying
    STUCK = "stuck"  # the rank answered but made no progress while its peers waited for it (policy/health.py)
    ERROR = "error"  # the job's own code raised
    COLLECTIVE_ERROR = "collective-error"  # a collective raised with every peer alive
    COLLECTIVE_TIMEOUT = "collective-timeout"  # a collective timed out with every peer alive
    START_FAILED = "start-failed"  # a rank could not be placed or built
    # not a loss: a straggler the driver chose to replace by a spare (world.replace_stragglers), after a bundle
    STRAGGLER = "straggler"

    @classmethod
    def of(cls, cause: str) -> LossCause:
        """The cause a ledger string names (``notice:aws`` is :attr:`NOTICE`)."""
        return cls.NOTICE if cause.startswith("notice:") else cls(cause)

    @property
    def preemption(self) -> bool:
        """A loss of this cause is a preemption whatever came before it: the machine was taken."""
        return self in (LossCause.NODE_LOST, LossCause.NOTICE)

    @property
    def warm(self) -> bool:
        """The survivors may restart warm: a rank's process or node is gone (or, hung or stuck, is killed),
        nothing the others hold is suspect: they were waiting for it, their state is the last boundary's.
        After a failure the group cannot place on one rank (the job raised, a collective failed with every
        peer alive, a call that hung) every rank starts anew."""
        return self in (LossCause.NODE_LOST, LossCause.NOTICE, LossCause.PROCESS_EXIT, LossCause.OOM,
                        LossCause.HANG, LossCause.STUCK, LossCause.STRAGGLER)


def notice_cause(source: str) -> str:
    """The cause recorded for a loss a notice from ``source`` (aws, gcp, azure, ray-drain, sigterm) led to."""
    return f"{LossCause.NOTICE}:{source}"


@dataclass(frozen=True)
class Loss:
    """A lost rank as the supervisor saw it: its ``cause`` (the ledger's string), the ``rank`` (None:
    not one rank's loss), and whether a notice for its node or the rank itself came first (``noticed``)."""

    cause: str
    rank: int | None
    noticed: bool = False

    @property
    def kind(self) -> LossCause:
        return LossCause.of(self.cause)

    @property
    def loss_class(self) -> LossClass:
        """Preemption or failure: each has its budget (orchestrator/policy/budgets.py)."""
        return "preemption" if self.noticed or self.kind.preemption else "failure"


@dataclass(frozen=True)
class GroupCan:
    """What the worker group can do for a warm restart, and how large the lost attempt was."""

    reform: bool  # re-form with the survivors (a Ray group; not a rank running in the driver's process)
    world_size: int


@dataclass(frozen=True)
class Fail:
    reason: str


@dataclass(frozen=True)
class Warm:
    loss_class: LossClass
    backoff_s: float


@dataclass(frozen=True)
class Cold:
    reason: str  # why not warm (the ledger's ``cold_because``)
    loss_class: LossClass
    backoff_s: float


Decision = Fail | Warm | Cold


def plan_recovery(loss: Loss, verdict: str | None, spec: JobSpec, newest_bundle: str | None, group: GroupCan,
                  losses_in_a_row: int, backoff: Callable[[], float]) -> Decision:
    """The restart after ``loss``: :class:`Fail` when the budgets' ``verdict`` says the job cannot go on;
    :class:`Warm` when the job, the group, the cause and a bundle this driver published allow it (at
    once for the first loss since the last bundle: the backoff is for losses in a row); otherwise
    :class:`Cold`, with the reason and ``backoff()``'s wait. ``newest_bundle``: the newest bundle this
    driver published (a warm restart restores it from memory), None when there is none."""
    if verdict is not None:
        return Fail(verdict)
    reason = why_cold(loss, spec, newest_bundle, group)
    if reason is None:
        return Warm(loss.loss_class, 0.0 if losses_in_a_row <= 1 else backoff())
    return Cold(reason, loss.loss_class, backoff())


def why_cold(loss: Loss, spec: JobSpec, newest_bundle: str | None, group: GroupCan) -> str | None:
    """Why the restart after ``loss`` cannot be warm (the first rule that says so), or None."""
    reason = ineligible(spec)
    if reason is not None:
        return reason
    if not group.reform or group.world_size < 2:
        return "one rank: no other process holds its state"
    if loss.rank is None or not loss.kind.warm:
        return f"a loss of cause {loss.cause}: the job restarts in new processes"
    if newest_bundle is None:
        return "no bundle published since the driver started: the newest is in storage only"
    return None


def warm_world(placement: topology.Decision, world_size: int) -> int | str:
    """The world a warm restart of an attempt of ``world_size`` ranks restores into, or why there is none
    (the restart goes cold). The placement policy chooses the world as for any restart (the largest the
    capacity holds: ``placement``); warm is how, never what: a spare (or a new process) keeps the size,
    the survivors alone are the world only when that is it."""
    size = placement.world_size
    if placement.action != "restart" or size is None or size not in (world_size, world_size - 1):
        return f"the policy restarts with {size or 'no'} ranks: {placement.reason}"
    return size


@dataclass(frozen=True)
class WarmPlan:
    """How a warm restart fills the world: ``spares`` ready spares take the first lost ranks' places,
    new processes are placed in the ``replace`` ranks' slots; or the survivors alone (shrink)."""

    path: WarmPath
    world_size: int
    spares: int = 0
    replace: tuple[int, ...] = ()


def plan_warm(lost: Sequence[int], survivors: Sequence[int], ready_spares: int, world_size: int,
              sizes: Sequence[int], slot_held: Mapping[int, bool]) -> WarmPlan | str:
    """The path of a warm restart that lost ranks ``lost`` of ``world_size`` (``survivors`` kept their
    processes), with ``ready_spares`` spares ready, into a world of one of ``sizes`` (what the policy
    allows), where ``slot_held[r]`` says whether lost rank r's slot still holds room for a new process.
    The same size first: spares, then new processes where every remaining slot is held; else the
    survivors alone. A string says why none fits (the restart goes cold)."""
    lost = sorted(lost)
    if not survivors:
        return "no rank survived"
    if world_size in sizes:
        spares = min(ready_spares, len(lost))
        replace = tuple(lost[spares:])
        if not replace:
            return WarmPlan("warm-spare", world_size, spares)
        if all(slot_held.get(r, False) for r in replace):
            return WarmPlan("warm-replace", world_size, spares, replace)
    if len(survivors) in sizes:
        return WarmPlan("warm-shrink", len(survivors))
    return (f"{len(survivors)} ranks survived and {ready_spares} spares are ready; the policy allows "
            f"{list(sizes) or 'no'} ranks (world.spares places spares)")
