"""A GPU rank's bundle holds its own device's CUDA generator, and a bundle holding another count of
them is refused with the reason (not a plain error that fails the job). torch.cuda is faked: this
runs on CPUs, and says nothing of a real GPU."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from spotrun.trainer.bundle.bundles import LoadedBundle
from spotrun.trainer.bundle.errors import BundleIncompatible
from spotrun.trainer.run.session import TrainSession
from spotrun.trainer.state import rng as rng_module
from spotrun.trainer.state.rng import GeneratorMismatch, RngState
from tests.conftest import make_spec

FAKE_STATE = torch.arange(16, dtype=torch.uint8)


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda's generator calls, recording which device each touched; every-device calls raise."""
    calls: list[tuple[str, object]] = []

    def every_device(*_a, **_k):
        raise AssertionError("a rank's RNG state touched every visible GPU's generator")

    monkeypatch.setattr(rng_module.torch.cuda, "get_rng_state", lambda device: calls.append(("get", device))
                        or FAKE_STATE.clone())
    monkeypatch.setattr(rng_module.torch.cuda, "set_rng_state", lambda state, device: calls.append(("set", device)))
    monkeypatch.setattr(rng_module.torch.cuda, "get_rng_state_all", every_device)
    monkeypatch.setattr(rng_module.torch.cuda, "set_rng_state_all", every_device)
    monkeypatch.setattr(rng_module.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(rng_module.torch.cuda, "device_count", lambda: 4)  # the node shows 4; the rank uses one
    return calls


def test_a_gpu_rank_saves_and_restores_its_own_devices_generator_only(fake_cuda):
    state = RngState("cuda:2").state_dict()
    assert len(state["torch_cuda"]) == 1 and fake_cuda == [("get", "cuda:2")]
    RngState("cuda:2").load_state_dict(state)
    assert fake_cuda == [("get", "cuda:2"), ("set", "cuda:2")]


def test_a_cpu_rank_saves_no_cuda_generator_even_where_cuda_is_available(fake_cuda):
    assert RngState("cpu").state_dict()["torch_cuda"] == [] and fake_cuda == []


def test_a_count_mismatch_is_refused_before_any_stream_changes(fake_cuda):
    state = RngState("cuda:0").state_dict()
    state["torch_cuda"] = state["torch_cuda"] * 2  # what a rank that saw two GPUs wrote
    random.seed(7)
    before = random.getstate()
    with pytest.raises(GeneratorMismatch) as e:
        RngState("cuda:0").load_state_dict(state)
    assert "2 CUDA generator states" in str(e.value) and "one GPU (cuda:0)" in str(e.value)
    assert random.getstate() == before and ("set", "cuda:0") not in fake_cuda


def test_the_session_refuses_such_a_bundle_as_incompatible_naming_the_reason(tmp_path, fake_cuda):
    """A refused bundle (BundleIncompatible crosses the actor boundary typed), not a ValueError that
    fails the job: the supervisor refuses it with the reason instead of retrying it."""
    session = TrainSession(make_spec(tmp_path, "train.updates=1"))
    payloads = session.state.capture().files()
    session.state.rng.device = "cuda:0"  # as a GPU rank would restore it
    rng = dict(payloads["rank-0/rng.json"], torch_cuda=["AAAA", "AAAA"])
    manifest = SimpleNamespace(data=SimpleNamespace(shards=[]), loop_convention=2)
    bundle = LoadedBundle("u0000000001-a1", manifest, {**payloads, "rank-0/rng.json": rng})  # type: ignore[arg-type]
    with pytest.raises(BundleIncompatible) as e:
        session.restore(bundle)
    assert "bundle u0000000001-a1" in str(e.value) and "2 CUDA generator states" in str(e.value)
