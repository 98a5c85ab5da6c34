"""A week of ledger on S3: requests and seconds of the readers, with the ledger folded and not.

    python -m bench.ledger_week [--quick]

A week on spot machines with a checkpoint every 30 s: 20,000 published bundles (each as the
supervisor records it: bundle_published, then offsets_committed), 150 restarts (preemptions and
failures, alternately: worker_lost, then attempt_started and restored), 4 of them onto another
world size (topology_changed), written through the real Ledger to a moto server twice: with
folding off (the ledger as it was: one object per event, and nothing else) and with the default
folding (segments of 100, 1,000 and 10,000 events). Then over each: `history` (the function behind
`spotrun history`, which reads with a new Ledger), a cold dashboard load (a new read-only storage
and Reader, as a new dashboard process has; its job view, `reader.job`, which `/api/jobs/{id}`
answers) and a warm refresh of that view after 3 more events (folding off, as the dashboard was
before it kept each job's Ledger: the ledger read again whole). Requests are counted on the reading
boto3 client with a botocore `before-send` hook: every HTTP request sent, retries included. The
job views also list the job's bundles and metric sink (none here): one request each.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from bench.moto import local_s3
from bench.s3_metrics import counting
from bench.tables import Section, Stopwatch, Table, cli, fmt, ratio
from spotrun.orchestrator.dashboard.views import Reader
from spotrun.orchestrator.ledger.access import open_readonly
from spotrun.orchestrator.ledger.events import (
    AttemptStarted,
    BundlePublished,
    Event,
    OffsetsCommitted,
    Restored,
    TopologyChanged,
    WorkerLost,
)
from spotrun.orchestrator.ledger.folding import DEFAULT_FOLD, FoldPolicy
from spotrun.orchestrator.ledger.history import history
from spotrun.orchestrator.ledger.store import Ledger
from spotrun.trainer.storage.s3 import S3Storage

JOB = "week"
EVERY_S = 30  # seconds between checkpoints
T0 = datetime(2026, 11, 23, tzinfo=UTC)


def week(bundles: int, restarts: int, resizes: int, tail: int = 0, *, job: str = JOB,
         every_updates: int = 10) -> Iterator[Event]:
    """The events of a week, in the order the supervisor appends them, stamped on a simulated clock;
    ``tail``: that many bundles more, without restarts (what a refresh finds new). A bundle every
    ``every_updates`` updates (at least 8: each loss is 7 updates past the bundle restored)."""
    at, attempt, world, update = T0, 1, 4, 0
    every = bundles // (restarts + 1)
    resize_at = set(range(1, restarts + 1, max(1, restarts // resizes))[:resizes]) if resizes else set()
    yield AttemptStarted(attempt=1, world_size=world, pid=100, lineage_id="week", at=at)
    for n in range(1, bundles + tail + 1):
        at, update = at + timedelta(seconds=EVERY_S), update + every_updates
        key = f"{job}/bundles/u{update:010d}-a{attempt}"
        yield BundlePublished(attempt=attempt, bundle=key, update=update, bytes=1 << 30, stall_seconds=0.2,
                              write_seconds=4.0, at=at)
        yield OffsetsCommitted(attempt=attempt, bundle=key, update=update, at=at)
        k = n // every
        if n % every or not 1 <= k <= restarts:
            continue
        cause = "node-lost" if k % 2 else "process-exit"  # a preemption, then a failure
        yield WorkerLost(attempt=attempt, rank=k % world, node_id=f"node-{k}", cause=cause,
                         last_update=update + 7, at=at + timedelta(seconds=25))
        before, world = world, (world - 1 if world > 2 else world + 1) if k in resize_at else world
        at, attempt = at + timedelta(seconds=90), attempt + 1
        yield AttemptStarted(attempt=attempt, world_size=world, pid=100 + attempt, lineage_id="week", at=at)
        yield Restored(attempt=attempt, bundle=key, update=update, recovery_label="exact" if world == before
                       else "exact-data", policy="elastic", restore_mode="snapshot", restore_seconds=6.0,
                       lost_updates=7, cause=cause, world_size_before=before, world_size_after=world,
                       at=at + timedelta(seconds=6))
        if world != before:
            yield TopologyChanged(attempt=attempt, world_size_before=before, world_size_after=world,
                                  accum_steps_after=2, at=at + timedelta(seconds=6))


def write(storage: S3Storage, events: Sequence[Event], fold: FoldPolicy | None) -> dict[str, Any]:
    """Append ``events`` through one Ledger, as the supervisor does: requests and seconds per event."""
    ledger = Ledger(storage, JOB, fold=fold)
    sent = counting(storage)
    t0 = time.perf_counter()
    for e in events:
        ledger.append(e)
    seconds = time.perf_counter() - t0
    objects = storage.list(f"{JOB}/events")
    return {"events": len(events), "seconds": seconds, "requests": dict(sent),
            "objects": len(objects), "segments": sum("/segments/" in k for k in objects)}


def measured(storage: S3Storage, read: Callable[[], dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Requests and seconds of ``read()`` over ``storage``, and what it returned."""
    sent = counting(storage)
    t0 = time.perf_counter()
    doc = read()
    return {"seconds": time.perf_counter() - t0, "requests": sum(sent.values()), "lists": sent["ListObjectsV2"],
            "gets": sent["GetObject"]}, doc


