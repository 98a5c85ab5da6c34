"""Bench 12 — what knowing the data by content and seeding the global generators per occurrence cost.

1. The data fingerprint a ``MapData`` without ``version=`` gets at every rank's start (and in the
   driver before a continuation): ``dataset[i]`` for 64 records, each digested. Three datasets:
   scikit-learn's digits in memory (examples/digits), a table of 100,000 rows in memory, and a
   folder of 2,000 ``.npy`` files read one per record (a disk read per ``dataset[i]``). Baseline: the
   time of one update of the digits example, measured in the same process.
2. Per-occurrence seeding of the global generators (Python's ``random``, NumPy's, torch's CPU
   generator) in the data path: the µs it adds per occurrence (in a prefetch worker) and per
   micro-batch (in the rank's own process, where the rank's streams are saved and given back),
   timed in a loop; and end to end, the digits example (one prefetch worker) with the seeding on and
   off, interleaved, ``reps`` rounds: updates/s from the rank's own metric points.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.tables import ROOT, Section, Stopwatch, Table, cli, fmt, median, pct, ratio, work_folder
from spotrun.orchestrator.control.launch import run_in_process
from spotrun.orchestrator.control.specfile import load_spec
from spotrun.trainer.data import feed as feed_module
from spotrun.trainer.data.identity import SPREAD, map_fingerprint
from spotrun.trainer.data.transform import OccurrenceStreams
from spotrun.trainer.metrics import SqliteSink, metrics_dir

DIGITS = "examples/digits/digits.yaml"


class Table2D:
    def __init__(self, rows: int, width: int) -> None:
        self.x = torch.randn(rows, width, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.x[i], i % 10


class NpyFolder:
    def __init__(self, folder: Path, files: int) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(0)
        self.paths = []
        for i in range(files):
            path = folder / f"{i:05d}.npy"
            np.save(path, rng.standard_normal((3, 32, 32)).astype(np.float32))
            self.paths.append(path)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> np.ndarray:
        return np.load(self.paths[i])


def timed(fn: Any, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def digits_run(root: Path, tag: str, updates: int, seed_globals: bool) -> float:
    """Updates/s of the digits example (one rank, one prefetch worker) between update 5 and the last."""
    job_id = f"digits-{tag}"
    spec = load_spec(ROOT / DIGITS, [f"storage=file://{root}", "world.size=1", f"train.updates={updates}",
                                     f"checkpoint.every_updates={updates + 1}"], job_id)
    saved = feed_module.MapFeed.seed_globals
    feed_module.MapFeed.seed_globals = seed_globals
    try:
        outcome = run_in_process(spec)
    finally:
        feed_module.MapFeed.seed_globals = saved
    if outcome.state != "finished":
        raise RuntimeError(f"{job_id} ended {outcome.state}: {outcome.reason}")
    sink = SqliteSink(metrics_dir(spec.storage, job_id, spec.metrics.local_dir) / "metrics.sqlite")
    at = {p.update: p.at.timestamp() for p in sink.read(job_id) if p.name == "loss"}
    sink.close()
    return (updates - 5) / (at[updates] - at[5])


def spread3(xs: Sequence[float], scale: float = 1.0) -> str:
    return f"{fmt(min(xs) * scale)} / {fmt(median(xs) * scale)} / {fmt(max(xs) * scale)}"


def run(quick: bool, folder: Path) -> dict[str, Any]:
    import sys

    sys.path.insert(0, str(ROOT))  # the digits example is imported from the repository, as run does
    from examples.digits.job import Digits

    reps = 2 if quick else 5
    updates = 12 if quick else 60
    rounds = 1 if quick else 3
    results: dict[str, Any] = {"reps": reps, "updates": updates, "rounds": rounds, "runs": {"on": [], "off": []}}
    for r in range(rounds):  # interleaved: drift in the machine's load hits both alike
        for variant in ("on", "off"):
            results["runs"][variant].append(digits_run(folder / f"{variant}{r}", f"{variant}{r}", updates,
                                                       variant == "on"))
    update_s = 1 / median(results["runs"]["off"])
    datasets = {"digits (1,437 images 1×8×8, in memory)": Digits(),
                "table (100,000 rows × 64 floats, in memory)": Table2D(100_000, 64),
                "npy folder (2,000 files of 3×32×32 floats, one read per record)":
                    NpyFolder(folder / "npy", 200 if quick else 2000)}
    results["fingerprint_s"] = {name: timed(lambda d=d: map_fingerprint(d, 0), reps) for name, d in datasets.items()}
    results["update_s"] = update_s
    n = 2000 if quick else 20000
    streams = OccurrenceStreams(0)

    def seed_each() -> None:
        for i in range(n):
            streams.seed(0, i)

    def fork_each() -> None:
        for _ in range(n // 10):
            with OccurrenceStreams(0):
                pass

    results["seed_us"] = [s / n * 1e6 for s in timed(seed_each, reps)]
    results["fork_us"] = [s / (n // 10) * 1e6 for s in timed(fork_each, reps)]
    return results


def tables(r: dict[str, Any]) -> tuple[list[Table], dict[str, Any]]:
    update_ms = r["update_s"] * 1e3
    t1 = Table(f"The data fingerprint at start ({SPREAD} records read and digested), against one update",
               ["dataset", "ms (min / median / max)", "median, in updates of the digits example"])
    for name, xs in r["fingerprint_s"].items():
        t1.add(name, spread3(xs, 1e3), fmt(median(xs) / r["update_s"]))
    t1.notes.append(f"one update of the digits example (1 rank, 64 images, one prefetch worker): {fmt(update_ms)} ms "
                    "(the median of the seeding-off runs below); the fingerprint is taken once per rank start, and "
                    "in the driver before a continuation; a dataset with version= takes none")
    on, off = r["runs"]["on"], r["runs"]["off"]
    ratios = [ratio(a, b) for a, b in zip(on, off, strict=True)]
    t2 = Table("Seeding the global generators per occurrence: cost per occurrence and end to end",
               ["measure", "value (min / median / max)", "median, share of an update"])
    per_update = 64  # the digits example's occurrences per update
    t2.add("µs per occurrence (seeding Python, NumPy and torch CPU)", spread3(r["seed_us"]),
           pct(median(r["seed_us"]) * 1e-6 * per_update / r["update_s"]))
    t2.add("µs per micro-batch in the rank's own process (the rank's streams saved and given back)",
           spread3(r["fork_us"]), pct(median(r["fork_us"]) * 1e-6 * 2 / r["update_s"]))
    t2.add("digits example, updates/s with seeding on / off", f"{pct(min(ratios))} / {pct(median(ratios))} / "
           f"{pct(max(ratios))}", "—")
    t2.notes += [f"share of an update: per occurrence × {per_update} occurrences (or × 2 micro-batches) over one "
                 "update's time; in a prefetch worker the seeding runs beside training, so the end-to-end row is "
                 "what the rank sees",
                 f"end to end: {r['rounds']} rounds of {r['updates']} updates each way, interleaved; updates/s from "
                 "the rank's metric points between update 5 and the last"]
    summary = {"fingerprint_ms_median": {k: median(v) * 1e3 for k, v in r["fingerprint_s"].items()},
               "seed_us_median": median(r["seed_us"]), "fork_us_median": median(r["fork_us"]),
               "end_to_end_ratio_median": median(ratios), "update_ms": update_ms}
    return [t1, t2], summary


INTRO = """What the content identity of a `MapData` and the per-occurrence seeding of the global
generators (loop convention 2) cost. The fingerprint is timed directly on three datasets; the seeding
in a loop, and end to end on the digits example (`examples/digits`, one rank in this process, one
prefetch worker) with the seeding switched off for comparison, in the same process."""


def main(argv: Sequence[str] | None = None) -> None:
    args = cli(__doc__.splitlines()[0], argv)
    clock = Stopwatch()
    with work_folder("identity") as folder:
        results = run(args.quick, folder)
    tabs, summary = tables(results)
    Section("12-data-identity", "12. Data identity and per-occurrence seeding: what they cost", INTRO, tabs, [],
            clock.seconds, {"results": results, "summary": summary}, clock.measured).emit(args.out)


if __name__ == "__main__":
    main()
