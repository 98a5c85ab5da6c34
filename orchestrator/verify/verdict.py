"""What a verify run proves: the contracts, their tolerances, and the checks a pass needs.

Pure functions from the compared figures to the report's ``failures`` (an empty list is a pass),
and the restart figures the report copies from the chaos job's history. Each runs in the process
that ran ``spotrun verify``, once both jobs ended; none touches Ray or storage.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping
from typing import Any

from spotrun.orchestrator.ledger.history_model import History
from spotrun.orchestrator.verify.comparison import MetricComparison
from spotrun.orchestrator.verify.faultplan import fixed_interval, sure_restore
from spotrun.trainer.job.spec import JobSpec

CONTRACTS = ("exact", "exact-data", "fresh-epoch")  # strongest first
DECLARED = {"strict": "exact", "elastic": "exact-data", "fresh-epoch": "fresh-epoch"}
PARAM_TOLERANCE = 1e-3  # exact-data: max |param difference| after the run, and relative metric difference
# the tolerance on metric values each contract promises (None: values are not promised equal)
METRIC_TOLERANCE = {"exact": 0.0, "exact-data": PARAM_TOLERANCE, "fresh-epoch": None}


def restart_figures(hist: History) -> dict[str, Any]:
    """The report's restart figures, from the chaos job's history (each defined once, in
    :mod:`spotrun.orchestrator.ledger.losses`: the report shows what ``spotrun history`` shows)."""
    totals = hist.totals
    restored = [r for r in hist.restarts if r.restored_from is not None]
    return {"restarts": totals.restarts, "restores_from_bundle": len(restored),
            "recovery_paths": dict(Counter(r.recovery_path for r in restored)),
            "lost_updates": totals.lost_updates, "lost_updates_known": totals.lost_updates_known,
            "restart_seconds": totals.downtime_seconds}


def proof_failures(spec: JobSpec, kills: int, seed: int, nodes: bool, planned: int, delivered: int,
                   restores: int, warm: bool = False, epochs: Mapping[int, int] | None = None,
                   only: Collection[str] = ()) -> list[str]:
    """Why the interrupted run proved nothing, if it did not (empty: it did). A pass needs at least
    one fault that fired and one restart that restored a published bundle: without them no restore
    was compared with anything, and a run that nothing interrupted passes every other check. Each
    line names the numbers to change (``--kills``, ``checkpoint.every_updates``, ``train.updates``).
    ``epochs``: the reference's, and ``only``: the sites verify --sites chose, which the plan it names is
    planned with (:func:`plan_faults`)."""
    every, last = fixed_interval(spec), spec.train.updates
    if kills < 1:
        return ["no fault was planned (--kills 0), so no restore was tested: run verify with --kills 1 or more"]
    if planned == 0:
        return [f"no fault was planned: train.updates={last} with checkpoint.every_updates={every} leaves room for "
                f"no fault after a published bundle (the first is published at update {every}, and a fault needs "
                f"an update after it); lower checkpoint.every_updates to <= {max(1, last - 1)} or raise "
                f"train.updates to >= {every + 1}"]
    if delivered == 0:
        return [f"none of the {planned} planned faults fired (a fault counts once it records itself as it fires; "
                "faults_not_delivered lists where they were planned), so no restore was tested"]
    if restores == 0:
        return [f"no restart restored a published bundle: the {delivered} fault(s) that fired all came before the "
                f"first bundle (update {every}) was published, so every restart began from nothing and no restore "
                f"was tested; {sure_restore(spec, kills, seed, nodes, warm, epochs, only)}"]
    return []


def verdict_failures(declared: str, observed: str, short: list[str], metrics: MetricComparison,
                     counters_equal: bool, sites_missed: list[str]) -> list[str]:
    """One line per check that did not hold (an empty list is a pass)."""
    holds = observed in CONTRACTS and CONTRACTS.index(observed) <= CONTRACTS.index(declared)
    failures = [] if holds else [f"the contract that held ({observed}) is weaker than the declared {declared}"]
    failures += short
    if not metrics.ok:
        failures.append(f"metric points: {metrics.duplicates} duplicated, {metrics.missing} missing, "
                        f"{metrics.extra} unexpected, {metrics.mismatches} differing from the reference, "
                        f"{metrics.stale} older than their latest write ({'; '.join(metrics.problems)})")
    if not counters_equal:
        failures.append("the final bundles' counters differ (or a run published none)")
    if sites_missed:
        failures.append(f"planned fault sites never hit: {', '.join(sites_missed)} (no fault there fired)")
    return failures
