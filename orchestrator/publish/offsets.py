"""Reader offsets, committed after a bundle is published.

Two stores, one rule. ``<job_id>/offsets/`` in the job's storage holds the data
cursor of every published bundle; with a streaming reader (``data.order:
sequential``) the per-shard record offsets are also committed under the source
itself, ``<data.shards>/_consumers/<job_id>/``, where other systems (retention of
consumed shards, a producer's dashboard) look. An entry appears only for a
published bundle, entries are create-only and keyed by the bundle's update, and
the newest entry never moves backwards. A restore re-commits the restored
bundle's offsets if a store lags behind it (the job died between publish and commit).
"""

from __future__ import annotations

import json
from typing import Any

from spotrun.trainer.bundle.manifest import Manifest
from spotrun.trainer.storage import Storage


class OffsetsStore:
    def __init__(self, storage: Storage, job_id: str, *, under_source: bool = False) -> None:
        self.storage = storage
        self.prefix = f"_consumers/{job_id}/" if under_source else f"{job_id}/offsets/"

    def latest(self) -> dict[str, Any] | None:
        keys = [k for k in self.storage.list(self.prefix) if k.endswith(".json")]
        return json.loads(self.storage.get(keys[-1])) if keys else None

    def commit(self, manifest: Manifest) -> bool:
        """Commit ``manifest``'s offsets; False if already committed or older than the newest entry."""
        update = manifest.counters.attempted_updates
        latest = self.latest()
        if latest is not None and latest["update"] >= update:
            return False
        entry = {
            "update": update,
            "bundle": manifest.bundle_id,
            "lineage_id": manifest.lineage_id,
            "dataset_version": manifest.data.dataset_version,
            "cursor": manifest.data.cursor.model_dump(),
            "epoch": manifest.data.cursor.epoch,
            "records_consumed": manifest.data.source_offsets,
        }
        return self.storage.put_new(f"{self.prefix}u{update:010d}.json", json.dumps(entry, indent=2).encode())
