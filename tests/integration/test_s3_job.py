"""A 2-rank job with its data, bundles, ledger, offsets and metrics all on a real S3-compatible
server (moto), killed twice; and the same job through a proxy that fails >= 10 % of requests."""

from __future__ import annotations

import os
import re
import signal

import pytest

from spotrun.orchestrator.control.launch import run_on_ray
from spotrun.orchestrator.ledger.events import (
    BundlePublished,
    CorruptEvent,
    JobFailed,
    JobFinished,
    OffsetsCommitted,
    Restored,
    StorageOutage,
    WorkerLost,
)
from spotrun.orchestrator.ledger.store import Ledger
from spotrun.orchestrator.publish.offsets import OffsetsStore
from spotrun.trainer.bundle.bundles import list_bundles, read_manifest
from spotrun.trainer.metrics import S3Sink
from spotrun.trainer.observe.faults import FaultLog
from spotrun.trainer.observe.ranklog import list_rank_logs, read_rank_log
from spotrun.trainer.observe.trace import first_divergence, latest_per_update, read_trace
from spotrun.trainer.storage import StoragePermanentError, open_storage
from tests.conftest import ROOT, make_spec
from tests.helpers.ray_local import local_ray
from tests.helpers.runs import Background, assert_exact_coverage
from tests.helpers.s3 import DUMMY_CREDENTIALS, FaultProxy, MotoServer

pytestmark = pytest.mark.slow
SETS = ("world.size=2", "train.updates=24", "checkpoint.every_updates=4", "data.workers=1",
        "model.dropout=0.1", "metrics.sinks=[s3]", "world.restart_backoff_s=0.1")
