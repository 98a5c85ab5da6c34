"""Bench 16 — a long storage outage mid-run: the job trains through it and publishes again once storage answers.

A 2-rank tiny job on a local Ray keeps everything on a real S3-compatible server (moto: bundles, ledger,
offsets, metric points through the s3 sink), reached through a proxy. Once the job has published a few
bundles the proxy answers every request ``503 SlowDown`` for the outage's length (10 minutes,
``--minutes``), then forwards again; a while later a stop notice to the driver ends the run (an
emergency bundle, then the end). Measured: the updates trained during the outage and the updates at
risk at its end (trained since the newest published bundle: what a loss then would have cost), the
requests refused, the memory the driver and the ranks held more at the outage's end than at its start
(resident set size: every buffered event, point, log line and bundle write is in it), the driver's
ledger backlog, and the time from storage's return to the first bundle published after it.

    python -m bench.storage_outage [--minutes 10]
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.moto import local_s3
from bench.tables import ROOT, Section, Stopwatch, Table, cli_minutes, fmt, mib, work_folder
from spotrun.orchestrator.control.launch import check_entrypoint, ensure_ray, ray_platform
from spotrun.orchestrator.control.platform import Options
from spotrun.orchestrator.control.progress import NullProgress
from spotrun.orchestrator.control.specfile import load_spec
from spotrun.orchestrator.control.supervisor import Supervisor
from spotrun.orchestrator.ledger.events import AttemptStarted, BundlePublished, JobFailed
from spotrun.orchestrator.ledger.store import Ledger
from spotrun.orchestrator.notices.notice import Notice
from spotrun.trainer.observe.trace import UpdateRecord
from spotrun.trainer.run.context import Instrumentation
from spotrun.trainer.storage import open_storage
from tests.helpers.s3 import FaultProxy

SETS = ("world.size=2", "train.updates=1000000", "checkpoint.every_updates=8", "data.workers=1",
        "metrics.sinks=[s3]")
WARMUP_BUNDLES = 3  # published before the outage begins
LOOK_S = 0.05  # how often the bench looks at the ledger (a bench measures; a test never waits on time)
AFTER_S = 20.0  # trained after storage returns, before the stop notice


@dataclass
class Watched:
    """What the driver saw, by wall time: rank 0's furthest update."""

    updates: list[tuple[float, int]] = field(default_factory=list)

    def at(self, t: float) -> int:
        return max((u for when, u in self.updates if when <= t), default=0)


class Recording(NullProgress):
    def __init__(self, watched: Watched) -> None:
        self.watched = watched

    def updates(self, records: Sequence[UpdateRecord], world_size: int) -> None:
        if records:
            self.watched.updates.append((time.time(), records[-1].update))


