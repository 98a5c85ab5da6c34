"""The restore oracle acts: a restore whose state differs from its bundle is refused under strict
(each bundle in turn, then the job, naming the category) and labelled ``unverified`` otherwise; and
every submodule's train/eval flag is state (a frozen backbone kept in eval mode stays there)."""

from __future__ import annotations

import pytest

from spotrun.orchestrator.ledger.events import BundleRejected, JobFailed, Restored, RunRefused
from spotrun.orchestrator.ledger.store import Ledger
from spotrun.trainer.storage import open_storage
from tests.helpers.runs import run_cmd, run_to_end
from tests.integration.test_user_jobs import verify

pytestmark = pytest.mark.slow
SETS = ("train.updates=12", "checkpoint.every_updates=3", "data.workers=0", "metrics.sinks=[]",
        "job.entrypoint=tests.helpers.jobs:forgetful_state")
KILL_AFTER_6 = "faults=[{site: after_publish, update: 6}]"  # the driver SIGKILLed once bundle 6 is published


def killed_then_rerun(tmp_path, *sets: str):
    cmd = run_cmd(tmp_path / "runs", "forgetful", tmp_path / "t.jsonl", *SETS, *sets, KILL_AFTER_6)
    assert run_to_end(cmd).returncode == -9
    return run_to_end(cmd), Ledger(open_storage(f"file://{tmp_path / 'runs'}"), "forgetful").read()


def test_strict_refuses_every_bundle_the_oracle_finds_different_and_names_the_category(tmp_path):
    done, events = killed_then_rerun(tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    rejected = [e for e in events if isinstance(e, BundleRejected)]
    assert [e.bundle.rsplit("/", 1)[-1] for e in rejected] == ["u0000000006-a1", "u0000000003-a1"]
    assert all("state:calls" in e.reason and "restore oracle" in e.reason for e in rejected), rejected
    assert not any(isinstance(e, Restored) for e in events)  # nothing trained on a state unlike its bundle
    # the refused rerun is an event of its own: the job is not recorded as failed
    assert [e.check for e in events if isinstance(e, RunRefused)] == ["start"]
    assert not any(isinstance(e, JobFailed) for e in events)
    assert "state:calls" in done.stderr and "restore oracle" in done.stderr, done.stderr[-2000:]


def test_elastic_restores_and_labels_the_restore_unverified(tmp_path):
    done, events = killed_then_rerun(tmp_path, "world.policy=elastic")
    assert done.returncode == 0, done.stderr[-2000:]
    (restored,) = [e for e in events if isinstance(e, Restored)]
    assert restored.recovery_label == "unverified"
    assert restored.roundtrip_mismatches == ["rank 0: state:calls"]


def test_a_frozen_backbone_in_eval_mode_restores_bitwise(tmp_path):
    """Batch norm and dropout in a frozen backbone kept in eval(): a restore that set every submodule
    to the root's mode would train its statistics and drop its units from then on."""
    code, report, err = verify(tmp_path, "configs/tiny.yaml", "--kills", "3", "--no-ray", "--seed", "1",
                               sets=("train.updates=18", "checkpoint.every_updates=3", "data.workers=0",
                                     "job.entrypoint=tests.helpers.jobs:frozen_backbone"))
    assert code == 0, err[-3000:]
    assert report["verdict"] == "pass" and report["params_bitwise_equal"] is True
    assert report["restores_from_bundle"] > 0 and report["restore_oracle"] == []
