"""Storage failures have a kind (unavailable: it passes; permanent: it does not), and a storage path rides
an outage out however long it lasts, believing a permanent refusal only once it has persisted."""

from __future__ import annotations

import errno
import os

import pytest

from spotrun.trainer.storage import (
    LocalStorage,
    Outage,
    StorageFullError,
    StoragePermanentError,
    StorageUnavailableError,
)
from spotrun.trainer.storage.outage import Backoff, OutageView


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.ESTALE])
def test_a_full_disk_or_a_stale_handle_is_unavailable_and_leaves_no_temp_file(tmp_path, monkeypatch, code):
    s = LocalStorage(tmp_path)

    def full(*a: object, **k: object) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "fsync", full)  # the write got as far as the sync
    with pytest.raises(StorageUnavailableError, match=os.strerror(code)) as raised:
        s.put("job/events/000000000001.json", b"{}")
    # only a full disk or quota is "full": the remedy (removing a partial bundle, pruning) is for want of room
    assert isinstance(raised.value, StorageFullError) == (code in (errno.ENOSPC, errno.EDQUOT))
    with pytest.raises(StorageUnavailableError):
        s.put_new("job/x", b"{}")
    monkeypatch.undo()
    assert s.list("job") == [] and not any(p.is_file() for p in tmp_path.rglob("*"))


def test_a_path_that_is_not_a_directory_is_permanent_and_a_missing_key_stays_file_not_found(tmp_path):
    s = LocalStorage(tmp_path)
    s.put("job/file", b"x")
    with pytest.raises(StoragePermanentError, match="job/file"):
        s.put("job/file/under", b"y")  # "job/file" is a file: ENOTDIR
    with pytest.raises(FileNotFoundError):
        s.get("job/nothing")


def test_an_unavailable_storage_is_ridden_out_however_long_and_its_end_is_measured():
    clock = Clock()
    o = Outage("the ledger", bound_s=60, clock=clock)
    assert o.due() and not o.down
    for _ in range(100):  # an hour and a half of refusals, far past the bound
        o.failed(StorageUnavailableError("503 SlowDown"))
        clock.now += 60
    assert o.down and o.refused == 100 and o.down_s() == pytest.approx(6000)
    assert o.recovered() == pytest.approx(6000)
    assert not o.down and o.refused == 0 and o.outages == 1 and o.refused_total == 100


def test_a_permanent_refusal_is_believed_only_once_it_persisted_for_the_bound():
    clock = Clock()
    o = Outage("publish", bound_s=60, clock=clock)
    denied = StoragePermanentError("AccessDenied")
    o.failed(denied)
    clock.now += 59
    o.failed(denied)  # a credential refresh is still possible
    o.recovered()  # ... and it came: the clock starts again
    clock.now += 30
    o.failed(denied)
    clock.now += 59
    o.failed(denied)
    clock.now += 1
    with pytest.raises(StoragePermanentError):
        o.failed(denied)


def test_the_backoff_is_capped_exponential_and_says_when_to_try_again():
    clock = Clock()
    o = Outage("metrics", backoff=Backoff(initial_s=1, max_s=4), clock=clock)
    waits = []
    for _ in range(30):
        o.failed(StorageUnavailableError("reset"))
        t = clock.now
        while not o.due():
            clock.now += 0.01
        waits.append(clock.now - t)
        clock.now = t
    assert max(waits) <= 4.01 and max(waits[8:]) > 1  # capped, yet grown past the first waits
    assert len(set(round(w, 2) for w in waits)) > 5  # jittered


def answering(*answers: Exception | str):
    """A storage call that raises or returns ``answers`` in turn, one a call."""
    left = iter(answers)

    def call() -> str:
        a = next(left)
        if isinstance(a, Exception):
            raise a
        return a
    return call


def test_call_waits_out_refusals_then_returns_and_ends_the_outage(monkeypatch):
    o = Outage("the last flush", backoff=Backoff(initial_s=0.001, max_s=0.002))
    fn = answering(StorageUnavailableError("503"), StoragePermanentError("AccessDenied"), "done")
    assert o.call(fn) == "done"
    assert not o.down and o.refused_total == 2


def test_a_write_that_must_be_done_asks_for_room_at_each_refusal_for_want_of_it():
    """The job's last bundle waits a full disk out (:meth:`Outage.call`): every refusal for want of room is told
    ``on_full`` (the rank's report then asks the driver to prune), other refusals are not."""
    told: list[str] = []
    o = Outage("rank 0's checkpoints", backoff=Backoff(initial_s=0.001, max_s=0.002), on_full=told.append)
    fn = answering(StorageFullError("No space left on device (1)"), StorageUnavailableError("503"),
                   StorageFullError("No space left on device (2)"), "written")
    assert o.call(fn) == "written"
    assert told == ["No space left on device (1)", "No space left on device (2)"]


