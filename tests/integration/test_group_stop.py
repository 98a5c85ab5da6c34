"""A stop signal to the whole process group of `spotrun run` (what `systemctl stop`, `tini -g` or
`kill -TERM -PGID` send) reaches the embedded Ray's processes too. The job must still publish its
emergency bundle, exit 143, and a rerun must repeat no update."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from spotrun.orchestrator.ledger.events import NoticeHandled, Restored
from spotrun.orchestrator.ledger.store import Ledger
from spotrun.trainer.observe.trace import read_trace
from spotrun.trainer.storage import open_storage
from tests.conftest import ROOT
from tests.helpers.ray_local import ray_address  # noqa: F401 - the module's local Ray, for the reruns
from tests.helpers.runs import hold, run_cmd, run_to_end, wait_until_held

pytestmark = pytest.mark.slow
# 2 ranks, no periodic checkpoint due: any bundle is the emergency one.
SETS = ("world.size=2", "checkpoint.every_updates=1000", "data.workers=1", "model.n_layer=1")
# Rank 0 holds before update 3's optimizer step until the stop is acted on: the job cannot finish
# first, and the emergency bundle is update 3's.
HELD_AT = 3


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_the_whole_process_group_publishes_exits_143_and_loses_nothing(tmp_path, signum, ray_address):
    trace, job = tmp_path / "t.jsonl", f"group-{signum.name.lower()}"
    cmd = run_cmd(tmp_path / "runs", job, trace, "train.updates=10", *SETS, f"faults=[{hold(HELD_AT)}]", ray=True)
    # its own process group, as a service manager starts it; the group id is its pid
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    storage = open_storage(f"file://{tmp_path / 'runs'}")
    try:
        wait_until_held(storage, job, lambda: proc.poll() is None, timeout=180)
        os.killpg(proc.pid, signum)
        code = proc.wait(timeout=180)
        err = proc.stderr.read() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert code == 143, err
    handled = [e for e in Ledger(storage, job).read() if isinstance(e, NoticeHandled)]
    assert handled, f"no emergency bundle was published: {err}"
    bundle_update = handled[0].update
    assert bundle_update == HELD_AT
    first_run = read_trace(trace)
    assert max(r.update for r in first_run) == bundle_update, "updates after the bundle were lost"

    # the rerun on a running Ray: what is tested is the embedded one's stop, and the resume
    done = run_to_end(run_cmd(tmp_path / "runs", job, trace, f"train.updates={bundle_update + 2}", *SETS,
                              ray=ray_address))
    assert done.returncode == 0, done.stderr
    restored = [e for e in Ledger(storage, job).read() if isinstance(e, Restored)]
    assert restored and restored[-1].update == bundle_update
    rerun = read_trace(trace)[len(first_run):]
    assert [r.update for r in rerun] == [bundle_update + 1, bundle_update + 2], "the rerun repeated updates"
