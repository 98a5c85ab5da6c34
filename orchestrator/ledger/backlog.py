"""The ledger's backlog: events appended while the storage refused them, kept in order until it answers
(runs in the driver)."""

from __future__ import annotations

from spotrun.orchestrator.ledger.events import EVENT, LedgerEvent
from spotrun.trainer.storage.spill import MEMORY_BYTES, SpillQueue


def _parse(blob: bytes) -> LedgerEvent:
    return EVENT.validate_json(blob)


class Backlog(SpillQueue[LedgerEvent]):
    """The driver's events the storage has not taken yet: in memory up to ``memory_bytes`` (default 1 MiB,
    ~1,000 events of ~1 KB: hours of an outage's events for a busy job), spilled to a local file past that."""

    def __init__(self, memory_bytes: int = MEMORY_BYTES, spill_dir: str | None = None) -> None:
        super().__init__(_parse, memory_bytes, spill_dir, prefix="spotrun-ledger-")