def test_call_raises_a_permanent_refusal_that_outlasts_the_bound():
    clock = Clock()
    o = Outage("the last flush", bound_s=5, backoff=Backoff(initial_s=0.0001, max_s=0.0001), clock=clock)
    calls = []

    def fn() -> None:
        calls.append(1)
        clock.now += 1
        raise StoragePermanentError("NoSuchBucket")

    with pytest.raises(StoragePermanentError, match="NoSuchBucket"):
        o.call(fn)
    assert len(calls) == 6  # refusals at 1..5 s after the first one: the sixth is past the bound


def test_the_s3_sink_keeps_a_refused_segment_and_writes_it_with_the_next_flush(tmp_path):
    from spotrun.trainer.metrics import S3Sink, points_of
    from tests.helpers.outage import NO_WAIT, Flaky

    storage = Flaky(tmp_path)
    sink = S3Sink(storage, Outage("the sink", backoff=NO_WAIT))  # any storage: it writes through the protocol
    points = [points_of("j", u, 1, "L", {"loss": float(u)}) for u in range(1, 7)]
    sink.write(points[0])
    sink.flush()
    storage.down = True
    for p in points[1:4]:
        sink.write(p)
        with pytest.raises(StorageUnavailableError):
            sink.flush()  # the rank skips the checkpoint this flush preceded
    storage.down = False
    sink.write(points[4])
    sink.flush()
    storage.down, storage.up_after = True, 3
    sink.write(points[5])
    sink.close()  # waits the outage out
    assert [(p.update, p.value) for p in sink.read("j")] == [(u, float(u)) for u in range(1, 7)]


def test_a_rank_skips_checkpoints_while_storage_is_down_abandons_refused_writes_but_waits_for_its_last():
    from spotrun.trainer.run.write_gate import WriteGate

    gate = WriteGate(rank=1, outage_s=60)
    clock = Clock()
    gate.outage = Outage("rank 1", 60, Backoff(initial_s=10, max_s=10), clock)
    assert gate.opens(4, final=False)

    def refused() -> None:
        raise StorageUnavailableError("503 SlowDown")

    assert gate.finished(refused) is None and gate.outage.down  # abandoned, not raised
    clock.now += 0.001
    assert not gate.opens(8, final=False)  # known down, backoff not over: no capture, no write
    assert gate.opens(24, final=True)  # the last checkpoint is always taken
    assert not gate.attempt(8, refused, final=False)  # a refused metric flush skips the checkpoint
    clock.now += 11
    assert gate.opens(12, final=False)  # the backoff passed: try again
    assert gate.finished(lambda: "result") == "result" and not gate.outage.down
    assert gate.skipped == 3


def test_a_long_outage_says_its_skipped_checkpoints_once_a_minute_not_at_every_boundary(caplog):
    from spotrun.trainer.run.write_gate import SAY_EVERY_S, WriteGate

    clock = Clock()
    gate = WriteGate(rank=1, outage_s=900, clock=clock)
    gate.outage = Outage("rank 1", 900, Backoff(initial_s=1000, max_s=1000), clock)

    def refused() -> None:
        raise StorageUnavailableError("503 SlowDown")

    with caplog.at_level("WARNING", logger="spotrun.trainer.run.write_gate"):
        assert not gate.attempt(4, refused, final=False)  # the outage's first skip: said
        for update in range(8, 200, 4):  # a boundary every second: counted, not said
            clock.now += 1
            assert not gate.opens(update, final=False)
        assert gate.finished(refused) is None  # a write abandoned within the minute: counted, not said
        clock.now += SAY_EVERY_S
        assert not gate.opens(200, final=False)  # a minute on: said, with the count since
        gate.outage.recovered()
        assert not gate.attempt(204, refused, final=False)  # a new outage: said at once
    said = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage() or "abandoned" in r.getMessage()]
    assert len(said) == 3 and gate.skipped == 52, said
    assert "update 4 skipped" in said[0], said
    assert "(50 checkpoints skipped or abandoned since the last line)" in said[1], said
    assert "update 204 skipped" in said[2] and "since" not in said[2], said


def test_a_path_keeps_its_outage_s_first_refusal_and_whether_a_full_disk_was_among_them():
    clock = Clock()
    o = Outage("p", clock=clock)
    assert o.view() == OutageView(None, 0, None, False)
    o.failed(StorageUnavailableError("503 SlowDown"))
    clock.now += 3
    o.failed(StorageFullError("cannot write x: No space left on device"))
    assert o.view() == OutageView(3.0, 2, "503 SlowDown", True)
    o.recovered()
    clock.now += 2
    # the last outage's, until the next begins: its first refusal, and when it ended and how long it lasted
    assert o.view() == OutageView(None, 2, "503 SlowDown", True, ended_s=2.0, lasted_s=3.0)
    o.failed(StorageUnavailableError("reset"))
    assert o.view() == OutageView(0.0, 3, "reset", False)


