"""What a growing source contributed at each rescan, decided once for every rank.

Every rank plans the same global stream, so every rank rescans a growing source at
the same point of it, but not at the same instant: a shard that lands in between
would give two ranks different listings, and from then on different plans. So the
first rank to reach a rescan point records what it found, create-only, at
``<job_id>/source/<lineage_id>/e<epoch>-r<records>.json``; the others adopt that
record (by name and hash, reading a shard their own rescan missed). A restored
attempt of the same lineage reaching a point that a lost attempt had already
passed adopts the lost attempt's record too, so it reads what that attempt read.

The records are JSON validated by :class:`~spotrun.trainer.data.listing.ShardInfo` (plain
file names only), never unpickled.
"""

from __future__ import annotations

import json

from pydantic import TypeAdapter

from spotrun.trainer.data.listing import ShardInfo
from spotrun.trainer.storage import Storage

_RECORD = TypeAdapter(list[ShardInfo])


class GrowthRecords:
    def __init__(self, storage: Storage, job_id: str, lineage_id: str) -> None:
        self.storage = storage
        self.prefix = f"{job_id}/source/{lineage_id}"

    def decide(self, epoch: int, records: int, found: list[ShardInfo]) -> list[ShardInfo]:
        """The shards the rescan at (``epoch``, ``records`` known) contributes: ``found`` if this
        process is the first to record it, else what the first one recorded."""
        key = f"{self.prefix}/e{epoch:06d}-r{records:012d}.json"
        if self.storage.put_new(key, json.dumps([f.model_dump() for f in found]).encode()):
            return found
        return _RECORD.validate_json(self.storage.get(key))
