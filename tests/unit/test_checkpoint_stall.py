"""The stall recorded with a bundle is everything the training loop waited for at its checkpoint:
the previous bundle's write finishing, the capture and the manifest draft, not the capture alone.

A rank runner checkpoints after every update; the write of bundle 1 is held back (its storage puts
wait on a gate) until at least ``HOLD_S`` after the loop reported update 2, so the checkpoint at 2
must wait that long for it before it can capture."""

from __future__ import annotations

import threading
import time

from spotrun.trainer.bundle.bundles import BundleWriter
from spotrun.trainer.run.context import AttemptContext, Instrumentation
from spotrun.trainer.run.rank import RankRunner
from spotrun.trainer.runtime.collective import LocalCollective
from tests.conftest import make_spec

HOLD_S = 0.3


class GatedStorage:
    """The job's storage, except that puts under bundle 1 wait until :attr:`gate` is set."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.uri = inner.uri
        self.gate = threading.Event()
        self.held = threading.Event()  # a put of bundle 1 is waiting

    def _hold(self, key: str) -> None:
        if "/u0000000001-" in key:
            self.held.set()
            self.gate.wait(timeout=60)

    def put(self, key: str, data: bytes) -> None:
        self._hold(key)
        self.inner.put(key, data)

    def put_chunks(self, key: str, chunks, algorithm: str) -> str:
        self._hold(key)
        return self.inner.put_chunks(key, chunks, algorithm)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_the_stall_includes_waiting_for_the_previous_write(tmp_path):
    spec = make_spec(tmp_path, "train.updates=3", "checkpoint.every_updates=1", "data.workers=0")
    ctx = AttemptContext(spec=spec, attempt=1, world_size=1, lineage_id="L", recovery_label="fresh",
                         instrument=Instrumentation(trace=True))
    runner = RankRunner(ctx, rank=0, collective=LocalCollective())
    storage = GatedStorage(runner.storage)
    runner.writer = BundleWriter(storage, runner.session.faults)
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    bundles = []
    assert storage.held.wait(timeout=60), "bundle 1 was never written"
    seen_at = None
    while seen_at is None or time.monotonic() - seen_at < HOLD_S:  # the write of bundle 1 is slow
        report = runner.poll()
        bundles += report.bundles
        if seen_at is None and report.last_update >= 2:
            seen_at = time.monotonic()  # the loop is at the checkpoint of update 2, waiting
        time.sleep(0.005)
    storage.gate.set()
    thread.join(timeout=60)
    bundles += runner.poll().bundles
    drafts = {b.update: b.draft for b in bundles}
    assert sorted(drafts) == [1, 2, 3]
    second = drafts[2]
    assert second["write_wait_seconds"] >= HOLD_S - 0.05
    assert second["stall_seconds"] >= second["write_wait_seconds"] + second["capture_seconds"]
    assert second["capture_seconds"] > 0
    assert drafts[1]["write_wait_seconds"] < HOLD_S / 3  # nothing was in flight before bundle 1
