"""The local Ray the tests run on: one shared by every module that asks for it (ray.init takes seconds),
or one multi-node local cluster (ray.cluster_utils.Cluster) for the tests that lose nodes.

The shared one (:class:`SharedRay`) is started by the first module that asks for it (``ray_for_module``,
``ray_address``) and kept for the next: tests/conftest.py runs those modules one after another and stops
it after the last, and after each of their tests makes sure nothing the test started still holds it (a
job left running by a failed test would starve every later test of the cluster)."""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import ray
from ray.cluster_utils import Cluster

# The shared Ray's CPUs: two ranks and a spare, or three ranks, of one CPU each.
SHARED_CPUS = 3
# How long a passing test's jobs may take to hand their CPUs back (a driver that exited, a placement
# group removed: Ray frees them within a second or so) before the cluster counts as left busy.
RELEASE_S = 15.0


def _init_local(num_cpus: int, env: dict[str, str] | None = None) -> None:
    """``address="local"`` always starts a new instance (never attaches to a stale one)."""
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": env} if env else None)


@contextmanager
def local_ray(num_cpus: int = 3, env: dict[str, str] | None = None):
    """A local Ray of the caller's own (the shared one is stopped first: one Ray per process)."""
    SharedRay.stop()
    _init_local(num_cpus, env)
    try:
        yield
    finally:
        ray.shutdown()


@contextmanager
def local_cluster(workers: int) -> Iterator[Cluster]:
    """A head that runs no ranks and ``workers`` one-CPU worker nodes (one rank's room each), this
    process connected to it (the shared Ray is stopped first)."""
    SharedRay.stop()
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


class SharedRay:
    """The one local Ray the sharing modules use, this process connected to it."""

    address: str | None = None

    @classmethod
    def start(cls) -> str:
        """Its GCS address, starting it if it is not running."""
        if cls.address is None:
            _init_local(SHARED_CPUS)
            cls.address = ray.get_runtime_context().gcs_address
        return cls.address

    @classmethod
    def stop(cls) -> None:
        if cls.address is not None:
            ray.shutdown()
            cls.address = None

    @classmethod
    def busy_cpus(cls) -> float:
        """CPUs something still holds (a rank, a placement group's reservation)."""
        return ray.cluster_resources().get("CPU", 0.0) - ray.available_resources().get("CPU", 0.0)

    @classmethod
    def left_behind(cls, stopped: list[str]) -> str | None:
        """After a test on it, which left the jobs ``stopped`` running on threads of this process (now
        stopped): when they or anything else (a driver subprocess, a placement group) still hold CPUs,
        start the shared Ray afresh; says what was left, or None when the test left it as it found it."""
        if cls.address is None:
            return None
        if stopped:  # their ranks are left without a supervisor: nothing will hand their CPUs back
            left = f"{len(stopped)} job(s) running on the shared Ray ({', '.join(stopped)})"
        else:
            deadline = time.monotonic() + RELEASE_S
            while (busy := cls.busy_cpus()) > 0 and time.monotonic() < deadline:
                time.sleep(0.1)  # polling Ray's resource view until the jobs' CPUs are back
            if busy <= 0:
                return None
            left = f"{busy:g} CPU(s) of the shared Ray held {RELEASE_S:g}s after it ended"
        cls.stop()
        cls.start()
        return f"{left}: stopped, and Ray started afresh, so that later tests are not starved"


# -- jobs run on threads of the test process --------------------------------------------------------------

_job_threads: list[threading.Thread] = []


def job_thread(target, name: str) -> threading.Thread:
    """Start ``target`` (a job: ``run_on_ray`` and the like) on a daemon thread the shared Ray's
    cleanup knows of, so that a test that fails while it runs does not leave it running."""
    thread = threading.Thread(target=target, name=f"job {name}", daemon=True)
    _job_threads.append(thread)
    thread.start()
    return thread


def stop_job_threads(timeout: float = 30.0) -> list[str]:
    """Stop every registered job thread still running: a ``SystemExit`` raised in it (the supervisor's
    waits return to Python every 0.1 s), then joined; returns their names."""
    alive = [t for t in _job_threads if t.is_alive()]
    _job_threads[:] = []
    for t in alive:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(t.ident or 0), ctypes.py_object(SystemExit))
    for t in alive:
        t.join(timeout)
    return [t.name for t in alive]


@pytest.fixture(scope="module")
def ray_for_module(shared_ray):
    """Import into a test module and mark it ``usefixtures``/autouse: the shared local Ray, this
    process connected to it."""
    shared_ray.start()


@pytest.fixture
def ray_address(shared_ray) -> str:
    """The address of the shared local Ray, for the module's `spotrun run` subprocesses (each would
    start its own otherwise: seconds a run); the test process is connected to it too. Asked for by
    each test: the cleanup after a failed test may have started it afresh, at another address."""
    return shared_ray.start()
