"""Opening a job's sinks by name: the one place that knows every sink, above all of them."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from spotrun.trainer.metrics.points import MetricSink
from spotrun.trainer.metrics.s3_sink import S3Sink
from spotrun.trainer.metrics.sinks import FanOut, JsonlSink, NullSink, SqliteSink, TensorBoardSink
from spotrun.trainer.storage import Storage


def metrics_dir(storage_uri: str, job_id: str, local_dir: str) -> Path:
    """Where a job's local sink files live: beside its bundles on file storage, else under ``local_dir``."""
    if storage_uri.startswith("file://") or "://" not in storage_uri:
        root = storage_uri[len("file://"):] if storage_uri.startswith("file://") else storage_uri
        return Path(root).resolve() / job_id
    return Path(local_dir).resolve() / job_id


def open_sinks(kinds: Iterable[str], directory: Path, storage: Storage | None = None, *,
               mlflow: Any = None, job_id: str = "", at_write: bool = False) -> MetricSink:
    """The sinks named in ``kinds``; file sinks under ``directory``, ``s3`` in ``storage`` (the job's);
    ``mlflow`` buffers in ``storage`` too and reads from the tracking server ``mlflow`` (a
    ``MlflowSpec``) names for job ``job_id`` (``at_write``: verify's broken build, trainer/metrics/mlflow_sink.py)."""
    kinds = list(kinds)
    sinks: list[MetricSink] = []
    for kind in kinds:
        if kind == "sqlite":
            sinks.append(SqliteSink(directory / "metrics.sqlite"))
        elif kind == "jsonl":
            sinks.append(JsonlSink(directory / "metrics.jsonl"))
        elif kind == "s3":
            if storage is None or not storage.uri.startswith("s3://"):
                raise ValueError("metrics.sinks: the s3 sink writes into the job's storage, which must be "
                                 "s3://BUCKET/PREFIX")
            sinks.append(S3Sink(storage))
        elif kind == "tensorboard":
            sinks.append(TensorBoardSink(directory / "tensorboard"))
        elif kind == "mlflow":
            from spotrun.trainer.metrics.mlflow_sink import MlflowSink

            if storage is None or mlflow is None:
                raise ValueError("metrics.sinks: the mlflow sink buffers in the job's storage and needs "
                                 "metrics.mlflow")
            sinks.append(MlflowSink(storage, mlflow, job_id, segments="s3" not in kinds, at_write=at_write))
        else:
            raise ValueError(f"metrics.sinks: unknown sink {kind!r}; choose from sqlite, jsonl, s3, tensorboard, "
                             "mlflow")
    return FanOut(sinks) if sinks else NullSink()
