"""Bench 9 — sharded bundles (``train.parallelism: fsdp``) against rank 0 writing everything (ddp), at 2 ranks.

Two gloo ranks (two processes) each build a real ``TrainSession`` over the synthetic model at about
100 MB and 1 GB of training state (parameters, EMA, AdamW's two moments), once replicated (ddp:
rank 0 captures and writes the model, EMA and optimizer; rank 1 only its own small files) and once
sharded (fsdp: each rank captures and writes its own rows of them). Each repetition, interleaved
between the two: the ranks meet, each takes a capture (the stall at the boundary; then its deferred
copies landing, which overlap the next update in a job), meet again, and each hands its capture to
a ``BundleWriter`` on the same local disk. The bundle write is the time from that common start
until the last rank's files are written and hashed (what publishing waits for). Both layouts hold
the same state: the bytes are the same, split differently. Medians of the repetitions, min–max
beside them; ratios fsdp / ddp measured in this one run.

``--json`` prints, as the last line, ``{"sizes": [{"state_bytes", "write_fsdp_over_ddp",
"stall_fsdp_over_ddp"}, ...]}``.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

from bench.checkpoint_stall import Size
from bench.synthetic import synthetic_session
from bench.tables import Section, Stopwatch, Table, cli, median, mib, ratio, work_folder
from spotrun.trainer.bundle.bundles import BundleWriter
from spotrun.trainer.observe.faults import FaultInjector
from spotrun.trainer.run.session import TrainSession
from spotrun.trainer.storage import LocalStorage

WORLD = 2
MODES = ("ddp", "fsdp")


FULL = (Size("~100 MB", 1024, 100e6, 9, False), Size("~1 GB", 2048, 1e9, 5, False))  # bench 1's sizes, no S3
QUICK = (Size("~1 MB", 128, 1e6, 2, False),)


def session_for(size: Size, mode: str, root: Path, rank: int) -> TrainSession:
    """A rank's real session over the synthetic model, its AdamW moments allocated (as past update 1)."""
    return synthetic_session(size.n_embd, size.state_bytes, root, f"shard-{mode}", f"train.parallelism={mode}",
                             f"world.size={WORLD}", "data.workers=0", rank=rank, world_size=WORLD)


def one_checkpoint(session: TrainSession, storage: LocalStorage, writer: BundleWriter) -> list[float]:
    """This rank's [stall at the boundary, capture with its deferred copies, write start -> this rank done,
    bytes written], the ranks meeting before the capture and before the write."""
    dist.barrier()
    t0 = time.perf_counter()
    cap = session.capture()
    stall = time.perf_counter() - t0
    cap.wait()
    copies = time.perf_counter() - t0
    key = f"bench/bundles/{uuid.uuid4().hex}"
    dist.barrier()
    t1 = time.perf_counter()
    writer.submit(cap, key)
    result = writer.wait()
    written = time.perf_counter() - t1
    assert result is not None
    dist.barrier()
    storage.delete_prefix(key)
    return [stall, copies, written, float(sum(f.bytes for f in result.files))]


def rank_main(rank: int, port: int, sizes: Sequence[Size], root: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    storage = LocalStorage(root)
    writer = BundleWriter(storage, FaultInjector((), 1, rank))
    results: dict[str, dict[str, list[list[float]]]] = {}
    try:
        for size in sizes:
            sessions = {mode: session_for(size, mode, Path(root), rank) for mode in MODES}
            runs: dict[str, list[list[float]]] = {mode: [] for mode in MODES}
            for rep in range(size.reps):
                for mode in (MODES if rep % 2 == 0 else MODES[::-1]):  # interleaved, the order alternating
                    mine = one_checkpoint(sessions[mode], storage, writer)
                    every: list[list[float] | None] = [None] * WORLD
                    dist.all_gather_object(every, mine)
                    runs[mode].append([v for r in every if r is not None for v in r])  # rank 0's, then rank 1's
            for s in sessions.values():
                s.close()
            del sessions
            results[size.label] = runs
    finally:
        writer.close()
        dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(results))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def span(xs: Sequence[float], digits: str = ".3g") -> str:
    return f"{median(xs):{digits}} ({min(xs):{digits}}–{max(xs):{digits}})"


def main(argv: Sequence[str] | None = None) -> None:
    args = cli(__doc__.splitlines()[0], argv, json_summary=True)
    clock = Stopwatch()
    sizes = QUICK if args.quick else FULL
    with work_folder("sharded") as root:
        out = root / "results.json"
        mp.spawn(rank_main, args=(free_port(), sizes, str(root), str(out)), nprocs=WORLD, join=True)
        results = json.loads(out.read_text())
    table = Table("Sharded (fsdp) against rank-0-writes-all (ddp) bundles of the same state, 2 gloo ranks, one disk",
                  ["state", "layout", "reps", "rank 0 / rank 1 bytes", "stall s (slower rank)",
                   "capture + copies s (slower rank)", "bundle write s", "bundle MB/s"])
    summary, verdict = [], []
    for size in sizes:
        runs = results[size.label]
        per: dict[str, dict[str, list[float]]] = {}
        for mode in MODES:
            rows = runs[mode]  # each: rank 0's 4 figures, then rank 1's
            stall = [max(r[0], r[4]) for r in rows]
            copies = [max(r[1], r[5]) for r in rows]
            write = [max(r[2], r[6]) for r in rows]
            nbytes = rows[0][3] + rows[0][7]
            per[mode] = {"stall": stall, "write": write}
            table.add(size.label, mode, str(len(rows)), f"{mib(rows[0][3])} / {mib(rows[0][7])}", span(stall),
                      span(copies), span(write), f"{nbytes / median(write) / 1e6:,.0f}")
        w = ratio(median(per["fsdp"]["write"]), median(per["ddp"]["write"]))
        s = ratio(median(per["fsdp"]["stall"]), median(per["ddp"]["stall"]))
        table.add(size.label, "fsdp / ddp", "", "", f"{s:.2f}×", "", f"{w:.2f}×", "")
        summary.append({"state_bytes": size.state_bytes, "write_fsdp_over_ddp": w, "stall_fsdp_over_ddp": s})
        verdict.append(f"{size.label}: write {w:.2f}×, stall {s:.2f}×")
    table.notes.append("stall = what the loop waits for at the boundary (the larger of the two ranks'); capture + "
                       "copies = until the deferred copies of parameters, EMA and moments landed (in a job they "
                       "overlap the next update's forward and backward); bundle write = from the ranks' common "
                       "start until the slower rank's files are written and hashed; ranges are min–max")
    Section("9-sharded-bundles", "9. Sharded bundles against rank 0 writing all", __doc__.split("\n\n")[1],
            [table], ["sharded bundle at 2 ranks against rank 0 writing all, fsdp / ddp (medians): "
                      + "; ".join(verdict)], clock.seconds, {"sizes": summary}, clock.measured).emit(args.out)
    if getattr(args, "json", False):
        print(json.dumps({"sizes": summary}))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
