"""S3 requests of the metric sink and of a dashboard refresh, before and after segments.

    python -m bench.s3_metrics [--quick]

A metric history of the deploy spec's size (20,000 updates, 3 points each: loss, lr, applied;
a checkpoint every 200 updates) is written to a moto server twice: as the s3 sink wrote it before
(one object per point, one PUT per point on the training thread) and as it writes it now (one
JSONL segment per checkpoint interval, flushed at the checkpoint). Then the dashboard's job view
is refreshed over each: "before" reads as the dashboard did (list, then one GET per object, on
every refresh, so one refresh says it all; here the same reader with its cache emptied), "after"
three times with its ETag cache (the first refresh cold). Requests are counted on the boto3 clients themselves (every
request sent, retries included), so the figures are counts, not timings.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from bench.moto import local_s3
from bench.tables import Section, Stopwatch, Table, cli
from spotrun.orchestrator.dashboard.views import Reader
from spotrun.orchestrator.ledger.access import open_readonly
from spotrun.orchestrator.ledger.events import AttemptStarted
from spotrun.orchestrator.ledger.store import Ledger
from spotrun.trainer.metrics import S3Sink, points_of
from spotrun.trainer.storage.s3 import S3Storage

EVERY = 200  # the deploy spec's checkpoint.every_updates


def counting(storage: S3Storage) -> Counter:
    """Requests ``storage``'s client sends from now on, by operation."""
    seen: Counter = Counter()

    def count(event_name: str, **_: Any) -> None:
        seen[event_name.rsplit(".", 1)[-1]] += 1

    storage.s3.client.meta.events.register("before-send.s3", count)
    return seen


def values(u: int) -> dict[str, float]:
    return {"loss": 1 / u, "lr": 3e-4, "applied": 1.0}


def write_per_point(storage: S3Storage, job: str, updates: int) -> None:
    """The sink before segments: each point its own object, ``<job>/metrics/<update>/<name>.json``."""
    def put_update(u: int) -> None:
        for p in points_of(job, u, 1, "L", values(u)):
            storage.put(f"{job}/metrics/{u}/{p.name}.json", p.model_dump_json().encode())

    with ThreadPoolExecutor(8) as pool:  # the old sink also put an update's points in parallel
        list(pool.map(put_update, range(1, updates + 1)))


def write_segments(storage: S3Storage, job: str, updates: int) -> None:
    sink = S3Sink(storage)
    for u in range(1, updates + 1):
        sink.write(points_of(job, u, 1, "L", values(u)))
        if u % EVERY == 0:
            sink.flush()  # what the rank does at each checkpoint
    sink.close()


def refreshes(uri: str, endpoint: str, job: str, cached: bool, n: int = 3) -> list[dict[str, int]]:
    """Requests of ``n`` refreshes of the job view (the first one cold)."""
    storage = open_readonly(uri, endpoint)
    reader = Reader(storage)
    seen = counting(storage.inner)  # type: ignore[attr-defined]
    out = []
    for _ in range(n):
        if not cached:
            reader.objects = type(reader.objects)()  # the old reader kept nothing between refreshes
        seen.clear()
        points = len(reader.job(job)["loss"]["points"])
        out.append({"points": points, "requests": sum(seen.values()), "gets": seen["GetObject"],
                    "lists": seen["ListObjectsV2"]})
    return out


def main(argv: Sequence[str] | None = None) -> None:
    args = cli(__doc__.splitlines()[0], argv)
    clock = Stopwatch()
    updates = 400 if args.quick else 20_000
    rows: dict[str, dict[str, Any]] = {}
    with local_s3() as moto:
        for layout, write, cached in (("before: one object per point", write_per_point, False),
                                      ("after: one segment per checkpoint interval", write_segments, True)):
            bucket = moto.new_bucket()
            uri = f"s3://{bucket}/runs"
            writer = S3Storage(uri, moto.url)
            Ledger(writer, "j").append(AttemptStarted(attempt=1, world_size=1, pid=1, lineage_id="L"))
            sent = counting(writer)
            write(writer, "j", updates)
            puts = sent["PutObject"]
            rows[layout] = {"puts": puts, "refreshes": refreshes(uri, moto.url, "j", cached, 3 if cached else 1)}
            print(layout, rows[layout], flush=True)
    table = Table(f"a {updates:,}-update metric history (3 points per update, a checkpoint every {EVERY}) on moto",
                  ["layout", "PUTs per update", "1st refresh: requests (GETs)", "next refreshes: requests (GETs)",
                   "points read"])
    for layout, r in rows.items():
        first, later = r["refreshes"][0], r["refreshes"][1:]
        table.add(layout, r["puts"] / updates, f"{first['requests']:,} ({first['gets']:,})",
                  " / ".join(f"{x['requests']:,} ({x['gets']:,})" for x in later) or "the same: nothing is kept",
                  first["points"])
    table.notes.append("A refresh is the dashboard's job view (reader.job): ledger, bundles and metric points; "
                       "the ledger here is one event and there are no bundles, so nearly every request is the "
                       "metric sink's.")
    before, after = rows.values()
    Section(
        name="6-s3-metrics", title="6. S3 metric sink and dashboard refresh: requests",
        intro=__doc__.split("\n\n", 2)[2],
        tables=[table], verdicts=[
            f"PUTs per update: before {before['puts'] / updates:.3g}, after {after['puts'] / updates:.3g} "
            f"(at most 1 per {EVERY}-update checkpoint interval)",
            f"requests per refresh (warm): before {before['refreshes'][-1]['requests']:,}, "
            f"after {after['refreshes'][-1]['requests']:,}"],
        seconds=clock.seconds, data=rows, measured=clock.measured,
    ).emit(args.out)


if __name__ == "__main__":
    main()
