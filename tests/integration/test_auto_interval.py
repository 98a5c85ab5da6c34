"""``checkpoint.every_updates: auto`` on a real 2-rank Ray job: the supervisor chooses the interval,
asks the ranks for every checkpoint but the last, records each decision, and a restart from one of
its bundles finishes exactly as an uninterrupted run."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from spotrun.orchestrator.control.launch import run_on_ray
from spotrun.orchestrator.control.supervisor import Outcome
from spotrun.orchestrator.ledger.events import BundlePublished, IntervalChosen, Restored
from spotrun.orchestrator.ledger.store import Ledger
from spotrun.trainer.observe.trace import first_divergence, latest_per_update, read_trace
from spotrun.trainer.storage import open_storage
from tests.conftest import ROOT, make_spec
from tests.helpers.ray_local import job_thread, ray_for_module  # noqa: F401 - the module's local Ray
from tests.helpers.runs import hold

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_for_module")]
UPDATES = 16
SETS = ("world.size=2", f"train.updates={UPDATES}", "data.workers=1", "model.dropout=0.1",
        "world.restart_backoff_s=0.1")
# Rank 0 holds at updates 6 and 10 until the supervisor asks for a checkpoint (a request it already
# took does not release a hold): the bundle of update 6 is the supervisor's, and the request that
# releases update 10 comes only after a bundle was published, so the SIGKILL of rank 1 at update 12
# always finds one of the supervisor's bundles to restore.
FAULTS = f"faults=[{hold(6)}, {hold(10)}, {{site: microstep, update: 12, microstep: 1, rank: 1}}]"


def run_bounded(spec, trace, timeout: float = 240) -> Outcome:
    """``run_on_ray`` on a thread of its own: a job whose checkpoints are never asked for holds at
    update 6 for ever, and the test fails instead of hanging."""
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["outcome"] = run_on_ray(spec, trace_path=str(trace))
        except BaseException as e:  # re-raised on the test's thread
            result["error"] = e

    thread = job_thread(target, spec.job_id)
    thread.join(timeout)
    assert not thread.is_alive(), f"the job did not finish in {timeout:g}s: no checkpoint was asked for"
    if "error" in result:
        raise result["error"]
    return result["outcome"]


def test_auto_interval_requests_checkpoints_records_decisions_and_restarts_exactly(tmp_path):
    ref = make_spec(tmp_path / "ref", *SETS, "checkpoint.every_updates=100", job_id="ref")
    run_on_ray(ref, trace_path=str(tmp_path / "ref.jsonl"))
    spec = make_spec(tmp_path, *SETS, "checkpoint.every_updates=auto", "checkpoint.min_interval_s=0.05",
                     "checkpoint.max_interval_s=0.05", FAULTS, job_id="auto")
    outcome = run_bounded(spec, tmp_path / "t.jsonl")

    assert outcome.state == "finished" and outcome.restarts == 1
    final = latest_per_update(read_trace(tmp_path / "t.jsonl"))
    assert sorted(final) == list(range(1, UPDATES + 1))
    assert first_divergence(read_trace(tmp_path / "ref.jsonl"), list(final.values())) is None

    events = Ledger(open_storage(spec.storage), "auto").read()
    first = [e.update for e in events if isinstance(e, BundlePublished) and e.attempt == 1]
    assert 6 in first, "the supervisor asked for a checkpoint, which released rank 0's hold at update 6"
    assert max(first) < 12, "the ranks' own schedule takes only the last update's bundle"
    assert any(e.overlap_seconds is not None for e in events if isinstance(e, BundlePublished))
    restored = next(e for e in events if isinstance(e, Restored))
    assert restored.attempt == 2 and 6 <= restored.update < 12

    decisions = [e for e in events if isinstance(e, IntervalChosen)]
    assert [(d.attempt, d.reason) for d in decisions] == [(1, "start"), (1, "measured"), (2, "loss")]
    assert decisions[0].decision.checkpoint_cost_s is None and decisions[0].inputs.checkpoint_costs_s == []
    assert decisions[1].decision.checkpoint_cost_s is not None and decisions[1].decision.interval_s == 0.05
    assert decisions[2].inputs.uptime_s > 0 and decisions[2].inputs.checkpoint_costs_s

    shown = subprocess.run([sys.executable, "-m", "spotrun", "history", "auto", "--storage", spec.storage, "--json"],
                           cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    listed = json.loads(shown.stdout)["checkpoint_intervals"]
    assert [(d["attempt"], d["reason"], d["interval_s"]) for d in listed] == [
        (d.attempt, d.reason, d.decision.interval_s) for d in decisions]
    assert listed[-1]["inputs"]["min_interval_s"] == 0.05 and listed[-1]["expected_lost_work_s"] == 0.025
