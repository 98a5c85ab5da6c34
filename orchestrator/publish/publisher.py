"""The publish step, in its fixed order: manifest (the commit point), offsets, metric points, retention.

Only the publisher writes manifests. The manifest is merged from rank 0's
draft and every rank's file list once every rank *of the attempt that wrote
the bundle* has reported its write. Reports are per attempt: when a new attempt
begins (:meth:`Publisher.begin_attempt`), what the previous one left incomplete
is dropped, never counted against the new attempt's world size. Its directory
is an orphan that retention removes. The publisher keeps no other state across
attempts that could change what it publishes.

Retention runs last and only removes what a newer published bundle supersedes:
published bundles beyond ``keep_last``, and unpublished (orphaned) directories
older than the newest published bundle; a newer one may be a write in flight.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable

from spotrun.orchestrator.ledger.events import BundlePublished, OffsetsCommitted
from spotrun.orchestrator.ledger.store import Ledger
from spotrun.orchestrator.publish.metric_commit import MetricCommitter
from spotrun.orchestrator.publish.offsets import OffsetsStore
from spotrun.trainer.bundle.bundles import list_bundles, publish
from spotrun.trainer.bundle.manifest import FileEntry, Manifest
from spotrun.trainer.run.rank import BundleReport
from spotrun.trainer.storage import Storage

log = logging.getLogger("spotrun.publisher")
STOPPED_SEND_WAIT_S = 10.0  # a stopped or failed job's wait for its last metric sends (the rest: the next run)


class PublishError(RuntimeError):
    """The ranks' reports of a bundle contradict each other; nothing was published from them."""


