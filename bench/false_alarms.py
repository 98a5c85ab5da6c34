"""Bench 14 — zero false hangs: a 2-rank job trains for minutes beside a CPU hog; no rank is hung, stuck or a straggler.

A rank is hung when it answers no health poll for ``world.hang_after_s``, stuck when it stands in its own
work past its adaptive bound while a peer waits for it at a collective (orchestrator/policy/health.py).
A bound set too tight turns a loaded host, a long checkpoint write, a slow first batch or a GC pause
into a false alarm: a live rank's process killed and the job restarted. Here the built-in character LM
trains on 2 ranks of a local Ray, checkpointing every 4 updates, while one busy process per core keeps
every core of the host taken; after the run's length (10 minutes, ``--minutes``) a stop notice to the
driver ends it (an emergency checkpoint, then the end). The driver's own health watch says how near the
run came to each verdict: the polls it judged, the slowest poll answer and the longest silence it judged
against ``world.hang_after_s``, the largest stand-still of a rank in its own work while a peer waited
against that rank's stuck bound, and the largest slowdown of a rank's own work against its peers'
against ``world.straggler_ratio``. The ledger says what was recorded: hung and stuck ranks and straggler
flags (target: none).

    python -m bench.false_alarms [--minutes 10]

tests/integration/test_hang.py runs the same for one minute (a false alarm fails it).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from bench.tables import ROOT, Section, Stopwatch, Table, cli_minutes, fmt, work_folder
from spotrun.orchestrator.control.launch import check_entrypoint, ensure_ray, ray_platform
from spotrun.orchestrator.control.platform import Options
from spotrun.orchestrator.control.specfile import load_spec
from spotrun.orchestrator.control.supervisor import Supervisor
from spotrun.orchestrator.ledger.events import Slowdowns, WorkerLost
from spotrun.orchestrator.ledger.store import Ledger
from spotrun.orchestrator.notices.notice import Notice
from spotrun.orchestrator.workers.watch import Margins
from spotrun.trainer.bundle.bundles import list_bundles
from spotrun.trainer.job.spec import JobSpec
from spotrun.trainer.run.context import Instrumentation
from spotrun.trainer.storage import open_storage

# The job: configs/tiny.yaml on 2 ranks, a checkpoint every 4 updates, far more updates than a run reaches
# (the stop notice ends it). A wider network than tiny's, so that an update and a bundle write take long
# enough under the hog for the stuck bound to be approached by something.
SETS = ("world.size=2", "train.updates=1000000", "checkpoint.every_updates=4", "data.workers=1",
        "model.n_layer=2", "model.n_embd=128")


@dataclass
class Loaded:
    """One loaded run: what it did, how near its ranks came to a verdict, and what the ledger recorded."""

    seconds: float
    state: str  # stopped: the stop notice ended it (finished: it ran out of updates first)
    updates: int
    checkpoints: int
    restarts: int
    margins: Margins
    lost: list[WorkerLost]  # every rank lost; a false alarm is one with cause hang or stuck
    flagged: list[Slowdowns]  # the records that named a straggler (a false one here: every rank runs alike)
    hogs: int
    load_at_end: float  # the 1-minute load average just before the hogs were stopped

    @property
    def false_alarms(self) -> list[WorkerLost]:
        return [e for e in self.lost if e.cause in ("hang", "stuck")]


def hog(count: int) -> list[subprocess.Popen]:
    """``count`` processes that each keep one core busy until killed."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def loaded_run(spec: JobSpec, seconds: float | None = None, hogs: int | None = None,
               until_published: int | None = None) -> Loaded:
    """Run ``spec`` on the connected (else an embedded) Ray beside ``hogs`` busy processes (default: one per
    core) for ``seconds``, or until a bundle of update ``until_published`` or later is published (a test's
    run: as long as the machine needs for that much training, never a wall-clock guess); then stop it with
    a notice to the driver, as ``spotrun run`` would be stopped."""
    check_entrypoint(spec)
    ensure_ray(spec, None)
    platform = ray_platform(spec, Instrumentation.of())
    groups: list[Any] = []

    def make_group(*args: Any) -> Any:  # keep each attempt's group: its health watch holds the margins
        group = platform.make_group(*args)
        groups.append(group)
        return group

    sup = Supervisor(spec, replace(platform, make_group=make_group), Options())

    def stop_now() -> None:  # made when sent: a notice's grace runs from its received_at
        sup.notify(Notice(source="sigterm", node_id=None, deadline=None, detail="the loaded run's length is over"))

    if until_published is not None:
        stop: threading.Thread = threading.Thread(target=_after_bundle, args=(spec, until_published, stop_now),
                                                  name="loaded-run-stop", daemon=True)
    else:
        stop = threading.Timer(seconds or 0.0, stop_now)
    busy = hog((os.cpu_count() or 1) if hogs is None else hogs)
    t0 = time.perf_counter()
    try:
        stop.start()
        outcome = sup.run()
        load = os.getloadavg()[0]
    finally:
        if isinstance(stop, threading.Timer):
            stop.cancel()
        for p in busy:
            p.kill()
            p.wait()
    took = time.perf_counter() - t0
    events = Ledger(open_storage(spec.storage), spec.job_id).read()
    return Loaded(seconds=took, state=outcome.state,
                  updates=outcome.counters.attempted_updates if outcome.counters else 0,
                  checkpoints=len(outcome.published), restarts=outcome.restarts,
                  margins=merged([g.watch.margins for g in groups]),
                  lost=[e for e in events if isinstance(e, WorkerLost)],
                  flagged=[e for e in events if isinstance(e, Slowdowns) and e.stragglers], hogs=len(busy),
                  load_at_end=load)


