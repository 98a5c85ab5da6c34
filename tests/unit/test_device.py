"""Which device a rank trains on, and the refusal of a GPU that torch cannot see."""

from __future__ import annotations

import pytest
import torch

from spotrun.trainer.device import DeviceError, select_device, set_determinism


def test_a_rank_without_gpus_trains_on_the_cpu():
    assert select_device(0, [], cuda_available=False, device_count=0, node="n1") == "cpu"
    assert select_device(0, ["0"], cuda_available=True, device_count=1, node="n1") == "cpu"


@pytest.mark.parametrize("share", [1, 0.5])
def test_a_rank_given_a_gpu_trains_on_the_first_visible_device(share):
    # Ray sets CUDA_VISIBLE_DEVICES to the assigned id(s): the rank's own GPU is visible device 0
    assert select_device(share, ["3"], cuda_available=True, device_count=1, node="n1") == "cuda:0"


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

    from spotrun.orchestrator.launch import run_in_process
    from spotrun.trainer.bundle import BundleIncompatible, check_compatible, list_bundles, read_manifest
    from spotrun.trainer.session import TrainSession
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
        + "from spotrun.trainer.device import set_determinism\n"
        "set_determinism(1)\n"
        "imported = 'torch._inductor' in sys.modules\n"
        "import torch._inductor.config as c\n"
        "print(torch.are_deterministic_algorithms_enabled(), imported, c.deterministic)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", str(inductor_first), "True"]
