"""verify names the stage where a broken job's restart first differs, on real runs (subprocesses,
no Ray, one rank): a transform drawing from a generator of the job's own -> batch; an
optimizer state dropped at restore (the mutant build) -> parameters. (The unregistered loss-scale
counter -> loss is in test_user_jobs.py; the elastic world change -> gradient in test_node_loss.py.)

Each chaos run is killed once, right after the bundle of update 4 is published (the
publish-to-offsets site), so its restart restores exactly that bundle and the first update it
trains again is 5.
"""

from __future__ import annotations

import pytest

from spotrun.orchestrator.control.specfile import load_spec
from spotrun.orchestrator.verify.oracle import Verifier
from spotrun.orchestrator.verify.report import Report
from spotrun.trainer.job.sections import FaultSpec
from tests.conftest import ROOT

pytestmark = pytest.mark.slow
KILL_AFTER_PUBLISHING_4 = FaultSpec(site="after_publish", update=4, rank=0)


def verify(tmp_path, entrypoint: str, mutate: tuple[str, ...] = ()) -> Report:
    overrides = [f"storage=file://{tmp_path / 'runs'}", "train.updates=6", "checkpoint.every_updates=2",
                 f"job.entrypoint={entrypoint}"]
    verifier = Verifier(str(ROOT / "configs/tiny.yaml"), overrides, kills=1, seed=0, no_ray=True,
                        workdir=tmp_path, load=lambda path, o: load_spec(path, o, "stages"), mutate=mutate)
    return verifier.run(faults=[KILL_AFTER_PUBLISHING_4])


def restored_bundle_4(report: Report) -> dict:
    d = report.first_divergence
    assert d is not None, report.failures
    assert d["restore"]["bundle"] == "stages.verify-chaos/bundles/u0000000004-a1", d["restore"]
    assert d["restore"]["attempt"] == 2 and d["restore"]["fault"] == "publish-to-offsets (rank 0, update 4)"
    assert d["update"] == 5 and d["rank"] == 0
    return d


def test_a_generator_of_the_jobs_own_in_a_transform_diverges_at_the_batch(tmp_path):
    """A NumPy generator the job made at import, drawn in the transform: no bundle holds it, and the
    restarted process (and its prefetch worker, tiny: data.workers=1) draws it from its beginning."""
    report = verify(tmp_path, "tests.helpers.jobs:own_generator_augmentation")
    assert report.verdict == "fail" and report.restore_oracle == []  # nothing registered was lost
    d = restored_bundle_4(report)
    assert (d["stage"], d["microstep"]) == ("batch", 0)
    assert d["reading"].startswith("same records, different batch")
    assert d["allowed_by_policy"] is False and d["restore_oracle"] == []


def test_optimizer_moments_dropped_at_restore_diverge_at_the_parameters(tmp_path):
    report = verify(tmp_path, "tests.helpers.jobs:adamw_points", mutate=("optimizer_moments",))
    assert report.verdict == "fail" and report.mutated == ["optimizer_moments"]
    d = restored_bundle_4(report)
    assert d["stage"] == "parameters" and d["microstep"] is None
    assert d["reading"].startswith("same gradient, different parameters")
    assert d["restore_oracle"] == ["rank 0: optimizer_moments"]
    assert "tensor model." in d["detail"]  # the first differing tensor, read from the bundles
