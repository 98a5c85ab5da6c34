"""One embedded local Ray per test module (ray.init takes seconds; every test of a module shares it), or
one multi-node local cluster (ray.cluster_utils.Cluster) for the tests that lose nodes."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import ray
from ray.cluster_utils import Cluster


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


@contextmanager
def local_cluster(workers: int) -> Iterator[Cluster]:
    """A head that runs no ranks and ``workers`` one-CPU worker nodes (one rank's room each), this
    process connected to it."""
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    for _ in range(workers):
        c.add_node(num_cpus=1)
    ray.init(address=c.address, log_to_driver=False)
    c.wait_for_nodes()
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


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
