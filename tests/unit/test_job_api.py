"""The job API in one process: user jobs restore exactly, bad jobs are refused before any update."""

from __future__ import annotations

import pytest

from spotrun.orchestrator.control.launch import run_in_process
from spotrun.trainer.job.contract import JobError
from spotrun.trainer.observe.trace import first_divergence
from tests.conftest import make_spec
from tests.helpers.oracle import reference_run, resume

BASE = ("train.updates=12", "checkpoint.every_updates=4", "data.workers=1")


def job_spec(tmp_path, entrypoint: str, *sets: str, job_id: str = "user"):
    return make_spec(tmp_path, *BASE, f"job.entrypoint={entrypoint}", *sets, job_id=job_id)


@pytest.mark.parametrize("entrypoint", ["tests.helpers.jobs:stream_job", "tests.helpers.jobs:registered_counter",
                                        "examples.digits.job:build", "examples.center_loss.job:build",
                                        "examples.bpe_lm.job:build"])
@pytest.mark.parametrize("mode", ["snapshot", "replay"])
def test_every_boundary_of_a_user_job_restores_exactly(tmp_path, entrypoint, mode):
    spec = job_spec(tmp_path, entrypoint, "train.micro_batch=4", "train.accum_steps=2",
                    f"checkpoint.restore_mode={mode}", "data.shards=configs/data/tiny")
    trace, keys = reference_run(spec, tmp_path / "ref.jsonl")
    assert len(keys) == 3
    for key in keys[:-1]:
        assert first_divergence(trace, resume(spec, key, 5)) is None, key


def test_state_kept_outside_the_registered_objects_diverges_at_the_first_update_after_a_restore(tmp_path):
    spec = job_spec(tmp_path, "tests.helpers.jobs:unregistered_counter")
    trace, keys = reference_run(spec, tmp_path / "ref.jsonl")
    d = first_divergence(trace, resume(spec, keys[0], 4))
    assert d is not None and d.update == 5 and d.field == "params"


@pytest.mark.parametrize("entrypoint,message", [
    ("tests.helpers.jobs:not_a_job", "returned a dict, not a spotrun.Job"),
    ("tests.helpers.jobs:empty_dataset", "has no sample (len 0)"),
    ("tests.helpers.jobs:unsaveable_state", "spotrun.Job(state={'bank': HoldsAFunction}): its state_dict() cannot "
                                            "be saved as data"),
    ("no_such_module.anywhere:build", "module 'no_such_module.anywhere' cannot be imported"),
    ("tests.helpers.jobs:no_such_function", "has no function 'no_such_function'"),
])
def test_a_bad_job_is_refused_before_any_update(tmp_path, entrypoint, message):
    spec = job_spec(tmp_path, entrypoint)
    with pytest.raises(JobError) as e:
        run_in_process(spec)
    assert message in str(e.value)


def test_state_that_stops_being_saveable_is_refused_at_the_checkpoint_naming_it(tmp_path):
    spec = job_spec(tmp_path, "tests.helpers.jobs:state_turns_unsaveable")
    with pytest.raises(Exception, match=r"spotrun.Job\(state=\{'late': \.\.\.\}\) \(at a checkpoint\)"):
        run_in_process(spec)


@pytest.mark.parametrize("misuse,message", [
    ("backward", "changed the gradients of ['weight', 'bias'] while it ran (a backward() or zero_grad()"),
    ("backward-retained", "changed the gradients of ['weight', 'bias'] while it ran (a backward() or zero_grad()"),
    ("optimizer-step", "called optimizer.step()"),
    ("zero-grad", "changed the gradients of ['weight', 'bias'] while it ran (a backward() or zero_grad()"),
])
def test_a_step_that_does_spotruns_part_is_refused_at_the_first_update(tmp_path, misuse, message):
    """backward (plain, or keeping the graph so that spotrun's own backward would double every gradient),
    optimizer.step() or zero_grad() inside the step (zero_grad at the second microstep, where it would
    drop the first's gradients): a JobError naming the contract at update 1, before any update counts."""
    from spotrun.trainer.run.session import TrainSession

    spec = job_spec(tmp_path, "tests.helpers.jobs:does_the_engines_part", "data.workers=0", "train.accum_steps=2",
                    f"job.config={{misuse: {misuse}}}")
    session = TrainSession(spec)
    session.start()
    try:
        with pytest.raises(JobError) as e:
            session.run_update()
    finally:
        session.close()
    assert str(e.value).startswith("update 1: the job's step ") and message in str(e.value)
    assert "a job's step only computes and returns the loss" in str(e.value)
    assert session.counters.attempted_updates == 0
