"""Bench 20 — goodput on replayed spot traces: spotrun and Ray Train with its preemption API, side by side.

The same 2-rank job (spotrun's ``tiny`` model; bench/peer_loop.py says exactly what the Ray Train loop
does) runs on one local multi-node Ray cluster (a head with no CPUs and three one-CPU nodes, kept by a
process of its own: bench/cluster_process.py) while a spot trace is replayed against it
(bench/spot_trace.py, bench/replayer.py): ranks' processes killed, nodes lost and new ones added, nodes
drained through Ray's GCS with a deadline and removed at it (both systems hear a drain there), the driver
killed and its command run again. Each system's driver is a process of its own, as a user's is, so that
the replayer can kill it. One uninterrupted run of each system first gives its update time and its final
state; the trace is scaled to spotrun's uninterrupted length. Rows run interleaved, one run at a time on
the same cluster, for each trace and repetition.

Goodput, one function for both (``bench.runs.goodput``): the useful update-time over the wall time from the
job's first completed update to its last, where useful is the system's own median uninterrupted update time
for every update of the final lineage after the first (a redone update counts once; restarts, stalls and
redone work count as wall only).

    python -m bench.trace_goodput [--traces aws-notices ...] [--reps 3] [--updates 6000]
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.cluster_process import ClusterProcess
from bench.observe import alive, read_jsonl
from bench.replayer import Fired, Replayer
from bench.runs import Run, goodput, peer_run, spotrun_run
from bench.spot_trace import TRACES, Trace, load_trace
from bench.tables import ROOT, Section, Stopwatch, Table, cli, fmt, median, pct, work_folder

WORLD = 2
NODES = 3  # one rank each, and one for a spare (or the node a restart moves to)
EVERY = 50  # updates between checkpoints, both systems (spotrun's `auto` row chooses its own)
LOOK_S = 0.1  # how often the bench looks at a driver and the job's logs (a bench measures; a test never sleeps)
FIRST_UPDATE_WAIT_S = 180.0
PEER_POLL_S = 0.2  # Ray Train's controller poll and drain watcher poll, as fast as bench 4 sets the first
PEER_MARGIN_S = 0.5  # its last checkpoint ends this long before the deadline (0.4 s sufficed in a probe)
# get_preemption_info is a barrier of every worker through Ray Train's controller: asked every step of a
# ~12 ms update it cost a third of the rate in a trial (uninterrupted: median 14.3 ms an update, 20.7 ms on
# average); every 10 updates (~0.15 s, under its drain watcher's poll) it reacts about as soon, and the
# section's uninterrupted figures say what it costs
PEER_ASK_EVERY = 10
WINDOW_S = 60.0  # the longest an event's pause is looked for after it (no restart here takes that long)
OVERRUN = 4.0  # a run still going after this many uninterrupted lengths (plus the trace's reruns) is stopped


@dataclass(frozen=True)
class System:
    label: str
    key: str
    sets: tuple[str, ...] = ()  # spotrun: extra --set overrides


SPOTRUN = System("spotrun (defaults)", "spotrun")
SPOTRUN_SPARE = System("spotrun, a spare", "spotrun-spare", ("world.spares=1",))
SPOTRUN_AUTO = System("spotrun, auto interval", "spotrun-auto", ("checkpoint.every_updates=auto",))
RAY_TRAIN = System("Ray Train (preemption API)", "ray-train")
SYSTEMS = (SPOTRUN, SPOTRUN_SPARE, SPOTRUN_AUTO, RAY_TRAIN)


class RayCluster:
    """The replayer's hands on the cluster: Ray's GCS for drains, the cluster's process for nodes."""

    def __init__(self, cluster: ClusterProcess) -> None:
        import ray._raylet

        self.cluster = cluster
        self.gcs = ray._raylet.GcsClient(address=cluster.address)

    def drain(self, node: str, lead_s: float) -> str | None:
        from ray.core.generated import autoscaler_pb2

        accepted, why = self.gcs.drain_node(
            node, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
            "spot interruption (replayed trace)", int((time.time() + lead_s) * 1000))
        return None if accepted else (why or "refused")

    def remove(self, node: str) -> bool:
        return self.cluster.remove({node}) == 1

    def add(self) -> str:
        return self.cluster.add(1)[0]

    def top_up(self) -> None:
        """Back to :data:`NODES` worker nodes (a run whose node's return missed leaves one short)."""
        missing = NODES - len(self.cluster.worker_node_ids())
        if missing > 0:
            self.cluster.add(missing)


