"""An fp16 overflow skips the optimizer step: applied < attempted, and the scheduler follows its declared counter."""

from __future__ import annotations

import pytest

from spotrun.orchestrator.control.launch import run_in_process
from spotrun.trainer.bundle.bundles import list_bundles, load_bundle
from spotrun.trainer.observe.trace import read_trace
from spotrun.trainer.storage import open_storage

# A scale of 2^40 overflows fp16 activations' gradients: the scaler halves it on every
# overflow, so the first updates are skipped until the scale is small enough.
FP16 = ("train.updates=30", "checkpoint.every_updates=30", "train.precision=fp16",
        "train.grad_scaler.init_scale=1099511627776", "model.dropout=0.0")


@pytest.mark.parametrize("counts", ["applied", "attempted"])
def test_forced_overflow_skips_and_scheduler_follows_declared_counter(spec_factory, tmp_path, counts):
    spec = spec_factory(*FP16, f"train.scheduler_counts={counts}", job_id=f"fp16-{counts}")
    result = run_in_process(spec, trace_path=str(tmp_path / "t.jsonl"))
    c = result.counters
    assert c.attempted_updates == 30
    assert 0 < c.applied_updates < c.attempted_updates
    trace = read_trace(tmp_path / "t.jsonl")
    assert sum(r.applied for r in trace) == c.applied_updates
    storage = open_storage(spec.storage)
    final = load_bundle(storage, list_bundles(storage, spec.job_id)[0].key, None)
    scheduler = final.payloads["rank-0/optimizer.pt"]["scheduler"]
    expected = c.applied_updates if counts == "applied" else c.attempted_updates
    assert scheduler["last_epoch"] == expected
    # While updates are skipped under "applied", the LR stays at its first warmup value.
    skipped_lrs = {r.lr for r in trace if not r.applied and r.update <= 3}
    if counts == "applied":
        assert len(skipped_lrs) == 1
    else:
        assert len(skipped_lrs) == 3
    assert final.manifest.counters.last_update_applied == trace[-1].applied
