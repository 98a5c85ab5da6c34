"""The mlflow sink against a real `mlflow server` (SQLite backend, local artifact root; one per module,
the runs on the shared local Ray): points reach MLflow only once a published bundle covers them, each exactly once
whatever the restarts, read back with ``MlflowClient.get_metric_history``; a send that reached MLflow
without its record is not sent again; and verify fails a build that sends points as they are written."""

from __future__ import annotations

import json

import pytest
from mlflow import MlflowClient

from spotrun.orchestrator.control.specfile import load_spec
from spotrun.orchestrator.ledger.history import history
from spotrun.orchestrator.publish.metric_commit import MetricCommitter, restart_tags, sent_prefix
from spotrun.orchestrator.verify.comparison import compare_metrics
from spotrun.orchestrator.verify.oracle import Verifier, read_sink
from spotrun.trainer.bundle.bundles import list_bundles, read_manifest
from spotrun.trainer.bundle.manifest import Manifest, Versions
from spotrun.trainer.job.code_identity import CodeInfo
from spotrun.trainer.job.sections import FaultSpec
from spotrun.trainer.metrics import SEGMENTS, JsonlSink, metrics_dir, open_sinks, points_of
from spotrun.trainer.metrics.mlflow_sink import ATTEMPT, SEND_AT_WRITE, Tracker
from spotrun.trainer.state.counters import Counters
from spotrun.trainer.storage import open_storage
from tests.conftest import ROOT, make_spec
from tests.helpers.mlflow_server import mlflow_server
from tests.helpers.ray_local import ray_address  # noqa: F401 - the shared local Ray, for the runs
from tests.helpers.runs import run_cmd, run_to_end

pytestmark = pytest.mark.slow
EXPERIMENT = "spotrun-tests"


@pytest.fixture(scope="module")
def tracking_uri(tmp_path_factory):
    """The module's MLflow server."""
    with mlflow_server(tmp_path_factory.mktemp("mlflow")) as server:
        yield server.wait()


def sinks(uri: str, kinds: str = "sqlite, jsonl, mlflow") -> tuple[str, ...]:
    return (f"metrics.sinks=[{kinds}]", f"metrics.mlflow.tracking_uri={uri}", f"metrics.mlflow.experiment={EXPERIMENT}")


def the_run(uri: str, job: str):
    (run,) = Tracker(uri, EXPERIMENT, job, job).runs()
    return run


def steps(uri: str, run_id: str, name: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in MlflowClient(uri).get_metric_history(run_id, name))


def test_two_rank_job_killed_twice_has_one_point_per_update_equal_to_the_uninterrupted_run(
        tracking_uri, ray_address, tmp_path):
    """Killed once between the publish of bundle 4 and its send (the driver, at after_publish), and once
    while rank 1 wrote bundle 12 (rank 0 had put the points of 9..12 into storage already, so the
    replay's points and the lost attempt's both wait there). MLflow holds each update's point once,
    the uninterrupted run's value, computed by the attempt that published it; the restarts are tags."""
    root = tmp_path / "runs"
    sets = ("world.size=2", "train.updates=16", "checkpoint.every_updates=4", "data.workers=0", *sinks(tracking_uri))
    done = run_to_end(run_cmd(root, "ref", tmp_path / "ref.jsonl", *sets, ray=ray_address))
    assert done.returncode == 0, done.stderr[-3000:]
    cmd = run_cmd(root, "killed", tmp_path / "t.jsonl", *sets,
                  "faults=[{site: after_publish, update: 4}, "
                  "{site: bundle_write, update: 12, rank: 1, attempt: 2, after_bundle: 8}]",
                  ray=ray_address)
    assert run_to_end(cmd).returncode == -9
    assert Tracker(tracking_uri, EXPERIMENT, "killed", "killed").read() == []  # bundle 4 published, nothing sent
    done = run_to_end(cmd)
    assert done.returncode == 0, done.stderr[-3000:]

    storage = open_storage(f"file://{root}")
    # what was sent, per bundle: bundle 4's by the restore that followed the kill (nothing else sends it
    # before bundle 8 exists), 16 last (12's may have gone with it)
    sent = [json.loads(storage.get(k))["bundle"].rsplit("/", 1)[-1] for k in storage.list(sent_prefix("killed"))]
    assert sent[:2] == ["u0000000004-a1", "u0000000008-a2"] and sent[-1] == "u0000000016-a3", sent
    segments = storage.list(f"killed/{SEGMENTS}")
    assert f"killed/{SEGMENTS}/a000002-u0000000009.jsonl" in segments  # the lost attempt's 9..12, never sent
    assert f"killed/{SEGMENTS}/a000003-u0000000009.jsonl" in segments  # the replay's, sent
    ref, run = the_run(tracking_uri, "ref"), the_run(tracking_uri, "killed")
    names = sorted(ref.data.metrics)
    assert {"loss", "lr", "applied", ATTEMPT} <= set(names) and sorted(run.data.metrics) == names
    for name in names:
        got, want = steps(tracking_uri, run.info.run_id, name), steps(tracking_uri, ref.info.run_id, name)
        assert [s for s, _ in want] == list(range(1, 17))
        if name == ATTEMPT:  # 1..4 computed by attempt 1 (sent by attempt 2's restore), 9..12 by the replay
            assert got == [(u, 1.0 if u <= 4 else 2.0 if u <= 8 else 3.0) for u in range(1, 17)]
        else:
            assert got == want, name  # one point per update, bitwise the uninterrupted run's

    rows = history(storage, "killed").restarts
    assert [r.attempt for r in rows] == [2, 3]
    tags = run.data.tags
    assert {k: v for k, v in tags.items() if k.startswith("spotrun.restart.")} == restart_tags(rows)
    assert "bundle=killed/bundles/u0000000004-a1" in tags["spotrun.restart.2"]
    assert "bundle=killed/bundles/u0000000008-a2" in tags["spotrun.restart.3"]
    newest = read_manifest(storage, next(b.key for b in list_bundles(storage, "killed") if b.published))
    assert tags["spotrun.code.fingerprint"] == newest.code.fingerprint
    assert tags["spotrun.version.torch"] == newest.versions.torch
    assert tags["spotrun.bundle"] == "killed/bundles/u0000000016-a3"
    assert run.data.params["train.updates"] == "16" and run.data.params["world.size"] == "2"
    assert run.info.status == "FINISHED"

    # verify's metric comparison accepts it, the raw writes (the jsonl log) holding the replayed points twice
    spec = make_spec(tmp_path, *sets, job_id="killed")
    log = JsonlSink(metrics_dir(spec.storage, "killed", spec.metrics.local_dir) / "metrics.jsonl").writes("killed")
    finals = {kind: read_sink(spec, storage, kind, "killed") for kind in ("mlflow", "sqlite")}
    compared = compare_metrics(read_sink(spec, storage, "mlflow", "ref"), finals, log, 0.0)
    assert compared.ok, compared.problems
    assert compared.duplicates_written > 0


