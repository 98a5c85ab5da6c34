"""Bench 13 — how long a live, busy rank takes to answer the driver's health poll: what the hang bound is chosen from.

A rank is hung when it answers no poll for ``hang_after_s`` (orchestrator/policy/health.py); the bound
must stay above what a live rank ever takes to answer, under every load a job meets, or a slow answer
becomes a false hang. Two Ray actors shaped like rank actors (threaded, ``max_concurrency`` 5, one CPU
each) run a training-like thread — a small MLP's forward, backward and optimizer step on CPU, marking a
:class:`~spotrun.trainer.run.beacon.Beacon` — while the driver polls each every 0.1 s for the beacon's
reading and times the round trip. Scenarios, one after another on the same actors:

- ``quiet``: training alone;
- ``cpu hog``: two busy processes beside it, one per core (the host's cores all taken);
- ``gc storm``: the training thread also builds a large object graph and collects it each update
  (the interpreter's lock held through each collection);
- ``checkpoint write``: the training thread also writes 64 MiB and fsyncs it each update.

The table gives the round trip's median, 99th percentile and maximum per scenario, and the ratio of the
bound spotrun ships (``Bounds.hang_after_s``) to the worst answer seen.
"""

from __future__ import annotations

import gc
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any

from bench.tables import Section, Stopwatch, Table, cli, fmt, median
from spotrun.orchestrator.policy.health import Bounds

SCENARIOS = ("quiet", "cpu hog", "gc storm", "checkpoint write")


class BusyRank:
    """A stand-in for a rank actor: a training thread, and a poll answered from another thread."""

    def __init__(self) -> None:
        from spotrun.trainer.run.beacon import Beacon

        self.beacon = Beacon()
        self.mode = "quiet"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._train, daemon=True)
        self._thread.start()

    def _train(self) -> None:
        import torch

        from spotrun.trainer.run.beacon import Phase

        torch.set_num_threads(1)
        model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))
        opt = torch.optim.AdamW(model.parameters())
        x = torch.randn(64, 256)
        blob = os.urandom(64 << 20)
        update = 0
        while not self._stop.is_set():
            update += 1
            self.beacon.enter(Phase.FORWARD, update=update, microstep=0)
            loss = model(x).square().mean()
            self.beacon.enter(Phase.BACKWARD)
            loss.backward()
            self.beacon.enter(Phase.OPTIMIZER)
            opt.step()
            opt.zero_grad()
            if self.mode == "gc storm":
                junk = [{"i": i, "l": [i] * 4} for i in range(300_000)]
                del junk
                gc.collect()
            elif self.mode == "checkpoint write":
                self.beacon.enter(Phase.CAPTURE)
                with tempfile.TemporaryFile() as f:
                    f.write(blob)
                    f.flush()
                    os.fsync(f.fileno())

    def set_mode(self, mode: str) -> None:
        self.mode = mode

    def read(self) -> Any:
        return self.beacon.read()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def run(quick: bool) -> dict[str, list[float]]:
    import ray

    seconds = 3.0 if quick else 30.0
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    try:
        actor = ray.remote(BusyRank).options(num_cpus=1, max_concurrency=5)
        ranks = [actor.remote() for _ in range(2)]
        ray.get([r.read.remote() for r in ranks])
        out: dict[str, list[float]] = {}
        for scenario in SCENARIOS:
            ray.get([r.set_mode.remote(scenario) for r in ranks])
            hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)] \
                if scenario == "cpu hog" else []
            try:
                rtts: list[float] = []
                end = time.monotonic() + seconds
                while time.monotonic() < end:
                    for r in ranks:
                        t0 = time.perf_counter()
                        ray.get(r.read.remote(), timeout=60)
                        rtts.append(time.perf_counter() - t0)
                    time.sleep(0.1)  # the poll's own period
                out[scenario] = rtts
            finally:
                for h in hogs:
                    h.kill()
                    h.wait()
        ray.get([r.stop.remote() for r in ranks])
        return out
    finally:
        ray.shutdown()


def percentile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def tables(r: dict[str, list[float]]) -> tuple[list[Table], dict[str, Any]]:
    bound = Bounds().hang_after_s
    t = Table("The health poll's round trip to a live, busy rank (2 rank-like Ray actors, polled every 0.1 s)",
              ["scenario", "polls", "median ms", "p99 ms", "max ms", f"hang bound ({bound:g} s) / max"])
    worst = 0.0
    for scenario, xs in r.items():
        worst = max(worst, max(xs))
        t.add(scenario, len(xs), fmt(median(xs) * 1e3), fmt(percentile(xs, 0.99) * 1e3), fmt(max(xs) * 1e3),
              fmt(bound / max(xs)))
    t.notes.append("a rank is hung when silent past the bound: the last column is the margin between the slowest "
                   "live answer seen and a false hang")
    return [t], {"worst_s": worst, "bound_s": bound, "margin": bound / worst}


def main(argv: Sequence[str] | None = None) -> None:
    args = cli(__doc__.splitlines()[0], argv)
    clock = Stopwatch()
    results = run(args.quick)
    tabs, summary = tables(results)
    verdicts = [f"no live answer near the hang bound: worst {fmt(summary['worst_s'] * 1e3)} ms against "
                f"{summary['bound_s']:g} s ({fmt(summary['margin'])}x margin)"]
    Section("13-health-poll", "13. Health poll: how long a live rank takes to answer", __doc__.split("\n", 2)[2],
            tabs, verdicts, clock.seconds, {"results": results, "summary": summary}, clock.measured).emit(args.out)


if __name__ == "__main__":
    main()
