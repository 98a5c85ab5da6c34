"""Rank write reports of scripted bundles, for driving the supervisor's publisher without ranks."""

from __future__ import annotations

from pathlib import Path

from spotrun.orchestrator.control.launch import run_in_process
from spotrun.trainer.bundle.bundles import bundle_dir, list_bundles, read_manifest
from spotrun.trainer.run.rank import BundleReport
from spotrun.trainer.storage import LocalStorage
from tests.conftest import make_spec

SHA = "0" * 64


def real_draft(tmp: Path) -> dict:
    """A manifest draft as rank 0 makes one (from a real in-process run), minus its files."""
    run_in_process(make_spec(tmp, "train.updates=5", job_id="d"))
    storage = LocalStorage(tmp / "runs")
    m = read_manifest(storage, list_bundles(storage, "d")[0].key).model_dump(mode="json")
    for k in ("files", "write_seconds"):
        m.pop(k)
    return m


def draft_for(base: dict, job: str, update: int, attempt: int, world: int) -> dict:
    return {**base, "job_id": job, "bundle_id": bundle_dir(job, update, attempt).rsplit("/", 1)[-1],
            "attempt": attempt, "world": {**base["world"], "size": world},
            "counters": {**base["counters"], "attempted_updates": update}}


def part(job: str, rank: int, update: int, attempt: int, world: int, base: dict) -> BundleReport:
    """Rank ``rank``'s report of its write of bundle u<update>-a<attempt>."""
    return BundleReport(rank=rank, attempt=attempt, bundle_key=bundle_dir(job, update, attempt), update=update,
                        files=[{"path": f"rank-{rank}/rng.json", "bytes": 10, "sha256": SHA}], write_seconds=0.1,
                        draft=draft_for(base, job, update, attempt, world) if rank == 0 else None)
