"""The mlflow sink: metric points in an MLflow run, each sent once, after a published bundle covers it.

MLflow appends every point it is sent and has no call that deletes one, so the upsert the other sinks
rely on is not available there: a point sent before its update is safe from a restart would be sent
again by the replay. The rank therefore only *buffers*: :class:`MlflowSink` writes the points of each
checkpoint interval into the job's storage as a segment (the s3 sink's segments, the same objects
when both sinks are listed), durable before the interval's bundle can be published. The driver sends
them (``spotrun.orchestrator.publish.metric_commit``) once the bundle covering their update is published.

:class:`Tracker` is everything spotrun asks of MLflow: the job's experiment, the one run per job
lineage (found again after any restart by its ``spotrun.run`` tag, ``<job id>/<lineage id>``, never by
its name), sending points and tags with ``log_batch``, and reading a run's history back. Each update
also gets a point ``spotrun/attempt`` (the attempt that computed it), as the tensorboard sink does.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from spotrun.trainer.job.sections import MlflowSpec
from spotrun.trainer.metrics.points import MetricPoint
from spotrun.trainer.metrics.s3_sink import S3Sink
from spotrun.trainer.storage import Storage

ATTEMPT = "spotrun/attempt"  # one point per update: the attempt that computed it
RUN_TAG, JOB_TAG, LINEAGE_TAG = "spotrun.run", "spotrun.job_id", "spotrun.lineage_id"
# verify --mutate's deliberately broken build: the rank sends each point as it is written (what a tracker
# callback does), the driver sends nothing at publish. Nothing else selects it (trainer/run/rank.py strips it).
SEND_AT_WRITE = "mlflow:send-at-write"
# MLflow's limits on one log_batch call and on a param's value (mlflow.utils.validation)
BATCH_METRICS, BATCH_PARAMS_TAGS, PARAM_CHARS, TAG_CHARS, KEY_CHARS = 1000, 100, 6000, 8000, 250


def tracking_uri(settings: MlflowSpec) -> str:
    """``metrics.mlflow.tracking_uri``, else ``MLFLOW_TRACKING_URI`` (where MLflow users already set it);
    a ``ValueError`` naming both when neither is set."""
    uri = settings.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        raise ValueError("metrics.sinks lists mlflow, but neither metrics.mlflow.tracking_uri nor the environment "
                         "variable MLFLOW_TRACKING_URI names the tracking server to send the points to")
    return uri


def check_tracker(settings: MlflowSpec) -> str:
    """Before a job with the mlflow sink starts: the tracking URI it sends to, and mlflow installed (a
    ``ValueError`` saying what is missing)."""
    uri = tracking_uri(settings)
    if importlib.util.find_spec("mlflow") is None:
        raise ValueError("metrics.sinks lists mlflow, but the mlflow package is not installed: "
                         "pip install 'spotrun[mlflow]'")
    return uri


def spec_params(spec: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """A spec as MLflow params: one per key, dotted as ``--set`` spells it, lists as JSON, cut to MLflow's
    length limits."""
    out: dict[str, str] = {}
    for key, value in spec.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(spec_params(value, f"{name}."))
        else:
            text = value if isinstance(value, str) else json.dumps(value)
            out[name[:KEY_CHARS]] = text[:PARAM_CHARS]
    return out


def _chunks(items: list, size: int) -> Iterable[list]:
    for i in range(0, len(items), size):
        yield items[i:i + size]


@dataclass
class Tracker:
    """One job's place in MLflow: its experiment (``experiment``, created when missing) on the server at
    ``uri``, and its runs, one per lineage."""

    uri: str
    experiment: str
    run_name: str
    job_id: str
    _client: Any = field(default=None, repr=False)  # MlflowClient, imported only when used

    @classmethod
    def of(cls, settings: MlflowSpec, job_id: str) -> Tracker:
        return cls(tracking_uri(settings), settings.experiment or job_id, settings.run_name or job_id, job_id)

    @property
    def client(self) -> Any:
        if self._client is None:
            from mlflow import MlflowClient

            self._client = MlflowClient(tracking_uri=self.uri)
        return self._client

    def experiment_id(self, create: bool = False) -> str | None:
        found = self.client.get_experiment_by_name(self.experiment)
        if found is not None or not create:
            return None if found is None else found.experiment_id
        from mlflow.exceptions import MlflowException

        try:
            return self.client.create_experiment(self.experiment)
        except MlflowException:  # another process created it meanwhile
            return self.client.get_experiment_by_name(self.experiment).experiment_id

    def runs(self, lineage_id: str | None = None) -> list[Any]:
        """The job's active runs (of one lineage, when given), oldest first."""
        exp = self.experiment_id()
        if exp is None:
            return []
        tag, value = (RUN_TAG, f"{self.job_id}/{lineage_id}") if lineage_id else (JOB_TAG, self.job_id)
        return list(self.client.search_runs([exp], filter_string=f"tags.`{tag}` = '{value}'",
                                            order_by=["attributes.start_time ASC"]))

    def open_run(self, lineage_id: str, params: dict[str, str]) -> str:
        """The run of ``lineage_id``: found by its tag, else created. The spec's ``params`` are logged
        where the run lacks them (a run created by a driver that died before logging them); MLflow
        refuses to change a param, so a run keeps the values its lineage began with."""
        runs = self.runs(lineage_id)
        if runs:
            run = runs[0]
        else:
            run = self.client.create_run(self.experiment_id(create=True), run_name=self.run_name, tags={
                RUN_TAG: f"{self.job_id}/{lineage_id}", JOB_TAG: self.job_id, LINEAGE_TAG: lineage_id})
        from mlflow.entities import Param

        missing = [Param(k, v) for k, v in sorted(params.items()) if k not in run.data.params]
        for chunk in _chunks(missing, BATCH_PARAMS_TAGS):
            self.client.log_batch(run.info.run_id, params=chunk)
        return run.info.run_id

    def send(self, run_id: str, metrics: list[Any], tags: dict[str, str]) -> None:
        """``metrics`` (mlflow ``Metric``s) and ``tags`` with ``log_batch``, in as few calls as its limits
        allow; the tags first (they only overwrite), the metrics after."""
        from mlflow.entities import RunTag

        for chunk in _chunks([RunTag(k[:KEY_CHARS], v[:TAG_CHARS]) for k, v in sorted(tags.items())],
                             BATCH_PARAMS_TAGS):
            self.client.log_batch(run_id, tags=chunk)
        for chunk in _chunks(metrics, BATCH_METRICS):
            self.client.log_batch(run_id, metrics=chunk)

    def history(self, run_id: str, names: Iterable[str]) -> dict[str, list[Any]]:
        """Every point MLflow holds of each of ``names`` in the run, as it holds them (sent twice: twice)."""
        return {name: list(self.client.get_metric_history(run_id, name)) for name in names}

    def read(self) -> list[MetricPoint]:
        """Every point of every run of the job, as MLflow's history holds it: a point sent twice appears
        twice (MLflow appends; verify counts such duplicates). Each carries the attempt its update's
        ``spotrun/attempt`` point names (the k-th send of a step pairs with its k-th attempt point)."""
        out = []
        for run in self.runs():
            run_id, lineage = run.info.run_id, run.data.tags.get(LINEAGE_TAG, "")
            hist = self.history(run_id, run.data.metrics)
            attempts: dict[int, list[int]] = defaultdict(list)
            for m in sorted(hist.get(ATTEMPT, []), key=lambda m: (m.step, m.timestamp)):
                attempts[m.step].append(int(m.value))
            for name, points in hist.items():
                if name == ATTEMPT:
                    continue
                seen: dict[int, int] = defaultdict(int)
                for m in sorted(points, key=lambda m: (m.step, m.timestamp)):
                    sent = attempts.get(m.step, [])
                    attempt = sent[min(seen[m.step], len(sent) - 1)] if sent else 0
                    seen[m.step] += 1
                    out.append(MetricPoint(job_id=self.job_id, update=m.step, name=name, value=m.value,
                                           attempt=attempt, lineage_id=lineage,
                                           at=datetime.fromtimestamp(m.timestamp / 1000, UTC)))
        return sorted(out, key=lambda p: (p.update, p.name))

    def forget(self) -> int:
        """Delete every run of the job (verify, before it runs a job id again); returns how many."""
        runs = self.runs()
        for run in runs:
            self.client.delete_run(run.info.run_id)
        return len(runs)


