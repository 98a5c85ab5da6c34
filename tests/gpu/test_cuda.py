"""The GPU path, on a machine with a CUDA device (skipped elsewhere; bench/gpu_check.py runs these).

One rank on ``cuda:0`` in this process: it trains there, its bundle says on which GPU, its
capture goes through pinned host buffers on a side stream, a restart is bitwise equal to the
uninterrupted run, and the CUDA generator is in the bundle.
"""

from __future__ import annotations

import pytest
import torch

from spotrun.orchestrator.control.launch import run_in_process
from spotrun.trainer.bundle.bundles import list_bundles, load_bundle
from spotrun.trainer.observe.trace import first_divergence, latest_per_update, read_trace
from spotrun.trainer.run.session import TrainSession
from spotrun.trainer.storage import open_storage
from tests.conftest import make_spec

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")]
GPU = ("world.num_gpus_per_rank=1", "train.updates=12", "checkpoint.every_updates=4", "data.workers=1",
       "model.dropout=0.1")


def test_a_gpu_rank_trains_on_its_gpu_and_the_bundle_names_it(tmp_path):
    spec = make_spec(tmp_path, *GPU, job_id="gpu")
    run_in_process(spec)
    storage = open_storage(spec.storage)
    bundle = load_bundle(storage, list_bundles(storage, "gpu")[0].key, None)
    v = bundle.manifest.versions
    assert v.gpu == torch.cuda.get_device_name(0) and v.cuda == torch.version.cuda
    assert v.cudnn == str(torch.backends.cudnn.version()) and v.nccl == ".".join(map(str, torch.cuda.nccl.version()))
    assert bundle.manifest.deterministic
    assert len(bundle.payloads["rank-0/rng.json"]["torch_cuda"]) == 1, "the rank's own CUDA generator, alone"


def test_the_capture_copies_through_pinned_buffers_on_a_side_stream(tmp_path):
    spec = make_spec(tmp_path, *GPU, job_id="pin")
    session = TrainSession(spec, device="cuda:0")
    try:
        assert next(session.state.model.parameters()).is_cuda
        session.start()
        session.run_update()
        capture = session.capture()
        assert capture.ready is not None, "the copies were issued asynchronously"
        capture.wait()
        params = capture.torch_files["rank-0/model.pt"]["model"]
        assert all(t.is_pinned() and not t.is_cuda for t in params.values())
        live = session.state.model.state_dict()
        assert all(torch.equal(params[k], live[k].cpu()) for k in params)
    finally:
        session.close()


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_a_restart_on_the_gpu_is_bitwise_equal(tmp_path, precision):
    """The driver is SIGKILLed mid-run and started again; every update equals the uninterrupted run."""
    import subprocess
    import sys

    from tests.conftest import ROOT
    from tests.helpers.runs import run_cmd

    sets = (*GPU, f"train.precision={precision}")
    ref = tmp_path / "ref.jsonl"
    assert subprocess.run(run_cmd(tmp_path / "runs", "ref", ref, *sets), cwd=ROOT).returncode == 0
    chaos = tmp_path / "chaos.jsonl"
    killed = run_cmd(tmp_path / "runs", "chaos", chaos, *sets, "faults=[{site: microstep, update: 7, microstep: 1}]")
    assert subprocess.run(killed, cwd=ROOT).returncode == -9
    assert subprocess.run(killed, cwd=ROOT, stderr=sys.stderr).returncode == 0
    assert first_divergence(read_trace(ref), list(latest_per_update(read_trace(chaos)).values())) is None


def test_a_buffer_copy_is_from_the_boundary_even_when_the_next_forward_updates_it_at_once():
    """A buffer (batch-norm statistics) is copied on the training stream: an update of it queued right
    after the capture, as the next forward's, cannot reach the copy. 256 MB, so that a copy on
    another stream would still be reading when the update ran."""
    from spotrun.trainer.state.training import HostBuffers

    host = HostBuffers("cuda:0")
    running = torch.zeros(64 * 2**20, device="cuda:0")
    with torch.no_grad():
        with host.copies():
            copied = host.copy("model/bn.running_mean", running)  # not deferred: a buffer
        ready = host.done()
        running.add_(1.0)  # the next forward, queued at once on the training stream
    ready.synchronize()
    assert copied.is_pinned() and float(copied.max()) == 0.0 and float(running.min()) == 1.0


def test_a_session_built_in_a_fresh_process_runs_deterministic_gemms(tmp_path):
    """CUBLAS_WORKSPACE_CONFIG unset: the session sets it before cuBLAS starts, so the first GEMM
    under deterministic algorithms does not raise."""
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    code = ("import sys; from tests.conftest import make_spec; from pathlib import Path; "
            "from spotrun.trainer.run.session import TrainSession; "
            f"spec = make_spec(Path({str(tmp_path)!r}), *{GPU!r}, job_id='cublas'); "
            "s = TrainSession(spec, device='cuda:0'); s.start(); s.run_update(); s.close()")
    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
