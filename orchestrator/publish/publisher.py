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

A full disk (file storage) is an outage with a remedy: when a write was refused for want of room
(a rank's bundle write, as its report says, or this publisher's own manifest write),
:meth:`Publisher.make_room` removes the published bundles older than the newest one, and the unpublished
folders older than it, so that the next checkpoint fits; until new bundles are published the job then
keeps fewer than ``keep_last``. The newest published bundle is never removed.

A storage outage delays publication, it never ends the job: a complete bundle whose manifest cannot be
written waits (oldest first) and is published when the outage's capped backoff next allows, by a later
:meth:`Publisher.collect`; offsets that could not be committed are committed then too; retention skips
a round rather than fail (it never removes the newest published bundle). A manifest that landed before
its reply was lost is recognised as ours. When the ranks have finished, :meth:`Publisher.collect` with
``wait`` rides the outage out (a permanent refusal ends the job once it persisted ``outage_s``).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from spotrun.orchestrator.ledger.events import BundlePublished, OffsetsCommitted
from spotrun.orchestrator.ledger.store import Ledger
from spotrun.orchestrator.publish.metric_commit import MetricCommitter
from spotrun.orchestrator.publish.offsets import OffsetsStore
from spotrun.trainer.bundle.bundles import list_bundles, publish
from spotrun.trainer.bundle.manifest import FileEntry, Manifest, ManifestError, parse_manifest
from spotrun.trainer.run.rank import BundleReport
from spotrun.trainer.storage import Outage, Storage, StorageError, StorageFullError
from spotrun.trainer.storage.outage import DEFAULT_BOUND_S

log = logging.getLogger("spotrun.publisher")
STOPPED_SEND_WAIT_S = 10.0  # a stopped or failed job's wait for its last metric sends (the rest: the next run)


class PublishError(RuntimeError):
    """The ranks' reports of a bundle contradict each other; nothing was published from them."""


@dataclass(frozen=True)
class _Ready:
    """A bundle every rank wrote, merged, waiting for its manifest to be written."""

    key: str
    manifest: Manifest
    overlap: float | None
    shipped: dict[str, bytes]


@dataclass(frozen=True)
class Pruned:
    """What :meth:`Publisher.make_room` removed: published bundles, oldest first, and the bytes their
    manifests record (files and manifest; the unpublished folders also removed are not counted)."""

    bundles: list[str]
    freed_bytes: int