def as_metrics(points: Iterable[MetricPoint]) -> list[Any]:
    """Points as MLflow metrics (step = the update, timestamp = when it was measured), with one
    ``spotrun/attempt`` point per update."""
    from mlflow.entities import Metric

    points = list(points)
    out = [Metric(p.name, p.value, int(p.at.timestamp() * 1000), p.update) for p in points]
    firsts = {p.update: p for p in points}
    out += [Metric(ATTEMPT, float(p.attempt), int(p.at.timestamp() * 1000), u) for u, p in sorted(firsts.items())]
    return out


class MlflowSink:
    """The rank's side of the mlflow sink: points wait in the job's storage (the s3 sink's segments,
    written at each checkpoint before its bundle can be published) until the driver sends them.
    ``segments=False`` when the s3 sink is listed too and writes the same segments. ``read`` is MLflow's
    history of the job. ``at_write``: verify's broken build (:data:`SEND_AT_WRITE`) sends each write at
    once instead."""

    def __init__(self, storage: Storage, settings: MlflowSpec, job_id: str, *, segments: bool = True,
                 at_write: bool = False) -> None:
        self._buffer = S3Sink(storage)  # writes the segments: its buffer, flushed at each checkpoint
        self.settings, self.job_id = settings, job_id
        self.segments, self.at_write = segments, at_write
        self._tracker: Tracker | None = None
        self._run_ids: dict[str, str] = {}

    @property
    def tracker(self) -> Tracker:
        if self._tracker is None:
            self._tracker = Tracker.of(self.settings, self.job_id)
        return self._tracker

    def write(self, points: Iterable[MetricPoint]) -> None:
        points = list(points)
        if self.at_write:
            for lineage in sorted({p.lineage_id for p in points}):
                if lineage not in self._run_ids:
                    self._run_ids[lineage] = self.tracker.open_run(lineage, {})
                self.tracker.send(self._run_ids[lineage], as_metrics(p for p in points if p.lineage_id == lineage), {})
        elif self.segments:
            self._buffer.write(points)

    def flush(self) -> None:
        self._buffer.flush()

    def read(self, job_id: str) -> list[MetricPoint]:
        return self.tracker.read() if job_id == self.job_id else Tracker.of(self.settings, job_id).read()

    def close(self) -> None:
        self._buffer.close()
