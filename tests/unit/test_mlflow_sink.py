"""The mlflow sink without a server: where the tracking URI comes from, the spec as params, the restart
tags, and the rank's side, which only buffers (the points wait in storage for the driver)."""

from __future__ import annotations

import pytest

from spotrun.orchestrator.ledger.history_model import RestartRow
from spotrun.orchestrator.publish.metric_commit import restart_tags
from spotrun.trainer.job.sections import MlflowSpec
from spotrun.trainer.metrics import SEGMENTS, open_sinks, points_of
from spotrun.trainer.metrics.mlflow_sink import MlflowSink, check_tracker, spec_params, tracking_uri
from spotrun.trainer.storage import open_storage


def test_the_tracking_uri_comes_from_the_spec_else_the_environment(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://from-env:5000")
    assert tracking_uri(MlflowSpec()) == "http://from-env:5000"
    assert tracking_uri(MlflowSpec(tracking_uri="http://from-spec:5000")) == "http://from-spec:5000"
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    with pytest.raises(ValueError, match="MLFLOW_TRACKING_URI"):
        check_tracker(MlflowSpec())


def test_spec_keys_become_dotted_params():
    params = spec_params({"seed": 0, "train": {"updates": 16, "lr": 0.003}, "job": None, "metrics": {
        "sinks": ["sqlite", "mlflow"], "mlflow": {"experiment": "e"}}, "long": "x" * 7000})
    assert params == {"seed": "0", "train.updates": "16", "train.lr": "0.003", "job": "null",
                      "metrics.sinks": '["sqlite", "mlflow"]', "metrics.mlflow.experiment": "e", "long": "x" * 6000}


def test_one_tag_per_restart_as_history_computes_it():
    # the fields the tags read; model_construct leaves out the rest
    rows = [RestartRow.model_construct(attempt=2, cause="driver-exit", restored_from="j/bundles/u0000000004-a1",
                                       lost_updates=3, lost_range=[5, 7]),
            RestartRow.model_construct(attempt=3, cause="node-lost", restored_from=None, lost_updates=None,
                                       lost_range=[])]
    assert restart_tags(rows) == {
        "spotrun.restart.2": "cause=driver-exit; bundle=j/bundles/u0000000004-a1; lost_updates=3 (5-7)",
        "spotrun.restart.3": "cause=node-lost; bundle=none; lost_updates=unknown"}


def test_the_rank_only_buffers_points_in_the_jobs_storage(tmp_path):
    """No tracking server is named: the rank never contacts one (only verify's broken build does)."""
    storage = open_storage(f"file://{tmp_path}")
    sink = open_sinks(["mlflow"], tmp_path, storage, mlflow=MlflowSpec(), job_id="j")
    sink.write(points_of("j", 1, 1, "lin", {"loss": 2.0}))
    assert storage.list(f"j/{SEGMENTS}") == []  # nothing until the checkpoint's flush
    sink.flush()
    assert storage.list(f"j/{SEGMENTS}") == [f"j/{SEGMENTS}/a000001-u0000000001.jsonl"]
    sink.close()
    # beside the s3 sink, which writes the same segments, the mlflow sink writes none of its own
    both = MlflowSink(storage, MlflowSpec(), "k", segments=False)
    both.write(points_of("k", 1, 1, "lin", {"loss": 2.0}))
    both.close()
    assert storage.list(f"k/{SEGMENTS}") == []