def _after_bundle(spec: JobSpec, update: int, then: Callable[[], None]) -> None:
    """Call ``then`` once the job has published a bundle of ``update`` or later (its listing looked at ten
    times a second)."""
    storage = open_storage(spec.storage)
    while not any(r.published and r.update >= update for r in list_bundles(storage, spec.job_id)):
        time.sleep(0.1)  # polling a condition: the job's bundles
    then()


def merged(each: Sequence[Margins]) -> Margins:
    """The margins of several attempts as one run's (the polls added, the nearest approach kept)."""
    out = Margins()
    for m in each:
        out.polls += m.polls
        out.slowest_answer_s = max(out.slowest_answer_s, m.slowest_answer_s)
        out.silence = max(out.silence, m.silence)
        if m.stuck > out.stuck:
            out.stuck, out.stuck_age_s, out.stuck_bound_s = m.stuck, m.stuck_age_s, m.stuck_bound_s
        out.slowdown = max(out.slowdown, m.slowdown)
    return out


def tables(run: Loaded, spec: JobSpec, minutes: float) -> tuple[list[Table], list[str]]:
    m, hang = run.margins, spec.world.hang_after_s
    t = Table(f"A 2-rank job beside {run.hogs} busy processes (one per core) for {fmt(run.seconds / 60)} min, a "
              "checkpoint every 4 updates", ["measure", "value", "bound", "value / bound"])
    t.add("updates", run.updates, "", "")
    t.add("checkpoints published", run.checkpoints, "", "")
    t.add("polls judged", m.polls, "", "")
    t.add("slowest poll answer (s)", m.slowest_answer_s, f"hang_after_s {hang:g}", m.slowest_answer_s / hang)
    t.add("longest silence judged (s)", m.silence * hang, f"hang_after_s {hang:g}", m.silence)
    t.add("largest stand-still in own work while a peer waited (s)", m.stuck_age_s,
          f"its stuck bound {fmt(m.stuck_bound_s or None)}", m.stuck)
    ratio = spec.world.straggler_ratio
    t.add("largest slowdown of a rank's own work against its peers' (x)", m.slowdown,
          f"straggler_ratio {ratio:g}", m.slowdown / ratio)
    t.add("hung ranks recorded", sum(e.cause == "hang" for e in run.lost), "0", "")
    t.add("stuck ranks recorded", sum(e.cause == "stuck" for e in run.lost), "0", "")
    t.add("straggler flags recorded", len(run.flagged), "0", "")
    t.add("ranks lost for any cause", len(run.lost), "", "")
    t.notes += [f"ended {run.state} (a stop notice after {fmt(minutes)} min), {run.restarts} restarts; the 1-minute "
                f"load average at the end {run.load_at_end:.2f}",
                f"stuck bound: world.stuck_factor {spec.world.stuck_factor:g} x the median update time, at least "
                f"world.stuck_floor_s {spec.world.stuck_floor_s:g} s (a capture: 300 s); a ratio over 1 is a verdict",
                "the slowest poll answer is the longest the driver waited for every rank's answer to one poll"]
    ok = not run.false_alarms and not run.flagged and run.state == "stopped" and run.restarts == 0
    verdict = (f"no hung, stuck or straggling rank in {fmt(run.seconds / 60)} min beside a CPU hog (one busy process "
               f"per core), checkpoints every 4 updates: **{'MET' if ok else 'NOT MET'}** ({len(run.false_alarms)} "
               f"false alarms and {len(run.flagged)} straggler flags over {m.polls:,} polls; slowest poll answer "
               f"{fmt(m.slowest_answer_s)} s against hang_after_s {hang:g} s; largest stuck ratio {fmt(m.stuck)}; "
               f"largest slowdown {fmt(m.slowdown)}x against straggler_ratio {ratio:g})")
    return [t], [verdict]


def main(argv: Sequence[str] | None = None) -> None:
    args, minutes = cli_minutes(__doc__.splitlines()[0], argv, 10.0, "how long the job trains beside the hog")
    clock = Stopwatch()
    with work_folder("false-alarms") as folder:
        spec = load_spec(ROOT / "configs/tiny.yaml", [f"storage=file://{folder / 'runs'}",
                                                      f"data.shards={ROOT / 'configs/data/tiny'}", *SETS], "loaded")
        run = loaded_run(spec, minutes * 60)
    tabs, verdicts = tables(run, spec, minutes)
    data = {"minutes": minutes, "seconds": run.seconds, "state": run.state, "updates": run.updates,
            "checkpoints": run.checkpoints, "restarts": run.restarts, "margins": run.margins.__dict__,
            "lost": [e.model_dump(mode="json") for e in run.lost],
            "flagged": [e.model_dump(mode="json") for e in run.flagged], "hogs": run.hogs,
            "load_at_end": run.load_at_end,
            "hang_after_s": spec.world.hang_after_s}
    Section("14-false-alarms", "14. Zero false hangs: a loaded host, minutes of training", __doc__.split("\n", 2)[2]
            .split("\n\n    python")[0], tabs, verdicts, clock.seconds, data, clock.measured).emit(args.out)
    if run.false_alarms or run.flagged:
        sys.exit(1)


if __name__ == "__main__":
    main()
