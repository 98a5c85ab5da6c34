"""The oracle at every boundary: a restore takes the next updates exactly as the uninterrupted run did."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from spotrun.trainer.bundle.bundles import load_bundle
from spotrun.trainer.observe.trace import first_divergence, read_trace
from spotrun.trainer.storage import open_storage
from tests.conftest import ROOT
from tests.helpers.oracle import reference_run, resume

K = 5
# Every difficult piece is live: a non-empty shuffle buffer at each boundary, a prefetching
# worker two batches deep, accumulation over 2 microsteps, dropout drawing from torch's stream.
ORACLE_SET = ("train.updates=35", "checkpoint.every_updates=5", "data.shuffle_buffer=16", "data.workers=1",
              "data.prefetch=2", "train.accum_steps=2", "model.dropout=0.2", "data.seq_len=64")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    from tests.conftest import make_spec

    tmp = tmp_path_factory.mktemp("oracle")
    spec = make_spec(tmp, *ORACLE_SET, job_id="oracle")
    trace, keys = reference_run(spec, tmp / "ref.jsonl")
    return spec, trace, keys, tmp


def test_reference_has_live_state_at_every_boundary(reference):
    """The oracle is only meaningful if the hard state is non-empty where bundles are taken."""
    spec, trace, keys, _ = reference
    assert len(trace) == 35 and len(keys) == 7
    storage = open_storage(spec.storage)
    remainders = 0
    epochs = set()
    for key in keys:
        planner = load_bundle(storage, key, None).payloads["rank-0/state.json"]["planner"]
        assert planner["snapshot"]["stream"]["buffer"], f"{key}: shuffle buffer empty at the boundary"
        remainders += planner["snapshot"]["packer"]["remainder"] is not None
        manifest = load_bundle(storage, key, None).manifest
        epochs.add(manifest.data.cursor.epoch)
        if manifest.counters.attempted_updates < 35:  # the last bundle has nothing left to prefetch
            assert manifest.data.prefetched_ahead >= 2
    assert epochs == {0, 1}, "the run should cross an epoch boundary"
    assert remainders >= len(keys) - 1, "the packer remainder should straddle nearly every boundary"


@pytest.mark.parametrize("mode", ["snapshot", "replay"])
def test_every_boundary_restores_exactly(reference, mode):
    """For each published boundary u, updates u+1..u+K are bitwise equal (occurrences and parameters)."""
    spec, trace, keys, _ = reference
    by_update = {r.update: r for r in trace}
    for key in keys:
        resumed = resume(spec, key, K, restore_mode=mode)
        u = load_bundle(open_storage(spec.storage), key, None).manifest.counters.attempted_updates
        assert [r.update for r in resumed] == list(range(u + 1, min(u + K, 35) + 1))
        assert first_divergence(trace, resumed) is None, f"{mode} restore from {key} diverged"
        for r in resumed:  # the ids themselves, not only their digest
            assert r.occurrences == by_update[r.update].occurrences


def test_fresh_process_resume_matches(reference, tmp_path):
    """A real `spotrun run` in a new process, given only the boundary-15 bundle, finishes identically."""
    spec, trace, keys, tmp = reference
    key = next(k for k in keys if k.endswith("u0000000015-a1"))
    src = open_storage(spec.storage)
    dst_root = tmp_path / "runs"
    shutil.copytree(src.root / key, dst_root / key)
    out = tmp_path / "resumed.jsonl"
    cmd = [sys.executable, "-m", "spotrun", "run", str(ROOT / "configs/tiny.yaml"), "--no-ray",
           "--job-id", "oracle",
           "--trace", str(out), "--set", f"storage=file://{dst_root}",
           "--set", f"data.shards={ROOT / 'configs/data/tiny'}", *[a for s in ORACLE_SET for a in ("--set", s)]]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
    resumed = read_trace(out)
    assert [r.update for r in resumed] == list(range(16, 36))
    assert first_divergence(trace, resumed) is None


def test_worker_count_may_change(reference):
    """The cursor is global: restoring with 0 or 2 loader workers gives the same next updates."""
    spec, trace, keys, _ = reference
    for workers in (0, 2):
        other = spec.model_copy(update={"data": spec.data.model_copy(update={"workers": workers})})
        resumed = resume(other, keys[2], K)
        assert len(resumed) == K
        assert first_divergence(trace, resumed) is None, f"workers={workers} diverged"
