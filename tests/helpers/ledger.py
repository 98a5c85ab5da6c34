"""A made-up job's ledger events for the folding tests, and the names its objects get."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from spotrun.orchestrator.ledger.events import AttemptStarted, BundlePublished, OffsetsCommitted
from spotrun.orchestrator.ledger.folding import FoldPolicy
from spotrun.trainer.storage import Storage

POLICY = FoldPolicy(block=4, fanout=2, levels=3)  # segments of 4, 8 and 16 events
T0 = datetime(2026, 12, 1, tzinfo=UTC)


def event(i: int, tag: str = "") -> AttemptStarted | BundlePublished | OffsetsCommitted:
    """The ``i``-th event of a made-up job: an attempt every 10 events, else a bundle's two events;
    ``tag`` marks whose event it is (in its lineage id or bundle name)."""
    at, attempt = T0 + timedelta(seconds=30 * i), 1 + i // 10
    if i % 10 == 0:
        return AttemptStarted(attempt=attempt, world_size=2, pid=i, lineage_id=tag or "L", at=at)
    if i % 2:
        return BundlePublished(attempt=attempt, bundle=f"b{tag}{i}", update=i, bytes=1, stall_seconds=0.1,
                               write_seconds=0.2, at=at)
    return OffsetsCommitted(attempt=attempt, bundle=f"b{tag}{i - 1}", update=i - 1, at=at)


def names(storage: Storage, job: str = "j") -> list[str]:
    """The job's ledger objects, relative to its events folder."""
    return [k.split("/events/", 1)[1] for k in storage.list(f"{job}/events")]


def singles(*seqs: int) -> list[str]:
    return [f"{n:012d}.json" for n in seqs]


def segment(first: int, last: int) -> str:
    return f"segments/{first:012d}-{last:012d}.jsonl"