class _FullAt:
    """A local storage whose disk is full for one file of a bundle: the others are written whole first."""

    def __init__(self, root, full: str, error=StorageFullError) -> None:
        self.inner, self.full, self.error = LocalStorage(root), full, error
        self.uri = self.inner.uri

    def put_chunks(self, key, chunks, algorithm):
        if key.endswith(self.full):
            raise self.error(f"cannot write {key}: [Errno 28] No space left on device")
        return self.inner.put_chunks(key, chunks, algorithm)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _capture(update: int):
    import torch

    from spotrun.trainer.state.training import Capture

    return Capture(update=update, rank=1, torch_files={"rank-1/model.pt": {"w": torch.arange(4096.0)}},
                   json_files={"rank-1/rng.json": {"seed": 1}, "rank-1/state.json": {"update": update}})


@pytest.mark.parametrize("error", [StorageFullError, StorageUnavailableError])
def test_a_bundle_write_refused_for_a_full_disk_removes_its_own_files_and_nothing_else(tmp_path, error):
    """A full disk: the files this rank wrote of the refused bundle are removed (they would hold the room
    the next checkpoint needs); another bundle's files stay. Any other outage leaves them to retention
    (a delete sent to a storage that is down would only wait out its own retries)."""
    from spotrun.trainer.bundle.bundles import BundleWriter
    from spotrun.trainer.observe.faults import FaultInjector

    storage = _FullAt(tmp_path, "rank-1/state.json", error)
    storage.inner.put("j/bundles/u0000000004-a1/manifest.json", b"{}")  # a published bundle: never touched
    storage.inner.put("j/bundles/u0000000004-a1/rank-1/rng.json", b"{}")
    writer = BundleWriter(storage, FaultInjector([], 1, 1))
    try:
        writer.submit(_capture(8), "j/bundles/u0000000008-a1")
        with pytest.raises(error):
            writer.wait()
    finally:
        writer.close()
    left = storage.inner.list("j/bundles/u0000000008-a1")
    if error is StorageFullError:
        assert left == []
    else:
        assert "j/bundles/u0000000008-a1/rank-1/model.safetensors" in left
    assert storage.inner.list("j/bundles/u0000000004-a1") == ["j/bundles/u0000000004-a1/manifest.json",
                                                              "j/bundles/u0000000004-a1/rank-1/rng.json"]
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]


def test_the_gate_tells_the_rank_of_a_write_abandoned_for_a_full_disk_only():
    from spotrun.trainer.run.write_gate import WriteGate

    told: list[str] = []
    gate = WriteGate(rank=1, outage_s=60, on_full=told.append)

    def refused(error):
        def write() -> None:
            raise error("cannot write x: No space left on device" if error is StorageFullError else "503 SlowDown")
        return write

    assert gate.finished(refused(StorageUnavailableError)) is None and told == []
    assert gate.finished(refused(StorageFullError)) is None
    assert told == ["cannot write x: No space left on device"] and gate.skipped == 2


def test_a_long_outage_s_points_spill_past_the_memory_bound_and_are_written_in_several_segments(tmp_path):
    """A memory bound of ~7 points: an outage's 200 points wait mostly in a local file, the sink's memory never
    holding more than the bound; once storage answers one flush writes them all, a segment per memory's worth,
    and every point reads back once, in order."""
    from spotrun.trainer.metrics import S3Sink, points_of
    from tests.helpers.outage import NO_WAIT, Flaky

    storage = Flaky(tmp_path / "store")
    spill = tmp_path / "spill"
    spill.mkdir()
    points = [points_of("j", u, 1, "L", {"loss": float(u), "lr": 0.1}) for u in range(1, 101)]
    bound = 7 * len(points[0][0].model_dump_json())
    sink = S3Sink(storage, Outage("the sink", backoff=NO_WAIT), memory_bytes=bound, spill_dir=str(spill))
    storage.down = True
    for p in points:
        sink.write(p)
        with pytest.raises(StorageUnavailableError):
            sink.flush()
        assert sink._buffer.held_bytes <= bound
    assert sink.waiting == 200 and sink._buffer.spilled > 180 and len(list(spill.iterdir())) == 1
    storage.down = False
    sink.flush()
    assert sink.waiting == 0 and list(spill.iterdir()) == []
    segments = storage.inner.list("j/metrics/segments/")
    assert len(segments) >= 25  # a memory's worth each
    assert [(p.update, p.name, p.value) for p in sink.read("j")] == [
        (u, name, value) for u in range(1, 101) for name, value in (("loss", float(u)), ("lr", 0.1))]