ENV = {**DUMMY_CREDENTIALS, "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}


@pytest.fixture(scope="module")
def moto():
    with MotoServer() as server:
        yield server


@pytest.fixture(scope="module", autouse=True)
def ray_for_module(moto):
    saved = {k: os.environ.get(k) for k in ENV}
    os.environ.update(ENV)  # the driver's S3 client reads these; the ranks get them via runtime_env
    with local_ray(env=ENV):
        yield
    for k, v in saved.items():
        os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def s3_spec(tmp_path, moto, endpoint, job, *extra):
    """Storage and data in a new bucket: the shards are uploaded under ``corpus/``."""
    bucket = moto.new_bucket()
    client = moto.client(aws_access_key_id=ENV["AWS_ACCESS_KEY_ID"], aws_secret_access_key=ENV["AWS_SECRET_ACCESS_KEY"])
    for shard in sorted((ROOT / "configs/data/tiny").glob("*.jsonl")):
        client.put_object(Bucket=bucket, Key=f"corpus/{shard.name}", Body=shard.read_bytes())
    return make_spec(tmp_path, *SETS, f"storage=s3://{bucket}/spot", f"storage_endpoint_url={endpoint}",
                     f"data.shards=s3://{bucket}/corpus", *extra, job_id=job)


@pytest.fixture(scope="module")
def reference(moto, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("s3ref")
    spec = s3_spec(tmp, moto, moto.url, "ref")
    run_on_ray(spec, trace_path=str(tmp / "ref.jsonl"), record_ids=True)
    sink = S3Sink(open_storage(spec.storage, spec.storage_endpoint_url))
    return read_trace(tmp / "ref.jsonl"), {(p.update, p.name): p.value for p in sink.read("ref")}


def check_like_reference(spec, trace, reference, endpoint):
    ref_trace, ref_points = reference
    storage = open_storage(spec.storage, endpoint)
    final = latest_per_update(read_trace(trace))
    assert sorted(final) == list(range(1, 25))
    assert first_divergence(ref_trace, list(final.values())) is None
    assert_exact_coverage(final, 120)
    points = S3Sink(storage).read(spec.job_id)
    assert len(points) == len({(p.update, p.name) for p in points}) == len(ref_points)
    assert {(p.update, p.name): p.value for p in points} == ref_points
    newest = next(r for r in list_bundles(storage, spec.job_id) if r.published)
    committed = OffsetsStore(storage, spec.job_id).latest()
    assert committed["update"] == 24
    assert committed["cursor"] == read_manifest(storage, newest.key).data.cursor.model_dump()
    return storage


def test_two_rank_job_on_s3_killed_twice(moto, reference, tmp_path):
    spec = s3_spec(tmp_path, moto, moto.url, "killed",
                   "faults=[{site: microstep, update: 7, microstep: 1, rank: 1, attempt: 1}, "
                   "{site: backward, update: 15, microstep: 0, rank: 0, attempt: 2}]")
    outcome = run_on_ray(spec, trace_path=str(tmp_path / "t.jsonl"), record_ids=True)
    assert outcome.restarts == 2
    storage = check_like_reference(spec, tmp_path / "t.jsonl", reference, moto.url)
    events = Ledger(storage, "killed").read()
    losses = {e.attempt: e for e in events if isinstance(e, WorkerLost)}
    assert [(e.attempt, e.rank) for e in losses.values()] == [(1, 1), (2, 0)]
    assert losses[1].last_update == 6 and losses[2].last_update == 14
    # Which bundle a restart finds depends on how far its S3 writes got; the count must match it.
    for r in (e for e in events if isinstance(e, Restored)):
        assert r.update % 4 == 0 and r.lost_updates == losses[r.attempt - 1].last_update - r.update


def test_same_job_through_a_failing_proxy_finishes_identically(moto, reference, tmp_path):
    with FaultProxy(moto.url, rate=0.12, seed=11) as proxy:
        spec = s3_spec(tmp_path, moto, proxy.url, "flaky")
        outcome = run_on_ray(spec, trace_path=str(tmp_path / "t.jsonl"), record_ids=True)
        injected = sum(proxy.injected.values())
    assert outcome.state == "finished" and injected > 0
    storage = check_like_reference(spec, tmp_path / "t.jsonl", reference, moto.url)  # the proxy is gone
    events = Ledger(storage, "flaky").read()
    finished = next(e for e in events if isinstance(e, JobFinished))
    assert finished.storage_retries > 0, "the retries must be counted in the ledger"
    assert max(e.storage_retries for e in events if isinstance(e, BundlePublished)) <= finished.storage_retries


@pytest.mark.parametrize("fault", ["503", "403", "reset"])
def test_a_storage_outage_mid_run_costs_checkpoints_never_the_job(moto, reference, tmp_path, fault, capfd):
    """Every request answered 503 SlowDown (or 403 AccessDenied, as while a credential is refreshed, or every
    connection reset) for 8 s, from the moment bundle 8's manifest is written: longer than any call's own
    retries (~5 s at most), so the ledger, the publisher, the ranks' bundle writes and the s3 metric sink all
    meet it. The job stays alive (a denial is believed only once it persisted storage_outage_s), publishes again once
    storage answers, and ends exactly like the uninterrupted run, every ledger event and every rank-log line
    written once and in order."""
    with FaultProxy(moto.url, rate=0.0) as proxy:
        began = proxy.outage(8.0, fault, after="/bundles/u0000000008-a1/manifest.json")
        spec = s3_spec(tmp_path, moto, proxy.url, "outage")
        outcome = run_on_ray(spec, trace_path=str(tmp_path / "t.jsonl"), record_ids=True)
        refused = proxy.injected[fault]
    assert began.is_set() and refused > 0, "the outage must have happened mid-run"
    assert outcome.state == "finished" and outcome.restarts == 0
    storage = check_like_reference(spec, tmp_path / "t.jsonl", reference, moto.url)
    events = Ledger(storage, "outage").read()
    assert not [e for e in events if isinstance(e, CorruptEvent)]
    assert [type(e).__name__ for e in events].count("AttemptStarted") == 1 and isinstance(events[-1], JobFinished)
    updates = [e.update for e in events if isinstance(e, BundlePublished)]
    assert updates == sorted(set(updates)) and updates[:2] == [4, 8] and updates[-1] == 24  # once each, in order
    offsets = [e.update for e in events if isinstance(e, OffsetsCommitted)]
    assert offsets == updates  # each bundle's offsets after it, none lost
    held: list[int] = []  # the numbers of the singles and segments on storage: 0..n-1, none twice, no gap
    for key in storage.list("outage/events/"):
        nums = [int(n) for n in re.findall(r"\d{12}", key)]
        held += range(nums[0], nums[-1] + 1)
    assert sorted(held) == list(range(len(events)))
    # recorded once storage answered: the driver's paths and the ranks' as they reported them
    outages = [e for e in events if isinstance(e, StorageOutage)]
    assert outages and all(e.began_at < e.ended_at and e.first_error and e.requests_refused > 0 for e in outages)
    first = outages[0]
    assert "ledger" in first.paths  # bundle 8's bundle_published was the first request refused
    assert {p for o in outages for p in o.paths} <= {"ledger", "publisher", "rank 0 checkpoints", "rank 1 checkpoints"}
    published = {e.bundle: e.update for e in events if isinstance(e, BundlePublished)}
    assert first.newest_update is not None and first.newest_update >= 8
    assert first.newest_bundle is not None and published[first.newest_bundle] == first.newest_update
    assert all(o.update_at_end - (o.newest_update or 0) >= 0 for o in outages)  # the updates at risk
    missing = set(range(4, 25, 4)) - set(updates)  # boundaries never published: skipped or abandoned
    skipped = sum(o.bundles_skipped for o in outages)
    assert (skipped > 0) == bool(missing) and skipped <= len(missing)
    # every line a rank wrote, once and in order, in its rank log: as the driver received them by poll (which
    # needs no storage); the lines about the outage itself were written while storage refused
    forwarded: dict[str, list[str]] = {}
    for line in capfd.readouterr().err.splitlines():
        if (m := re.match(r"^\[(rank \d+)\] (.*)$", line)) and not m[2].startswith("[spotrun: "):
            forwarded.setdefault(m[1], []).append(m[2])
    logged = {ref.label: read_rank_log(storage, ref).splitlines()
              for ref in list_rank_logs(storage, "outage") if ref.attempt == 1}
    assert logged == forwarded and any("storage unavailable" in x for lines in logged.values() for x in lines)


def test_a_denial_that_persists_past_storage_outage_s_ends_the_job_loudly_and_says_so_in_its_ledger(moto, tmp_path):
    """Every request for a bundle's object denied (403 AccessDenied, as a bucket policy denying that prefix)
    from bundle 8's manifest on, for longer than the job's storage_outage_s (2 s): the job rides the first
    refusals out, as it would a credential refresh, then ends with the permanent error naming the denial (a
    denial that passes sooner is ridden out: the 403 case above), without a restart, and its ledger, which
    storage still takes, ends with the job_failed that says why. Runs last."""
    with FaultProxy(moto.url, rate=0.0) as proxy:
        began = proxy.outage(600.0, "403", after="/bundles/u0000000008-a1/manifest.json", only="/bundles/")
        spec = s3_spec(tmp_path, moto, proxy.url, "denied", "storage_outage_s=2")
        with pytest.raises(StoragePermanentError, match="AccessDenied"):
            run_on_ray(spec, trace_path=str(tmp_path / "t.jsonl"), record_ids=True)
    assert began.is_set()
    events = Ledger(open_storage(spec.storage, moto.url), "denied").read()
    assert isinstance(events[-1], JobFailed), events[-1]
    reason = events[-1].reason
    assert "for longer than storage_outage_s (2 s)" in reason and "AccessDenied" in reason, reason
    # not a restart, which would meet the same storage: whichever side (driver or rank) met the bound first
    assert [type(e).__name__ for e in events].count("AttemptStarted") == 1
    assert not [e for e in events if isinstance(e, WorkerLost)]


def test_a_cold_restart_during_an_outage_waits_for_storage_and_a_kill_after_it_returns_is_ridden_too(
        moto, reference, tmp_path):
    """Every rank held at update 12 (bundle 8 published); storage then answers 503 to every request and rank 1
    is killed. The restart is cold (world.warm_recovery off): its ranks are gone, and the next attempt waits
    for storage (its ledger read, its listing, the ranks' storage check). Once storage answers it restores
    bundle 8 and goes on; once bundle 16 is published rank 0 is killed too. The run ends exactly like the
    uninterrupted one."""
    with FaultProxy(moto.url, rate=0.0) as proxy:
        spec = s3_spec(tmp_path, moto, proxy.url, "downrestart", "world.warm_recovery=false",
                       "faults=[{site: before_update, signal: HOLD, update: 12, attempt: 1}, "
                       "{site: microstep, update: 18, microstep: 1, rank: 0, attempt: 2, after_bundle: 16}]")
        job = Background(spec, tmp_path / "t.jsonl", endpoint=moto.url, record_ids=True)
        job.wait_until_held(attempt=1, published=8)
        pids = {f.rank: f.pid for f in FaultLog(job.storage, "downrestart").read() if f.signal == "HOLD"}
        proxy.outage(600.0, "503")
        os.kill(pids[1], signal.SIGKILL)
        # the attempt's ranks are gone (torn down for the cold restart), then the driver, restarting, keeps
        # asking the refusing storage for a while
        job.wait_for(lambda: not alive(pids[0]))
        torn_down = proxy.injected["503"]
        job.wait_for(lambda: proxy.injected["503"] >= torn_down + 10)
        proxy.end_outage()
        job.join()
    assert job.error is None and job.outcome.state == "finished" and job.outcome.restarts == 2, job.story()
    storage = check_like_reference(spec, tmp_path / "t.jsonl", reference, moto.url)
    events = Ledger(storage, "downrestart").read()
    lost = [(e.attempt, e.rank, e.cause) for e in events if isinstance(e, WorkerLost)]
    assert lost == [(1, 1, "process-exit"), (2, 0, "process-exit")], job.story()
    restored = {e.attempt: (e.update, e.recovery_path) for e in events if isinstance(e, Restored)}
    assert restored[2] == (8, "cold") and restored[3][0] >= 16, job.story()
    assert isinstance(events[-1], JobFinished)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
