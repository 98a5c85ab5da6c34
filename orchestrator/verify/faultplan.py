"""verify's fault plan: which faults the interrupted run gets, where, and in which attempt.

:func:`plan_faults` cycles through the fault sites, one fault per attempt, spread over the run at
updates where each is sure to be reachable, one of them restoring across an epoch boundary;
:func:`sure_restore` names a plan whose restart is sure to restore a published bundle;
:func:`fault_rows` lists the plan in verify's report. verify's own generator (seeded by ``--seed``,
which the report prints) draws every choice, never the job's streams.
"""

from __future__ import annotations

import random
import secrets
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from spotrun.orchestrator.control.specfile import SpecError
from spotrun.orchestrator.ledger.events import WorkerLost
from spotrun.orchestrator.verify.comparison import HANG_SITE, NODE_SITE, WARM_SITE, site_name
from spotrun.orchestrator.verify.sites import BOUNDARY_SITES, MID_UPDATE, SITES, unavailable_sites
from spotrun.trainer.job.sections import FaultSpec
from spotrun.trainer.job.spec import JobSpec
from spotrun.trainer.observe.faults import FaultFired
from spotrun.trainer.run.warm import ineligible

CANDIDATES = 256  # epoch-crossing placements tried at most (each is one cheap greedy plan)


def restarts_warm(spec: JobSpec) -> bool:
    """Whether a rank killed on Ray restarts warm (trainer/run/warm.py): the survivors keep their processes
    (a spare or a new process takes its place, or the policy goes on without it)."""
    return ineligible(spec) is None and spec.world.size >= 2


@dataclass(frozen=True)
class NodeRemoval:
    """Remove the node hosting ``rank`` once ``attempt`` has completed ``update`` (verify does it)."""

    attempt: int
    update: int
    rank: int


Plan = tuple[list[FaultSpec], list[NodeRemoval]]


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


def plan_faults(spec: JobSpec, kills: int, seed: int, nodes: bool = False, warm: bool = False,
                epochs: Mapping[int, int] | None = None,
                only: Collection[str] = ()) -> tuple[list[FaultSpec], list[NodeRemoval]]:
    """``kills`` faults at increasing updates, one per attempt, cycling through the fault sites
    (with node removals among them when the job runs on several nodes; a kill as a warm restart
    re-forms the group, and a rank stopped mid-update until the health watch finds it hung, when
    ``warm``: on Ray, where :func:`restarts_warm` and with 2 or more ranks; ``only``: just the sites
    it names, in the cycle's order, when it names any), as many as fit before
    ``train.updates``, spread over the run: the first after the second checkpoint boundary, the
    last late in the run (in its last third, where the sites leave room), the others evenly between,
    each at a random offset. ``epochs`` (update -> the epoch its data reached, from the reference
    run's trace: :func:`~spotrun.trainer.observe.trace.update_epochs`) places one kill (inside an update, or
    during a bundle write) just after an epoch boundary, so that its restart restores a bundle of the
    epoch before (:func:`restore_crosses_epoch`), wherever the run has such a boundary and the other
    faults still fit around it. When the run is too short to spread them, the faults follow each
    other as closely as their sites allow (still with one across an epoch boundary where they fit).
    The same inputs give the same plan (``--seed`` replays it).

    The plan starts after the second checkpoint boundary, so that the first bundle is published
    before any fault. When the interval is too long for that (no fault would fit), it starts
    instead with a kill right after the first bundle is published (the publish-to-offsets site),
    which the next attempt is sure to restore. With ``checkpoint.every_updates >= train.updates``
    no bundle comes before the end and nothing is planned
    (:func:`~spotrun.orchestrator.verify.verdict.proof_failures` says so)."""
    sites = _sites(spec, nodes, warm, only)
    every, last = fixed_interval(spec), spec.train.updates
    # From one interval after the first bundle on: it is written in the background and published by
    # the supervisor's next poll, and a fault an update after its boundary often came first (under
    # load, every fault of a short plan did), so that no restart restored a bundle at all.
    faults, removals = _spread(spec, kills, seed, sites, 2 * every, epochs or {})
    if faults or removals or every >= last or "publish-to-offsets" not in sites:
        return faults, removals
    first = ("publish-to-offsets", *(s for s in sites if s != "publish-to-offsets"))
    return _spread(spec, kills, seed, first, 0, epochs or {})


