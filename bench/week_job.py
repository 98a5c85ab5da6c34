"""A week-sized job written into storage, small but real: what a dashboard over such a job reads.

The ledger is :func:`bench.ledger_week.week`'s events (a bundle every ``every_updates`` updates,
each restart losing 7 updates past the bundle it restores), appended through the real
:class:`~spotrun.orchestrator.ledger.store.Ledger`, then ``job_finished``. Each published bundle gets
its ``manifest.json`` (a real manifest, copied from ``template`` with this bundle's job, name, attempt,
update and world size; its rank files are listed, not written: nothing here reads them). The loss
goes to the job's SQLite sink (one point per update, the last write) and its JSONL log (every write
in order: an attempt writes from the update after the bundle it restored to the update it reached,
so each restart's lost updates are written twice, the first write replaced).

Used by ``bench/week_page.py`` and by the dashboard's week-scale test; nothing is random but the
loss's noise, drawn from its own seeded generator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np

from bench.ledger_week import EVERY_S, week
from spotrun.orchestrator.ledger.events import AttemptStarted, BundlePublished, JobFinished, Restored, WorkerLost
from spotrun.orchestrator.ledger.store import Ledger
from spotrun.trainer.bundle.manifest import Manifest
from spotrun.trainer.metrics import JsonlSink, MetricPoint, SqliteSink
from spotrun.trainer.storage import LocalStorage

LINEAGE = "week"  # the lineage id week() stamps on every attempt


@dataclass(frozen=True)
class WeekJob:
    """What was written: the job's size, and each restart as ``(attempt, restored update, last update
    the lost attempt reached)``: the points a chart of it must keep."""

    job: str
    updates: int
    bundles: int
    restarts: list[tuple[int, int, int]]
    replaced_writes: int


def manifest_for(template: Manifest, key: str, update: int, attempt: int, world: int) -> Manifest:
    """``template`` as bundle ``key`` of ``world`` ranks: its rank-0 files listed again for every rank."""
    doc = template.model_dump(mode="json")
    rank0 = [f for f in doc["files"] if f["path"].startswith("rank-0/")]
    files = [{**f, "path": f"rank-{r}/" + f["path"].split("/", 1)[1]} for r in range(world) for f in rank0]
    job, name = key.split("/bundles/")
    return Manifest.model_validate({**doc, "job_id": job, "bundle_id": name, "attempt": attempt,
                                    "world": {**doc["world"], "size": world}, "files": files,
                                    "counters": {**doc["counters"], "attempted_updates": update,
                                                 "applied_updates": update}})


def loss_values(updates: int, seed: int = 0) -> np.ndarray:
    """The loss at each update (index 0 unused): a decay to a floor, with seeded noise."""
    noise = np.random.default_rng(seed).normal(0.0, 0.04, updates + 1)
    u = np.arange(updates + 1)
    return 0.4 + 2.6 * np.exp(-u / max(1.0, updates / 6)) + noise


def write_week_job(storage: LocalStorage, job: str, updates: int, restarts: int, template: Manifest,
                   every_updates: int = 50) -> WeekJob:
    """Write a finished job of ``updates`` updates (a bundle every ``every_updates``) and ``restarts``
    restarts, four of them onto another world size, under ``job`` in ``storage``."""
    bundles = updates // every_updates
    if bundles <= restarts:
        raise ValueError(f"{restarts} restarts need more than {restarts} bundles (got {bundles}): "
                         f"lower every_updates or ask for more updates")
    events = list(week(bundles, restarts, min(4, restarts), job=job, every_updates=every_updates))
    ledger = Ledger(storage, job)
    worlds: dict[int, int] = {}
    spans: dict[int, list[Any]] = {}  # attempt -> [first update, last update, started at]
    lost: list[tuple[int, int, int]] = []
    for e in events:
        ledger.append(e)
        if isinstance(e, AttemptStarted):
            worlds[e.attempt] = e.world_size
            spans[e.attempt] = [1, bundles * every_updates, e.at]
        elif isinstance(e, WorkerLost):
            spans[e.attempt][1] = e.last_update
        elif isinstance(e, Restored):
            spans[e.attempt][0] = e.update + 1
            lost.append((e.attempt, e.update, spans[e.attempt - 1][1]))
        elif isinstance(e, BundlePublished):
            m = manifest_for(template, e.bundle, e.update, e.attempt, worlds[e.attempt])
            storage.put(f"{e.bundle}/manifest.json", m.to_json())
    last = max(spans)
    ledger.append(JobFinished(attempt=last, counters={"attempted_updates": spans[last][1],
                                                      "applied_updates": spans[last][1]}))
    replaced = _write_loss(storage, job, spans, every_updates)
    return WeekJob(job, spans[last][1], bundles, lost, replaced)


def _write_loss(storage: LocalStorage, job: str, spans: dict[int, list[Any]], every_updates: int) -> int:
    """Each attempt's loss writes, in order, to the JSONL log; the last write of each update to SQLite.
    Returns how many writes a later attempt replaced."""
    values = loss_values(max(hi for _, hi, _ in spans.values()))
    per_update = timedelta(seconds=EVERY_S / every_updates)
    final: dict[int, MetricPoint] = {}
    folder = storage.root / job  # where a job on local storage keeps its sinks
    log = JsonlSink(folder / "metrics.jsonl")
    written = 0
    for attempt, (lo, hi, at) in sorted(spans.items()):
        points = [MetricPoint(job_id=job, update=u, name="loss", value=float(values[u]), attempt=attempt,
                              lineage_id=LINEAGE, at=at + per_update * (u - lo + 1)) for u in range(lo, hi + 1)]
        log.write(points)
        written += len(points)
        final.update((p.update, p) for p in points)
    sink = SqliteSink(folder / "metrics.sqlite")
    sink.write(final[u] for u in sorted(final))
    sink.close()
    return written - len(final)


def updates_label(updates: int) -> str:
    """``10^5`` for 100000: how the bench's table names a size."""
    power = round(math.log10(updates))
    return f"10^{power}" if 10 ** power == updates else f"{updates:,}"
