"""Where one spotrun update's time goes: cProfile around a rank's loop, and the per-update collectives.

:func:`profile_updates` trains a job in this process (world size 1, no Ray, the default SQLite
sink, no checkpoint in the run but the last) under ``cProfile`` and attributes each update's time
to the loop's parts by the cumulative time of the functions that do them. cProfile slows the
Python-heavy parts more than the torch kernels, so the shares are what to read, not the totals.
:func:`collective_cost` times the per-update small collectives of two gloo ranks: the loss mean
and the boundary flags as two all-reduces (before) or one (now).
"""

from __future__ import annotations

import cProfile
import json
import pstats
import time
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

from bench.plain_ddp import free_port
from bench.tables import ROOT

# part -> the functions whose cumulative time it is ((file suffix, function name); the first found counts)
PARTS: dict[str, list[tuple[str, str]]] = {
    "next batch from the loader": [("trainer/run/session.py", "_counting")],
    "forward (the job's step)": [("trainer/run/loop.py", "forward")],
    "backward": [("torch/_tensor.py", "backward")],
    "sync, clip, optimizer and scheduler step": [("trainer/run/loop.py", "_step")],
    "seeding the global streams per microstep": [("trainer/state/rng.py", "seed_all")],
    "loss mean and boundary flags (collective)": [("trainer/runtime/collective.py", "mean_and_agree"),
                                                  ("trainer/runtime/collective.py", "mean")],
    "metric points: build": [("trainer/metrics/points.py", "points_of")],
    "metric points: write (training thread)": [("trainer/metrics/writer.py", "write"),
                                               ("trainer/metrics/sinks.py", "write")],
}
TOTAL = ("trainer/run/rank.py", "run")


def _cumulative(stats: pstats.Stats, suffix: str, name: str) -> float | None:
    found = [v[3] for (file, _, func), v in stats.stats.items()  # type: ignore[attr-defined]
             if func == name and file.endswith(suffix)]
    return max(found) if found else None


def profile_updates(config: str, sets: list[str], updates: int, folder: Path) -> dict[str, float]:
    """Milliseconds per update of each part (and ``total``), under cProfile."""
    from spotrun.orchestrator.control.launch import run_in_process
    from spotrun.orchestrator.control.specfile import load_spec
    from spotrun.trainer.run import rank

    spec = load_spec(ROOT / config, [*sets, f"storage=file://{folder}", f"train.updates={updates}",
                                     f"checkpoint.every_updates={updates + 1}"], "profile")
    profiler = cProfile.Profile()
    run = rank.RankRunner.run

    def profiled(self: rank.RankRunner) -> str:
        profiler.enable()
        try:
            return run(self)
        finally:
            profiler.disable()

    rank.RankRunner.run = profiled  # type: ignore[method-assign]
    try:
        outcome = run_in_process(spec)
    finally:
        rank.RankRunner.run = run  # type: ignore[method-assign]
    if outcome.state != "finished":
        raise RuntimeError(f"the profiled job ended {outcome.state}: {outcome.reason}")
    stats = pstats.Stats(profiler)
    out = {"total": 1e3 * (_cumulative(stats, *TOTAL) or float("nan")) / updates}
    for part, candidates in PARTS.items():
        seconds = next((s for s in (_cumulative(stats, *c) for c in candidates) if s is not None), 0.0)
        out[part] = 1e3 * seconds / updates
    return out


def _collectives(rank: int, port: int, n: int, out: str) -> None:
    import torch

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    times = {}
    for label, tensors in (("two", 2), ("one", 1)):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            for _ in range(tensors):
                dist.all_reduce(torch.tensor([1.0, 2.0, 0.0], dtype=torch.float64))
        times[label] = (time.perf_counter() - t0) / n
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


def collective_cost(n: int, folder: Path) -> dict[str, float]:
    """Milliseconds per update of the small collectives between two gloo ranks: two all-reduces or one."""
    out = folder / "collectives.json"
    mp.spawn(_collectives, args=(free_port(), n, str(out)), nprocs=2, join=True)
    return {k: 1e3 * v for k, v in json.loads(out.read_text()).items()}
