"""Which device a rank trains on, and the refusal of a GPU that torch cannot see."""

from __future__ import annotations

import os

import pytest
import torch

from spotrun.trainer.runtime.device import DeviceError, select_device, set_determinism


def test_a_rank_without_gpus_trains_on_the_cpu():
    assert select_device(0, [], cuda_available=False, device_count=0, node="n1") == "cpu"
    assert select_device(0, ["0"], cuda_available=True, device_count=1, node="n1") == "cpu"


def test_a_rank_given_a_gpu_trains_on_the_device_ray_assigned_it():
    # Ray's default: CUDA_VISIBLE_DEVICES is the assigned id alone, so the rank's GPU is visible device 0
    assert select_device(1, ["3"], cuda_available=True, device_count=1, node="n1", visible="3") == "cuda:0"


@pytest.mark.parametrize(("visible", "gpu", "device"), [(None, "2", "cuda:2"), (None, "0", "cuda:0"),
                                                         ("4,5,6,7", "6", "cuda:2"), ("1, 3", "3", "cuda:1")])
def test_with_noset_cuda_visible_devices_each_rank_uses_its_own_gpu_not_gpu_0(visible, gpu, device):
    """RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES: the rank sees the node's GPUs (every one when the
    variable is unset), and trains on the one Ray assigned, found by its id (a faked assignment)."""
    assert select_device(1, [gpu], cuda_available=True, device_count=4, node="n1", visible=visible) == device


def test_an_assigned_gpu_this_process_cannot_see_is_refused_naming_the_fix():
    with pytest.raises(DeviceError) as e:
        select_device(1, ["5"], cuda_available=True, device_count=2, node="n1", visible="0,1")
    msg = str(e.value)
    assert "Ray assigned GPU 5" in msg and "sees GPUs 0,1" in msg and "CUDA_VISIBLE_DEVICES=0,1" in msg
    assert "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES" in msg
    with pytest.raises(DeviceError, match="Ray assigned GPU 3"):  # beyond what torch counts
        select_device(1, ["3"], cuda_available=True, device_count=2, node="n1", visible=None)


@pytest.mark.parametrize(("share", "words"), [
    (0.5, ["world.num_gpus_per_rank=0.5", "Duplicate GPU detected", "set world.num_gpus_per_rank=1"]),
    (0.25, ["two ranks on one GPU", "or 0 to train on CPUs"]),
    (2, ["world.num_gpus_per_rank=2", "sit idle", "set world.num_gpus_per_rank=1 and world.size"])])
def test_a_fraction_or_several_gpus_per_rank_are_refused_with_exit_2_naming_the_fix(tmp_path, share, words):
    from spotrun.orchestrator.control.specfile import SpecError
    from tests.conftest import make_spec

    with pytest.raises(SpecError) as e:  # the CLI's exit 2
        make_spec(tmp_path, f"world.num_gpus_per_rank={share}")
    assert all(w in str(e.value) for w in words), str(e.value)
    assert make_spec(tmp_path, "world.num_gpus_per_rank=1").world.num_gpus_per_rank == 1


def test_a_gpu_torch_cannot_see_is_refused_naming_the_node_the_build_and_the_fix():
    with pytest.raises(DeviceError) as e:
        select_device(1, ["0"], cuda_available=False, device_count=0, node="node-abc")
    msg = str(e.value)
    assert "node node-abc" in msg and "Ray assigned GPU 0" in msg
    assert f"torch {torch.__version__}" in msg and "sees no CUDA device" in msg
    assert "install a CUDA build of torch" in msg and "world.num_gpus_per_rank=0" in msg


def test_a_gpu_rank_that_ray_gave_no_gpu_is_refused():
    with pytest.raises(DeviceError, match="assigned this rank no GPU"):
        select_device(1, [], cuda_available=True, device_count=1, node="n1")


def test_a_session_sets_the_cublas_workspace_before_the_job_is_built(tmp_path, monkeypatch):
    """Whoever builds a session (a rank, a GPU test, bench/gpu_check.py) gets CUBLAS_WORKSPACE_CONFIG
    before the job's build can touch CUDA: cuBLAS reads it once, at its first handle."""
    from spotrun.trainer.run import session as session_module
    from tests.conftest import make_spec

    spec = make_spec(tmp_path, "train.updates=1")
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    seen: list[str | None] = []
    real = session_module.build_job

    def build(*args, **kw):
        seen.append(os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
        return real(*args, **kw)

    monkeypatch.setattr(session_module, "build_job", build)
    session_module.TrainSession(spec)
    assert seen == [":4096:8"]


def test_determinism_settings_set_the_cublas_workspace_unless_the_user_chose_one(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    set_determinism(1)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # the other deterministic setting: kept
    set_determinism(1)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


def test_determinism_settings_turn_tf32_off_unless_allowed():
    try:
        set_determinism(1, allow_tf32=False)
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
        assert not torch.backends.cudnn.benchmark
        set_determinism(1, allow_tf32=True)
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    finally:
        set_determinism(1, allow_tf32=False)


def test_strict_refuses_a_restore_onto_another_device_model_and_elastic_allows_it(tmp_path):
    """A bundle written on CPUs restored on a GPU model (the desc as a GPU rank would describe
    itself): strict refuses naming both, elastic restores (labelled exact-data by the supervisor)."""
    import dataclasses

    from spotrun.orchestrator.control.launch import run_in_process
    from spotrun.trainer.bundle.bundles import list_bundles, read_manifest
    from spotrun.trainer.bundle.compat import check_compatible
    from spotrun.trainer.bundle.errors import BundleIncompatible
    from spotrun.trainer.run.session import TrainSession
    from spotrun.trainer.storage import open_storage
    from tests.conftest import make_spec

    spec = make_spec(tmp_path, "train.updates=4", "checkpoint.every_updates=2", job_id="dev")
    run_in_process(spec)
    storage = open_storage(spec.storage)
    manifest = read_manifest(storage, list_bundles(storage, "dev")[0].key)
    assert manifest.versions.gpu is None
    desc = TrainSession(spec).desc
    check_compatible(manifest, desc, "bundle b")  # same device model: fine
    on_gpu = dataclasses.replace(desc, runtime=desc.runtime.model_copy(update={"gpu": "NVIDIA H200"}))
    with pytest.raises(BundleIncompatible) as e:
        check_compatible(manifest, on_gpu, "bundle b")
    assert "written on CPUs, this rank has NVIDIA H200" in str(e.value) and "world.policy: elastic" in str(e.value)
    check_compatible(manifest, dataclasses.replace(on_gpu, policy="elastic"), "bundle b")


@pytest.mark.parametrize("inductor_first", [False, True], ids=["inductor-later", "inductor-before"])
def test_determinism_reaches_inductor_without_importing_it(inductor_first):
    """A fresh interpreter (this one may have imported TorchInductor already): the kernel switch is
    on, TorchInductor is not imported for it, and its config says deterministic whether it was
    imported before set_determinism or after."""
    import subprocess
    import sys

    probe = (
        "import sys, torch\n"
        + ("import torch._inductor.config\n" if inductor_first else "")
        + "from spotrun.trainer.runtime.device import set_determinism\n"
        "set_determinism(1)\n"
        "imported = 'torch._inductor' in sys.modules\n"
        "import torch._inductor.config as c\n"
        "print(torch.are_deterministic_algorithms_enabled(), imported, c.deterministic)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", str(inductor_first), "True"]
