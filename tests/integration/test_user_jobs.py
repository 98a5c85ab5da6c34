"""Users' own jobs through the public API: proven by `spotrun verify` on 2 Ray ranks, mutants caught,
unregistered state caught, bad input refused before training, no shadowing by a user's modules, and
what a user's rank prints reaching the terminal and its rank log."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from spotrun.trainer.storage import open_storage
from tests.conftest import ROOT
from tests.helpers.ray_local import ray_address  # noqa: F401 - the module's local Ray, for verify's runs
from tests.helpers.runs import assert_rank_output

pytestmark = pytest.mark.slow
EXAMPLES = {"digits": "examples/digits/digits.yaml", "bpe_lm": "examples/bpe_lm/bpe_lm.yaml",
            "center_loss": "examples/center_loss/center_loss.yaml", "hf_gpt2": "examples/hf_gpt2/hf_gpt2.yaml"}
# a short restart backoff: the waits between restarts prove nothing here (the budgets' tests are elsewhere)
SHORT = ("train.updates=24", "checkpoint.every_updates=3", "world.restart_backoff_s=0.1")


def spotrun(*args: str, cwd: Path = ROOT, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "spotrun", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def verify(tmp_path: Path, config: str, *args: str, sets: tuple[str, ...] = SHORT) -> tuple[int, dict, str]:
    done = spotrun("verify", config, *args, "--json", "--set", f"storage=file://{tmp_path / 'runs'}",
                   *[a for s in sets for a in ("--set", s)])
    return done.returncode, json.loads(done.stdout) if done.stdout.strip() else {}, done.stderr


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_each_example_verifies_bitwise_on_two_ranks_restored_warm_and_cold(tmp_path, example, ray_address):
    # 3 faults: mid-accumulation (the restart is warm: the survivor keeps its process and state), mid-microstep,
    # and a kill during the warm restart that follows (that restart goes cold: every rank from storage); all on
    # the shared local Ray (verify --address), none starting a cluster of its own. (The sites the examples do
    # not reach are the chaos suite's: tests/integration/test_verify.py.)
    code, report, err = verify(tmp_path, EXAMPLES[example], "--kills", "3", "--seed", "1", "--address", ray_address)
    assert code == 0, err[-3000:]
    assert report["verdict"] == "pass" and report["observed_contract"] == report["declared_contract"] == "exact"
    assert report["faults_delivered"] == report["faults_planned"] == 3 and report["restores_from_bundle"] > 0
    assert report["recovery_paths"].get("warm-replace", 0) > 0 and report["recovery_paths"].get("cold", 0) > 0
    assert report["occurrence_gaps"] == 0 and report["occurrence_duplicates"] == 0
    assert report["params_bitwise_equal"] is True and report["updates_compared"] == 24
    assert report["restore_oracle"] == [] and report["metric_mismatches"] == 0


def test_augmentation_from_the_global_generators_in_two_loader_workers_verifies_bitwise(tmp_path, ray_address):
    """Augmentation written as most code is (random, numpy.random and torch.rand in the dataset's
    __getitem__ and in the transform), two prefetch workers per rank, two ranks, three kills: bitwise.
    spotrun seeds the global generators from each occurrence in the workers; without that, a restarted
    worker draws them afresh and the first update after a restore differs at the batch."""
    code, report, err = verify(tmp_path, str(ROOT / "configs/tiny.yaml"), "--kills", "3", "--seed", "2",
                               "--address", ray_address,
                               sets=("train.updates=12", "checkpoint.every_updates=3", "world.size=2",
                                     "data.workers=2", "job.entrypoint=tests.helpers.jobs:naive_global_augmentation"))
    assert code == 0, err[-3000:]
    assert report["verdict"] == "pass" and report["observed_contract"] == "exact"
    assert report["faults_delivered"] == 3 and report["restores_from_bundle"] > 0
    assert report["params_bitwise_equal"] is True and report["first_divergence"] is None


def test_losing_registered_objects_at_restore_fails_verify_naming_each(tmp_path):
    """Both of center_loss's registered objects lost at every restore, in one chaos run: the restore
    oracle names each of them (each is compared on its own, so one found does not hide the other)."""
    # 4 faults: the fourth (kill between publish and offsets) always restores from a published bundle
    categories = ["state:centers", "state:seen"]
    code, report, err = verify(tmp_path, EXAMPLES["center_loss"], "--kills", "4", "--no-ray", "--seed", "0",
                               "--mutate", ",".join(categories), sets=(*SHORT, "world.size=1", "train.accum_steps=4"))
    assert code == 0, err[-3000:]  # caught: what --mutate asks of verify
    assert report["verdict"] == "fail" and report["mutated"] == categories and report["mutation_caught"] is True
    named = [m for m in report["restore_oracle"] if m.startswith("rank 0: state:")]
    assert named == [f"rank 0: {c}" for c in categories], report["restore_oracle"]
    assert report["first_divergence"] is not None


def test_state_outside_the_registered_objects_fails_verify_naming_the_update(tmp_path):
    """A loss-scale counter kept outside ``state``: a restart resets it, so the same batch gives
    another loss, and verify names that stage (nothing registered was lost: the oracle is silent)."""
    # one fault: the divergence is at the first update its restart replays
    code, report, err = verify(tmp_path, str(ROOT / "configs/tiny.yaml"), "--kills", "1", "--no-ray", "--seed", "0",
                               sets=(*SHORT, "job.entrypoint=tests.helpers.jobs:unregistered_counter"))
    assert code == 1, err[-3000:]
    assert report["verdict"] == "fail" and report["restore_oracle"] == []
    first_kill = report["faults"][0]["update"]
    d = report["first_divergence"]
    assert d["stage"] == "loss" and 1 < d["update"] <= first_kill + 1, (d, report["faults"])
    assert d["reading"].startswith("same batch, different loss") and d["restore_oracle"] == []
    assert d["restore"]["attempt"] > 1 and d["rank"] == 0


def readme_block(first_line: str) -> str:
    """The README's fenced block that starts with ``first_line`` (the "Bring your own job" example)."""
    text = (ROOT / "README.md").read_text()
    start = text.index(first_line)
    return text[start:text.index("```", start)]


