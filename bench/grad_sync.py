"""Gradient sync, exactness against speed: the flat all-reduce spotrun keeps, or torch's DDP.

    python -m bench.grad_sync [--quick]

For each sync (``train.grad_sync``: ``allreduce`` | ``ddp``) and each world size (2 and 3 gloo
ranks on local Ray), one ``spotrun verify`` of the ``tiny`` job (dropout on, 4 faults) says
whether a restart is still bitwise equal to the uninterrupted run, and where it first differs if
not. The world is fixed (``elastic`` with min = max, since ``strict`` refuses ``ddp`` at 3 ranks
because of this very result), so every restart is at the same size and a difference is the sync's.
(Speed is bench 2's business.)
Why it can differ: DDP sums a bucket with a ring all-reduce whose order of summation per element
depends on where the element sits in the bucket, and DDP rebuilds its buckets after the first
iteration of every process: the first update after a restore sums in the default layout while the
uninterrupted run sums in the rebuilt one. With 2 ranks a + b = b + a, so only 3 or more can differ.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from bench.tables import ROOT, Section, Stopwatch, Table, cli, work_folder
from spotrun.orchestrator.control.specfile import load_spec
from spotrun.orchestrator.verify.oracle import Verifier

SYNCS = ("allreduce", "ddp")


def verify_one(folder: Path, sync: str, world: int, updates: int, kills: int) -> dict:
    # A fixed world under elastic: strict refuses ddp at 3+ ranks (spec validation, because of what this
    # bench measures), and min = max keeps every restart at the same size, so "bitwise" still means exact.
    sets = [f"storage=file://{folder / 'runs'}", f"data.shards={ROOT / 'configs/data/tiny'}", f"world.size={world}",
            "world.policy=elastic", f"world.min_size={world}", f"world.max_size={world}",
            f"train.grad_sync={sync}", f"train.updates={updates}", "checkpoint.every_updates=3", "data.workers=1",
            "train.micro_batch=2", "train.accum_steps=2", "model.dropout=0.1"]
    work = folder / f"{sync}-{world}"
    work.mkdir()
    v = Verifier(str(ROOT / "configs/tiny.yaml"), sets, kills=kills, seed=5, no_ray=False, workdir=work,
                 load=lambda path, overrides: load_spec(path, overrides, f"gs-{sync}-{world}"))
    report = v.run()
    return {"sync": sync, "world": world, "verdict": report.verdict, "bitwise": report.params_bitwise_equal,
            "observed": report.observed_contract, "max_diff": report.params_max_abs_diff,
            "first_divergence": report.first_divergence, "kills": report.faults_delivered}


def main(argv: Sequence[str] | None = None) -> None:
    args = cli(__doc__.splitlines()[0], argv)
    clock = Stopwatch()
    updates, kills = (9, 2) if args.quick else (24, 4)
    rows = []
    with work_folder("grad-sync") as folder:
        for world in ((2,) if args.quick else (2, 3)):
            for sync in SYNCS:
                t = Stopwatch()
                row = verify_one(folder, sync, world, updates, kills)
                row["verify_seconds"] = t.seconds
                rows.append(row)
                print(json.dumps(row, default=str), flush=True)
    table = Table("restarts under each gradient sync (verify, a fixed world of N gloo ranks on local Ray)",
                  ["sync", "ranks", "verdict", "bitwise", "max abs Δparam", "first divergence", "faults",
                   "verify seconds"])
    for r in rows:
        d = r["first_divergence"]
        table.add(r["sync"], str(r["world"]), r["verdict"], str(r["bitwise"]), f"{r['max_diff']:.3g}",
                  "-" if d is None else f"update {d['update']} ({d['what']})", str(r["kills"]),
                  f"{r['verify_seconds']:.0f}")
    held = {(r["sync"], r["world"]): r["bitwise"] for r in rows}
    verdicts = [f"{s}: bitwise after restarts at " + ", ".join(
        f"{w} ranks {'yes' if held[(s, w)] else 'NO'}" for (s2, w) in held if s2 == s) for s in SYNCS]
    Section("5-grad-sync", "5. Gradient sync: flat all-reduce or DDP", __doc__.split("\n\n")[2], [table],
            verdicts, clock.seconds, {"rows": rows}, clock.measured).emit(args.out)


if __name__ == "__main__":
    main()
