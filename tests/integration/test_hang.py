"""A hung rank on a real local Ray: rank 1's process SIGSTOPs itself mid-update (alive, silent: what a
wedged driver call or a dying node looks like). It is found hung after world.hang_after_s, its stacks are
kept in the attempt's logs naming where it stopped, it is killed, the spare takes its place from memory,
and the run ends bitwise equal to the uninterrupted one."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys

import pytest
import ray

from bench.false_alarms import SETS as LOADED
from bench.false_alarms import loaded_run
from spotrun.orchestrator.control.launch import run_on_ray
from spotrun.orchestrator.ledger.events import Restored, Slowdowns, StragglerReplacing, WorkerLost
from spotrun.orchestrator.ledger.history import history
from spotrun.orchestrator.ledger.store import Ledger
from spotrun.orchestrator.policy.health import Hung
from spotrun.orchestrator.workers.watch import condemn
from spotrun.trainer.observe.trace import first_divergence, latest_per_update, read_trace
from spotrun.trainer.storage import open_storage
from tests.conftest import make_spec
from tests.helpers.ray_local import ray_for_module  # noqa: F401 - the module's local Ray
from tests.helpers.runs import uninterrupted_trace

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_for_module")]
SETS = ("world.size=2", "train.updates=16", "checkpoint.every_updates=4", "data.workers=1", "model.dropout=0.1")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return uninterrupted_trace(tmp_path_factory.mktemp("hangref"), *SETS)


def test_a_stopped_rank_is_found_hung_named_by_its_stacks_and_replaced_warm_bitwise(reference, tmp_path):
    spec = make_spec(tmp_path, *SETS, "world.spares=1",
                     "faults=[{site: backward, signal: SIGSTOP, update: 10, microstep: 1, rank: 1}]", job_id="hung")
    outcome = run_on_ray(spec, trace_path=str(tmp_path / "t.jsonl"))
    assert outcome.state == "finished" and outcome.restarts == 1
    final = latest_per_update(read_trace(tmp_path / "t.jsonl"))
    assert sorted(final) == list(range(1, 17))
    assert first_divergence(reference, list(final.values())) is None
    storage = open_storage(spec.storage)
    events = Ledger(storage, "hung").read()
    (lost,) = [e for e in events if isinstance(e, WorkerLost)]
    assert (lost.rank, lost.cause, lost.signal) == (1, "hang", "hang")
    # the last reading the rank gave before it fell silent: polled every 0.1 s while its updates take milliseconds,
    # that may be a few updates before the fault's (seen: 6 to 10); where it stopped is what its stacks say
    assert 1 <= lost.stopped_update <= 10 and lost.stopped_phase is not None
    assert lost.loss == "failure"
    assert lost.stacks == "hung/logs/attempt-1/rank-1.stacks.txt" and lost.host == socket.gethostname()
    stacks = storage.get(lost.stacks).decode()
    # py-spy reads a stopped process's stacks. A process's SIGSTOP to itself takes effect at each thread's next
    # trip into the kernel, so the training thread is found at the fault's line or a little past it (seen: in
    # the backward call, at the gradients' all-reduce), inside the update's loop
    assert "the process was stopped" in stacks, stacks
    assert "TrainLoop.run_update" in stacks and "RankRunner.run" in stacks, stacks
    (restored,) = [e for e in events if isinstance(e, Restored)]
    assert restored.recovery_path == "warm-spare" and restored.recovery_label == "exact"


def test_a_step_blocked_forever_on_one_rank_is_found_stuck_named_by_its_line_and_replaced_warm(tmp_path):
    """Rank 1's step waits on an event nobody sets (once per job): it answers every poll, but stands in
    its forward pass while rank 0 waits for it at the all-reduce. Past the bound (world.stuck_floor_s
    here: the updates take milliseconds) it is stuck: its stacks name the blocking line, it is killed,
    and the spare takes its place from memory."""
    spec = make_spec(tmp_path, "world.size=2", "world.spares=1", "world.stuck_floor_s=2", "train.updates=10",
                     "checkpoint.every_updates=2", "data.workers=0", "job.entrypoint=tests.helpers.jobs:blocks_once",
                     f"job.config.marker={tmp_path / 'blocked'}", job_id="stuck")
    outcome = run_on_ray(spec)
    assert outcome.state == "finished" and outcome.restarts == 1
    storage = open_storage(spec.storage)
    events = Ledger(storage, "stuck").read()
    (lost,) = [e for e in events if isinstance(e, WorkerLost)]
    assert (lost.rank, lost.cause, lost.signal) == (1, "stuck", "stuck")
    assert (lost.stopped_phase, lost.stopped_update) == ("forward", 5)
    stacks = storage.get(lost.stacks).decode()
    assert "step (tests/helpers/jobs.py" in stacks, stacks
    (restored,) = [e for e in events if isinstance(e, Restored)]
    assert restored.recovery_path == "warm-spare"


def test_a_rank_that_aborts_in_native_code_is_reported_with_its_ray_worker_log_s_last_words(tmp_path):
    """Rank 1 aborts (SIGABRT, no Python traceback: what glibc does on heap corruption). Ray says only that the
    actor died; the loss's detail quotes the end of its Ray worker log, where the abort is named."""
    spec = make_spec(tmp_path, "world.size=2", "train.updates=8", "checkpoint.every_updates=2", "data.workers=0",
                     "job.entrypoint=tests.helpers.jobs:aborts_once", f"job.config.marker={tmp_path / 'aborted'}",
                     job_id="abort")
    outcome = run_on_ray(spec)
    assert outcome.state == "finished" and outcome.restarts == 1
    (lost,) = [e for e in Ledger(open_storage(spec.storage), "abort").read() if isinstance(e, WorkerLost)]
    assert (lost.rank, lost.cause) == (1, "process-exit")
    assert "its Ray worker log ends:" in lost.detail and "SIGABRT" in lost.detail, lost.detail
    assert "tests/helpers/jobs.py" in lost.detail and " in step" in lost.detail, lost.detail  # the aborting line