class RecordLost:
    """The job's storage, except that a sent record is never written: a driver dying right after a send."""

    def __init__(self, storage) -> None:
        self.storage = storage

    def __getattr__(self, name: str):
        return getattr(self.storage, name)

    def put_new(self, key: str, data: bytes) -> bool:
        if "/sent/" in key:
            raise OSError("the driver died before recording the send")
        return self.storage.put_new(key, data)


def bundle(update: int) -> tuple[Manifest, str]:
    manifest = Manifest.model_construct(
        counters=Counters(attempted_updates=update), lineage_id="lin",
        versions=Versions(python="3.11", torch="2.13.0", torchdata="0.11.0", numpy="2", spotrun="0.1.0"),
        code=CodeInfo(entrypoint="spotrun.recipes.char_lm:build", fingerprint="f00d"))
    return manifest, f"torn/bundles/u{update:010d}-a1"


def test_a_send_that_reached_mlflow_without_its_record_is_not_sent_again(tracking_uri, tmp_path):
    spec = make_spec(tmp_path, *sinks(tracking_uri, "mlflow"), job_id="torn")
    storage = open_storage(spec.storage)
    sink = open_sinks(["mlflow"], tmp_path, storage, mlflow=spec.metrics.mlflow, job_id="torn")
    for u in range(1, 13):
        sink.write(points_of("torn", u, 1, "lin", {"loss": 1 / u, "lr": 0.5}))
        if u % 4 == 0:
            sink.flush()  # as the rank does before each checkpoint's capture
    sink.close()

    first = MetricCommitter(RecordLost(storage), spec)
    with pytest.raises(OSError):
        first.send_through(*bundle(8))
    first.close(finished=False)
    run = the_run(tracking_uri, "torn")
    assert [s for s, _ in steps(tracking_uri, run.info.run_id, "loss")] == list(range(1, 9))  # sent, unrecorded

    second = MetricCommitter(storage, spec)  # a new driver: MLflow's history says what it holds
    assert second.send_through(*bundle(8)) == 0
    assert second.send_through(*bundle(12)) == 4 * 3  # updates 9..12: loss, lr and spotrun/attempt
    second.close(finished=True)
    for name in ("loss", "lr", ATTEMPT):
        assert [s for s, _ in steps(tracking_uri, run.info.run_id, name)] == list(range(1, 13)), name
    assert steps(tracking_uri, run.info.run_id, "loss")[8] == (9, 1 / 9)
    assert the_run(tracking_uri, "torn").info.status == "FINISHED"


def test_verify_fails_a_build_that_sends_points_as_they_are_written(tracking_uri, tmp_path):
    """Killed after publishing bundle 4, then in update 7 of the attempt that restored it: the next
    restore from bundle 4 replays 5 and 6, whose points the broken build had sent already. Everything
    else verify checks holds, so the duplicates in MLflow alone fail it."""
    overrides = [f"storage=file://{tmp_path / 'runs'}", f"data.shards={ROOT / 'configs/data/tiny'}",
                 "train.updates=8", "checkpoint.every_updates=4", "data.workers=0",
                 *sinks(tracking_uri, "sqlite, mlflow")]
    verifier = Verifier(str(ROOT / "configs/tiny.yaml"), overrides, kills=2, seed=0, no_ray=True, workdir=tmp_path,
                        load=lambda path, o: load_spec(path, o, "mutant"), mutate=(SEND_AT_WRITE,))
    report = verifier.run(faults=[FaultSpec(site="after_publish", update=4),
                                  FaultSpec(site="microstep", update=7, microstep=1, attempt=2)])
    assert report.mutation_caught is True and report.verdict == "fail"
    assert report.observed_contract == "exact" and report.params_bitwise_equal and report.restores_from_bundle == 2
    assert report.metric_duplicates > 0 and report.metric_missing == report.metric_mismatches == 0
    assert all(p.startswith("mlflow: ") for p in report.metric_problems), report.metric_problems
    assert any(p.startswith("mlflow: update 5 ") and "appears" in p for p in report.metric_problems)
    assert [f.split(":")[0] for f in report.failures] == ["metric points"], report.failures