class Publisher:
    def __init__(self, storage: Storage, ledger: Ledger, job_id: str, keep_last: int,
                 after_publish: Callable[[int], None] = lambda update: None,
                 source_offsets: OffsetsStore | None = None, points: MetricCommitter | None = None,
                 outage_s: float = DEFAULT_BOUND_S) -> None:
        """``outage_s``: how long a permanent-looking refusal must persist before it is raised."""
        self.storage = storage
        self.outage = Outage(f"publishing {job_id}", outage_s)
        self._ready: list[_Ready] = []  # complete, unpublished while the storage is unavailable; oldest first
        self._tried: set[str] = set()  # bundles whose manifest write failed: it may have landed
        self._offsets_due: tuple[Manifest, str, int] | None = None  # a commit the outage held back
        self._full: str | None = None  # a manifest write refused for want of room, not yet made room for
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
        for ready in self._ready:  # the new attempt starts from a published bundle: these stay orphans
            log.info("bundle %s was not published: the storage was unavailable until its attempt ended; "
                     "retention removes it", ready.key)
        self._reports, self._ready = defaultdict(list), []
        self._attempt, self._world_size = attempt, world_size

    def collect(self, reports: list[BundleReport], wait: bool = False) -> list[Manifest]:
        """Add the current attempt's rank reports; publish every bundle that every rank of the attempt
        has reported, and those an outage held back. Returns those published, oldest first. Raises
        :class:`PublishError` when the reports of a bundle contradict each other (nothing of it is
        published). ``wait``: ride out an outage until every complete bundle is published (the ranks
        have finished); else what the storage refuses waits for a later call."""
        if self._attempt is None:
            raise RuntimeError("Publisher.collect before begin_attempt")
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
            self._ready.append(_Ready(key, manifest, overlap,
                                      {path: blob for p in parts for path, blob in p.shipped.items()}))
        return self._publish_ready(wait)

    def _publish_ready(self, wait: bool) -> list[Manifest]:
        """Publish the waiting bundles in order, and commit offsets an outage held back; those published."""
        done = []
        while self._ready or self._offsets_due is not None:
            if not wait and not self.outage.due():
                break
            try:
                if self._offsets_due is not None:
                    manifest, key, attempt = self._offsets_due
                    self._call(partial(self._commit_offsets, manifest, key, attempt, False), wait)
                    self._offsets_due = None
                    continue
                ready = self._ready[0]
                ours = self._call(partial(self._create, ready.manifest, ready.key), wait)
            except StorageError as e:
                self.outage.failed(e)  # raises a permanent refusal past the bound
                log.warning("publish deferred (storage unavailable for %.0f s): %s", self.outage.down_s(), e)
                if isinstance(e, StorageFullError):
                    self._full = str(e)
                break
            self.outage.recovered()
            del self._ready[0]
            if ours:
                self._after_create(ready.manifest, ready.key, ready.overlap)
                done.append(ready.manifest)
                self.newest = (ready.key, ready.manifest, ready.shipped)
        return done

    def _call(self, fn: Callable[[], bool], wait: bool) -> bool:
        return self.outage.call(fn) if wait else fn()

    @property
    def waiting(self) -> int:
        """Complete bundles waiting for the storage to publish them."""
        return len(self._ready)

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
        if not self._create(manifest, bundle_key):
            return False
        self._after_create(manifest, bundle_key, overlap_seconds)
        return True

    def _create(self, manifest: Manifest, bundle_key: str) -> bool:
        """Create the manifest; False if another publisher's is there. A write that failed may have landed:
        the next try finds our own bytes and says True."""
        try:
            if publish(self.storage, manifest, bundle_key):
                return True
        except StorageError:
            self._tried.add(bundle_key)
            raise
        if bundle_key in self._tried and self.storage.get(f"{bundle_key}/manifest.json") == manifest.to_json():
            self._tried.discard(bundle_key)
            return True
        return False

    def _after_create(self, manifest: Manifest, bundle_key: str, overlap_seconds: float | None) -> None:
        """What follows the commit point: the ledger event, offsets, metric points, retention. An outage
        here costs nothing: offsets wait for the next try, retention for the next publish."""
        update = manifest.counters.attempted_updates
        self.ledger.append(BundlePublished(
            attempt=manifest.attempt, bundle=bundle_key, update=update, bytes=manifest.total_bytes,
            stall_seconds=manifest.stall_seconds, write_seconds=manifest.write_seconds,
            capture_seconds=manifest.capture_seconds, write_wait_seconds=manifest.write_wait_seconds,
            overlap_seconds=overlap_seconds, storage_retries=self.storage_retries))
        self.after_publish(update)
        try:
            self.commit_offsets(manifest, bundle_key, manifest.attempt)
        except StorageError as e:
            self.outage.failed(e)
            self._offsets_due = (manifest, bundle_key, manifest.attempt)
            log.warning("offsets of %s not committed yet (storage unavailable): %s", bundle_key, e)
        self.commit_points(manifest, bundle_key)
        try:
            self.retain()
        except StorageError as e:  # the next publish retains; the newest published bundle is never a candidate
            self.outage.failed(e)
            log.warning("retention skipped (storage unavailable): %s", e)

    @property
    def storage_retries(self) -> int:
        return getattr(self.storage, "retries", 0) + self.retries_elsewhere

    def _commit_offsets(self, manifest: Manifest, bundle_key: str, attempt: int, recommit: bool) -> bool:
        self.commit_offsets(manifest, bundle_key, attempt, recommit)
        return True

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

    def take_full(self) -> str | None:
        """The error of a manifest write this publisher had refused for want of room since the last call
        (the caller makes room, :meth:`make_room`), else None."""
        full, self._full = self._full, None
        return full

    def make_room(self, reason: str) -> Pruned | None:
        """A write was refused for want of room (``reason``: its error): remove every published bundle
        older than the newest, oldest first, and the unpublished folders older than the newest (what
        retention would remove), so that the next checkpoint fits. The newest published bundle is never
        removed: it is what the job restarts from. Returns what was removed (None: nothing was). A
        storage refusal stops it: what was removed by then is returned, the rest waits for the next
        full-disk report or retention."""
        removed: list[str] = []
        freed = 0
        try:
            older, orphans = self._superseded(keep=1)
            for key in reversed(older):
                freed += self._recorded_bytes(key)
                self._remove(key)
                removed.append(key)
            for key in orphans:
                self.storage.delete_prefix(key)
        except StorageError as e:
            log.warning("making room on the full storage stopped (%d bundles removed): %s", len(removed), e)
        if not removed:
            return None
        log.warning("storage full (%s): removed %d older bundles (%d bytes) so that the next checkpoint fits; "
                    "the newest published bundle is kept", reason, len(removed), freed)
        return Pruned(removed, freed)

    def _recorded_bytes(self, key: str) -> int:
        """A published bundle's bytes as its manifest records them (its files and the manifest); 0 when
        the manifest cannot be read (it is removed all the same: older than the newest)."""
        try:
            blob = self.storage.get(f"{key}/manifest.json")
            return parse_manifest(blob, f"bundle {key}").total_bytes + len(blob)
        except (FileNotFoundError, ManifestError) as e:
            log.warning("bundle %s: size unknown (%s)", key, e)
            return 0

    def _remove(self, key: str) -> None:
        """Remove a published bundle, its manifest first: a removal cut short leaves an unpublished folder
        (never read, removed by retention), never a published bundle with files missing."""
        self.storage.delete([f"{key}/manifest.json"])
        self.storage.delete_prefix(key)

    def retain(self) -> list[str]:
        """Delete superseded bundles; returns the keys deleted."""
        older, orphans = self._superseded(keep=self.keep_last)
        for key in older:
            self._remove(key)
        for key in orphans:
            self.storage.delete_prefix(key)
        return older + orphans

    def _superseded(self, keep: int) -> tuple[list[str], list[str]]:
        """What a newer published bundle supersedes: the published bundles beyond the newest ``keep`` (newest
        first), and the unpublished folders older than the newest published one (a newer one may be a write
        in flight). Nothing while none is published: every folder may be a write in flight."""
        refs = list_bundles(self.storage, self.job_id)
        published = [r for r in refs if r.published]
        if not published:
            return [], []
        newest = published[0]
        return ([r.key for r in published[keep:]],
                [r.key for r in refs if not r.published and (r.update, r.attempt) < (newest.update, newest.attempt)])
