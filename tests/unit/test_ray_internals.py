"""Ray's private APIs live in one module: a Ray that changed them is a clear error at start, naming
the API, both versions and the way out; nothing else in spotrun touches them."""

from __future__ import annotations

import re
import sys
import types

import pytest

from spotrun.orchestrator import ray_internals
from spotrun.orchestrator.ray_internals import RayInternalsChanged, drain_reader, enable_token_auth, untested_version
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
