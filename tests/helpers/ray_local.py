"""One embedded local Ray per test module (ray.init takes seconds; every test of a module shares it)."""

from __future__ import annotations

import logging
from contextlib import contextmanager

import pytest
import ray


@contextmanager
def local_ray(num_cpus: int = 3, env: dict[str, str] | None = None):
    """``address="local"`` always starts a new instance (never attaches to a stale one)."""
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": env} if env else None)
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_for_module():
    """Import into a test module and mark it ``usefixtures``/autouse to share one local Ray."""
    with local_ray():
        yield


@pytest.fixture(scope="module")
def ray_address():
    """The address of one local Ray for the module's `spotrun run` subprocesses (each would start
    its own otherwise: seconds a run); the test process is connected to it too."""
    with local_ray(num_cpus=2):
        yield ray.get_runtime_context().gcs_address
