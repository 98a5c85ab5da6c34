"""Bench 11 — ``checkpoint.every_updates: auto`` against fixed intervals, on synthetic preemption traces.

A pure simulation (no Ray, no training): a job with a known update time and checkpoint cost runs
through a week of preemptions drawn from a seed, once per checkpoint policy, and every policy sees
the same preemptions. ``auto`` decides with the supervisor's own function
(``spotrun.orchestrator.policy.interval.decide``), from what it has seen so far only: the cost of each
bundle it published, the preemptions before now (and whether a notice covered them), its run time.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.tables import Section, Stopwatch, Table, cli, fmt, median, pct
from spotrun.orchestrator.policy import interval
from spotrun.orchestrator.policy.interval import IntervalDecision, IntervalInputs
from spotrun.trainer.job.sections import CheckpointSpec

WEEK_S = 7 * 24 * 3600.0
RESTART_S = 5.06  # bench 3: kill -> the first update after the restart (snapshot), the same for every policy
FIXED = (10, 100, 1000)  # checkpoint every this many updates
SEEDS = (0, 1, 2, 3, 4)


@dataclass(frozen=True)
class SimJob:
    """A job as the simulation sees it: plain update time, and what one checkpoint costs."""

    label: str
    update_s: float
    stall_s: float  # the loop waits this long at the boundary
    write_s: float  # then the background write runs this long (the bundle counts once it is published)
    overlap_s: float  # and slows the updates it overlaps by this much in all
    source: str

    @property
    def cost_s(self) -> float:
        return self.stall_s + self.overlap_s

    @property
    def write_updates(self) -> float:
        """Updates completed while a write is in flight."""
        return (self.write_s - self.overlap_s) / self.update_s


JOBS = (
    # bench 8 (gpt-char ×1: 32.2 updates/s), bench 2 (gpt-char at every 10: a checkpoint costs 0.920
    # update-times, 0.0638 of them stall), bench 1 (a ~10 MB bundle writes at 445 MB/s: 13.29 MB)
    SimJob("gpt-char (13 MB bundle)", 1 / 32.2, 0.0638 / 32.2, 13.29e6 / 445e6, (0.920 - 0.0638) / 32.2,
           "bench 8 and 2: update 31 ms, a checkpoint 0.92 update-times of which 0.064 stall; bench 1: write 30 ms"),
    # bench 1 at ~1 GB: plain update 2.88 s, stall 1.69 ms, 966.9 MiB written at 1,592 MB/s; the write
    # is taken to slow training by its whole length (as bench 2 found for the small job: 0.86 of 0.97)
    SimJob("~1 GB state", 2.88, 0.00169, 966.9 * 2**20 / 1592e6, 966.9 * 2**20 / 1592e6,
           "bench 1 at ~1 GB: update 2.88 s, stall 1.7 ms, write 0.64 s, all of it taken as slowdown"),
)


@dataclass(frozen=True)
class Trace:
    label: str
    mean_s: float  # mean run time between preemptions
    noticed: float  # share of preemptions a notice announces in time


TRACES = (Trace("20 min, no notice", 1200, 0.0), Trace("20 min, 80 % noticed", 1200, 0.8),
          Trace("4 h, no notice", 4 * 3600, 0.0), Trace("4 h, 80 % noticed", 4 * 3600, 0.8))


@dataclass(frozen=True)
class Gap:
    run_s: float  # run time from the restart to the preemption (or the end of the trace)
    preempted: bool
    noticed: bool


def draw(trace: Trace, seed: int, span_s: float) -> list[Gap]:
    """Exponential gaps of run time, each followed by a restart, until ``span_s`` of wall time."""
    rng, out, wall = random.Random(seed), [], 0.0
    while True:
        gap = rng.expovariate(1 / trace.mean_s)
        noticed = rng.random() < trace.noticed
        if wall + gap >= span_s:
            return [*out, Gap(span_s - wall, False, False)]
        out.append(Gap(gap, True, noticed))
        wall += gap + RESTART_S


# -- policies ---------------------------------------------------------------------------------


class Fixed:
    """``checkpoint.every_updates: k``: the ranks' own schedule."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.label = f"every {every:,}"

    def next_boundary(self, job: SimJob, a: Attempt) -> float:
        """The next checkpoint's update: the next multiple of the interval."""
        return (math.floor(a.done) // self.every + 1) * self.every


class Auto:
    """``checkpoint.every_updates: auto`` as the supervisor runs it: decide at each attempt's start,
    once the first bundle measured the cost and every few minutes when the interval moves; ask for a
    checkpoint once the interval has passed since the attempt's start or the latest publication."""

    def __init__(self, job: SimJob, oracle_mtbp_s: float | None = None) -> None:
        self.job = job
        self.label = "auto" if oracle_mtbp_s is None else "Young, true rate"
        self.spec = CheckpointSpec(every_updates="auto")  # the defaults: prior 1 h, bounds 10 s .. 1 h
        self.costs: list[float] = []
        self.preemptions = self.losing = 0
        self.uptime_before = 0.0  # run time of the attempts before this one
        self.decision: IntervalDecision | None = None
        self.decided_at = 0.0  # run time of this attempt
        self.oracle = oracle_mtbp_s  # Young's interval with the trace's true mean, for reference
        self.chosen: list[float] = []

    def decide(self, at: float, periodic: bool = False) -> None:
        self.decided_at = at
        if self.oracle is not None:  # the trace's true mean, every preemption losing work
            self.decision = self.decision or interval.choose(
                self.job.cost_s, self.oracle, self.oracle, self.job.update_s, self.spec.min_interval_s,
                self.spec.max_interval_s)
            return
        decision = interval.decide(IntervalInputs(
            checkpoint_costs_s=self.costs[-interval.RECENT_BUNDLES:], sec_per_update=self.job.update_s,
            preemptions=self.preemptions, preemptions_losing_work=self.losing, uptime_s=self.uptime_before + at,
            prior_interval_s=self.spec.expected_preemption_interval_s, min_interval_s=self.spec.min_interval_s,
            max_interval_s=self.spec.max_interval_s))
        if not periodic or interval.moved(self.decision, decision):
            self.decision = decision
            self.chosen.append(decision.interval_s)

    def request_at(self, since: float) -> float:
        """When the checkpoint after a publication at ``since`` is asked for, the periodic decisions
        before then taken."""
        assert self.decision is not None
        while self.decided_at + interval.REDECIDE_S <= since + self.decision.interval_s:
            self.decide(self.decided_at + interval.REDECIDE_S, periodic=True)
        return max(since + self.decision.interval_s, self.decided_at)

    def next_boundary(self, job: SimJob, a: Attempt) -> float:
        """The boundary after the update in flight when the request reaches the ranks."""
        return math.ceil(a.progress(job, self.request_at(a.published_at)) + 1e-9)


# -- the simulation ---------------------------------------------------------------------------


@dataclass
class Attempt:
    """One attempt's progress, in updates counted from the job's start."""

    at: float = 0.0  # run time of the attempt at its last boundary (0: its start)
    done: float = 0.0  # updates at that boundary (at the start: those restored)
    published_at: float = 0.0  # when that boundary's bundle is published (the start: at once)
    durable: float = 0.0  # the updates that boundary's bundle covers
    before: float = 0.0  # the updates of the bundle before it (the newest until that one is published)
    stalled: bool = False  # whether the last boundary took a checkpoint (the attempt's start did not)

    def progress(self, job: SimJob, t: float) -> float:
        """Updates done at run time ``t`` (>= the last boundary)."""
        x = t - self.at
        if not self.stalled:
            return self.done + x / job.update_s
        if x <= job.stall_s:
            return self.done
        x -= job.stall_s
        if x <= job.write_s:
            return self.done + x * job.write_updates / job.write_s
        return self.done + job.write_updates + (x - job.write_s) / job.update_s

    def reach(self, job: SimJob, updates: float) -> float:
        """Run time at which ``updates`` (more than at the last boundary) are done."""
        d = updates - self.done
        if not self.stalled:
            return self.at + d * job.update_s
        if d <= job.write_updates:
            return self.at + job.stall_s + d * job.write_s / job.write_updates
        return self.at + job.stall_s + job.write_s + (d - job.write_updates) * job.update_s

    def checkpoint(self, job: SimJob, t: float, update: float) -> None:
        """A boundary at run time ``t`` takes a bundle of ``update``."""
        self.before, self.durable = self.durable, update
        self.at, self.done, self.stalled = t, update, True
        self.published_at = t + job.stall_s + job.write_s


@dataclass
class Result:
    kept: float = 0.0  # updates that survived
    wall: float = 0.0
    checkpoints: int = 0
    lost: float = 0.0  # updates thrown away
    intervals: list[float] = field(default_factory=list)


def simulate(job: SimJob, policy: Fixed | Auto, gaps: Sequence[Gap]) -> Result:
    """Run ``job`` through ``gaps`` under ``policy``: what survived, the wall time, what was lost."""
    r = Result()
    restored = 0.0
    for gap in gaps:
        a = Attempt(done=restored, durable=restored, before=restored)
        if isinstance(policy, Auto):
            policy.decide(0.0)
        while True:
            boundary = policy.next_boundary(job, a)
            t = a.reach(job, boundary)
            if t >= gap.run_s:
                break
            if a.stalled and a.published_at > t:
                raise ValueError(f"{job.label}, {policy.label}: a boundary comes before the last write is published; "
                                 "the simulation does not model a write waiting for another")
            a.checkpoint(job, t, boundary)
            r.checkpoints += 1
            if isinstance(policy, Auto):
                policy.costs.append(job.cost_s)
                if policy.decision is not None and policy.decision.checkpoint_cost_s is None:
                    policy.decide(a.published_at)
            elif a.stalled:
                _skip_cycles(job, policy, a, gap.run_s, r)
        restored = _end_attempt(job, policy, a, gap, r)
        r.wall += gap.run_s + (RESTART_S if gap.preempted else 0.0)
    r.kept = restored
    if isinstance(policy, Auto):
        r.intervals = policy.chosen
    return r


def _skip_cycles(job: SimJob, policy: Fixed, a: Attempt, until: float, r: Result) -> None:
    """A fixed interval's cycles are all alike: jump over the whole ones before ``until`` at once."""
    cycle = job.stall_s + job.overlap_s + policy.every * job.update_s
    n = int((until - a.at) // cycle) - 1
    if n > 0:
        a.checkpoint(job, a.at + n * cycle, a.done + n * policy.every)
        a.before = a.durable - policy.every
        r.checkpoints += n


def _end_attempt(job: SimJob, policy: Fixed | Auto, a: Attempt, gap: Gap, r: Result) -> float:
    """The preemption (or the trace's end) at ``gap.run_s``: the updates the next attempt starts from."""
    progress = a.progress(job, gap.run_s)
    durable = a.durable if a.published_at <= gap.run_s else a.before
    if isinstance(policy, Auto):
        policy.uptime_before += gap.run_s
    if not gap.preempted:
        return progress  # the trace ends; the job goes on with all it did
    if isinstance(policy, Auto):
        policy.preemptions += 1
    if gap.noticed:  # the update in flight finishes, an emergency bundle is written, the ranks stop
        kept = math.ceil(progress - 1e-9)
        r.wall += (kept - progress) * job.update_s + job.stall_s + job.write_s
        r.checkpoints += 1
        if isinstance(policy, Auto):
            policy.costs.append(job.stall_s)  # its write overlaps no update
        return kept
    if isinstance(policy, Auto):
        policy.losing += 1
    r.lost += progress - durable
    return durable


# -- tables -----------------------------------------------------------------------------------

INTRO = """
`checkpoint.every_updates: auto` chooses the checkpoint interval from what the job measured: Young's
interval, the square root of 2 × checkpoint cost × mean run time between preemptions that lose work,
within `checkpoint.min_interval_s` .. `max_interval_s` (orchestrator/policy/interval.py). This bench is a
simulation, no Ray and no training: a job with a known update time and checkpoint cost runs through a
week of preemptions, exponential gaps of run time with a mean of 20 min or 4 h, with no notice or with
a notice before 80 % of them (a noticed preemption finishes the update in flight, writes an emergency
bundle and loses nothing; an unnoticed one loses everything after the newest published bundle). Every
policy sees the same preemptions; after each one the job is down for the same 5.06 s (bench 3: kill to
the first update of the restarted job). `auto` runs with the defaults (prior 1 h, bounds 10 s .. 1 h)
and calls the supervisor's own decision function with what it has seen so far: the cost of every
bundle published, the preemptions before now and whether a notice covered them, its run time. It
never sees the trace's mean. Goodput = the run time of the updates that survived / wall time.
A checkpoint stalls the loop, then its background write slows the updates it overlaps; the bundle
counts once published, after the write. The two jobs' figures come from other sections, as the first
note under each table says.
"""


def run(quick: bool) -> dict[str, Any]:
    span = WEEK_S / 7 if quick else WEEK_S
    seeds = SEEDS[:1] if quick else SEEDS
    out: dict[str, Any] = {"span_s": span, "seeds": list(seeds), "restart_s": RESTART_S, "jobs": {}}
    for job in JOBS:
        rows = out["jobs"][job.label] = {}
        for trace in TRACES:
            runs = rows[trace.label] = []
            for seed in seeds:
                gaps = draw(trace, seed, span)
                policies: list[Fixed | Auto] = [*(Fixed(k) for k in FIXED), Auto(job),
                                                Auto(job, oracle_mtbp_s=trace.mean_s / (1 - trace.noticed))]
                results = {p.label: simulate(job, p, gaps) for p in policies}
                runs.append({"seed": seed, "preemptions": sum(g.preempted for g in gaps),
                             "goodput": {k: v.kept * job.update_s / v.wall for k, v in results.items()},
                             "checkpoints": {k: v.checkpoints for k, v in results.items()},
                             "lost_updates": {k: round(v.lost, 1) for k, v in results.items()},
                             "auto_intervals_s": results["auto"].intervals})
    return out


def _spread(xs: list[float]) -> str:
    """min / median / max, as percentages."""
    return " / ".join(pct(x) for x in (min(xs), median(xs), max(xs)))


def tables(results: dict[str, Any]) -> tuple[list[Table], list[str], dict[str, Any]]:
    fixed = [f"every {k:,}" for k in FIXED]
    tabs, worst, aim = [], [], []
    for job in JOBS:
        t = Table(f"{job.label}: goodput over {results['span_s'] / 86400:g} days, {len(results['seeds'])} seeds "
                  f"(median; auto min / median / max)",
                  ["trace", "preemptions", *fixed, "auto", "auto / best fixed", "Young, true rate",
                   "auto's intervals (s, median of decisions)"])
        for trace in TRACES:
            runs = results["jobs"][job.label][trace.label]
            ratios = [r["goodput"]["auto"] / max(r["goodput"][f] for f in fixed) for r in runs]
            worst.append((min(ratios), job.label, trace.label))
            autos = [r["goodput"]["auto"] for r in runs]
            if trace.mean_s == 4 * 3600 and trace.noticed == 0.8:
                aim.append((min(autos), job.label))
            chosen = [median(r["auto_intervals_s"]) for r in runs]
            t.add(trace.label, int(median([r["preemptions"] for r in runs])),
                  *(pct(median([r["goodput"][f] for r in runs])) for f in fixed), _spread(autos), _spread(ratios),
                  pct(median([r["goodput"]["Young, true rate"] for r in runs])),
                  f"{fmt(median(chosen))} (≈ {fmt(median(chosen) / job.update_s, 2)} updates)")
        t.notes = [f"{job.label}: update {fmt(job.update_s)} s; a checkpoint stalls {fmt(job.stall_s)} s, then "
                   f"its write runs {fmt(job.write_s)} s and slows training by {fmt(job.overlap_s)} s: cost "
                   f"{fmt(job.cost_s)} s = {fmt(job.cost_s / job.update_s)} update-times ({job.source})",
                   "auto / best fixed: per seed, auto's goodput over the best of the three fixed intervals on the "
                   "same preemptions; Young, true rate: Young's interval from the trace's true mean (what auto "
                   "would choose if it knew the trace), for reference"]
        tabs.append(t)
    low = min(worst)
    verdicts = [
        f"auto within 3 % of the best fixed interval on every trace, job and seed: "
        f"**{'MET' if low[0] >= 0.97 else 'NOT MET'}** (lowest auto / best fixed: {pct(low[0])}, {low[1]}, "
        f"{low[2]})",
        "goodput >= 99 % on a week with a preemption every 4 h on average, 80 % noticed: **"
        + ("MET" if all(g >= 0.99 for g, _ in aim) else "NOT MET") + "** ("
        + ", ".join(f"{label}: lowest of {len(results['seeds'])} seeds {pct(g)}" for g, label in aim) + ")"]
    return tabs, verdicts, {"worst_ratio": low, "four_hour_noticed": aim}


def main(argv: Sequence[str] | None = None) -> None:
    args = cli(__doc__.splitlines()[0], argv)
    clock = Stopwatch()
    results = run(args.quick)
    tabs, verdicts, summary = tables(results)
    Section("11-auto-interval", "11. Checkpoint interval: `auto` against fixed intervals", INTRO, tabs, verdicts,
            clock.seconds, {"results": results, "summary": summary}, clock.measured).emit(args.out)


if __name__ == "__main__":
    main()