def reads(uri: str, endpoint: str, more: Sequence[Event], fold: FoldPolicy | None) -> tuple[dict, list]:
    """``history``, a cold dashboard load, then a warm refresh after ``more`` events are appended: the
    requests and seconds of each, and the history each one saw (the same before and after folding)."""
    cold = S3Storage(uri, endpoint)
    figures, docs = {}, []
    figures["history"], doc = measured(cold, lambda: history(cold, JOB))
    docs.append(doc.model_dump(mode="json"))  # as the dashboard holds it (below)
    dashboard = open_readonly(uri, endpoint)
    reader = Reader(dashboard)
    inner = dashboard.inner  # type: ignore[attr-defined]
    figures["cold dashboard"], doc = measured(inner, lambda: reader.job(JOB))
    docs.append(doc["history"])
    writer = Ledger(S3Storage(uri, endpoint), JOB, fold=fold)
    for e in more:
        writer.append(e)
    if fold is None:
        reader.ledgers.clear()  # the dashboard before folding kept nothing between refreshes
    figures["warm refresh"], doc = measured(inner, lambda: reader.job(JOB))
    docs.append(doc["history"])
    return figures, docs


def main(argv: Sequence[str] | None = None) -> None:
    args = cli(__doc__.splitlines()[0], argv)
    clock = Stopwatch()
    bundles, restarts, resizes = (200, 2, 1) if args.quick else (20_000, 150, 4)
    events = list(week(bundles, restarts, resizes))
    more = list(week(bundles, restarts, resizes, tail=2))[len(events):len(events) + 3]
    results: dict[str, dict[str, Any]] = {}
    seen = {}
    with local_s3() as moto:
        for layout, fold in (("before", None), ("after", DEFAULT_FOLD)):
            uri = f"s3://{moto.new_bucket()}/runs"
            written = write(S3Storage(uri, moto.url), events, fold)
            print(layout, "written", written, flush=True)
            figures, seen[layout] = reads(uri, moto.url, more, fold)
            results[layout] = {"write": written, "reads": figures}
            print(layout, figures, flush=True)
    if seen["before"] != seen["after"]:
        raise SystemExit("the folded ledger's history differs from the plain one's: a bug, not a figure")
    before, after = results["before"], results["after"]
    Section(
        name="10-ledger-week", title="10. A week of ledger on S3: what its readers pay",
        intro=__doc__.split("\n\n", 2)[2],
        tables=[read_table(before, after, len(events)), write_table(before, after)],
        verdicts=verdicts(before, after, len(events)),
        seconds=clock.seconds, data={"bundles": bundles, "restarts": restarts, "resizes": resizes, **results},
        measured=clock.measured,
    ).emit(args.out)


def read_table(before: dict[str, Any], after: dict[str, Any], n: int) -> Table:
    table = Table(f"reading a ledger of {n:,} events on moto: requests (LIST + GET) and seconds",
                  ["read", "before: requests", "after: requests", "requests: before / after",
                   "before: s", "after: s", "seconds: before / after"])
    for name in ("history", "cold dashboard", "warm refresh"):
        b, a = before["reads"][name], after["reads"][name]
        table.add(name, f"{b['requests']:,} ({b['lists']:,} + {b['gets']:,})",
                  f"{a['requests']:,} ({a['lists']:,} + {a['gets']:,})", ratio(b["requests"], a["requests"]),
                  b["seconds"], a["seconds"], ratio(b["seconds"], a["seconds"]))
    per_request = 1000 * before["reads"]["history"]["seconds"] / before["reads"]["history"]["requests"]
    table.notes += [
        "The machine was shared while this ran (other engineers' builds and tests ran at the same time): the "
        "request counts are exact, the seconds are context.",
        f"moto on the loopback took {per_request:.1f} ms a request here (before's history); S3 adds a network "
        "round trip to each, so the request counts are the figure that carries over.",
    ]
    return table


def verdicts(before: dict[str, Any], after: dict[str, Any], n: int) -> list[str]:
    def cost(name: str) -> str:
        b, a = before["reads"][name]["requests"], after["reads"][name]["requests"]
        return f"{a:,} requests instead of {b:,} ({fmt(ratio(b, a))}× fewer)"

    return [f"ledger of a simulated week on S3 ({n:,} events), folded: a cold `spotrun history` reads it in "
            f"{cost('history')}; a cold dashboard job view in {cost('cold dashboard')}",
            f"ledger, warm dashboard refresh after 3 new events: {cost('warm refresh')}"]


def write_table(before: dict[str, Any], after: dict[str, Any]) -> Table:
    table = Table("writing it (the supervisor's side): requests per event appended",
                  ["layout", "objects under events/", "PUT", "LIST", "GET", "DELETE (batches)", "ms per event"])
    for layout, r in (("before: one object per event", before), ("after: folded", after)):
        w = r["write"]
        w_req = Counter(w["requests"])
        per = w["events"]
        table.add(layout, f"{w['objects']:,} ({w['segments']} segments)", w_req["PutObject"] / per,
                  w_req["ListObjectsV2"] / per, w_req["GetObject"] / per, w_req["DeleteObjects"] / per,
                  1000 * w["seconds"] / per)
    table.notes.append("After each write a folding writer lists the segments (one request) to check that no segment "
                       "holds another event under its sequence number (a writer behind another one); at each "
                       "100th event it lists the ledger and folds one closed block (a PUT, a DeleteObjects, and a "
                       "GET per segment it merges).")
    return table


if __name__ == "__main__":
    main()
