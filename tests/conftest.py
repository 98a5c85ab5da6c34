"""Shared fixtures: specs under a temporary storage root, reference runs, and the oracle."""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

import pytest

from spotrun.orchestrator.control.specfile import load_spec
from spotrun.trainer.job.spec import JobSpec

ROOT = Path(__file__).resolve().parent.parent


def make_spec(tmp_path: Path, *overrides: str, config: str = "configs/tiny.yaml", job_id: str = "job") -> JobSpec:
    """The named config with its storage under ``tmp_path`` and its data addressed absolutely."""
    base = [f"storage=file://{tmp_path / 'runs'}", f"data.shards={ROOT / 'configs/data/tiny'}"]
    return load_spec(ROOT / config, [*base, *overrides], job_id)


@pytest.fixture
def spec_factory(tmp_path: Path):
    def factory(*overrides: str, **kw) -> JobSpec:
        return make_spec(tmp_path, *overrides, **kw)

    return factory


def chunked_sha256(data: bytes, chunk: int) -> str:
    """The ``sha256-chunks-<chunk>`` digest of ``data`` as trainer/storage/digest.py documents it, computed here
    on one thread without that module's code: the reference every writer and verifier must equal."""
    chunks = [data[i:i + chunk] for i in range(0, len(data), chunk)]
    head, tail = b"spotrun sha256-chunks v1\n" + struct.pack(">Q", chunk), struct.pack(">Q", len(data))
    return hashlib.sha256(head + b"".join(hashlib.sha256(c).digest() for c in chunks) + tail).hexdigest()


# -- the shared local Ray (tests/helpers/ray_local.py) ------------------------------------------------


def uses_shared_ray(item: pytest.Item) -> bool:
    return "shared_ray" in getattr(item, "fixturenames", ())


SHARING = pytest.StashKey[set]()  # the modules (paths) with a test on the shared Ray


def shares_ray(item: pytest.Item) -> bool:
    """Whether the item's module has a test on the shared Ray (the module runs in the shared Ray's block)."""
    return item.path in item.config.stash.get(SHARING, set())


@pytest.fixture(scope="session")
def shared_ray():
    """The local Ray shared by the modules that ask for it (through ``ray_for_module``/``ray_address``)."""
    from tests.helpers.ray_local import SharedRay

    yield SharedRay
    SharedRay.stop()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run the modules that share the local Ray one after another, where the first of them was: one
    Ray start for all of them (seconds each) instead of one a module. The order within a module, and
    of every other module, stays.

    Every test is run once more if, and only if, it failed with :class:`UnplannedLoss` (a rank died of
    something the test did not do, named with its last words: a native crash seen once in hundreds
    of runs); any other failure fails at once."""
    from tests.helpers.runs import UnplannedLoss

    for item in items:
        item.add_marker(pytest.mark.flaky(reruns=1, only_rerun=[UnplannedLoss]))
    sharing = config.stash[SHARING] = {item.path for item in items if uses_shared_ray(item)}
    first = next((i for i, item in enumerate(items) if item.path in sharing), None)
    if first is None:
        return
    block = [item for item in items if item.path in sharing]
    rest = [item for item in items if item.path not in sharing]
    items[:] = rest[:first] + block + rest[first:]


CALL_FAILED = pytest.StashKey[bool]()  # whether the test itself (its call phase) failed


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    if call.when == "call":
        item.stash[CALL_FAILED] = outcome.get_result().failed


@pytest.fixture(autouse=True)
def nothing_left_running(request: pytest.FixtureRequest):
    """After every test: a job it left running on a thread of this process (a failed test's, typically)
    is stopped, so that it cannot train on into later tests; and on the shared Ray, nothing the test
    started may still hold CPUs (the Ray is started afresh otherwise, so later tests are not starved).
    The test errors in its teardown naming what it left, unless it failed already (that is its story)."""
    yield
    from tests.helpers.ray_local import SharedRay, stop_job_threads

    stopped = stop_job_threads()
    left = SharedRay.left_behind(stopped) if shares_ray(request.node) else None
    if left is None and stopped:
        left = f"{len(stopped)} job(s) running ({', '.join(stopped)}): stopped"
    if left is not None and not request.node.stash.get(CALL_FAILED, False):
        pytest.fail(f"{request.node.nodeid} left {left}")


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """The shared Ray stops after the last test that uses it (the tests after it start their own, or
    check that none runs)."""
    if shares_ray(item) and (nextitem is None or not shares_ray(nextitem)):
        from tests.helpers.ray_local import SharedRay

        SharedRay.stop()
