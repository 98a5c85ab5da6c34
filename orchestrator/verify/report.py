"""The report of ``spotrun verify`` and how it is shown: what was injected, compared and found.

:class:`Report` is what :class:`~spotrun.orchestrator.verify.oracle.Verifier` returns (``--json``
prints it as is); :func:`render` prints it for a person. Both run in the process that ran
``spotrun verify``, after its two jobs ended.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from spotrun.orchestrator.verify.divergence import divergence_rows
from spotrun.trainer.metrics.mlflow_sink import SEND_AT_WRITE


@dataclass
class Report:
    """What ``spotrun verify`` found: the verdict and why, the faults planned and delivered, and every
    figure compared with the uninterrupted run (``--json`` prints these fields)."""

    verdict: str
    failures: list[str]  # one line per check that did not hold; empty on a pass
    declared_contract: str
    observed_contract: str
    seed: int  # the fault plan's seed (drawn when --seed was not given): --seed SEED plans the same faults
    faults_planned: int
    faults_delivered: int  # recorded by the fault as it fired (or a node removal verify carried out)
    kills_injected: int  # delivered SIGKILLs and node removals
    notices_injected: int  # delivered SIGTERMs
    hangs_injected: int  # delivered SIGSTOPs (the rank then found hung by the health watch and killed)
    fault_sites_planned: list[str]
    fault_sites_hit: list[str]
    fault_sites_not_applicable: dict[str, str]
    faults_not_delivered: list[dict[str, Any]]
    restarts: int
    restores_from_bundle: int  # restarts that restored a bundle (the others started from nothing)
    recovery_paths: dict[str, int]  # restores by path: cold, warm-spare, warm-replace, warm-shrink
    reference_updates: int
    chaos_last_update: int
    occurrence_gaps: int
    occurrence_duplicates: int
    updates_compared: int
    params_bitwise_equal: bool
    params_max_abs_diff: float
    metric_sinks: list[str]
    metric_writes: int  # points written by every attempt of the interrupted run (the raw log)
    metric_duplicates_written: int  # what a consumer that appends instead of upserting would hold twice
    metric_duplicates: int  # in the sinks' final views: must be 0
    metric_missing: int
    metric_extra: int
    metric_mismatches: int
    metric_stale: int
    metric_problems: list[str]
    counters_equal: bool
    lost_updates: int | None  # None: some restart's is not known (README: What a restart cost)
    lost_updates_known: int
    restart_seconds: list[float]
    restore_oracle: list[str]
    first_divergence: dict[str, Any] | None
    reference_job: str
    chaos_job: str
    # every planned fault in plan order: site, planned update, attempt, rank, the epoch its update's data
    # reached, whether it was delivered, whether its restore is sure to cross an epoch boundary, and how the
    # driver found the loss it caused (found_as: a WorkerLost's signal, hang or stuck, else its cause)
    faults: list[dict[str, Any]] = field(default_factory=list)
    mutated: list[str] = field(default_factory=list)  # a deliberately broken build lost these at every restore
    # with ``mutated``: whether verify failed the broken build after faults and restores that exercised it
    mutation_caught: bool | None = None

    def succeeded(self) -> bool:
        """Whether verify did what it promises (exit status 0): a pass, or, for a deliberately broken
        build (``--mutate``), catching it."""
        return bool(self.mutation_caught) if self.mutated else self.verdict == "pass"


def render(report: Report, console) -> None:
    """The human report: what was injected, what was compared, what failed, and the first divergence."""
    from rich.table import Table

    ok = report.verdict == "pass"
    if report.mutated:
        lost = ", ".join(report.mutated)
        if report.mutation_caught:
            outcome = "verify caught it (the FAIL below is the expected outcome)"
        elif ok:
            outcome = "[bold red]not caught[/]: losing it had no observable effect on this job's updates"
        else:
            outcome = ("[bold red]not tested[/]: no restart restored a bundle, so nothing was lost (the first "
                       "failure below says what to change)")
        broken = ("its mlflow sink sent each point as it was written instead of at publish" if lost == SEND_AT_WRITE
                  else f"every restore of the chaos run lost {lost}")
        console.print(f"[bold]mutant build[/]: {broken}, on purpose: {outcome}")
    # the contract can hold while verify fails on something else (metrics, counters, a site not hit):
    # the headline then says so, instead of two equal contracts under a FAIL
    held = (f"; the contract held, but {len(report.failures)} other check(s) failed (first: {report.failures[0]})"
            if not ok and report.failures and report.observed_contract == report.declared_contract else "")
    console.print(f"[bold]{'PASS' if ok else 'FAIL'}[/]: declared contract [bold]{report.declared_contract}[/], "
                  f"observed [bold]{report.observed_contract}[/] ({report.faults_delivered} of "
                  f"{report.faults_planned} planned faults delivered, {report.restarts} restarts, "
                  f"{report.updates_compared} updates compared; fault seed {report.seed}){held}")
    t = Table(title="comparison with the uninterrupted run")
    t.add_column("check")
    t.add_column("result")
    for name, value in (
        ("fault sites planned", ", ".join(report.fault_sites_planned)),
        ("fault sites hit (recorded as they fired)", ", ".join(report.fault_sites_hit) or "none"),
        ("kills / notices / hangs delivered",
         f"{report.kills_injected} / {report.notices_injected} / {report.hangs_injected}"),
        ("restarts / of which from a bundle", f"{report.restarts} / {report.restores_from_bundle}"),
        ("restores by path (warm: the survivors' memory)",
         ", ".join(f"{p} {n}" for p, n in sorted(report.recovery_paths.items())) or "none"),
        ("updates: reference / reached", f"{report.reference_updates} / {report.chaos_last_update}"),
        ("occurrence gaps / duplicates", f"{report.occurrence_gaps} / {report.occurrence_duplicates}"),
        ("parameters bitwise equal", str(report.params_bitwise_equal)),
        ("max |param difference| at the end", f"{report.params_max_abs_diff:.3g}"),
        (f"metric points in {', '.join(report.metric_sinks)}: duplicated / missing / unexpected / differing / "
         "stale", f"{report.metric_duplicates} / {report.metric_missing} / {report.metric_extra} / "
                  f"{report.metric_mismatches} / {report.metric_stale}"),
        ("metric points written by every attempt / written again (an appending consumer's duplicates)",
         f"{report.metric_writes} / {report.metric_duplicates_written}"),
        ("final counters equal", str(report.counters_equal)),
        ("updates restarts lost (computed again)", str(report.lost_updates) if report.lost_updates is not None
         else f"{report.lost_updates_known} known, and restarts whose lost attempt's reach is not known"),
        ("restart seconds (history's downtime: loss → restored)",
         ", ".join(f"{x:.2f}" for x in report.restart_seconds)),
        ("restore oracle (state differing right after a restore)", ", ".join(report.restore_oracle) or "none"),
    ):
        t.add_row(name, value)
    console.print(t)
    if report.faults:
        console.print(fault_table(report))
    for line in report.failures:
        console.print(f"[red]failed[/]: {line}", highlight=False)
    if report.first_divergence:
        d = Table(title="where the interrupted run first differs (occurrences -> batch -> loss -> gradient -> "
                        "parameters)")
        d.add_column("")
        d.add_column("")
        for name, value in divergence_rows(report.first_divergence):
            d.add_row(name, value)
        console.print(d)
        if report.restore_oracle:
            console.print("state categories lost at a restore: " + ", ".join(report.restore_oracle)
                          + " (`spotrun inventory` gives each category's owner and restore action)")


def fault_table(report: Report):
    """The planned faults, one row each: where, when (update and the epoch its data reached), whether
    it was delivered, how the driver found the loss it caused (a stopped rank: ``hang``) and whether its
    restore crosses an epoch boundary."""
    from rich.table import Table

    t = Table(title=f"faults planned with seed {report.seed} (verify --seed {report.seed} plans the same ones)")
    wraps = ("delivered (found as)", "restore crosses epoch")  # 80 columns: only these wrap (folded, never cut)
    for name in ("site", "update", "epoch", "attempt", "rank", *wraps):
        t.add_column(name, no_wrap=name not in wraps, overflow="fold")
    for f in report.faults:
        crosses = {True: "yes", False: "no", None: "-"}[f.get("restore_crosses_epoch")]
        found = f" ({f['found_as']})" if f.get("found_as") else ""
        t.add_row(f["name"], str(f["update"]), "-" if f.get("epoch") is None else str(f["epoch"]),
                  str(f["attempt"]), str(f["rank"]), f"yes{found}" if f["delivered"] else "no", crosses)
    return t