class Publisher:
    def __init__(self, storage: Storage, ledger: Ledger, job_id: str, keep_last: int,
                 after_publish: Callable[[int], None] = lambda update: None,
                 source_offsets: OffsetsStore | None = None, points: MetricCommitter | None = None) -> None:
        self.storage = storage
        self.ledger = ledger
        self.job_id = job_id
        self.keep_last = keep_last
        self.offsets = [OffsetsStore(storage, job_id), *([source_offsets] if source_offsets else [])]
        self.after_publish = after_publish  # a fault-injection seam between commit point and offsets
        self.points = points  # the mlflow sink's sends, at publish (orchestrator/publish/metric_commit.py)
        self.retries_elsewhere = 0  # storage retries the ranks reported (the supervisor keeps it current)
        # The attempt whose reports are being collected, and its world size; its reports by bundle.
        self._attempt: int | None = None
        self._world_size = 0
        self._reports: dict[str, list[BundleReport]] = defaultdict(list)
        # The newest bundle this publisher published, and the files its ranks sent with their reports:
        # what a warm restart restores from the driver's memory (trainer/run/warm.py).
        self.newest: tuple[str, Manifest, dict[str, bytes]] | None = None

    def begin_attempt(self, attempt: int, world_size: int) -> None:
        """From now on collect the reports of ``attempt`` (``world_size`` ranks). Whatever an earlier
        attempt left incomplete can never complete (its ranks are gone): it is dropped here."""
        for key, parts in sorted(self._reports.items()):
            log.info("bundle %s was not written by every rank of its attempt (ranks %s of %d reported): "
                     "not published; retention removes it", key, sorted({p.rank for p in parts}),
                     self._world_size)
        self._reports = defaultdict(list)
        self._attempt, self._world_size = attempt, world_size

    def collect(self, reports: list[BundleReport]) -> list[Manifest]:
        """Add the current attempt's rank reports; publish every bundle that every rank of the attempt
        has reported. Returns those published, oldest first. Raises :class:`PublishError` when the
        reports of a bundle contradict each other (nothing of it is published)."""
        if self._attempt is None:
            raise RuntimeError("Publisher.collect before begin_attempt")
        done = []
        for r in reports:
            if r.attempt != self._attempt:
                log.warning("ignoring rank %d's report of bundle %s from attempt %d (collecting attempt %d)",
                            r.rank, r.bundle_key, r.attempt, self._attempt)
                continue
            if not 0 <= r.rank < self._world_size:
                raise PublishError(f"bundle {r.bundle_key}: a report from rank {r.rank}, but attempt "
                                   f"{self._attempt} has {self._world_size} ranks")
            self._reports[r.bundle_key].append(r)
        for key in sorted(self._reports):
            parts = self._reports[key]
            if {p.rank for p in parts} != set(range(self._world_size)):
                continue
            del self._reports[key]
            manifest = self._merge(key, parts)
            overlap = next((p.overlap_seconds for p in parts if p.rank == 0), None)
            if self.publish(manifest, key, overlap):
                done.append(manifest)
                self.newest = (key, manifest, {path: blob for p in parts for path, blob in p.shipped.items()})
        return done

    def _merge(self, key: str, parts: list[BundleReport]) -> Manifest:
        """Rank 0's draft with every rank's files: the manifest of a bundle all ranks wrote."""
        draft = next((p.draft for p in parts if p.rank == 0 and p.draft is not None), None)
        if draft is None:
            raise PublishError(f"bundle {key}: every rank reported its files, but rank 0's report carries no "
                               "manifest draft; the bundle is left unpublished")
        if draft["world"]["size"] != self._world_size:
            raise PublishError(f"bundle {key}: the draft says world size {draft['world']['size']}, attempt "
                               f"{self._attempt} has {self._world_size} ranks; the bundle is left unpublished")
        files = sorted((FileEntry(**f) for p in parts for f in p.files), key=lambda f: f.path)
        return Manifest.model_validate({**draft, "files": [f.model_dump() for f in files],
                                        "write_seconds": max(p.write_seconds for p in parts)})

    def publish(self, manifest: Manifest, bundle_key: str, overlap_seconds: float | None = None) -> bool:
        """Create the manifest; False if it already existed (another publisher won). ``overlap_seconds``:
        rank 0's measure of the write's slowdown of training, for the ledger (the manifest has no field)."""
        if not publish(self.storage, manifest, bundle_key):
            return False
        update = manifest.counters.attempted_updates
        self.ledger.append(BundlePublished(
            attempt=manifest.attempt, bundle=bundle_key, update=update, bytes=manifest.total_bytes,
            stall_seconds=manifest.stall_seconds, write_seconds=manifest.write_seconds,
            capture_seconds=manifest.capture_seconds, write_wait_seconds=manifest.write_wait_seconds,
            overlap_seconds=overlap_seconds, storage_retries=self.storage_retries))
        self.after_publish(update)
        self.commit_offsets(manifest, bundle_key, manifest.attempt)
        self.commit_points(manifest, bundle_key)
        self.retain()
        return True

    @property
    def storage_retries(self) -> int:
        return getattr(self.storage, "retries", 0) + self.retries_elsewhere

    def commit_offsets(self, manifest: Manifest, bundle_key: str, attempt: int, recommit: bool = False) -> bool:
        """Commit the bundle's offsets to every store that does not hold them (or newer) yet."""
        if not any([store.commit(manifest) for store in self.offsets]):  # a list: commit to all
            return False
        self.ledger.append(OffsetsCommitted(attempt=attempt, bundle=bundle_key,
                                            update=manifest.counters.attempted_updates, recommit=recommit))
        return True

    def commit_points(self, manifest: Manifest, bundle_key: str) -> None:
        """Send the append-only sinks' points up to the bundle's update (published, or restored: the job
        may have died between its publish and the send); on the committer's own thread."""
        if self.points is not None:
            self.points.commit(manifest, bundle_key)

    def close(self, finished: bool) -> None:
        """Wait for the points asked to be sent (the job ends here): a finished job until they are, a
        stopped or failed one (it may be on a machine about to go) at most :data:`STOPPED_SEND_WAIT_S`."""
        if self.points is not None:
            self.points.close(finished, None if finished else STOPPED_SEND_WAIT_S)

    def retain(self) -> list[str]:
        """Delete superseded bundles; returns the keys deleted."""
        refs = list_bundles(self.storage, self.job_id)
        published = [r for r in refs if r.published]
        if not published:
            return []
        newest = published[0]
        doomed = [r.key for r in published[self.keep_last:]]
        doomed += [r.key for r in refs if not r.published and (r.update, r.attempt) < (newest.update, newest.attempt)]
        for key in doomed:
            self.storage.delete_prefix(key)
        return doomed
