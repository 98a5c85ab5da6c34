"""A real kill: `spotrun run` SIGKILLed at random points, restarted with the same command, finishes exactly."""

from __future__ import annotations

import random

import pytest

from spotrun.orchestrator.ledger.events import Restored
from spotrun.orchestrator.ledger.store import Ledger
from spotrun.trainer.bundle.bundles import list_bundles
from spotrun.trainer.data.listing import scan
from spotrun.trainer.observe.trace import first_divergence, latest_per_update, read_trace
from spotrun.trainer.storage import open_storage
from tests.conftest import ROOT
from tests.helpers.runs import assert_exact_coverage, hold, kill_when_held, run_cmd, run_to_end

pytestmark = pytest.mark.slow
SETS = ("train.updates=45", "checkpoint.every_updates=5", "data.workers=2", "data.prefetch=2", "data.seq_len=48")
RECORDS = len(scan(ROOT / "configs/data/tiny"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("killref")
    trace = tmp / "ref.jsonl"
    done = run_to_end(run_cmd(tmp / "runs", "ref", trace, *SETS))
    assert done.returncode == 0, done.stderr
    return read_trace(trace)


def _finish_and_compare(cmd, trace, reference):
    done = run_to_end(cmd)
    assert done.returncode == 0, done.stderr
    final = latest_per_update(read_trace(trace))
    assert sorted(final) == list(range(1, 46))
    assert first_divergence(reference, list(final.values())) is None
    assert_exact_coverage(final, RECORDS)
    return final


def test_external_sigkill_at_random_points(reference, tmp_path):
    """Two SIGKILLs from outside at seeded-random updates; the same command resumes each time. Each run
    holds at its update (a HOLD fault), so it is still there to be killed however fast it trains."""
    rng = random.Random(20261129)  # the test's own generator
    trace = tmp_path / "t.jsonl"
    first, second = sorted(rng.sample(range(12, 40), 2))
    cmd = run_cmd(tmp_path / "runs", "killed", trace, *SETS,
                  f"faults=[{hold(first, site='microstep')}, {hold(second, site='microstep', attempt=2)}]")
    # each killed once the last bundle before its update is published: the next run restores it
    assert kill_when_held(cmd, tmp_path / "runs", "killed", attempt=1, published=(first - 1) // 5 * 5) == -9
    assert kill_when_held(cmd, tmp_path / "runs", "killed", attempt=2, published=(second - 1) // 5 * 5) == -9
    _finish_and_compare(cmd, trace, reference)
    events = Ledger(open_storage(f"file://{tmp_path / 'runs'}"), "killed").read()
    restores = [e for e in events if isinstance(e, Restored)]
    assert [r.attempt for r in restores] == [2, 3] and all(r.recovery_label == "exact" for r in restores)


def test_kill_mid_accumulation(reference, tmp_path):
    """SIGKILL between the two microsteps of update 13: the resumed run replays 11..13 identically."""
    trace = tmp_path / "t.jsonl"
    cmd = run_cmd(tmp_path / "runs", "midaccum", trace, *SETS, "faults=[{site: microstep, update: 13, microstep: 1}]")
    assert run_to_end(cmd).returncode == -9
    assert max(r.update for r in read_trace(trace)) <= 12  # the trace may lag a poll behind the rank
    _finish_and_compare(cmd, trace, reference)


def test_kill_during_bundle_write_never_restores_that_bundle(reference, tmp_path):
    """A kill while bundle 10 is being written leaves it unpublished; the restart resumes from bundle 5."""
    trace = tmp_path / "t.jsonl"
    storage = open_storage(f"file://{tmp_path / 'runs'}")
    cmd = run_cmd(tmp_path / "runs", "midwrite", trace, *SETS,
                  "faults=[{site: bundle_write, update: 10, after_bundle: 5}]")  # once bundle 5 is published
    assert run_to_end(cmd).returncode == -9
    torn = [r for r in list_bundles(storage, "midwrite") if r.update == 10]
    assert len(torn) == 1 and not torn[0].published
    assert storage.list(torn[0].key), "the torn bundle should hold some files"
    _finish_and_compare(cmd, trace, reference)
    restored = [e for e in Ledger(storage, "midwrite").read() if isinstance(e, Restored)]
    assert [r.bundle.rsplit("/", 1)[-1] for r in restored] == ["u0000000005-a1"]
    assert not any(r.key == torn[0].key for r in list_bundles(storage, "midwrite")), "orphan not collected"
