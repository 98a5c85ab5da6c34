"""Hang to next update: a 2-rank tiny job on a local Ray, rank 1's process SIGSTOPs itself mid-update (the
``SIGSTOP`` fault); the time from that signal (the fault's own record, written just before it) to the first
update of the next attempt reaching the driver, with a spare (``world.spares=1``) and without (a new process
in the held slot). Before hang detection the same fault cost ~68 s (the 60 s poll timeout) and a cold restart.

    python -m bench.hang_recovery [--trials 5]

Not part of ``make bench`` yet (no RESULTS.md section): its figures are in the branch's report.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import ray

from spotrun.orchestrator.control.launch import run_on_ray
from spotrun.orchestrator.control.specfile import load_spec
from spotrun.orchestrator.ledger.events import Restored
from spotrun.orchestrator.ledger.store import Ledger
from spotrun.trainer.observe.faults import FaultLog
from spotrun.trainer.storage import open_storage

ROOT = Path(__file__).resolve().parent.parent
LOOK_S = 0.02  # how often the bench looks at the trace file (a bench measures; a test never sleeps)


def trial(tmp: Path, spares: int, n: int) -> tuple[float, str]:
    """Seconds from the SIGSTOP to the next attempt's first update at the driver, and the recovery path."""
    job = f"hang{spares}-{n}"
    spec = load_spec(ROOT / "configs/tiny.yaml", [
        f"storage=file://{tmp / 'runs'}", f"data.shards={ROOT / 'configs/data/tiny'}", "world.size=2",
        f"world.spares={spares}", "train.updates=16", "checkpoint.every_updates=4", "data.workers=1",
        "faults=[{site: backward, signal: SIGSTOP, update: 10, microstep: 1, rank: 1}]"], job)
    trace = tmp / f"{job}.jsonl"
    seen: dict[str, float] = {}
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            if trace.exists():
                for line in trace.read_text().splitlines():
                    if json.loads(line).get("attempt") == 2:
                        seen.setdefault("next", datetime.now(UTC).timestamp())
            if "next" in seen:
                return
            time.sleep(LOOK_S)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    outcome = run_on_ray(spec, trace_path=str(trace))
    done.set()
    watcher.join()
    storage = open_storage(spec.storage)
    (fired,) = FaultLog(storage, job).read()
    paths = [e.recovery_path for e in Ledger(storage, job).read() if isinstance(e, Restored)]
    assert outcome.state == "finished" and "next" in seen, (outcome, seen)
    return seen["next"] - fired.at.timestamp(), ",".join(p or "?" for p in paths)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=5)
    args = p.parse_args()
    ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory() as d:
        for spares in (1, 0):
            got = [trial(Path(d), spares, n) for n in range(args.trials)]
            secs = [s for s, _ in got]
            print(f"world.spares={spares}: SIGSTOP -> next update median {statistics.median(secs):.2f} s, "
                  f"min {min(secs):.2f}, max {max(secs):.2f} over {len(secs)}; paths {sorted({p for _, p in got})}",
                  flush=True)


if __name__ == "__main__":
    main()
