"""The publish step, in its fixed order: manifest (the commit point), offsets, retention.

Only the publisher writes manifests. The manifest is merged from rank 0's
draft and every rank's file list once all ranks have reported their write.
Retention runs last and only removes what a newer published bundle supersedes:
published bundles beyond ``keep_last``, and unpublished (orphaned) directories
older than the newest published bundle; a newer one may be a write in flight.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

from trainer.bundle import list_bundles, publish
from trainer.manifest import FileEntry, Manifest
from trainer.rank import BundleReport
from trainer.storage import Storage

from orchestrator.ledger import BundlePublished, Ledger, OffsetsCommitted
from orchestrator.offsets import OffsetsStore


class Publisher:
    def __init__(self, storage: Storage, ledger: Ledger, job_id: str, keep_last: int,
                 after_publish: Callable[[int], None] = lambda update: None,
                 source_offsets: OffsetsStore | None = None) -> None:
        self.storage = storage
        self.ledger = ledger
        self.job_id = job_id
        self.keep_last = keep_last
        self.offsets = [OffsetsStore(storage, job_id), *([source_offsets] if source_offsets else [])]
        self.after_publish = after_publish  # a fault-injection seam between commit point and offsets
        self._reports: dict[str, list[BundleReport]] = defaultdict(list)
        self.retries_elsewhere = 0  # storage retries the ranks reported (the supervisor keeps it current)

    def collect(self, reports: list[BundleReport], world_size: int) -> list[Manifest]:
        """Add rank reports; publish every bundle whose ranks have all reported. Returns those published."""
        done = []
        for r in reports:
            self._reports[r.bundle_key].append(r)
        for key in sorted(self._reports):
            parts = self._reports[key]
            if len({p.rank for p in parts}) < world_size:
                continue
            del self._reports[key]
            draft = next(p.draft for p in parts if p.draft is not None)
            files = sorted((FileEntry(**f) for p in parts for f in p.files), key=lambda f: f.path)
            manifest = Manifest.model_validate(
                {**draft, "files": [f.model_dump() for f in files],
                 "write_seconds": max(p.write_seconds for p in parts)})
            if self.publish(manifest, key):
                done.append(manifest)
        return done

    def publish(self, manifest: Manifest, bundle_key: str) -> bool:
        """Create the manifest; False if it already existed (another publisher won)."""
        if not publish(self.storage, manifest, bundle_key):
            return False
        update = manifest.counters.attempted_updates
        self.ledger.append(BundlePublished(
            attempt=manifest.attempt, bundle=bundle_key, update=update, bytes=manifest.total_bytes,
            stall_seconds=manifest.stall_seconds, write_seconds=manifest.write_seconds,
            storage_retries=self.storage_retries))
        self.after_publish(update)
        self.commit_offsets(manifest, bundle_key, manifest.attempt)
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
