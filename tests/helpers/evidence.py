"""A made-up job whose ledger holds the evidence of #49: a hung rank (with its stacks in storage), a
straggler flagged and replaced, and another flagged in the newest attempt and not replaced.

Written straight into storage (no Ray): the readers (history, the CLI, the dashboard, /metrics) are
what is under test.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from spotrun.orchestrator.ledger.events import (
    AttemptStarted,
    BundlePublished,
    Restored,
    Slowdowns,
    StragglerReplacing,
    WorkerLost,
)
from spotrun.orchestrator.ledger.store import Ledger
from spotrun.trainer.storage import Storage

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
NODES = ["node-a", "node-b", "node-c"]
# faulthandler's own words, with what would be markup in a page: it must be shown, never rendered
STACKS_TEXT = ('Thread 0x7f01 (most recent call first):\n  File "step.py", line 9 in <module>\n'
               "<script>alert(1)</script>\n")


def stacks_key(job: str, attempt: int, rank: int) -> str:
    """Where the supervisor keeps a hung rank's stacks (spelled out: the test states the layout it expects)."""
    return f"{job}/logs/attempt-{attempt}/rank-{rank}.stacks.txt"


def write_evidence_job(storage: Storage, job: str) -> None:
    """Three attempts of three ranks: attempt 1 loses rank 2 (hung in backward at update 14; stacks kept)
    and restarts warm from update 10; attempt 2 flags rank 1 (1.9, then 2.4) and replaces it from the
    bundle of update 32; attempt 3 flags rank 2 (1.6, then 1.7) and runs on."""
    t = iter(T0 + timedelta(seconds=10 * i) for i in range(100))
    ledger = Ledger(storage, job)

    def slowdowns(attempt: int, update: int, figures: list[float]) -> Slowdowns:
        by_rank = dict(enumerate(figures))
        stragglers = sorted((r for r, f in by_rank.items() if f >= 1.5), key=lambda r: -by_rank[r])
        return Slowdowns(attempt=attempt, at=next(t), update=update, window=8, ratio=1.5, slowdown=by_rank,
                         stragglers=stragglers, node_ids=NODES)

    def restored(attempt: int, update: int, cause: str) -> Restored:
        return Restored(attempt=attempt, at=next(t), bundle=f"{job}/bundles/u{update:010d}-a{attempt - 1}",
                        update=update, recovery_label="exact", policy="strict", restore_mode="snapshot",
                        restore_seconds=0.5, lost_updates=None, cause=cause, world_size_before=3,
                        world_size_after=3, recovery_path="warm-spare")

    def published(attempt: int, update: int) -> BundlePublished:
        return BundlePublished(attempt=attempt, at=next(t), bundle=f"{job}/bundles/u{update:010d}-a{attempt}",
                               update=update, bytes=1, stall_seconds=0.01, write_seconds=0.1)

    ledger.append(AttemptStarted(attempt=1, at=next(t), world_size=3, node_ids=NODES, pid=1, lineage_id="L"))
    ledger.append(published(1, 10))
    ledger.append(slowdowns(1, 12, [1.0, 1.1, 0.97]))
    storage.put(stacks_key(job, 1, 2), STACKS_TEXT.encode())
    ledger.append(WorkerLost(attempt=1, at=next(t), rank=2, node_id="node-c", host="host-c", cause="hang",
                             loss="failure", detail="no answer for 4.0 s", last_update=14, signal="hang",
                             stopped_phase="backward", stopped_update=14, stacks=stacks_key(job, 1, 2)))
    ledger.append(AttemptStarted(attempt=2, at=next(t), world_size=3, node_ids=NODES, pid=1, lineage_id="L"))
    ledger.append(restored(2, 10, "hang"))
    ledger.append(slowdowns(2, 20, [1.0, 1.9, 1.02]))
    ledger.append(slowdowns(2, 30, [0.99, 2.4, 1.0]))
    ledger.append(StragglerReplacing(attempt=2, at=next(t), rank=1, node_id="node-b", slowdown=2.4, update=31))
    ledger.append(published(2, 32))
    ledger.append(AttemptStarted(attempt=3, at=next(t), world_size=3, node_ids=NODES, pid=1, lineage_id="L"))
    ledger.append(restored(3, 32, "straggler"))
    ledger.append(slowdowns(3, 40, [1.0, 1.05, 1.6]))
    ledger.append(slowdowns(3, 50, [1.01, 1.02, 1.7]))