def _sites(spec: JobSpec, nodes: bool, warm: bool, only: Collection[str] = ()) -> tuple[str, ...]:
    """The cycle of fault sites :func:`plan_faults` goes through: :data:`SITES` less those this job cannot
    have (:func:`unavailable_sites`) and, when ``only`` names any, just those (verify --sites)."""
    sites: tuple[str, ...] = (*SITES, NODE_SITE) if nodes else SITES
    if warm and restarts_warm(spec):  # after the second kill: its restart is from a bundle this driver published
        sites = (*sites[:2], WARM_SITE, *sites[2:])
    unavailable = unavailable_sites(spec, nodes, warm)
    sites = tuple(s for s in sites if s not in unavailable and (not only or s in only))
    if not sites:  # check_sites refuses such a choice first: this names it for any other caller
        raise SpecError(f"verify --sites {','.join(only)}: none of them can be planned for this job "
                        f"({'; '.join(f'{s}: {unavailable[s]}' for s in only if s in unavailable)})")
    return sites


def _spread(spec: JobSpec, kills: int, seed: int, sites: Sequence[str], start: int,
            epochs: Mapping[int, int]) -> Plan:
    """:func:`plan_faults` through ``sites`` from update ``start``: the faults spread over the run
    (one across an epoch boundary where ``epochs`` has one within reach), provided the spread plan
    holds as many faults as the compact one (each fault right after the previous); else the compact
    one (with one kill moved across an epoch boundary, where the faults after it still fit)."""
    every, last = fixed_interval(spec), spec.train.updates
    compact = _plan(spec, kills, random.Random(seed), sites, start)
    need = _count(compact)
    slots = [s for s in (sites[i % len(sites)] for i in range(kills)) if s != WARM_SITE]
    if not slots:
        return compact
    # the last fault as late as its site allows: a boundary site goes to the next boundary, the
    # others an update or two after their floor (_plan)
    top = (last - 1) // every * every - 1 if slots[-1] in BOUNDARY_SITES else last - 3
    even = _even(start, top, len(slots))

    def plan(floors: list[int], pin: tuple[int, int] | None = None, jitter: bool = True) -> Plan:
        rng = random.Random(seed)
        return _plan(spec, kills, rng, sites, start, _jitter(floors, rng, pin) if jitter else floors, pin)

    spread = plan(even)
    if _count(spread) < need:  # the random offsets pushed a boundary site a checkpoint too far: without them
        spread = plan(even, jitter=False)
    windows = [w for w in _windows(epochs, every, max(start + 1, every + 1)) if w[0] < last]
    if _count(spread) >= need and (not windows or _crosses(spread[0], every, epochs)):
        return spread
    # one fault pinned in an epoch-crossing window (a mid-update kill at its first update, a bundle-write
    # kill at its boundary); the others spread before and after it, else those after it as close as
    # their sites allow, else all of them: for each, the placements closest to the even spread first
    late = _late(spread, last)
    targets = [(j, first if s in MID_UPDATE else boundary) for j, s in enumerate(slots)
               if s in (*MID_UPDATE, "bundle-write") for first, boundary in windows]
    tries = sorted((abs(u - 1 - even[j]), j, u) for j, u in targets if u < last)[:CANDIDATES]
    n = len(slots)
    layouts = (lambda j, u: _even(start, u - 1, j + 1) + _even(u - 1, top, n - j)[1:],
               lambda j, u: _even(start, u - 1, j + 1) + [u - 1] * (n - j - 1),
               lambda j, u: [start] * j + [u - 1])
    for layout in layouts:
        for _, j, u in tries:
            pinned = plan(layout(j, u), (j, u), jitter=layout is not layouts[-1])
            if _count(pinned) >= need and _crosses(pinned[0], every, epochs) and (_late(pinned, last) or not late):
                return pinned
    if _count(spread) >= need:
        return spread
    # too many faults to spread: each right after the previous, but for one kill moved into an
    # epoch-crossing window where the faults after it still fit
    for _, j, u in tries:
        pinned = plan(layouts[-1](j, u), (j, u), jitter=False)
        if _count(pinned) >= need and _crosses(pinned[0], every, epochs):
            return pinned
    return compact


