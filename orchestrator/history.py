"""Views of a job built from its storage: the restart history and the bundles table.

Both are plain dicts (what ``--json`` prints); the CLI renders them as tables.
"""

from __future__ import annotations

from typing import Any

from trainer.bundle import list_bundles, read_manifest
from trainer.manifest import ManifestError
from trainer.storage import Storage

from orchestrator.ledger import (
    AttemptStarted,
    BundlePublished,
    BundleRejected,
    CorruptEvent,
    JobFailed,
    JobFinished,
    Ledger,
    Restored,
)


def history(storage: Storage, job_id: str) -> dict[str, Any]:
    """Attempts, and one row per restart with what it cost."""
    events = Ledger(storage, job_id).read()
    attempts: dict[int, dict[str, Any]] = {}
    restarts: list[dict[str, Any]] = []
    corrupt = []
    state = "unknown"
    for e in events:
        if isinstance(e, CorruptEvent):
            corrupt.append(e.model_dump())
            continue
        a = attempts.setdefault(e.attempt, {"attempt": e.attempt, "started_at": None, "world_size": None,
                                            "published": 0, "last_update": None, "ended": None})
        if isinstance(e, AttemptStarted):
            a.update(started_at=e.at.isoformat(), world_size=e.world_size, lineage_id=e.lineage_id)
            state = "running"
        elif isinstance(e, BundlePublished):
            a["published"] += 1
            a["last_update"] = e.update
        elif isinstance(e, Restored):
            prev = attempts.get(e.attempt - 1, {})
            restarts.append({
                "attempt": e.attempt,
                "cause": e.cause or ("process-exit" if prev.get("ended") is None else "resumed"),
                "detected_at": e.at.isoformat(),
                "restored_from": e.bundle,
                "restored_update": e.update,
                "recovery_label": e.recovery_label,
                "policy": e.policy,
                "restore_mode": e.restore_mode,
                "world_size_before": prev.get("world_size"),
                "world_size_after": a["world_size"],
                "lost_updates": e.lost_updates,
                "restore_seconds": round(e.restore_seconds, 4),
            })
        elif isinstance(e, BundleRejected):
            a.setdefault("rejected", []).append({"bundle": e.bundle, "reason": e.reason})
        elif isinstance(e, JobFinished):
            a["ended"] = "finished"
            a["last_update"] = e.counters.attempted_updates
            state = "finished"
        elif isinstance(e, JobFailed):
            a["ended"] = f"failed: {e.reason}"
            state = "failed"
    return {"job_id": job_id, "state": state, "attempts": list(attempts.values()),
            "restarts": restarts, "corrupt_events": corrupt}


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
            except (ManifestError, OSError) as e:
                row["error"] = str(e)
        rows.append(row)
    return rows
