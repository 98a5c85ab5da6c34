"""Metric sinks: one small interface, idempotent by key, so replayed updates never duplicate a point.

Every point has the key ``<job_id>/<update>/<name>`` (update = the attempted
update's index) and records the attempt and lineage that wrote it. Sinks
*upsert* by key: after a restart, the replayed updates replace the points the
lost attempt wrote instead of adding to them.

- :class:`SqliteSink` (default): a table with the key as primary key.
- :class:`JsonlSink`: append-only lines; :meth:`JsonlSink.read` keeps the
  newest line per key (the file itself is a log, the reader is the upsert).
- :class:`NullSink` and :class:`FanOut`, so call sites never branch on
  "is logging on".

- :class:`S3Sink`: points buffered and written in segments, one object per checkpoint
  interval (``<job>/metrics/segments/a<attempt>-u<first update>.jsonl``); a later segment's
  point replaces an earlier one's of the same key, which is the upsert.
- :class:`TensorBoardSink`: event files TensorBoard reads; each attempt opens its writer with
  ``purge_step`` at the first update it writes, so TensorBoard's reader drops what a lost
  attempt wrote from there on: its purge is the upsert.
- ``MlflowSink`` (trainer/metrics/mlflow_sink.py): MLflow cannot upsert (it appends every point), so a
  point is sent only once a published bundle covers its update, by the driver, from the s3 sink's
  segments in the job's storage: no replay can reach it then.
"""

from spotrun.trainer.metrics.open import metrics_dir, open_sinks
from spotrun.trainer.metrics.points import MetricPoint, MetricSink, points_of
from spotrun.trainer.metrics.s3_sink import SEGMENTS, S3Sink, read_object_points, segment_key, upsert
from spotrun.trainer.metrics.sinks import FanOut, JsonlSink, NullSink, SqliteSink, TensorBoardSink

__all__ = ["SEGMENTS", "FanOut", "JsonlSink", "MetricPoint", "MetricSink", "NullSink", "S3Sink", "SqliteSink",
           "TensorBoardSink", "metrics_dir", "open_sinks", "points_of", "read_object_points", "segment_key",
           "upsert"]