def test_80_updates_beside_a_cpu_hog_with_checkpoints_every_few_updates_record_no_hung_or_stuck_rank(tmp_path):
    """The CI version of bench 14 (bench/false_alarms.py: ten minutes): a 2-rank job trains 80 updates while
    one busy process per core takes every core, checkpointing every 4 updates, and is stopped by a notice.
    No rank may be found hung, stuck or straggling, and the health watch must really have judged it all along."""
    spec = make_spec(tmp_path, *LOADED, job_id="loaded")
    run = loaded_run(spec, until_published=80)  # two straggler windows and more; the ten-minute soak is bench 14
    assert run.false_alarms == [] and run.lost == [] and run.restarts == 0, run.lost
    assert run.flagged == [], run.flagged  # a rank as fast as its peer is no straggler, however loaded the host
    assert run.state == "stopped" and run.updates > 0 and run.checkpoints >= 2
    m = run.margins
    assert m.polls > 0 and m.slowest_answer_s < spec.world.hang_after_s and m.silence < 1 and m.stuck < 1, m
    assert m.slowdown > 0, m  # the paces were judged all along (a flag needs them over the ratio for two windows)


def test_a_rank_alone_on_its_node_has_its_stacks_taken_and_is_killed_by_a_task_pinned_there(tmp_path):
    """condemn without a live rank on the node to help (a cluster of one rank per node): a task pinned to
    the node takes the stopped process's stacks, keeps them, and kills it."""
    victim = subprocess.Popen([sys.executable, "-c", "import threading; print('up', flush=True); "
                               "threading.Event().wait()"], stdout=subprocess.PIPE, text=True)
    assert victim.stdout is not None and victim.stdout.readline() == "up\n"  # Python's own stacks exist by now
    victim.send_signal(signal.SIGSTOP)
    storage = open_storage(f"file://{tmp_path}")
    where = {"node_id": ray.get_runtime_context().get_node_id(), "pid": victim.pid, "host": "here"}
    try:
        evidence = condemn(Hung(1, 6.0, None), where, storage, "alone", 1)
        assert victim.wait(timeout=60) == -signal.SIGKILL
    finally:
        victim.kill()  # a failed test leaves no stopped process behind
    assert (evidence.signal, evidence.stacks_how, evidence.stacks_key) == ("hang", "py-spy", "alone/logs/attempt-1/"
                                                                            "rank-1.stacks.txt")
    stacks = storage.get(evidence.stacks_key).decode()
    assert "the process was stopped" in stacks and "wait" in stacks, stacks


STRAGGLER = ("world.size=2", "train.updates=48", "checkpoint.every_updates=4", "data.workers=0",
             "job.entrypoint=tests.helpers.jobs:slowed_rank")


def test_a_rank_slowed_in_its_data_path_is_flagged_and_replaced_by_a_spare_at_a_boundary_bitwise(tmp_path):
    """Rank 1's process sleeps before every element of its stream (its own work twice its peers' or more).
    Once over world.straggler_ratio for two windows (world.straggler_window) it is flagged; with
    world.replace_stragglers the ranks checkpoint at the next boundary, the spare takes its place from memory,
    nothing is lost, and the run ends bitwise equal to the uninterrupted one (the sleep changes no number)."""
    reference = uninterrupted_trace(tmp_path / "ref", *STRAGGLER)
    spec = make_spec(tmp_path, *STRAGGLER, "world.spares=1", "world.replace_stragglers=true",
                     "world.straggler_window=8", f"job.config.marker={tmp_path / 'slow'}", "job.config.sleep_s=0.002",
                     job_id="straggler")
    outcome = run_on_ray(spec, trace_path=str(tmp_path / "t.jsonl"))
    assert outcome.state == "finished" and outcome.attempts == 2 and outcome.restarts == 0
    final = latest_per_update(read_trace(tmp_path / "t.jsonl"))
    assert sorted(final) == list(range(1, 49))
    assert first_divergence(reference, list(final.values())) is None
    events = Ledger(open_storage(spec.storage), "straggler").read()
    assert not [e for e in events if isinstance(e, WorkerLost)]
    flagged = next(e for e in events if isinstance(e, Slowdowns) and e.stragglers)
    # flagged once over the ratio for a window more: rank 1 at least twice as slow as rank 0
    assert flagged.attempt == 1 and flagged.stragglers == [1] and flagged.slowdown[1] >= 2, flagged
    (replacing,) = [e for e in events if isinstance(e, StragglerReplacing)]
    assert (replacing.attempt, replacing.rank) == (1, 1)
    (restored,) = [e for e in events if isinstance(e, Restored)]
    assert (restored.cause, restored.recovery_path, restored.recovery_label) == ("straggler", "warm-spare", "exact")
    assert restored.lost_updates == 0 and restored.update >= replacing.update
    # the spare runs at its peer's speed: no straggler in the attempt it joined
    assert all(not e.stragglers for e in events if isinstance(e, Slowdowns) and e.attempt == 2)
    doc = history(open_storage(spec.storage), "straggler")
    (row,) = doc.restarts
    assert (row.cause, row.rank, row.loss, row.lost_updates) == ("straggler", 1, None, 0)
    (flag,) = doc.stragglers
    assert (flag.attempt, flag.rank, flag.replaced) == (1, 1, True) and flag.max_slowdown >= 2
