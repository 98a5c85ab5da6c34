"""Metric points off the training thread: written in order, durable at every flush, errors raised, and
flushed by the rank before every bundle's capture (so a published bundle never precedes its points)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from spotrun.orchestrator.control.launch import run_in_process
from spotrun.orchestrator.control.specfile import load_spec
from spotrun.trainer.metrics import MetricPoint, NullSink, SqliteSink, points_of
from spotrun.trainer.metrics.writer import BackgroundWriter, MetricSinkError
from spotrun.trainer.run import rank as rank_module
from spotrun.trainer.run.session import TrainSession
from spotrun.trainer.runtime.streams import seed_all
from tests.conftest import ROOT


class GatedSink(NullSink):
    """Records each write (and the thread it ran on); the first write waits until ``gate`` is set."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.writes: list[list[MetricPoint]] = []
        self.threads: set[int] = set()
        self.closed = False

    def write(self, points):
        self.entered.set()
        self.gate.wait()
        self.threads.add(threading.get_ident())
        self.writes.append(list(points))

    def close(self) -> None:
        self.closed = True


def test_points_are_written_off_the_caller_thread_in_order_and_in_the_sink_after_flush():
    sink = GatedSink()
    writer = BackgroundWriter(sink)
    writer.write(points_of("j", 1, 1, "L", {"loss": 1.0}))
    assert sink.entered.wait(timeout=30)  # the writer thread holds update 1 at the gate
    for u in range(2, 7):  # queued meanwhile: one batch once the gate opens
        writer.write(points_of("j", u, 1, "L", {"loss": float(u), "lr": 0.1}))
    sink.gate.set()
    writer.flush()
    assert [(p.update, p.name) for batch in sink.writes for p in batch] == [
        (1, "loss"), *((u, n) for u in range(2, 7) for n in ("loss", "lr"))]
    assert len(sink.writes) == 2 and threading.get_ident() not in sink.threads
    writer.close()
    assert sink.closed


def test_close_writes_what_is_queued(tmp_path):
    """Into a real SQLite sink: every point written before close is there, one per key (the upsert)."""
    writer = BackgroundWriter(SqliteSink(tmp_path / "m.sqlite"))
    for attempt, updates in ((1, range(1, 9)), (2, range(6, 11))):  # a replay of 6-8 by attempt 2
        for u in updates:
            writer.write(points_of("j", u, attempt, "L", {"loss": 10.0 * attempt + u}))
    writer.close()
    reader = SqliteSink(tmp_path / "m.sqlite")
    got = [(p.update, p.value, p.attempt) for p in reader.read("j")]
    reader.close()
    assert got == [*((u, 10.0 + u, 1) for u in range(1, 6)), *((u, 20.0 + u, 2) for u in range(6, 11))]


class BrokenSink(NullSink):
    def __init__(self) -> None:
        self.closed = False

    def write(self, points):
        raise OSError("disk full")

    def close(self) -> None:
        self.closed = True


def test_a_sink_error_is_raised_on_the_training_thread():
    sink = BrokenSink()
    writer = BackgroundWriter(sink)
    writer.write(points_of("j", 1, 1, "L", {"loss": 1.0}))
    with pytest.raises(MetricSinkError, match="disk full"):
        writer.flush()
    with pytest.raises(MetricSinkError, match="disk full"):
        writer.write(points_of("j", 2, 1, "L", {"loss": 1.0}))
    with pytest.raises(MetricSinkError):
        writer.close()
    assert sink.closed


def test_every_capture_finds_the_points_of_every_update_up_to_its_bundle_in_the_sink(tmp_path, monkeypatch):
    """A real job (no Ray): at each checkpoint's capture, the SQLite file (read through a connection of
    its own) already holds the loss point of every update up to the bundle's."""
    spec = load_spec(ROOT / "configs/tiny.yaml", [f"storage=file://{tmp_path}", f"data.shards={ROOT}/configs/data/tiny",
                                                 "train.updates=9", "checkpoint.every_updates=3"], "mw")
    seen: list[tuple[int, list[int]]] = []
    capture = TrainSession.capture

    def checked(session: TrainSession, **kw):
        reader = SqliteSink(tmp_path / "mw" / "metrics.sqlite")
        seen.append((session.counters.attempted_updates,
                     sorted(p.update for p in reader.read("mw") if p.name == "loss")))
        reader.close()
        return capture(session, **kw)

    class SlowWriter(BackgroundWriter):  # the thread only writes once asked to flush: a writer far behind
        def __init__(self, sink):
            self.asked = threading.Event()
            inner_write = sink.write

            def write(points):
                self.asked.wait()
                inner_write(points)
            sink.write = write
            super().__init__(sink)

        def flush(self):
            self.asked.set()
            super().flush()
            self.asked.clear()

        def close(self):
            self.asked.set()
            super().close()

    monkeypatch.setattr(TrainSession, "capture", checked)
    monkeypatch.setattr(rank_module, "BackgroundWriter", SlowWriter)
    assert run_in_process(spec).state == "finished"
    assert seen == [(u, list(range(1, u + 1))) for u in (3, 6, 9)]


def test_seed_all_leaves_every_stream_as_torch_manual_seed_does():
    """The microstep seeding skips torch.manual_seed's lazy CUDA bookkeeping on a CPU rank, not a stream."""
    import random

    def streams():
        return random.random(), float(np.random.random()), torch.rand(3).tolist(), torch.randn(2).tolist()

    random.seed(123), np.random.seed(123), torch.manual_seed(123)
    expected = streams()
    for s in (7, 2**62 + 5):
        seed_all(s)
        got = streams()
        random.seed(s), np.random.seed(s % 2**32), torch.manual_seed(s)
        assert got == streams()
    seed_all(123)
    assert streams() == expected