class Driver:
    """A system's driver command as a process of its own: started, SIGKILLed and run again by the replayer."""

    def __init__(self, cmd: list[str], log: Path) -> None:
        self.cmd, self.log = cmd, log
        self.process: subprocess.Popen | None = None
        self.runs = 0
        self.killed = False  # killed by the trace and not yet run again: its exit is not the job's end

    def start(self) -> None:
        self.runs += 1
        with open(self.log, "a") as out:
            self.process = subprocess.Popen(self.cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        self.killed = False

    def kill_driver(self) -> int | None:
        if self.process is None or self.process.poll() is not None:
            return None
        self.killed = True
        self.process.kill()
        self.process.wait()
        return self.process.pid

    def rerun_driver(self) -> None:
        self.start()

    def ended(self) -> int | None:
        """The exit status once the job's driver ended for good (not one the trace killed); else None."""
        if self.process is None or self.killed:
            return None
        return self.process.poll()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


class SpotrunJob(Driver):
    """``spotrun run`` against the cluster; its ranks found in its ledger's newest attempt."""

    def __init__(self, folder: Path, address: str, system: System, updates: int) -> None:
        from spotrun.orchestrator.control.specfile import load_spec
        from spotrun.orchestrator.ledger.store import Ledger
        from spotrun.trainer.storage import open_storage

        self.folder, self.job_id = folder, "job"
        self.trace_path = folder / "trace.jsonl"
        self.sets = [f"storage=file://{folder / 'runs'}", f"data.shards={ROOT / 'configs/data/tiny'}",
                     f"metrics.local_dir={folder / 'metrics'}", f"world.size={WORLD}", f"train.updates={updates}",
                     f"checkpoint.every_updates={EVERY}", "data.workers=1", "metrics.sinks=[sqlite, jsonl]",
                     "world.max_restarts=1000", *system.sets]
        self.spec = load_spec(ROOT / "configs/tiny.yaml", self.sets, self.job_id)
        self.ledger = Ledger(open_storage(self.spec.storage), self.job_id)
        super().__init__([sys.executable, "-m", "spotrun", "run", str(ROOT / "configs/tiny.yaml"), "--address",
                          address, "--job-id", self.job_id, "--trace", str(self.trace_path), "--trace-ids",
                          "--quiet", *(f"--set={s}" for s in self.sets)], folder / "driver.log")

    def _newest(self, rank: int) -> tuple[int, str] | None:
        from spotrun.orchestrator.ledger.events import AttemptStarted

        started = [e for e in self.ledger.read() if isinstance(e, AttemptStarted)]
        if not started or rank >= len(started[-1].rank_pids) or not alive(started[-1].rank_pids[rank]):
            return None
        return started[-1].rank_pids[rank], started[-1].node_ids[rank]

    def rank_pid(self, rank: int) -> int | None:
        found = self._newest(rank)
        return found[0] if found else None

    def rank_node(self, rank: int) -> str | None:
        found = self._newest(rank)
        return found[1] if found else None

    def first_update(self) -> bool:
        return self.trace_path.exists() and self.trace_path.stat().st_size > 0

    def result(self) -> Run:
        from spotrun.orchestrator.ledger.events import Restored

        restored = [e for e in self.ledger.read() if isinstance(e, Restored)]
        run = spotrun_run(self.spec, self.trace_path, len(restored), None)
        run.extra["paths"] = dict(Counter(e.recovery_path for e in restored))
        return run


class RayTrainJob(Driver):
    """bench/peer_driver.py against the cluster; its ranks found in its workers' logs."""

    def __init__(self, folder: Path, address: str, updates: int) -> None:
        from bench.ray_train_side_by_side import Shape, peer_config
        from bench.ray_train_side_by_side import System as PeerSystem

        self.out = folder / "peer"
        self.out.mkdir(parents=True)
        loop = peer_config(self.out, Shape(updates=updates, kill_at=0, intervals=(EVERY,), reps=1), EVERY, False,
                           PeerSystem("Ray Train", poll_s=PEER_POLL_S))
        # its preemption API as its docs wire it, and one better: once more at the last step before the
        # deadline (Ray Train tears the group down at the deadline, so the steps after a checkpoint taken
        # when the notice came would be redone)
        loop.update({"preemption_api": True, "preemption_checkpoint": "before_deadline",
                     "preemption_margin_s": PEER_MARGIN_S, "preemption_every": PEER_ASK_EVERY})
        path = folder / "peer.json"
        # at its best: its controller and its drain watcher poll every PEER_POLL_S (defaults 2 s and 5 s),
        # preemptions and failures both retried without limit
        path.write_text(json.dumps({"address": address, "storage": str(folder / "ray-train-storage"),
                                    "name": "trace", "loop": loop, "poll_s": PEER_POLL_S,
                                    "preemption_poll_s": PEER_POLL_S, "max_failures": -1,
                                    "max_preemption_failures": -1}))
        super().__init__([sys.executable, "-m", "bench.peer_driver", str(path)], folder / "driver.log")

    def _newest(self, rank: int) -> dict[str, Any] | None:
        starts = [r for r in read_jsonl(self.out / f"rank-{rank}.jsonl") if r["event"] == "start"]
        return starts[-1] if starts and alive(starts[-1]["pid"]) else None

    def rank_pid(self, rank: int) -> int | None:
        found = self._newest(rank)
        return found["pid"] if found else None

    def rank_node(self, rank: int) -> str | None:
        found = self._newest(rank)
        return found["node"] if found else None

    def first_update(self) -> bool:
        return any(r["event"] == "step" for r in read_jsonl(self.out / "rank-0.jsonl"))

    def result(self) -> Run:
        run = peer_run(self.out, WORLD, None, [])
        run.extra["paths"] = {"new worker group": run.restarts} if run.restarts else {}
        ends = [r for r in read_jsonl(self.out / "rank-0.jsonl") if r["event"] == "end"]
        run.extra["params_sha256"] = ends[-1]["params_sha256"] if ends else None
        return run


def make_job(system: System, folder: Path, address: str, updates: int) -> SpotrunJob | RayTrainJob:
    folder.mkdir(parents=True)
    if system is RAY_TRAIN:
        return RayTrainJob(folder, address, updates)
    return SpotrunJob(folder, address, system, updates)


def replay(system: System, trace: Trace | None, folder: Path, cluster: RayCluster, updates: int,
           limit_s: float) -> dict[str, Any]:
    """One run: the job started, ``trace`` replayed from its first update (None: uninterrupted), until the
    driver ends for good or ``limit_s`` passes (then stopped); what it did and what the replay hit."""
    cluster.top_up()
    job = make_job(system, folder, cluster.cluster.address, updates)
    job.start()
    deadline = time.monotonic() + FIRST_UPDATE_WAIT_S
    while not job.first_update():
        if job.ended() is not None or time.monotonic() > deadline:
            job.stop()
            raise RuntimeError(f"{system.label}: no first update ({job.log.read_text()[-2000:]})")
        time.sleep(LOOK_S)
    started = time.monotonic()
    ended = threading.Event()
    fired: list[Fired] = []
    thread = None
    if trace is not None:
        replayer = Replayer(trace, job, cluster)
        thread = threading.Thread(target=lambda: fired.extend(replayer.run(started, ended)), name="replayer")
        thread.start()
    stopped = None
    while (status := job.ended()) is None:
        if time.monotonic() - started > limit_s:
            stopped = f"still running after {limit_s:.0f} s: stopped"
            job.stop()
            status = job.process.returncode if job.process else None
            break
        time.sleep(LOOK_S)
    ended.set()
    if thread is not None:
        thread.join()
    run = job.result()
    return {"system": system.key, "trace": trace.name if trace else None, "status": status, "stopped": stopped,
            "driver_runs": job.runs, "fired": [vars(f) for f in fired], "run": run, "folder": str(folder),
            "wall_s": time.monotonic() - started}


def figures(r: dict[str, Any], reference: dict[str, Any], updates: int) -> dict[str, Any]:
    """A run's figures against its system's uninterrupted run (see the module's docstring)."""
    run: Run = r["run"]
    ref: Run = reference["run"]
    step_s = reference["step_s"]
    final = run.final()
    g = goodput(run, step_s)
    pauses = event_pauses(sorted(s.t for s in run.steps), r["fired"])
    finished = r["status"] == 0 and max(final, default=0) == updates
    if r["system"] == RAY_TRAIN.key:
        mine = run.extra.get("params_sha256")
        same = mine is not None and mine == ref.extra.get("params_sha256")
    else:
        same = bitwise(r["folder"], reference["folder"], updates)
    return {"goodput": g, "of_uninterrupted": g / reference["goodput"] if reference["goodput"] else None,
            "updates_replayed": len(run.steps) - len(final), "restarts": run.restarts,
            "paths": run.extra.get("paths", {}), "finished": finished, "same_as_uninterrupted": same,
            "pause_s": pauses,
            "fired": len(r["fired"]), "hit": sum(f["missed"] is None and f["fired_s"] is not None for f in r["fired"]),
            "missed": [f"{f['verb']} at {f['due_s']:.1f} s: {f['missed']}" for f in r["fired"] if f["missed"]],
            "not_fired": sum(f["fired_s"] is None for f in r["fired"])}


def event_pauses(times: list[float], fired: list[dict[str, Any]]) -> list[float]:
    """Per event of the trace that hit (its first action: a notice's drain, a node's loss, a kill), the
    longest pause in training from that moment until the next event's first action, or :data:`WINDOW_S`
    after it: the restart it caused, wherever in its notice that came (spotrun restarts once the emergency
    bundle is published, Ray Train at the deadline), counted once. ``times``: every completed update, sorted."""
    firsts: dict[int, float] = {}
    for f in fired:
        if f["fired_s"] is not None and f["event"] not in firsts:
            firsts[f["event"]] = f["wall"] if f["missed"] is None else float("nan")
    starts = sorted(firsts.items())
    out = []
    for i, (_, start) in enumerate(starts):
        if start != start:  # its first action missed: it stopped nothing
            continue
        later = [t for _, t in starts[i + 1:] if t == t]
        end = min([*later[:1], start + WINDOW_S])
        inside = [t for t in times if start < t <= end]
        if not inside:  # no update at all before the next event (or in the window)
            out.append(end - start)
            continue
        edges = [start, *inside]  # after the last: training went on past the window, or the job ended
        out.append(max(b - a for a, b in zip(edges, edges[1:], strict=False)))
    return out


def bitwise(folder: str, reference_folder: str, updates: int) -> bool:
    """Every update of the run's final lineage equal to the uninterrupted run's (parameters, data, loss)."""
    from spotrun.trainer.observe.trace import first_divergence, latest_per_update, read_trace

    ref = read_trace(Path(reference_folder) / "trace.jsonl")
    final = latest_per_update(read_trace(Path(folder) / "trace.jsonl"))
    complete = sorted(final) == list(range(1, updates + 1))
    return complete and first_divergence(ref, [final[u] for u in sorted(final)]) is None


def run_all(traces: list[Trace], reps: int, updates: int, scratch: Path) -> dict[str, Any]:
    import ray  # noqa: F401  (the GCS client's module)

    cluster = ClusterProcess(workers=NODES)
    try:
        hands = RayCluster(cluster)
        references: dict[str, dict[str, Any]] = {}
        for system in (SPOTRUN, RAY_TRAIN):
            ref = replay(system, None, scratch / f"ref-{system.key}", hands, updates, limit_s=1800)
            ref["step_s"] = step_time(ref["run"])
            ref["goodput"] = goodput(ref["run"], ref["step_s"])
            references[system.key] = ref
            print(f"uninterrupted {system.label}: {ref['wall_s']:.0f} s, update {ref['step_s'] * 1000:.1f} ms",
                  flush=True)
        length = references[SPOTRUN.key]["wall_s"]
        rows: list[dict[str, Any]] = []
        for trace in traces:
            scaled = trace.scaled(length)
            reruns = sum(e.rerun_after_s or 0 for e in scaled.events)
            for rep in range(reps):
                for system in SYSTEMS:
                    ref = references[RAY_TRAIN.key if system is RAY_TRAIN else SPOTRUN.key]
                    r = replay(system, scaled, scratch / f"{trace.name}-{system.key}-{rep}", hands, updates,
                               limit_s=OVERRUN * max(length, ref["wall_s"]) + reruns)
                    rows.append({"system": system.key, "trace": trace.name, "rep": rep,
                                 **figures(r, ref, updates), "wall_s": r["wall_s"], "stopped": r["stopped"]})
                    print(f"{trace.name} {rep} {system.label}: goodput {rows[-1]['goodput']:.3f}, "
                          f"{r['wall_s']:.0f} s, finished {rows[-1]['finished']}", flush=True)
        return {"updates": updates, "length_s": length, "traces": [t.model_dump() for t in traces], "reps": reps,
                "references": {k: {"wall_s": v["wall_s"], "step_s": v["step_s"], "goodput": v["goodput"]}
                               for k, v in references.items()}, "rows": rows}
    finally:
        cluster.shutdown()


def step_time(run: Run) -> float:
    """The median time between consecutive updates of one attempt, in an uninterrupted run."""
    by_attempt: dict[int, list[float]] = {}
    for s in run.steps:
        by_attempt.setdefault(s.attempt, []).append(s.t)
    gaps = [b - a for ts in by_attempt.values() for a, b in zip(sorted(ts), sorted(ts)[1:], strict=False)]
    return median(gaps)


def spread(values: Sequence[float | None], as_pct: bool = False) -> str:
    xs = [v for v in values if v is not None]
    if not xs:
        return "—"
    f = pct if as_pct else fmt
    lo, mid, hi = min(xs), median(xs), max(xs)
    return f(mid) if lo == hi else f"{f(mid)} ({f(lo)}–{f(hi)})"


def tables(results: dict[str, Any]) -> tuple[list[Table], list[str]]:
    out, verdicts = [], []
    rows = results["rows"]
    for trace in results["traces"]:
        name = trace["name"]
        t = Table(f"{name}: median (min–max) of {results['reps']} runs per system", ["", *(s.label for s in SYSTEMS)])
        mine = {s.key: [r for r in rows if r["trace"] == name and r["system"] == s.key] for s in SYSTEMS}

        for label, key, as_pct in (("goodput", "goodput", True),
                                   ("goodput / the uninterrupted run's", "of_uninterrupted", True),
                                   ("updates replayed (done again after a restart)", "updates_replayed", False),
                                   ("restarts", "restarts", False)):
            t.add(label, *(spread([r[key] for r in mine[s.key]], as_pct) for s in SYSTEMS))
        t.add("longest pause in training after each event (s): median (min–max) over every event of every run",
              *(spread([x for r in mine[s.key] for x in r["pause_s"]]) for s in SYSTEMS))
        t.add("restarts by kind (all runs)", *(", ".join(f"{k} {v}" for k, v in sorted(sum(
            (Counter(r["paths"]) for r in mine[s.key]), Counter()).items())) or "—" for s in SYSTEMS))
        t.add("runs finished", *(f"{sum(r['finished'] for r in mine[s.key])} of {len(mine[s.key])}" for s in SYSTEMS))
        t.add("runs equal to the uninterrupted run (spotrun: every update bitwise; Ray Train: final parameters)",
              *(f"{sum(bool(r['same_as_uninterrupted']) for r in mine[s.key])} of {len(mine[s.key])}" for s in SYSTEMS))
        t.add("trace actions hit / fired (all runs)", *(f"{sum(r['hit'] for r in mine[s.key])} / "
                                                       f"{sum(r['fired'] for r in mine[s.key])}" for s in SYSTEMS))
        missed = sorted({m for s in SYSTEMS for r in mine[s.key] for m in r["missed"]})
        t.notes.append(trace["derived"])
        if missed:
            t.notes.append("missed actions: " + "; ".join(missed[:6]) + (" …" if len(missed) > 6 else ""))
        out.append(t)
        best = max((median([r["goodput"] for r in mine[s.key]]), s.label) for s in SYSTEMS if s is not RAY_TRAIN)
        peer = median([r["goodput"] for r in mine[RAY_TRAIN.key]])
        ahead = all(median([r["goodput"] for r in mine[s.key]]) > peer for s in SYSTEMS if s is not RAY_TRAIN)
        verdicts.append(f"{name}: spotrun's goodput ahead of Ray Train's: **{'MET' if ahead else 'NOT MET'}** "
                        f"(medians: " + ", ".join(f"{s.label} {pct(median([r['goodput'] for r in mine[s.key]]))}"
                                                  for s in SYSTEMS) + f"; best spotrun row {best[1]})")
        verdicts.append(f"{name}, where Ray Train is ahead of a spotrun row (medians): "
                        + ("; ".join(peer_ahead(mine)) or "nowhere in this run"))
    notice_heavy = [r for r in rows if r["trace"] == "aws-notices" and r["system"] == SPOTRUN.key]
    if notice_heavy:
        x = median([r["of_uninterrupted"] for r in notice_heavy])
        verdicts.append(f"aws-notices (the notice-heavy trace): spotrun at its defaults ≥ 97 % of its uninterrupted "
                        f"run's goodput: **{'MET' if x >= 0.97 else 'NOT MET'}** ({pct(x)})")
    return out, verdicts


# compared figures: (label, per-run value, higher is better, as a percentage)
COMPARED = (("goodput", lambda r: r["goodput"], True, True),
            ("goodput / the uninterrupted run's", lambda r: r["of_uninterrupted"], True, True),
            ("updates replayed", lambda r: r["updates_replayed"], False, False),
            ("longest pause after an event (s)", lambda r: median(r["pause_s"]) if r["pause_s"] else None, False,
             False))


def peer_ahead(mine: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Each compared figure on which Ray Train's median beats a spotrun row's, with both medians."""
    out = []
    for label, value, higher, as_pct in COMPARED:
        med = {s.key: median([v for r in mine[s.key] if (v := value(r)) is not None]) for s in SYSTEMS}
        peer = med[RAY_TRAIN.key]
        show = pct if as_pct else fmt
        beaten = [f"{s.label} {show(med[s.key])}" for s in SYSTEMS if s is not RAY_TRAIN
                  and (peer > med[s.key] if higher else peer < med[s.key])]
        if beaten:
            out.append(f"{label}: Ray Train {show(peer)} against " + ", ".join(beaten))
    return out


def main(argv: Sequence[str] | None = None) -> None:
    import argparse

    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--traces", nargs="*", default=list(TRACES), choices=list(TRACES))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--updates", type=int, default=6000, help="updates per run (sets the uninterrupted length)")
    p.add_argument("--tables-from", type=Path, help="lay out the tables of a section JSON this bench wrote (no run)")
    known, rest = p.parse_known_args(argv)
    args = cli(__doc__.splitlines()[0], rest)
    clock = Stopwatch()
    if known.tables_from:
        saved = json.loads(known.tables_from.read_text())
        results, seconds, measured = saved["data"], saved["seconds"], saved["data"]["measured"]
    else:
        traces = [load_trace(t) for t in (known.traces[:1] if args.quick else known.traces)]
        with work_folder("traces") as folder:
            results = run_all(traces, 1 if args.quick else known.reps, 600 if args.quick else known.updates, folder)
        seconds, measured = clock.seconds, clock.measured
        results["measured"] = measured
    tabs, verdicts = tables(results)
    refs = results["references"]
    intro = (__doc__.split("\n", 2)[2].split("\n\n    python")[0] + f"\n\nUninterrupted: spotrun "
             f"{refs[SPOTRUN.key]['wall_s']:.0f} s at {refs[SPOTRUN.key]['step_s'] * 1000:.1f} ms an update, Ray Train "
             f"{refs[RAY_TRAIN.key]['wall_s']:.0f} s at {refs[RAY_TRAIN.key]['step_s'] * 1000:.1f} ms; "
             f"{results['updates']} updates, a checkpoint every {EVERY} on both (spotrun's `auto` row chooses "
             "its own); "
             f"each trace scaled to {results['length_s']:.0f} s.")
    Section("20-trace-goodput", "20. Goodput on replayed spot traces, against Ray Train", intro, tabs, verdicts,
            seconds, results, measured).emit(args.out)


if __name__ == "__main__":
    main()
