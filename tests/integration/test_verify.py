"""`spotrun verify` on real subprocess runs: the chaos suite passes on a faithful build and names
the lost category on a deliberately broken one."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow


def verify(tmp_path, *sets: str, kills: int, env: dict | None = None) -> tuple[int, dict, str]:
    cmd = [sys.executable, "-m", "orchestrator.cli", "verify", str(ROOT / "configs/tiny.yaml"), "--no-ray",
           "--kills", str(kills), "--seed", "3", "--json", "--set", f"storage=file://{tmp_path / 'runs'}",
           "--set", f"data.shards={ROOT / 'configs/data/tiny'}", *[a for s in sets for a in ("--set", s)]]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, **(env or {})})
    return done.returncode, json.loads(done.stdout) if done.stdout.strip() else {}, done.stderr


def test_chaos_suite_twenty_faults_every_site_strict_exact(tmp_path):
    code, report, err = verify(tmp_path, "train.updates=70", "checkpoint.every_updates=3", kills=20)
    assert code == 0, err
    assert report["verdict"] == "pass" and report["declared_contract"] == "exact"
    assert report["observed_contract"] == "exact"
    assert report["kills_injected"] >= 20
    assert set(report["fault_sites"]) >= {"mid-accumulation", "mid-microstep", "bundle-write",
                                          "publish-to-offsets", "notice"}
    assert report["occurrence_gaps"] == 0 and report["occurrence_duplicates"] == 0
    assert report["params_bitwise_equal"] is True and report["params_max_abs_diff"] == 0.0
    assert report["metric_duplicates"] == 0 and report["metric_mismatches"] == 0
    assert report["updates_compared"] == 70 and report["restore_oracle"] == []
    assert len(report["restart_seconds"]) == report["restarts"] > 0


@pytest.mark.parametrize("category,sets", [
    ("shuffle_buffer", ()),
    ("grad_scaler", ("train.precision=fp16", "train.grad_scaler.init_scale=1073741824",
                     "train.grad_scaler.growth_interval=2")),
])
def test_verify_catches_a_build_that_drops_a_category(tmp_path, category, sets):
    code, report, err = verify(tmp_path, "train.updates=24", "checkpoint.every_updates=4", *sets, kills=3,
                               env={"SPOTRUN_DROP_STATE": category})
    assert code == 1, err
    assert report["verdict"] == "fail"
    assert any(m.endswith(category) for m in report["restore_oracle"]), report["restore_oracle"]
    divergence = report["first_divergence"]
    assert divergence is not None and divergence["update"] > 0
    if category == "shuffle_buffer":
        assert divergence["what"] == "occurrences" and "expected occurrence" in divergence["detail"]
