"""`spotrun verify` on real subprocess runs: the chaos suite passes on a faithful build and names
the lost category on a deliberately broken one; a run that tested no restore, or a broken build
that went uncaught, exits 1."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.helpers.ray_local import ray_address  # noqa: F401 - the shared local Ray, for the 3-rank runs

pytestmark = pytest.mark.slow


def verify(tmp_path, *sets: str, kills: int, where: tuple[str, ...] = ("--no-ray",),
           timeout: float = 900) -> tuple[int, dict, str]:
    """Run ``spotrun verify --json`` on tiny; past ``timeout`` seconds it and the job drivers it started
    (its process group: their ranks go with their driver) are killed and the test fails."""
    cmd = [sys.executable, "-m", "spotrun", "verify", str(ROOT / "configs/tiny.yaml"), *where,
           "--kills", str(kills), "--seed", "3", "--json", "--set", f"storage=file://{tmp_path / 'runs'}",
           "--set", f"data.shards={ROOT / 'configs/data/tiny'}", *[a for s in sets for a in ("--set", s)]]
    with subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # verify and the drivers it started: nothing left on the shared Ray
            proc.communicate()
            pytest.fail(f"spotrun verify did not finish in {timeout:.0f} s")
    return proc.returncode, json.loads(out) if out.strip() else {}, err


# Two ranks and a spare on a local three-node cluster: every fault site, node removal and a kill as a
# warm restart re-forms the group included, restarted warm (the spare steps in) and cold.
CHAOS = ("checkpoint.every_updates=3", "world.size=2", "world.spares=1", "world.restart_backoff_s=0.1")
EVERY_SITE = {"mid-accumulation", "mid-microstep", "warm-rejoin", "bundle-write", "publish-to-offsets", "notice",
              "hang", "node-removed"}


def assert_chaos_passed(code: int, report: dict, err: str, updates: int) -> None:
    """The chaos run passed strict-exact through every site, both recovery paths taken."""
    assert code == 0, err
    assert report["verdict"] == "pass" and report["declared_contract"] == "exact"
    assert report["observed_contract"] == "exact"
    assert set(report["fault_sites_hit"]) == set(report["fault_sites_planned"]) == EVERY_SITE
    assert report["fault_sites_not_applicable"] == {}
    assert report["recovery_paths"].get("warm-spare", 0) > 0 and report["recovery_paths"].get("cold", 0) > 0
    assert report["occurrence_gaps"] == 0 and report["occurrence_duplicates"] == 0
    assert report["params_bitwise_equal"] is True and report["params_max_abs_diff"] == 0.0
    assert report["metric_duplicates"] == report["metric_mismatches"] == report["metric_missing"] == 0
    assert report["metric_duplicates_written"] > 0  # the replays wrote points again; the sinks upserted them
    assert report["updates_compared"] == updates and report["restore_oracle"] == []
    assert len(report["restart_seconds"]) == report["restarts"] > 0
    faults = report["faults"]  # every fault listed, delivery as counted
    assert len(faults) == report["faults_planned"] and sum(f["delivered"] for f in faults) == report["faults_delivered"]


def test_chaos_suite_every_site_once_strict_exact(tmp_path):
    """One cycle through the 8 sites (the plan's first 8 faults: what the 24-fault soak below repeats),
    the node removal last, so no fault waits behind it (the ranks may train past the next planned
    fault while a node is removed): every fault is injected, the hang (a rank SIGSTOPped mid-update)
    found as such by the health watch, and the run is bitwise the uninterrupted one."""
    code, report, err = verify(tmp_path, "train.updates=24", *CHAOS, kills=8, where=("--nodes", "3"))
    assert_chaos_passed(code, report, err, updates=24)
    assert report["faults_delivered"] == report["faults_planned"] == 8
    # the SIGSTOPped rank was found by the health watch, not by Ray giving up on it (node-lost, minutes later)
    [hang] = [f for f in report["faults"] if f["name"] == "hang"]
    assert (hang["delivered"], hang["found_as"], report["hangs_injected"]) == (True, "hang", 1), report["faults"]


@pytest.mark.soak
def test_chaos_soak_twenty_faults_every_site_strict_exact(tmp_path):
    """The soak (`make soak`; CI runs the one-cycle run above): at least 20 faults, each site three
    times. 24 are planned: removing a node takes long enough for the ranks to train past the next
    planned fault at times (2 runs in 8 injected 18 of 20), and only faults really injected count."""
    code, report, err = verify(tmp_path, "train.updates=80", *CHAOS, kills=24, where=("--nodes", "3"))
    assert_chaos_passed(code, report, err, updates=80)
    assert report["faults_delivered"] >= 20 and report["faults_planned"] == 24
    # at 16 sequences an update tiny's text is through about every 26 updates, and a fault is planned whose
    # restore goes back across such a boundary
    faults = report["faults"]
    assert max(f["epoch"] for f in faults) >= 1 and any(f["restore_crosses_epoch"] for f in faults), faults


def test_single_process_chaos(tmp_path):
    """The same harness without Ray: every kill takes the driver with it and verify runs it again. One
    fault at each of the 5 sites a single process has."""
    code, report, err = verify(tmp_path, "train.updates=30", "checkpoint.every_updates=3", kills=5)
    assert code == 0, err
    assert report["verdict"] == "pass" and report["params_bitwise_equal"] is True
    assert report["faults_delivered"] == report["faults_planned"] == 5 and report["restores_from_bundle"] > 0
    assert set(report["fault_sites_hit"]) == {"mid-accumulation", "mid-microstep", "bundle-write",
                                              "publish-to-offsets", "notice"}
    assert report["kills_injected"] + report["notices_injected"] == 5
    assert "node-removed" in report["fault_sites_not_applicable"]
    assert report["occurrence_gaps"] == report["occurrence_duplicates"] == report["metric_duplicates"] == 0
    assert report["metric_duplicates_written"] > 0 and report["failures"] == []
    # each fault listed: the seed's plan, spread over the run (one in its last third), all delivered
    assert report["seed"] == 3
    faults = report["faults"]
    assert [f["name"] for f in faults] == ["mid-accumulation", "mid-microstep", "bundle-write", "publish-to-offsets",
                                           "notice"]
    assert all(f["delivered"] and f["epoch"] == 0 for f in faults)  # 30 updates: tiny's first epoch
    assert faults[0]["update"] <= 8 and faults[-1]["update"] > 20


@pytest.mark.parametrize("category,sets", [
    ("shuffle_buffer", ()),
    ("grad_scaler", ("train.precision=fp16", "train.grad_scaler.init_scale=1073741824",
                     "train.grad_scaler.growth_interval=2")),
])
def test_verify_catches_a_build_that_drops_a_category(tmp_path, category, sets):
    # 2 faults (mid-accumulation, mid-microstep): each restart restores a bundle, where the category is lost
    code, report, err = verify(tmp_path, "train.updates=24", "checkpoint.every_updates=4", *sets, kills=2,
                               where=("--no-ray", "--mutate", category))
    assert report["restores_from_bundle"] > 0, "no restart restored a bundle: the dropped category was never lost"
    assert code == 0, err  # verify did what --mutate asks of it: it caught the broken build
    assert report["verdict"] == "fail" and report["mutated"] == [category] and report["mutation_caught"] is True
    assert any("weaker than the declared exact" in f for f in report["failures"])
    assert any(m.endswith(category) for m in report["restore_oracle"]), report["restore_oracle"]
    divergence = report["first_divergence"]
    assert divergence is not None and divergence["update"] > 0
    if category == "shuffle_buffer":
        assert divergence["what"] == "occurrences" and "expected occurrence" in divergence["detail"]


def test_a_run_no_fault_could_interrupt_fails_naming_the_numbers_to_change(tmp_path):
    """A bundle only at the last update leaves no room for a fault after a published bundle: no
    restore is tested, so the verdict fails (exit 1) and says which numbers to change, although
    every comparison of the two (uninterrupted) runs holds."""
    code, report, err = verify(tmp_path, "train.updates=6", "checkpoint.every_updates=6", kills=10)
    assert code == 1, err
    assert report["verdict"] == "fail" and report["faults_planned"] == report["restarts"] == 0
    assert report["failures"] == [
        "no fault was planned: train.updates=6 with checkpoint.every_updates=6 leaves room for no fault after a "
        "published bundle (the first is published at update 6, and a fault needs an update after it); lower "
        "checkpoint.every_updates to <= 5 or raise train.updates to >= 7"]
    assert report["params_bitwise_equal"] is True and report["observed_contract"] == "exact"


def test_a_mutation_verify_does_not_catch_exits_1(tmp_path):
    """Under fp32 the grad scaler is off, so a build that loses its state at restore trains the same
    updates: the verdict passes, which for a broken build means verify did not do what --mutate asks
    of it. The one fault (the interval is long: a kill right after the bundle of update 5 is
    published) makes the restart restore that bundle, so the loss really happened."""
    code, report, err = verify(tmp_path, "train.updates=8", "checkpoint.every_updates=5", kills=1,
                               where=("--no-ray", "--mutate", "grad_scaler"))
    assert report["restores_from_bundle"] == 1 and report["fault_sites_hit"] == ["publish-to-offsets"]
    assert report["verdict"] == "pass" and report["mutation_caught"] is False
    assert code == 1, err


def test_three_gloo_ranks_stay_bitwise_across_restarts(tmp_path, ray_address):
    """With 3 ranks the order of a sum matters ((a + b) + c may differ from a + (b + c)): the flat
    all-reduce must still give every update bitwise after restarts (DDP does not: bench section 5).
    On the shared local Ray (its 3 CPUs: one a rank)."""
    code, report, err = verify(tmp_path, "train.updates=15", "checkpoint.every_updates=3", "world.size=3",
                               "train.micro_batch=2", "train.accum_steps=2", "world.restart_backoff_s=0.1", kills=3,
                               where=("--address", ray_address))
    assert code == 0, err
    assert report["verdict"] == "pass" and report["observed_contract"] == "exact"
    assert report["params_bitwise_equal"] is True and report["updates_compared"] == 15
