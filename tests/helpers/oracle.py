"""The in-process oracle harness: a reference run, then restores from its bundles."""

from __future__ import annotations

from spotrun.orchestrator.control.launch import run_in_process
from spotrun.trainer.bundle.bundles import list_bundles, load_bundle
from spotrun.trainer.job.spec import JobSpec
from spotrun.trainer.observe.trace import UpdateRecord, read_trace
from spotrun.trainer.run.context import Instrumentation
from spotrun.trainer.run.session import TrainSession
from spotrun.trainer.storage import open_storage


def reference_run(spec: JobSpec, trace_path) -> tuple[list[UpdateRecord], list[str]]:
    """Run ``spec`` uninterrupted, keeping every bundle; the trace and the published bundle keys."""
    spec = spec.model_copy(update={"checkpoint": spec.checkpoint.model_copy(update={"keep_last": 10_000})})
    run_in_process(spec, trace_path=str(trace_path), record_ids=True)
    storage = open_storage(spec.storage)
    keys = [r.key for r in sorted(list_bundles(storage, spec.job_id), key=lambda r: r.update) if r.published]
    return read_trace(trace_path), keys


def resume(spec: JobSpec, bundle_key: str, updates: int, *, restore_mode: str | None = None,
           drop: tuple[str, ...] = (), record_ids: bool = True) -> list[UpdateRecord]:
    """Fresh objects restored from ``bundle_key``, then ``updates`` more updates (or until the job ends)."""
    session = TrainSession(spec, attempt=2, restore_mode=restore_mode,
                           instrument=Instrumentation(trace=True, record_ids=record_ids, drop=drop))
    try:
        session.restore(load_bundle(open_storage(spec.storage), bundle_key, session.desc))
        session.start()
        out = []
        for _ in range(updates):
            if session.done:
                break
            out.append(session.run_update())
        return out
    finally:
        session.close()
