"""Metric points committed to MLflow at publish: each point sent once, after nothing can replay it.

The publish step's last commit, after the reader offsets (orchestrator/publish/offsets.py) and by the same
rule: only for a published bundle, recorded per bundle, never moving backwards, and done again by a
restore when the job died between the publish and the commit. When a bundle of update *u* is
published (or restored), the points of the updates after the newest one already sent, up to *u*,
are read from the segments the rank wrote into the job's storage (the latest attempt's point of each
key: a replay's supersedes what a lost attempt wrote) and sent to the job lineage's MLflow run with
``log_batch``, step = update. Then ``<job>/sent/mlflow/u<u:010d>.json`` records it (create-only).
No restore reaches behind a published bundle, so a replayed update was never sent, and the updates a
lost attempt took with it are sent by whichever attempt publishes them.

A driver may die between the send and its record. MLflow is then the source of truth: the first send
of every committer (a new driver) and the first after a failed one leave out each (metric, update)
MLflow already holds past the newest record. Each send also sets the run's tags: the manifest's
versions and code fingerprint, the bundle the run is complete up to, and one ``spotrun.restart.<n>``
per restart (cause, bundle, lost updates, as ``spotrun history`` shows them).

Sending happens on a thread of its own: a slow or unreachable tracker never holds the supervisor up
(a failed send is logged and retried with the next bundle, or at close); :meth:`MetricCommitter.close`
waits for the sends asked for, and marks the run finished when the job is.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Sequence
from datetime import UTC, datetime

from spotrun.orchestrator.ledger.history_model import RestartRow
from spotrun.trainer.bundle.manifest import Manifest
from spotrun.trainer.job.spec import JobSpec
from spotrun.trainer.metrics import SEGMENTS, MetricPoint, read_object_points, upsert
from spotrun.trainer.metrics.mlflow_sink import Tracker, as_metrics, spec_params
from spotrun.trainer.storage import Storage

log = logging.getLogger("spotrun.metric_commit")

# restart rows as spotrun history computes them (attempt, cause, restored_from, lost_updates, lost_range)
Restarts = Callable[[], Sequence[RestartRow]]


def sent_prefix(job_id: str) -> str:
    return f"{job_id}/sent/mlflow/"


def restart_tags(rows: Sequence[RestartRow]) -> dict[str, str]:
    """One tag per restart, ``spotrun.restart.<attempt>``: why, from which bundle, which updates it lost."""
    out = {}
    for r in rows:
        lost, span = r.lost_updates, r.lost_range
        lost_text = "unknown" if lost is None else f"{lost}" + (f" ({span[0]}-{span[1]})" if span else "")
        out[f"spotrun.restart.{r.attempt}"] = (f"cause={r.cause}; bundle={r.restored_from or 'none'}; "
                                               f"lost_updates={lost_text}")
    return out


def manifest_tags(manifest: Manifest, bundle_key: str) -> dict[str, str]:
    """The runtime and code that computed the points, and how far the run is complete."""
    tags = {f"spotrun.version.{k}": str(v) for k, v in manifest.versions.model_dump().items() if v is not None}
    return {**tags, "spotrun.code.entrypoint": manifest.code.entrypoint,
            "spotrun.code.fingerprint": manifest.code.fingerprint, "spotrun.bundle": bundle_key,
            "spotrun.sent_through_update": str(manifest.counters.attempted_updates)}


class MetricCommitter:
    """Sends a job's buffered points to its MLflow run as bundles are published (see the module docstring)."""

    def __init__(self, storage: Storage, spec: JobSpec, restarts: Restarts = list) -> None:
        self.storage, self.job_id = storage, spec.job_id
        self.tracker = Tracker.of(spec.metrics.mlflow, spec.job_id)
        self.params = spec_params(spec.model_dump(mode="json", exclude={"faults"}))
        self.restarts = restarts
        self.run_id: str | None = None
        self._segments: dict[str, list[MetricPoint]] = {}  # parsed segments that still hold unsent points
        self._done: set[str] = set()  # segments whose every point is sent
        self._checked = False  # MLflow's history was read since the last send that may have half-happened
        self._tagged: dict[str, str] = {}  # the tags this committer set
        self._cond = threading.Condition()
        self._due: tuple[Manifest, str] | None = None  # the newest bundle to send up to
        self._closing = False
        self._thread = threading.Thread(target=self._drain, name="spotrun-metric-commit", daemon=True)
        self._thread.start()

    # -- the supervisor's side ----------------------------------------------------------------

    def commit(self, manifest: Manifest, bundle_key: str) -> None:
        """Send the points up to ``manifest``'s update (published or restored), on the committer's thread."""
        with self._cond:
            if self._due is None or manifest.counters.attempted_updates > self._due[0].counters.attempted_updates:
                self._due = (manifest, bundle_key)
            self._cond.notify_all()

    def close(self, finished: bool, wait_s: float | None = None) -> None:
        """Wait for the sends asked for (a failed one is tried once more), at most ``wait_s`` (None: until
        done); a finished job's run is ended. What is not sent by then stays in the job's storage: the
        restore of a later run of the job sends it."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(wait_s)
        if self._thread.is_alive():  # a daemon thread: it does not keep the driver's process alive
            log.warning("MLflow at %s did not take the metric points within %.0fs; they stay in the job's "
                        "storage, and the next run of the job sends them", self.tracker.uri, wait_s or 0)
            return
        if finished and self.run_id is not None:
            try:
                self.tracker.client.set_terminated(self.run_id, "FINISHED")
            except Exception as e:  # the points are sent; the run's status is cosmetic
                log.warning("could not mark MLflow run %s finished: %s", self.run_id, e)

    def _drain(self) -> None:
        failed: tuple[Manifest, str] | None = None
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._due is not None or self._closing)
                due, self._due = self._due, None
            last_try = due is None  # closing, nothing newer asked for: a failed send gets one more try
            if due is None:
                if failed is None:
                    return
                due = failed
            failed = self._try(due)
            if last_try:
                return

    def _try(self, due: tuple[Manifest, str]) -> tuple[Manifest, str] | None:
        """One send; returns ``due`` when it failed (the points stay buffered in storage)."""
        try:
            self.send_through(*due)
            return None
        except Exception as e:  # the tracker is down or refused: logged, never the job's failure
            self._checked = False
            log.warning("could not send the metric points up to update %d to MLflow at %s: %s; they stay in "
                        "the job's storage and go with the next bundle", due[0].counters.attempted_updates,
                        self.tracker.uri, e)
            return due

    # -- one send ---------------------------------------------------------------------------

    def sent_through(self) -> int:
        """The newest update whose points are recorded as sent (0: none)."""
        keys = [k for k in self.storage.list(sent_prefix(self.job_id)) if k.endswith(".json")]
        return json.loads(self.storage.get(keys[-1]))["update"] if keys else 0

    def send_through(self, manifest: Manifest, bundle_key: str) -> int:
        """Send the points of the updates after the newest sent one up to ``manifest``'s, then record
        it; returns how many MLflow metrics were sent (0 when that bundle's points already were)."""
        update, last = manifest.counters.attempted_updates, self.sent_through()
        restarts = restart_tags(self.restarts())
        if update <= last:  # a restore of a bundle already sent: only a new restart to tell
            new = {k: v for k, v in restarts.items() if self._tagged.get(k) != v}
            if new:
                self.tracker.send(self._run(manifest), [], new)
                self._tagged.update(new)
            return 0
        run_id = self._run(manifest)
        points = [p for p in self._pending(last) if p.update <= update]
        metrics = as_metrics(points)
        if not self._checked:  # a send may have reached MLflow without its record: MLflow says what it holds
            held = self.tracker.history(run_id, sorted({m.key for m in metrics}))
            there = {(m.key, m.step) for ms in held.values() for m in ms if m.step > last}
            metrics = [m for m in metrics if (m.key, m.step) not in there]
            self._checked = True
        tags = {**manifest_tags(manifest, bundle_key), **restarts}
        self.tracker.send(run_id, metrics, tags)
        self._tagged.update(tags)
        record = {"version": 1, "bundle": bundle_key, "update": update, "from_update": last + 1,
                  "metrics": len(metrics), "run_id": run_id, "at": datetime.now(UTC).isoformat()}
        self.storage.put_new(f"{sent_prefix(self.job_id)}u{update:010d}.json", json.dumps(record).encode())
        self._forget_sent(update)
        return len(metrics)

    def _run(self, manifest: Manifest) -> str:
        """The lineage's MLflow run, found or created on first use."""
        if self.run_id is None:
            self.run_id = self.tracker.open_run(manifest.lineage_id, self.params)
        return self.run_id

    def _pending(self, after: int) -> list[MetricPoint]:
        """The points after update ``after``, the latest write of each key (segments sort by attempt, then
        update: a replay's segment comes after the lost attempt's). Segments are read once each."""
        prefix = f"{self.job_id}/{SEGMENTS}"
        for key in self.storage.list(prefix):
            if key.endswith(".jsonl") and key not in self._segments and key not in self._done:
                self._segments[key] = read_object_points(key, self.storage.get(key), self.job_id)
        return [p for p in upsert(self._segments[k] for k in sorted(self._segments)) if p.update > after]

    def _forget_sent(self, update: int) -> None:
        for key in [k for k, ps in self._segments.items() if all(p.update <= update for p in ps)]:
            del self._segments[key]
            self._done.add(key)
