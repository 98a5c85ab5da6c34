"""A rank that Ray gives a GPU its torch cannot see stops the job before any update, exit 2.

The local cluster *declares* one GPU (``ray.cluster_utils.Cluster`` with ``num_gpus``): Ray then
assigns "GPU 0" to a rank that asks for one, while this machine's CPU build of torch sees no CUDA
device, exactly the situation of a CPU wheel on a GPU node."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from ray.cluster_utils import Cluster

from tests.conftest import ROOT

pytestmark = pytest.mark.slow


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch that sees no CUDA device")
def test_a_gpu_rank_whose_torch_sees_no_cuda_is_refused_before_any_update(tmp_path):
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 1, "include_dashboard": False})
    try:
        trace = tmp_path / "t.jsonl"
        done = subprocess.run(
            [sys.executable, "-m", "spotrun", "run", str(ROOT / "configs/tiny.yaml"), "--address", cluster.address,
             "--job-id", "gpu", "--trace", str(trace), "--set", f"storage=file://{tmp_path / 'runs'}",
             "--set", f"data.shards={ROOT / 'configs/data/tiny'}", "--set", "world.num_gpus_per_rank=1",
             "--set", "world.capacity_timeout_s=20"],
            cwd=ROOT, capture_output=True, text=True, timeout=180)
    finally:
        cluster.shutdown()
    assert done.returncode == 2, done.stderr[-3000:]
    err = " ".join(done.stderr.split())
    assert "Ray assigned GPU 0 to this rank" in err and "sees no CUDA device" in err
    assert f"torch {torch.__version__}" in err and "install a CUDA build of torch" in err
    assert "node " in err
    assert not trace.exists() or not trace.read_text().strip(), "no update ran"
    assert not list((tmp_path / "runs").glob("gpu/bundles/*")), "no bundle was written"
