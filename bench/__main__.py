"""``make bench``: run every bench in its own process, then assemble bench/RESULTS.md.

    python -m bench                    # the full set (about 30 minutes on a quiet 2-core machine)
    python -m bench --only NAME...     # those benches; the other sections of RESULTS.md stay as they were
    python -m bench --quick            # tiny runs, results under bench/.work/quick/

A run that is not ``--quick`` (``--only`` included: bench/RESULTS.md keeps the other sections) also
rewrites the figures in the README's Performance section from the new bench/RESULTS.md (bench/readme.py).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from bench.readme import README, update_readme
from bench.report import SECTIONS, assemble
from bench.tables import BENCH, DEFAULT_RESULTS, WORK

MODULES = {"1-checkpoint-stall": "bench.checkpoint_stall", "2-training-overhead": "bench.training_overhead",
           "3-restart-cost": "bench.restart_cost", "4-ray-train-side-by-side": "bench.ray_train_side_by_side",
           "5-grad-sync": "bench.grad_sync", "6-s3-metrics": "bench.s3_metrics", "7-trace-cost": "bench.trace_cost",
           "8-steady-speed": "bench.steady_speed", "9-sharded-bundles": "bench.sharded_bundles",
           "10-ledger-week": "bench.ledger_week", "11-auto-interval": "bench.auto_interval",
           "12-data-identity": "bench.data_identity", "13-health-poll": "bench.health_poll",
           "14-false-alarms": "bench.false_alarms", "15-hang-recovery": "bench.hang_recovery",
           "16-storage-outage": "bench.storage_outage",
           "17-endurance": "bench.endurance", "18-week-page": "bench.week_page",
           "19-week-history": "bench.week_history", "20-trace-goodput": "bench.trace_goodput"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", nargs="*", choices=list(MODULES), help="run these benches only")
    args = p.parse_args()
    out = WORK / "quick" if args.quick else DEFAULT_RESULTS
    target = out / "RESULTS.md" if args.quick else BENCH / "RESULTS.md"
    t0 = time.perf_counter()
    failed = []
    ran = tuple(name for name in SECTIONS if not args.only or name in args.only)
    for name in ran:
        print(f"\n=== {name} ===", flush=True)
        for stale in out.glob(f"{name}.*"):  # a failed run must not leave an older run's section as its own
            stale.unlink()
        cmd = [sys.executable, "-m", MODULES[name], "--out", str(out), *(["--quick"] if args.quick else [])]
        if subprocess.run(cmd).returncode != 0:
            failed.append(name)
    total = time.perf_counter() - t0
    text = assemble(out, target, None if args.only else total, failed, ran)
    if not args.quick:
        update_readme(README, text)
    print(f"\nwrote {target} ({total / 60:.1f} min){'; failed: ' + ', '.join(failed) if failed else ''}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