def test_the_readme_job_runs_in_a_project_with_its_own_trainer_and_orchestrator_modules(tmp_path):
    """The README's example, as a user would lay it out, beside their own trainer.py and orchestrator.py
    (which raise if imported): the ranks import from the working directory, spotrun's own modules are
    spotrun.trainer and spotrun.orchestrator, so nothing is shadowed. Run with the console script, whose
    sys.path[0] is not the project; `spotrun inspect --explain` there imports the job as run does."""
    project = tmp_path / "project"
    project.mkdir()
    for name in ("trainer", "orchestrator"):
        (project / f"{name}.py").write_text(f"raise ImportError('the user project {name}.py was imported')\n")
    (project / "myjob.py").write_text(readme_block("# myjob.py"))
    (project / "myjob.yaml").write_text(readme_block("# myjob.yaml"))
    done = subprocess.run([str(Path(sys.executable).parent / "spotrun"), "run", "myjob.yaml", "--trace", "t.jsonl"],
                          cwd=project, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "finished after 1 attempt(s)" in done.stderr and "attempted 30" in done.stderr
    last = json.loads((project / "t.jsonl").read_text().splitlines()[-1])
    assert last["update"] == 30 and set(last["metrics"]) == {"acc"}
    user_state = list((project / "runs/myjob/bundles").glob("*/rank-1/user.pt"))
    assert user_state, "each rank's registered state is in the bundle"
    # inspect --explain imports the entrypoint as run does: from the working directory
    bundle = sorted((project / "runs/myjob/bundles").glob("*/manifest.json"))[0].parent.relative_to(project)
    explained = subprocess.run([str(Path(sys.executable).parent / "spotrun"), "inspect", str(bundle), "--explain",
                                "myjob.yaml", "--json"], cwd=project, capture_output=True, text=True, timeout=120)
    assert explained.returncode == 0, explained.stderr[-3000:]
    nxt = json.loads(explained.stdout)["next"]
    assert nxt["next_update"] == int(bundle.name[1:11]) + 1 and nxt["next_occurrences"]


def test_an_entrypoint_that_cannot_be_imported_is_refused_before_placement(tmp_path):
    done = spotrun("run", str(ROOT / "configs/tiny.yaml"), "--set", "job.entrypoint=not_here.job:build",
                   "--set", f"storage=file://{tmp_path}", "--set", "world.size=2", cwd=tmp_path, timeout=120)
    assert done.returncode == 2
    assert "module 'not_here.job' cannot be imported" in done.stderr and str(tmp_path) in done.stderr
    assert not (tmp_path / "job").exists(), "nothing was started: no ledger, no bundle"


def test_a_changed_entrypoint_refuses_the_restore_and_says_how_to_start_a_new_lineage(tmp_path):
    shutil.copy(ROOT / "tests/helpers/jobs.py", tmp_path / "myjob.py")
    run = ("run", str(ROOT / "configs/tiny.yaml"), "--no-ray", "--job-id", "fp",
           "--set", "job.entrypoint=myjob:stream_job", "--set", f"storage=file://{tmp_path / 'runs'}",
           "--set", "train.updates=6", "--set", "checkpoint.every_updates=3")
    first = spotrun(*run, "--set", "train.updates=3", cwd=tmp_path, timeout=120)
    assert first.returncode == 0, first.stderr
    with open(tmp_path / "myjob.py", "a") as f:
        f.write("\n# an edit after the bundle was written\n")
    second = spotrun(*run, cwd=tmp_path, timeout=120)
    assert second.returncode == 2
    assert "job code" in second.stderr and "--init-from" in second.stderr
    assert "fp/bundles/u0000000003-a1" in second.stderr.replace("\n", "")


def test_without_ray_what_a_rank_prints_and_warns_reaches_the_terminal_prefixed_and_its_rank_log(tmp_path):
    """--no-ray: the rank is a thread of the driver, and its build's print, its step's print and warning
    still come out as its lines, ``[rank 0] ...`` (print on stdout, the warning on stderr), and are kept
    in the attempt's rank log; the job's own error then fails it (exit 2)."""
    done = spotrun("run", str(ROOT / "configs/tiny.yaml"), "--no-ray", "--job-id", "said",
                   "--set", "job.entrypoint=tests.helpers.jobs:raises_every_attempt", "--set", "world.size=1",
                   "--set", "world.max_restarts=0", "--set", f"storage=file://{tmp_path / 'runs'}", timeout=120)
    assert done.returncode == 2 and "the step's own bug" in done.stderr, done.stderr[-3000:]
    runs = open_storage(f"file://{tmp_path / 'runs'}")
    assert_rank_output(done.stdout, done.stderr, runs, "said", attempts=[1], ranks=[0])


def test_a_step_that_calls_backward_fails_once_on_ray_naming_the_contract(tmp_path, ray_address):
    """loss.backward() in the step, on 2 Ray ranks: one attempt, which fails at update 1 with the JobError
    naming the contract; bad input, so nothing restarts (no loss recorded, no failure budget used)."""
    from spotrun.orchestrator.control.launch import run_on_ray
    from spotrun.orchestrator.ledger.events import AttemptStarted, JobFailed, WorkerLost
    from spotrun.orchestrator.ledger.store import Ledger
    from spotrun.orchestrator.workers.groups import RankFailed
    from tests.conftest import make_spec

    spec = make_spec(tmp_path, "world.size=2", "train.updates=4", "data.workers=0", "world.max_restarts=3",
                     "job.entrypoint=tests.helpers.jobs:does_the_engines_part", "job.config={misuse: backward}",
                     job_id="backward")
    with pytest.raises(RankFailed, match=r"raised JobError: update 1: the job's step changed the gradients") as e:
        run_on_ray(spec, address=ray_address)
    assert e.value.refusal and "a job's step only computes and returns the loss" in str(e.value)
    events = Ledger(open_storage(spec.storage), spec.job_id).read()
    assert [type(ev) for ev in events if isinstance(ev, AttemptStarted | WorkerLost | JobFailed)] == [
        AttemptStarted, JobFailed]
    assert "the job's step changed the gradients" in next(ev for ev in events if isinstance(ev, JobFailed)).reason
