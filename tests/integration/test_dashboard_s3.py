"""The dashboard over S3 (a real moto server): jobs, events, the object metric sink, orphans, 404s,
and never a write (not even the probe object that ``open_storage`` puts to check a root)."""

from __future__ import annotations

from collections import Counter

import pytest
from fastapi.testclient import TestClient

pytest.importorskip("spotrun.trainer.storage.s3", reason="the S3 backend is not in this build")
s3_helpers = pytest.importorskip("tests.helpers.s3", reason="the S3 test helpers are not in this build")

from spotrun.orchestrator.dashboard import create_app  # noqa: E402
from spotrun.orchestrator.ledger.events import AttemptStarted  # noqa: E402
from spotrun.orchestrator.ledger.store import Ledger  # noqa: E402
from spotrun.trainer.metrics import MetricPoint, S3Sink, points_of  # noqa: E402
from spotrun.trainer.storage.s3 import S3Storage  # noqa: E402

moto, s3_env, bucket = s3_helpers.moto, s3_helpers.s3_env, s3_helpers.bucket
pytestmark = pytest.mark.slow


def test_dashboard_reads_a_job_on_s3(moto, bucket):
    uri = f"s3://{bucket}/runs"
    writer = S3Storage(uri, moto.url)
    Ledger(writer, "j").append(AttemptStarted(attempt=1, world_size=1, pid=1, lineage_id="L"))
    writer.put("j/events/000000000001.json", b"{torn")
    for u in (1, 2):
        point = MetricPoint(job_id="j", update=u, name="loss", value=3.0 - u, attempt=1, lineage_id="L")
        writer.put(f"j/metrics/{u}/loss.json", point.model_dump_json().encode())
    writer.put("j/bundles/u0000000002-a0/rank-0/model.pt", b"torn")
    before = sorted(writer.list(""))

    client = TestClient(create_app(uri, endpoint_url=moto.url), base_url="http://127.0.0.1")
    jobs = client.get("/api/jobs")
    assert jobs.status_code == 200, jobs.text
    assert [j["job_id"] for j in jobs.json()] == ["j"]
    job = client.get("/api/jobs/j").json()
    assert job["summary"]["state"] == "running" and job["summary"]["corrupt_events"] == 1
    assert [p["update"] for p in job["loss"]["points"]] == [1, 2] and job["loss"]["source"] == "objects"
    assert [b["status"] for b in client.get("/api/jobs/j/bundles").json()] == ["orphaned"]
    assert client.get("/jobs/j").status_code == 200
    assert client.get("/api/jobs/..%2Fj").status_code == 404 and client.get("/api/jobs/k").status_code == 404
    assert sorted(writer.list("")) == before  # read-only: not even a probe object


def test_s3_objects_are_read_in_chunks_for_checksums(moto, bucket):
    storage = S3Storage(f"s3://{bucket}/runs", moto.url)
    blob = bytes(range(256)) * 1025  # not a multiple of the chunk
    storage.put("j/bundles/b/rank-0/model.pt", blob)
    storage.put("j/empty", b"")
    chunks = list(storage.read_chunks("j/bundles/b/rank-0/model.pt", 4096))
    assert b"".join(chunks) == blob and max(map(len, chunks)) <= 4096 and len(chunks) > 1
    assert list(storage.read_chunks("j/empty", 4096)) == []
    with pytest.raises(FileNotFoundError):
        next(storage.read_chunks("j/missing", 4096))


def _count_requests(app) -> Counter:
    """Requests the dashboard's S3 client sends, by (operation, whether the key is a metric object)."""
    seen: Counter = Counter()

    def count(request, event_name, **_):  # event_name: before-send.s3.<Operation>
        seen[(event_name.rsplit(".", 1)[-1], "metrics" in request.url)] += 1

    app.state.reader.storage.inner.s3.client.meta.events.register("before-send.s3", count)
    return seen


def test_a_refresh_gets_only_the_metric_segments_that_are_new(moto, bucket):
    """60 updates written in 6 segments (a checkpoint every 10): the first view GETs the 6, a
    refresh with nothing new GETs none, one more segment costs one GET."""
    uri = f"s3://{bucket}/runs"
    writer = S3Storage(uri, moto.url)
    Ledger(writer, "seg").append(AttemptStarted(attempt=1, world_size=1, pid=1, lineage_id="L"))
    sink = S3Sink(writer)
    for u in range(1, 61):
        sink.write(points_of("seg", u, 1, "L", {"loss": 1 / u, "lr": 0.1, "applied": 1.0}))
        if u % 10 == 0:
            sink.flush()
    app = create_app(uri, endpoint_url=moto.url)
    client, seen = TestClient(app, base_url="http://127.0.0.1"), _count_requests(app)

    def refresh() -> dict:
        seen.clear()
        doc = client.get("/api/jobs/seg/metrics?name=loss").json()
        return {"points": len(doc["points"]), "gets": seen[("GetObject", True)],
                "lists": seen[("ListObjectsV2", True)]}

    assert refresh() == {"points": 60, "gets": 6, "lists": 1}
    assert refresh() == {"points": 60, "gets": 0, "lists": 1}  # cached by ETag
    sink.write(points_of("seg", 61, 1, "L", {"loss": 1 / 61, "lr": 0.1, "applied": 1.0}))
    sink.close()
    assert refresh() == {"points": 61, "gets": 1, "lists": 1}


def test_history_bundles_and_inspect_read_a_job_on_s3_through_the_endpoint(moto, bucket, tmp_path, capsys):
    """`--endpoint-url`, as `spotrun dashboard` takes it: a job trained on the moto server is read back by
    history, bundles and inspect (each --json document names the job's own bundle)."""
    import json

    from spotrun.orchestrator.cli.main import main
    from spotrun.orchestrator.control.launch import run_in_process
    from tests.conftest import make_spec

    uri = f"s3://{bucket}/runs"
    spec = make_spec(tmp_path, f"storage={uri}", f"storage_endpoint_url={moto.url}", "train.updates=2",
                     "checkpoint.every_updates=2", "data.workers=0", f"metrics.local_dir={tmp_path / 'm'}",
                     job_id="cli")
    [key] = run_in_process(spec).published
    capsys.readouterr()
    endpoint = ["--endpoint-url", moto.url, "--json"]
    assert main(["history", "cli", "--storage", uri, "--metrics-dir", str(tmp_path / "m"), *endpoint]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["state"] == "finished" and [a["published"] for a in doc["attempts"]] == [1]
    assert main(["bundles", "cli", "--storage", uri, *endpoint]) == 0
    assert [b["bundle"] for b in json.loads(capsys.readouterr().out)] == [key]
    assert main(["inspect", f"{uri}/{key}", *endpoint]) == 0
    assert json.loads(capsys.readouterr().out)["bundle"] == key
