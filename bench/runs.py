"""One job's run on either system, normalised: what each update consumed, when, and what it logged.

spotrun's run comes from its trace (occurrence ids per update and attempt), its
raw JSONL metric log (one timestamped point per update and attempt), its
default SQLite sink (what a reader of the metrics sees) and its ledger (the
stall of each checkpoint). The peer's comes from the logs its workers append
(bench/peer_loop.py: times, ids, the blocking time of each checkpoint call) and
from the metrics Ray Train itself kept. Both are compared with an uninterrupted
run of the same system.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from bench.observe import multiset_diff, read_jsonl


@dataclass
class Step:
    step: int
    attempt: int
    t: float  # epoch seconds, taken on rank 0 when the update completed
    ids: list[str]  # occurrences the whole update consumed (all ranks)


@dataclass
class Run:
    steps: list[Step]
    points: Counter  # (step, name) -> points a reader of the metrics sees
    raw_points: Counter  # (step, name) -> points written
    checkpoint_block_s: list[float]  # wall time the training loop spent in each checkpoint call (rank 0)
    killed_at: float | None = None
    restarts: int = 0
    extra: dict = field(default_factory=dict)

    def final(self) -> dict[int, Step]:
        """Each step as the latest attempt did it (a redone step replaces the lost one)."""
        out: dict[int, Step] = {}
        for s in self.steps:
            if s.step not in out or s.attempt >= out[s.step].attempt:
                out[s.step] = s
        return out

    def consumed(self) -> list[str]:
        return [i for _, s in sorted(self.final().items()) for i in s.ids]


def restart_figures(run: Run, reference: Run, kill_at: int) -> dict[str, float | int | None]:
    """What the kill cost, against the uninterrupted reference of the same system."""
    second = [s for s in run.steps if s.attempt >= 2]
    first = [s for s in run.steps if s.attempt == 1]
    gaps, dups = multiset_diff(reference.consumed(), run.consumed())
    again = next((s.t for s in second if s.step == kill_at), None)
    return {
        "kill_to_next_update_s": min(s.t for s in second) - run.killed_at if second and run.killed_at else None,
        "kill_to_killed_update_s": again - run.killed_at if again and run.killed_at else None,
        "resumed_from": min(s.step for s in second) - 1 if second else None,
        "updates_lost": max(s.step for s in first) - (min(s.step for s in second) - 1) if second else None,
        "gaps": gaps,
        "duplicates": dups,
        "metric_duplicates_read": sum(n - 1 for n in run.points.values() if n > 1),
        "metric_duplicates_written": sum(n - 1 for n in run.raw_points.values() if n > 1),
        "restarts": run.restarts,
    }


def goodput(run: Run, step_s: float) -> float:
    """Useful update-time over wall time, one definition for both systems: from the run's first completed
    update to the last update of its final lineage, the useful part is ``step_s`` (the system's own median
    update in its uninterrupted run) for each update of the final lineage after the first. An update done
    again after a restart counts once; restarts, checkpoint stalls and the lost work are wall time only."""
    final = run.final()
    if len(final) < 2:
        return float("nan")
    wall = max(s.t for s in final.values()) - min(s.t for s in run.steps)
    return (len(final) - 1) * step_s / wall if wall > 0 else float("nan")


def checkpoint_figures(reference: Run, every: int) -> dict[str, float]:
    """From an uninterrupted run: the blocking time and the extra step time a checkpoint costs."""
    from bench.tables import median

    t = {s.step: s.t for s in reference.final().values()}
    after, plain = [], []
    for s in sorted(t)[1:]:
        if s - 1 in t:
            (after if (s - 1) % every == 0 else plain).append(t[s] - t[s - 1])
    step_s = median(plain)
    extra = median(after) - step_s
    return {"block_s": median(reference.checkpoint_block_s), "extra_s": extra,
            "extra_updates": extra / step_s if step_s else float("nan"), "step_s": step_s,
            "wall_s": t[max(t)] - t[min(t)]}


# -- spotrun ------------------------------------------------------------------------------------


def spotrun_run(spec, trace: Path, restarts: int, killed_at: float | None) -> Run:
    from spotrun.orchestrator.ledger.events import BundlePublished
    from spotrun.orchestrator.ledger.store import Ledger
    from spotrun.trainer.metrics import SqliteSink, metrics_dir
    from spotrun.trainer.observe.trace import read_trace
    from spotrun.trainer.storage import open_storage

    folder = metrics_dir(spec.storage, spec.job_id, spec.metrics.local_dir)
    times = {(p["update"], p["attempt"]): _epoch(p["at"]) for p in read_jsonl(folder / "metrics.jsonl")
             if p.get("name") == "loss"}
    # The rank's own log says which updates each attempt completed (the driver's trace may miss the
    # last one or two of a lost attempt); the trace says what each consumed.
    ids = {(r.update, r.attempt): list(r.occurrences or []) for r in read_trace(trace)}
    steps = [Step(u, a, t, ids.get((u, a), [])) for (u, a), t in sorted(times.items())]
    sink = SqliteSink(folder / "metrics.sqlite")
    points = Counter((p.update, p.name) for p in sink.read(spec.job_id))
    sink.close()
    raw = Counter((p["update"], p["name"]) for p in read_jsonl(folder / "metrics.jsonl"))
    published = [e for e in Ledger(open_storage(spec.storage), spec.job_id).read() if isinstance(e, BundlePublished)]
    return Run(steps, points, raw, [e.stall_seconds for e in published], killed_at, restarts)


def _epoch(iso: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(iso).timestamp()


# -- the peer -------------------------------------------------------------------------------------


def peer_run(out: Path, world: int, killed_at: float | None, reported: list[dict]) -> Run:
    """The peer's run from its workers' logs (timing, ids, blocking) and ``reported``, the metrics
    Ray Train itself kept (``Result.metrics_dataframe`` rows: one per checkpoint report)."""
    by_key: dict[tuple[int, int], Step] = {}
    block: list[float] = []
    starts = 0
    for rank in range(world):
        for rec in read_jsonl(out / f"rank-{rank}.jsonl"):
            if rec["event"] == "step":
                key = (rec["step"], rec["attempt"])
                s = by_key.setdefault(key, Step(rec["step"], rec["attempt"], rec["t"], []))
                s.ids += rec["ids"]
                if rank == 0:
                    s.t = rec["t"]
            elif rec["event"] == "checkpoint" and rank == 0:
                block.append(rec["seconds"])
            elif rec["event"] == "start" and rank == 0:
                starts += 1
    points = Counter((int(m["step"]), "loss") for m in reported)
    steps = sorted(by_key.values(), key=lambda s: (s.attempt, s.step))
    return Run(steps, points, points, block, killed_at, max(0, starts - 1))


def peer_pid(out: Path, rank: int):
    def find() -> int | None:
        for rec in read_jsonl(out / f"rank-{rank}.jsonl"):
            if rec["event"] == "start" and rec["attempt"] == 1:
                return rec["pid"]
        return None

    return find


def first_attempt_pid(storage, job_id: str, rank: int):
    from spotrun.orchestrator.ledger.events import AttemptStarted
    from spotrun.orchestrator.ledger.store import Ledger

    ledger = Ledger(storage, job_id)

    def find() -> int | None:
        started = [e for e in ledger.read() if isinstance(e, AttemptStarted) and e.attempt == 1]
        return started[0].rank_pids[rank] if started else None

    return find


