"""The publish step: the manifest (the commit point), then retention.

Only the publisher writes manifests. Retention runs after a publish and only
removes what a newer published bundle supersedes: published bundles beyond
``keep_last``, and unpublished (orphaned) directories older than the newest
published bundle. A directory newer than it may be a write still in flight.
"""

from __future__ import annotations

from trainer.bundle import list_bundles, publish
from trainer.manifest import Manifest
from trainer.storage import Storage

from orchestrator.ledger import BundlePublished, Ledger


class Publisher:
    def __init__(self, storage: Storage, ledger: Ledger, job_id: str, keep_last: int) -> None:
        self.storage = storage
        self.ledger = ledger
        self.job_id = job_id
        self.keep_last = keep_last

    def publish(self, manifest: Manifest, bundle_key: str) -> bool:
        """Create the manifest; False if it already existed (another publisher won)."""
        if not publish(self.storage, manifest, bundle_key):
            return False
        self.ledger.append(BundlePublished(
            attempt=manifest.attempt, bundle=bundle_key, update=manifest.counters.attempted_updates,
            bytes=manifest.total_bytes, stall_seconds=manifest.stall_seconds,
            write_seconds=manifest.write_seconds,
        ))
        self.retain()
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
