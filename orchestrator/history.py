"""Views of a job built from its storage: the restart history and the bundles table.

Both are plain dicts (what ``--json`` prints); the CLI renders them as tables.
"""

from __future__ import annotations

from typing import Any

from spotrun.trainer.bundle import BundleCorrupt, list_bundles, read_manifest
from spotrun.trainer.manifest import ManifestError
from spotrun.trainer.storage import Storage

from spotrun.orchestrator.ledger import (
    AttemptStarted,
    BundlePublished,
    BundleRejected,
    CorruptEvent,
    InitializedFrom,
    JobFailed,
    JobFinished,
    Ledger,
    NoticeHandled,
    Resizing,
    Restored,
    TopologyChanged,
    WorkerLost,
)


def history(storage: Storage, job_id: str) -> dict[str, Any]:
    """Attempts, and one row per restart with its cause and what it cost.

    A restart row joins the loss that ended an attempt (``worker_lost``; absent when
    the driver itself died) with the restore that began the next one."""
    events = Ledger(storage, job_id).read()
    attempts: dict[int, dict[str, Any]] = {}
    restarts: list[dict[str, Any]] = []
    losses: dict[int, WorkerLost] = {}
    handled: dict[int, NoticeHandled] = {}
    corrupt, topology, rejected = [], [], []
    state = "unknown"
    for e in events:
        if isinstance(e, CorruptEvent):
            corrupt.append(e.model_dump())
            continue
        a = attempts.setdefault(e.attempt, {"attempt": e.attempt, "started_at": None, "ended_at": None,
                                            "world_size": None, "node_ids": [], "published": 0,
                                            "last_update": None, "ended": None})
        a["ended_at"] = e.at.isoformat()
        if isinstance(e, AttemptStarted):
            a.update(started_at=e.at.isoformat(), world_size=e.world_size, node_ids=e.node_ids,
                     lineage_id=e.lineage_id)
            state = "running"
        elif isinstance(e, BundlePublished):
            a["published"] += 1
            a["last_update"] = max(a["last_update"] or 0, e.update)
        elif isinstance(e, NoticeHandled):
            handled[e.attempt] = e
        elif isinstance(e, WorkerLost):
            losses[e.attempt] = e
            a.update(ended=f"lost: {e.cause}", last_update=e.last_update)
        elif isinstance(e, Resizing):
            a.update(ended=f"scale-up to {e.world_size_target}")
        elif isinstance(e, Restored):
            loss = losses.get(e.attempt - 1)
            previous_ended = attempts.get(e.attempt - 1, {}).get("ended")
            restarts.append({
                "attempt": e.attempt,
                # no loss recorded: the driver itself died (or a finished job was run again)
                "cause": loss.cause if loss else ("scale-up" if e.cause == "scale-up" else
                                                  "resumed" if previous_ended else "driver-exit"),
                "detected_at": (loss.at if loss else e.at).isoformat(),
                "restored_from": e.bundle,
                "restored_update": e.update,
                "recovery_label": e.recovery_label,
                "policy": e.policy,
                "restore_mode": e.restore_mode,
                "world_size_before": e.world_size_before,
                "world_size_after": e.world_size_after,
                "lost_updates": e.lost_updates,
                "restore_seconds": round(e.restore_seconds, 4),
                "downtime_seconds": round((e.at - loss.at).total_seconds(), 3) if loss else None,
                "notice_to_publish_seconds": (handled[e.attempt - 1].notice_to_publish_seconds
                                              if e.attempt - 1 in handled else None),
            })
        elif isinstance(e, InitializedFrom):
            a.update(initialized_from=e.bundle, recovery_label=e.recovery_label, reset=e.reset)
        elif isinstance(e, TopologyChanged):
            topology.append(e.model_dump(mode="json"))
        elif isinstance(e, BundleRejected):
            rejected.append(e.model_dump(mode="json"))
        elif isinstance(e, JobFinished):
            a["ended"] = "finished"
            a["last_update"] = e.counters.attempted_updates
            state = "finished"
        elif isinstance(e, JobFailed):
            a["ended"] = f"failed: {e.reason}"
            state = "failed"
    return {"job_id": job_id, "state": state, "attempts": list(attempts.values()), "restarts": restarts,
            "topology_changes": topology, "rejected_bundles": rejected, "corrupt_events": corrupt}


def bundles(storage: Storage, job_id: str) -> list[dict[str, Any]]:
    rows = []
    for ref in list_bundles(storage, job_id):
        row: dict[str, Any] = {"bundle": ref.key, "update": ref.update, "attempt": ref.attempt,
                               "published": ref.published}
        if ref.published:
            try:
                m = read_manifest(storage, ref.key)
                row.update(bytes=m.total_bytes, stall_seconds=m.stall_seconds, write_seconds=m.write_seconds,
                           cursor=m.data.cursor.model_dump(), recovery_label=m.recovery_label,
                           created_at=m.created_at.isoformat())
            except (ManifestError, BundleCorrupt, OSError) as e:  # e.g. retention removed it meanwhile
                row["error"] = str(e)
        rows.append(row)
    return rows