def _even(lo: int, hi: int, n: int) -> list[int]:
    """``n`` updates from ``lo`` to ``hi``, evenly apart (the first at ``lo``, the last at ``hi``)."""
    return [lo] if n == 1 else [lo + (hi - lo) * i // (n - 1) for i in range(n)]


def _jitter(floors: list[int], rng: random.Random, pin: tuple[int, int] | None) -> list[int]:
    """Each floor but the first, the last and a pinned one moved later by a random part of half the
    way to the next, so that the faults fall at random offsets from the checkpoint boundaries."""
    out = list(floors)
    for i in range(1, len(floors) - 1):
        if pin is None or i != pin[0]:
            out[i] += rng.randrange(max(1, (floors[i + 1] - floors[i]) // 2))
    return out


def _count(plan: Plan) -> int:
    return len(plan[0]) + len(plan[1])


def _late(plan: Plan, last: int) -> bool:
    """Whether a fault (or node removal) of ``plan`` falls in the last third of the run."""
    return any(3 * u > 2 * last for u in [*(f.update for f in plan[0]), *(r.update for r in plan[1])])


def _windows(epochs: Mapping[int, int], every: int, first: int) -> list[tuple[int, int]]:
    """For each epoch boundary, the updates from ``first`` on a mid-update kill may fire in for its
    restart to restore a bundle of an earlier epoch: from the first update that reaches the new epoch
    to the checkpoint boundary at or after it (from there on, a bundle of the new epoch may be
    published), which is also where a bundle-write kill restores across it."""
    out = []
    for u in sorted(epochs):
        if u - 1 in epochs and epochs[u] > epochs[u - 1]:
            lo, hi = max(u, first), (u - 1) // every * every + every
            if lo <= hi:
                out.append((lo, hi))
    return out


def _crosses(faults: Sequence[FaultSpec], every: int, epochs: Mapping[int, int]) -> bool:
    return any(restore_crosses_epoch(f, faults, every, epochs) for f in faults)


def restore_crosses_epoch(fault: FaultSpec, plan: Sequence[FaultSpec], every: int,
                          epochs: Mapping[int, int]) -> bool | None:
    """Whether the restore ``fault`` causes is sure to cross an epoch boundary, if it restores a bundle:
    the fault fires in a later epoch than that of the newest bundle that can be published before it
    (the restart may restore an older one, of the same epoch or an earlier one). Only kills (and hangs)
    inside an update and kills during a bundle write can: the other sites restore the bundle of their own
    boundary.
    ``plan``: the faults planned with it (a notice before it may have left an emergency bundle up to
    an interval past its update). None: the epochs of those updates are not known."""
    if fault.site in ("microstep", "backward") and fault.signal in ("SIGKILL", "SIGSTOP"):  # a hung rank: killed
        newest = (fault.update - 1) // every * every  # the last boundary before it
    elif fault.site == "bundle_write":
        newest = fault.update - every  # the rank dies writing its own bundle: it is never published
    else:
        return False
    notices = [f.update + every for f in plan if f.signal == "SIGTERM" and f.attempt < fault.attempt]
    newest = max(newest, *notices) if notices else newest
    if newest < every or newest >= fault.update:  # no bundle before it to restore
        return False
    if fault.update not in epochs or newest not in epochs:
        return None
    return epochs[fault.update] > epochs[newest]


def _plan(spec: JobSpec, kills: int, rng: random.Random, sites: Sequence[str], start: int,
          floors: Sequence[int] = (), pin: tuple[int, int] | None = None) -> Plan:
    """:func:`plan_faults`' plan through ``sites`` in turn, the first fault after update ``start``
    (a boundary site: at the first boundary after it), each after the previous one's room and after
    its own floor (``floors``: one per fault that takes an attempt; none: as close as the sites
    allow). ``pin``: (slot, update) puts that slot's mid-update kill at ``update`` (or right after
    the previous fault's room, when later; a boundary site goes by its floor alone, and the pin
    only spares that floor the jitter). ``rng`` is verify's own generator, never the job's streams."""
    every, last = fixed_interval(spec), spec.train.updates
    accum = spec.train.accum_steps
    faults: list[FaultSpec] = []
    removals: list[NodeRemoval] = []
    update, attempt, slot = start, 0, 0
    for i in range(kills):
        site = sites[i % len(sites)]
        if site == WARM_SITE:
            # the restart after the previous fault re-forms the group warm (attempt + 1), resuming at or
            # before that fault's update: a kill there sends it cold, within the same attempt
            faults.append(FaultSpec(site="rejoin", update=update, attempt=attempt + 1,
                                    rank=rng.randrange(spec.world.size) if spec.world.spares else 0))
            continue
        if slot < len(floors):
            update = max(update, floors[slot])
        if site in BOUNDARY_SITES:
            u = (update // every + 1) * every  # the next checkpoint boundary
        elif pin is not None and pin[0] == slot:
            u = max(pin[1], update + 1)
        else:
            u = update + 1 + rng.randrange(2)
        slot += 1
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
        # a hang: the rank stopped after its forward pass, alive and silent (its peers wait for it at the
        # gradients' sync). Its draw is taken only for it, so the other sites' plans stayed as they were
        fault = (dict(site="backward", microstep=rng.randrange(accum), signal="SIGSTOP") if site == HANG_SITE
                 else by_site[site])
        # a kill that restores the bundle before it fires once that bundle is published: the supervisor's
        # publish would otherwise race the kill, and a restart that finds nothing newer starts earlier
        restores = (u - 1) // every * every if site in MID_UPDATE else u - every if site == "bundle-write" else 0
        if restores >= every:
            fault = {**fault, "after_bundle": restores}
        faults.append(FaultSpec.model_validate({"update": u, "attempt": attempt, "rank": rank, **fault}))
        # a notice's emergency bundle is taken at the boundary the ranks reach when the request
        # arrives, which may be an update or two later: the next fault goes past it
        update = u + every if site == "notice" else u
    return faults, removals


def sure_restore(spec: JobSpec, kills: int, seed: int, nodes: bool, warm: bool,
                 epochs: Mapping[int, int] | None = None, only: Collection[str] = ()) -> str:
    """How to plan a fault whose restart restores a bundle whatever the timing: the publish-to-offsets
    site kills right after a publish (a kill inside an update or during a write waits for the bundle
    before it, but finds none before the job's first boundary).
    Names the plan :func:`plan_faults` gives for these inputs (the same ``epochs`` and seed), or, where
    this run is too short to reach that site, the ``train.updates`` from which on every plan does;
    ``only``: the sites verify --sites chose (the advice adds publish-to-offsets where they lack it)."""
    sites, every = _sites(spec, nodes, warm, only), fixed_interval(spec)
    if "publish-to-offsets" not in sites:
        return ("add publish-to-offsets to verify --sites: it kills right after a bundle is published, and its "
                "restart always restores it")
    # where the site comes in the cycle, and the room it needs: the compact plan's positions do not
    # depend on train.updates, which only cuts it short, and a spread plan holds as many faults
    unbounded = spec.model_copy(update={"train": spec.train.model_copy(update={"updates": 2**62})})
    compact, _ = _plan(unbounded, max(kills, len(sites)), random.Random(seed), sites, 2 * every)
    sure = next(f for f in compact if f.site == "after_publish")
    # its place in the plan: its attempt (node removals included) and the warm-rejoin kills before it,
    # which take no attempt of their own
    at = sure.attempt + sum(f.site == "rejoin" for f in compact[:compact.index(sure)])
    k = max(kills, at)
    faults, _ = plan_faults(spec, k, seed, nodes, warm, epochs, only)
    planned = next((f for f in faults if f.site == "after_publish" and f.attempt == sure.attempt), None)
    if planned is not None:
        return (f"run verify with --kills {k}: fault {at} of that plan kills right after the bundle of update "
                f"{planned.update} is published, and its restart always restores it")
    return (f"run verify with --kills {k} and train.updates to >= {sure.update + 1} (now {spec.train.updates}): "
            f"fault {at} of that plan kills right after a bundle is published, and its restart always restores it")


def draw_seed() -> int:
    """A fresh seed for a fault plan, for a verify run without ``--seed`` (reported, so that ``--seed``
    plans the same faults again). From the system's entropy: never from the job's generators."""
    return secrets.randbelow(1_000_000)


def fault_rows(faults: Sequence[FaultSpec], removals: Sequence[NodeRemoval], fired: Sequence[FaultFired],
               removals_done: int, every: int, epochs: Mapping[int, int],
               losses: Sequence[WorkerLost] = ()) -> list[dict[str, Any]]:
    """The report's planned faults, in the order they were planned: each fault's site as the report
    names it, its planned update, attempt and rank, the epoch its update's data reached (None: not
    known), whether it was delivered (recorded as it fired; a node removal, once verify carried it
    out, in plan order), whether its restore is sure to cross an epoch boundary
    (:func:`restore_crosses_epoch`), and ``found_as``: how the chaos job's driver found the loss it
    caused (:func:`found_as`, from ``losses``, the ledger's ``WorkerLost`` events)."""
    rows: list[dict[str, Any]] = [
        {"name": site_name(f.site, f.signal, f.microstep), **f.model_dump(), "epoch": epochs.get(f.update),
         "delivered": any(r.matches(f) for r in fired),
         "restore_crosses_epoch": restore_crosses_epoch(f, faults, every, epochs)} for f in faults]
    rows += [{"name": NODE_SITE, "update": r.update, "attempt": r.attempt, "rank": r.rank,
              "epoch": epochs.get(r.update), "delivered": i < removals_done, "restore_crosses_epoch": None}
             for i, r in enumerate(removals)]
    # a warm-rejoin kill shares the attempt of the fault after it, at the update of the one before
    rows = sorted(rows, key=lambda row: (row["attempt"], row["update"]))
    return found_as(rows, losses)


def found_as(rows: list[dict[str, Any]], losses: Sequence[WorkerLost]) -> list[dict[str, Any]]:
    """``rows`` (in plan order) with ``found_as`` set on each delivered one: how the driver found the loss
    it caused, the ``signal`` of a rank found alive but unresponsive (``hang``, ``stuck``) or else the
    ``cause`` of the first ``WorkerLost`` of the fault's attempt on its rank (or on no one rank) not
    already given to an earlier row; None where the ledger recorded no such loss."""
    left = list(losses)
    for row in rows:
        lost = next((e for e in left if row["delivered"] and e.attempt == row["attempt"]
                     and e.rank in (row["rank"], None)), None)
        if lost is not None:
            left.remove(lost)
        row["found_as"] = None if lost is None else lost.signal or lost.cause
    return rows
