"""Ray's private APIs live in one module: a Ray that changed them is a clear error at start, naming
the API, both versions and the way out; nothing else in spotrun touches them."""

from __future__ import annotations

import re
import sys
import types

import pytest

from spotrun.orchestrator.workers import ray_internals
from spotrun.orchestrator.workers.ray_internals import (
    RayInternalsChanged,
    drain_reader,
    enable_token_auth,
    untested_version,
)
from tests.conftest import ROOT

PRIVATE = re.compile(r"ray\._raylet|ray\._private|gcs_pb2")


def test_no_other_module_uses_ray_internals():
    sources = [p for folder in ("orchestrator", "trainer") for p in (ROOT / folder).rglob("*.py")]
    users = sorted(str(p.relative_to(ROOT)) for p in sources
                   if PRIVATE.search(p.read_text()) and p.name != "ray_internals.py")
    assert users == []


def test_the_tested_ray_passes_and_another_is_named():
    import ray

    assert untested_version(ray.__version__) is None  # the Ray this project pins
    text = untested_version("2.61.0")
    assert text is not None and "Ray 2.61.0" in text and "2.60" in text


def test_a_ray_without_the_drain_api_is_a_clear_error(monkeypatch):
    import ray.core.generated

    gone = types.ModuleType("gcs_pb2")  # no NodeSnapshot
    monkeypatch.setitem(sys.modules, "ray.core.generated.gcs_pb2", gone)
    monkeypatch.setattr(ray.core.generated, "gcs_pb2", gone, raising=False)
    with pytest.raises(RayInternalsChanged, match=r"NodeSnapshot.*tested with Ray 2\.60.*watch_ray_drain=false"):
        drain_reader("127.0.0.1:1")


def test_a_reply_of_another_shape_is_a_clear_error(monkeypatch):
    import ray

    class Client:  # a GcsClient whose node infos lost ``state_snapshot``
        def __init__(self, address: str) -> None:
            self.address = address

        def get_all_node_info(self):
            return {bytes.fromhex("ab"): types.SimpleNamespace()}

    monkeypatch.setattr(ray._raylet, "GcsClient", Client)
    read = drain_reader("127.0.0.1:1")
    with pytest.raises(RayInternalsChanged, match="state_snapshot"):
        read()


def test_a_ray_without_the_token_setup_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, ray_internals.AUTH_LOGGER, None)  # the import fails
    with pytest.raises(RayInternalsChanged, match="RAY_AUTH_MODE=token"):
        enable_token_auth()


def test_the_raylet_s_worker_death_notice_is_left_out_and_everything_else_printed(monkeypatch, capsys):
    """spotrun tells each lost rank itself; Ray's driver prints what Ray publishes through one function,
    which spotrun wraps (once, however often asked) to leave the raylet's worker-death notice out."""
    from ray._private import worker

    monkeypatch.setattr(worker, "print_to_stdstream", worker.print_to_stdstream)  # undone after the test
    ray_internals.quiet_worker_deaths()
    ray_internals.quiet_worker_deaths()
    died = {"lines": [f"{ray_internals.WORKER_DIED}. To troubleshoot ..."], "pid": "raylet", "is_err": False}
    other = {"lines": ["an autoscaler could not add a node"], "pid": "raylet", "is_err": False}
    worker.print_to_stdstream(died, ignore_prefix=False)
    worker.print_to_stdstream(other, ignore_prefix=False)
    out = capsys.readouterr().out
    assert "an autoscaler could not add a node" in out and ray_internals.WORKER_DIED not in out
    assert ray_internals.is_ray_control_line(":actor_name:RankActor")
    assert not ray_internals.is_ray_control_line("loss 0.3 :actor_name: in the middle")
