"""verify's fault sites: the cycle its plan goes through, which of them a job can have, and a choice
of them (``verify --sites``) checked before anything runs.

A site is named as the report names it (:func:`~spotrun.orchestrator.verify.comparison.site_name`);
:mod:`spotrun.orchestrator.verify.faultplan` places the faults of each.
"""

from __future__ import annotations

import difflib
from collections.abc import Collection, Mapping

from spotrun.orchestrator.control.specfile import SpecError
from spotrun.orchestrator.verify.comparison import HANG_SITE, NODE_SITE, WARM_SITE
from spotrun.trainer.job.spec import JobSpec
from spotrun.trainer.run.warm import ineligible

SITES = ("mid-accumulation", "mid-microstep", "bundle-write", "publish-to-offsets", "notice", HANG_SITE)
BOUNDARY_SITES = ("bundle-write", "publish-to-offsets")  # faults at a checkpoint boundary
# faults inside an update whose rank is then killed (at once, or once the health watch finds it hung):
# their restart restores the newest bundle before it
MID_UPDATE = ("mid-accumulation", "mid-microstep", HANG_SITE)


def unavailable_sites(spec: JobSpec, nodes: bool, ray: bool) -> dict[str, str]:
    """The sites verify cannot plan for this job, each with why and what to change. ``ray``: the runs
    are on Ray (verify without ``--no-ray``). A hang is found by the Ray group's health watch
    (``world.hang_after_s``), which verify plans only with 2 or more ranks: one of them stopped, its
    peers wait for it at the next collective."""
    out = {} if nodes else {NODE_SITE: "the job runs on a single node; run verify --nodes N to exercise it"}
    if not ray:
        out[WARM_SITE] = "without Ray every restart starts new processes; run verify without --no-ray"
        out[HANG_SITE] = ("without Ray no health watch looks for a stopped rank; run verify without --no-ray, "
                          "with world.size=2 or more")
    else:
        why = ineligible(spec) or ("one rank: no process survives its loss" if spec.world.size < 2 else None)
        if why is not None:
            out[WARM_SITE] = why
        if spec.world.size < 2:
            out[HANG_SITE] = (f"verify plans a hang only with 2 or more ranks (world.size={spec.world.size}); "
                              "set world.size=2 or more to exercise it")
    return out


def check_sites(only: Collection[str], unavailable: Mapping[str, str]) -> None:
    """Refuse a choice of sites (verify --sites) that verify could not carry out: a name it does not know,
    a site this job cannot have (``unavailable``: :func:`unavailable_sites`), or a warm-rejoin kill with
    no kill inside an update before it (the restart it fires at is that kill's warm one)."""
    known = (*SITES[:2], WARM_SITE, *SITES[2:], NODE_SITE)
    for name in only:
        if name not in known:
            near = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            raise SpecError(f"verify --sites: no fault site {name!r}{hint}; the sites are {', '.join(known)}")
        if name in unavailable:
            raise SpecError(f"verify --sites {name}: this verify cannot plan it: {unavailable[name]} (or leave "
                            f"{name} out of --sites)")
    if WARM_SITE in only and not set(MID_UPDATE[:2]) & set(only):
        raise SpecError(f"verify --sites {WARM_SITE} kills a rank as the warm restart after a kill inside an "
                        f"update re-forms the group: add mid-accumulation or mid-microstep to --sites")