def rss_bytes(pid: int) -> int:
    """A process's resident set size (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return 0
    return kb * 1024


def outage_run(minutes: float) -> dict[str, Any]:
    moto = local_s3()
    try:
        return _outage_run(moto, minutes)
    finally:
        moto.stop()


def _outage_run(moto: Any, minutes: float) -> dict[str, Any]:
    with FaultProxy(moto.url, rate=0.0) as proxy, work_folder("storage-outage") as folder:
        bucket = moto.new_bucket()
        client = moto.client()
        for shard in sorted((ROOT / "configs/data/tiny").glob("*.jsonl")):
            client.put_object(Bucket=bucket, Key=f"corpus/{shard.name}", Body=shard.read_bytes())
        spec = load_spec(ROOT / "configs/tiny.yaml", [
            f"storage=s3://{bucket}/spot", f"storage_endpoint_url={proxy.url}", f"data.shards=s3://{bucket}/corpus",
            f"metrics.local_dir={folder / 'metrics'}", *SETS], "outage")
        direct = Ledger(open_storage(spec.storage, moto.url), "outage")  # the bench's view, past the proxy
        check_entrypoint(spec)
        ensure_ray(spec, None)
        watched = Watched()
        sup = Supervisor(spec, ray_platform(spec, Instrumentation.of()), Options(progress=Recording(watched)))
        result: dict[str, Any] = {}
        thread = threading.Thread(target=lambda: result.setdefault("outcome", sup.run()), daemon=True)
        thread.start()

        def published() -> list[BundlePublished]:
            return [e for e in direct.read() if isinstance(e, BundlePublished)]

        while len(published()) < WARMUP_BUNDLES:
            if not thread.is_alive() or any(isinstance(e, JobFailed) for e in direct.read()):
                raise RuntimeError("the job ended before the outage began")
            time.sleep(LOOK_S)
        before = published()
        pids = [os.getpid(), *next(e for e in direct.read() if isinstance(e, AttemptStarted)).rank_pids]
        rss_before = {pid: rss_bytes(pid) for pid in pids}
        refused_before = proxy.injected["503"]
        began = time.time()
        proxy.outage(minutes * 60, "503")
        backlog_max = 0
        while time.time() - began < minutes * 60:
            backlog_max = max(backlog_max, sup.ctx.ledger.pending)
            time.sleep(min(1.0, minutes * 60 - (time.time() - began)))
        proxy.end_outage()
        ended = time.time()
        rss_after = {pid: rss_bytes(pid) for pid in pids}
        refused = proxy.injected["503"] - refused_before
        while not [e for e in published() if e.at.timestamp() > ended]:
            time.sleep(LOOK_S)
        first_after = min(e.at.timestamp() for e in published() if e.at.timestamp() > ended)
        time.sleep(AFTER_S)  # training on, publishing again, before the stop
        sup.notify(Notice(source="sigterm", node_id=None, deadline=None, detail="the bench's run is over"))
        thread.join(timeout=300)
        outcome = result.get("outcome")
        newest = max(e.update for e in before)
        at_begin, at_end = watched.at(began), watched.at(ended)
        return {"minutes": minutes, "outage_s": ended - began, "state": outcome.state if outcome else "?",
                "restarts": outcome.restarts if outcome else None, "update_at_begin": at_begin,
                "update_at_end": at_end, "trained_during": at_end - at_begin,
                "newest_bundle_update": newest, "at_risk_at_end": at_end - newest, "refused": refused,
                "rss_growth": {("driver" if pid == os.getpid() else f"rank {i - 1}"): rss_after[pid] - rss_before[pid]
                               for i, pid in enumerate(pids)},
                "ledger_backlog_max": backlog_max, "return_to_bundle_s": first_after - ended,
                "published_total": len(published())}


def tables(r: dict[str, Any]) -> tuple[list[Table], list[str]]:
    t = Table(f"A 2-rank job on S3 (moto) through {fmt(r['outage_s'] / 60)} min of 503 SlowDown to every request",
              ["measure", "value"])
    t.add("updates trained during the outage", r["trained_during"])
    t.add("newest published bundle while it lasted (update)", r["newest_bundle_update"])
    t.add("updates at risk at its end (trained since that bundle)", r["at_risk_at_end"])
    t.add("requests refused", r["refused"])
    t.add("largest ledger backlog in the driver (events)", r["ledger_backlog_max"])
    for who, grew in r["rss_growth"].items():
        t.add(f"resident memory grown over the outage: {who}", mib(grew))
    t.add("storage's return to the first bundle published (s)", r["return_to_bundle_s"])
    t.add("job's end", f"{r['state']} (a stop notice {AFTER_S:g} s after the first bundle), {r['restarts']} restarts")
    ok = r["state"] == "stopped" and r["restarts"] == 0 and r["trained_during"] > 0
    verdict = (f"a {fmt(r['outage_s'] / 60)}-minute storage outage costs checkpoints, never the job: "
               f"**{'MET' if ok else 'NOT MET'}** ({r['trained_during']:,} updates trained during it, "
               f"{r['at_risk_at_end']:,} at risk at its end, first bundle {fmt(r['return_to_bundle_s'])} s after "
               f"storage returned, {r['restarts']} restarts)")
    return [t], [verdict]


def main(argv: Sequence[str] | None = None) -> None:
    args, minutes = cli_minutes(__doc__.splitlines()[0], argv, 10.0, "how long storage refuses every request")
    clock = Stopwatch()
    r = outage_run(minutes)
    tabs, verdicts = tables(r)
    Section("16-storage-outage", "16. A long storage outage mid-run", __doc__.split("\n", 2)[2]
            .split("\n\n    python")[0], tabs, verdicts, clock.seconds, r, clock.measured).emit(args.out)
    if r["state"] != "stopped":
        sys.exit(1)


if __name__ == "__main__":
    main()
