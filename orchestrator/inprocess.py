"""Run a job as one rank in this process: resume from the newest published bundle, or start fresh.

The single-process driver (world size 1). It follows the same protocol the Ray
supervisor follows for many ranks: capture at a boundary, write in the
background, publish the manifest once the files are written, then retention.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass

from trainer.bundle import BundleWriter, WriteResult, build_manifest, bundle_dir, load_latest
from trainer.counters import Counters
from trainer.manifest import Manifest
from trainer.session import TrainSession
from trainer.spec import JobSpec
from trainer.storage import open_storage
from trainer.trace import TraceWriter

from orchestrator.ledger import AttemptStarted, BundleRejected, JobFinished, Ledger, Restored
from orchestrator.publisher import Publisher


@dataclass
class RunResult:
    attempt: int
    counters: Counters
    restored_from: str | None
    recovery_label: str
    published: list[str]


def run_in_process(spec: JobSpec, *, trace_path: str | None = None, record_ids: bool = False) -> RunResult:
    storage = open_storage(spec.storage, spec.storage_endpoint_url)
    ledger = Ledger(storage, spec.job_id)
    attempt = ledger.next_attempt()
    session = TrainSession(spec, attempt=attempt, record_ids=record_ids)
    latest, rejected = load_latest(storage, spec.job_id, session.desc)
    for r in rejected:
        ledger.append(BundleRejected(attempt=attempt, bundle=r.bundle_key, reason=r.reason))
    lineage = latest.manifest.lineage_id if latest else uuid.uuid4().hex[:12]
    ledger.append(AttemptStarted(attempt=attempt, world_size=1, pid=os.getpid(), lineage_id=lineage))
    label = "fresh"
    if latest is not None:
        seconds = session.restore(latest)
        label = "exact"
        ledger.append(Restored(
            attempt=attempt, bundle=latest.key, update=latest.manifest.counters.attempted_updates,
            recovery_label=label, policy=spec.world.policy, restore_mode=spec.checkpoint.restore_mode,
            restore_seconds=seconds,
        ))
    publisher = Publisher(storage, ledger, spec.job_id, spec.checkpoint.keep_last)
    writer = BundleWriter(storage, session.faults)
    trace = TraceWriter(trace_path, record_ids) if trace_path else None
    pending: dict[str, Manifest] = {}
    published: list[str] = []

    def finish(result: WriteResult | None) -> None:
        if result is None:
            return
        manifest = pending.pop(result.bundle_key).model_copy(
            update={"files": tuple(sorted(result.files, key=lambda f: f.path)),
                    "write_seconds": result.write_seconds})
        if publisher.publish(manifest, result.bundle_key):
            published.append(result.bundle_key)
        session.faults.hit("after_publish", result.update)

    session.start()
    try:
        while not session.done:
            record = session.run_update()
            if trace:
                trace.write(record)
            finish(writer.poll())
            u = record.update
            if u % spec.checkpoint.every_updates == 0 or u == spec.train.updates:
                prefetched = session.prefetched_ahead
                capture = session.capture()
                key = bundle_dir(spec.job_id, u, attempt)
                pending[key] = build_manifest(
                    session.desc, session.state, bundle_key=key, lineage_id=lineage, attempt=attempt,
                    recovery_label=label, files=[], accum_steps=session.accum_steps,
                    prefetched_ahead=prefetched, stall_seconds=capture.stall_seconds, write_seconds=0.0)
                finish(writer.submit(capture, key))
        finish(writer.wait())
    finally:
        writer.close()
        session.close()
        if trace:
            trace.close()
    ledger.append(JobFinished(attempt=attempt, counters=session.counters))
    return RunResult(attempt, session.counters, latest.key if latest else None, label, published)
