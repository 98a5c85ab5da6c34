"""`spotrun history` of a week-sized job on S3, cold: requests and seconds, against the same job on local disk.

The job is :func:`bench.week_job.write_week_job`'s (10^6 updates, a bundle every 50: 20,000 bundles, 500
restarts), written on local storage, then copied object for object into a bucket of a moto server on the
loopback (its ledger as the ledger wrote it, folded; every bundle's manifest); its metric sinks stay on
local disk, under the ``--metrics-dir`` that `spotrun history` reads for a job on S3. Each run is cold: a
new storage client and ledger, nothing cached, as a new `spotrun history` process has. Three runs of the
function behind the command over S3 and over the local copy (the baseline: no requests), then the command
itself once as a new process over S3 (Python's start and imports included). Requests are counted on the
reading boto3 client (every HTTP request sent, retries included).

    python -m bench.week_history [--quick] [--out DIR]

``--quick``: 10^4 updates and 20 restarts.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.moto import local_s3
from bench.s3_metrics import counting
from bench.tables import ROOT, Section, Stopwatch, Table, cli, fmt, ratio, work_folder
from bench.week_job import updates_label, write_week_job
from bench.week_page import template
from spotrun.orchestrator.ledger.history import history
from spotrun.trainer.storage import LocalStorage
from spotrun.trainer.storage.s3 import S3Storage

JOB = "week"
RUNS = 3
SINKS = ("metrics.jsonl", "metrics.sqlite")


def upload(root: Path, client: Any, bucket: str, prefix: str) -> int:
    """Every file under ``root/JOB`` but the metric sinks, as an object of the same relative name under
    ``prefix``; how many."""
    files = [p for p in (root / JOB).rglob("*") if p.is_file() and p.name not in SINKS]

    def put(path: Path) -> None:
        client.put_object(Bucket=bucket, Key=f"{prefix}/{path.relative_to(root)}", Body=path.read_bytes())

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(put, files))
    return len(files)


def timed(read: Any, *args: Any, **kwargs: Any) -> tuple[float, Any]:
    t0 = time.perf_counter()
    doc = read(*args, **kwargs)
    return time.perf_counter() - t0, doc


def run(updates: int, restarts: int) -> dict[str, Any]:
    with work_folder("week-history") as folder, local_s3() as moto:
        root = folder / "runs"
        job = write_week_job(LocalStorage(root), JOB, updates, restarts, template(folder / "template"))
        metrics = folder / "metrics"
        (metrics / JOB).mkdir(parents=True)
        for name in SINKS:
            shutil.copy(root / JOB / name, metrics / JOB / name)
        bucket = moto.new_bucket()
        uri = f"s3://{bucket}/runs"
        t0 = time.perf_counter()
        objects = upload(root, moto.client(), bucket, "runs")
        print(f"{objects} objects uploaded in {time.perf_counter() - t0:.0f} s", flush=True)
        local, s3, docs = [], [], []
        for _ in range(RUNS):
            seconds, doc = timed(history, LocalStorage(root), JOB)
            local.append({"seconds": seconds})
            docs.append(doc.model_dump(mode="json"))
            storage = S3Storage(uri, moto.url)
            sent = counting(storage)
            seconds, doc = timed(history, storage, JOB, metrics_local_dir=str(metrics))
            s3.append({"seconds": seconds, "requests": sum(sent.values()), "lists": sent["ListObjectsV2"],
                       "gets": sent["GetObject"]})
            docs.append(doc.model_dump(mode="json"))
            print(json.dumps({"local": local[-1], "s3": s3[-1]}), flush=True)
        if any(d != docs[0] for d in docs):
            raise SystemExit("history over S3 differs from history over the local copy: a bug, not a figure")
        env = {**os.environ, "AWS_ENDPOINT_URL": moto.url}
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "spotrun", "history", JOB, "--storage", uri,
                               "--endpoint-url", moto.url, "--metrics-dir", str(metrics), "--json"],
                              cwd=ROOT, env=env, capture_output=True, text=True)
        command_s = time.perf_counter() - t0
        if done.returncode != 0:
            raise SystemExit(f"spotrun history failed:\n{done.stderr[-2000:]}")
        if json.loads(done.stdout) != docs[0]:
            raise SystemExit("`spotrun history --json` printed another history than the function returned")
        return {"updates": job.updates, "restarts": len(job.restarts), "bundles": job.bundles,
                "ledger_events": _events(root), "objects": objects,
                "local": local, "s3": s3, "command_s": command_s}


def _events(root: Path) -> int:
    from spotrun.orchestrator.ledger.store import Ledger

    return len(Ledger(LocalStorage(root), JOB, fold=None).read())


def spread(xs: list[float]) -> str:
    return f"{fmt(min(xs))} / {fmt(statistics.median(xs))} / {fmt(max(xs))}"


def table(r: dict[str, Any]) -> Table:
    t = Table(f"`spotrun history` of a finished job of {updates_label(r['updates'])} updates, {r['restarts']} "
              f"restarts, {r['bundles']:,} bundles ({r['ledger_events']:,} ledger events), cold, {RUNS} runs: "
              f"min / median / max", ["storage", "seconds", "requests (LIST + GET)", "seconds: S3 / local"])
    local = [x["seconds"] for x in r["local"]]
    s3 = [x["seconds"] for x in r["s3"]]
    requests = {(x["requests"], x["lists"], x["gets"]) for x in r["s3"]}
    t.add("local disk (the baseline)", spread(local), "0", "1")
    t.add("S3 (moto on the loopback)", spread(s3),
          " or ".join(f"{n:,} ({li} + {g})" for n, li, g in sorted(requests)),
          ratio(statistics.median(s3), statistics.median(local)))
    t.add("S3, `spotrun history --json` as a new process", fmt(r["command_s"]), "—", "—")
    t.notes.append("the new process's time includes Python's start and spotrun's imports (torch among them)")
    t.notes.append("the machine is shared: the request counts are exact, the seconds are context; on real S3 "
                   "each request adds a network round trip, so the request count is the figure that carries "
                   "over")
    return t


def verdicts(r: dict[str, Any]) -> list[str]:
    median = statistics.median(x["seconds"] for x in r["s3"])
    requests = max(x["requests"] for x in r["s3"])
    return [f"a cold `spotrun history` of a week's job ({updates_label(r['updates'])} updates, {r['restarts']} "
            f"restarts, {r['bundles']:,} bundles) on S3 within 5 s and 200 requests: "
            f"**{'MET' if median <= 5 and requests <= 200 else 'NOT MET'}** (median {fmt(median)} s, "
            f"{requests:,} requests)"]


def main(argv: Sequence[str] | None = None) -> None:
    args = cli(__doc__.splitlines()[0], argv)
    clock = Stopwatch()
    r = run(*((10_000, 20) if args.quick else (1_000_000, 500)))
    intro = __doc__.split("\n", 2)[2].split("\n\n    python")[0]
    Section("19-week-history", "19. `spotrun history` of a week's job on S3", intro, [table(r)], verdicts(r),
            clock.seconds, r, clock.measured).emit(args.out)


if __name__ == "__main__":
    main()
