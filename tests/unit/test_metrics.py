"""Metric sinks upsert by idempotency key: a replayed update replaces the lost attempt's point."""

from __future__ import annotations

import pytest

from spotrun.trainer.metrics import FanOut, JsonlSink, NullSink, SqliteSink, TensorBoardSink, points_of
from spotrun.trainer.observe.trace import latest_per_update, read_trace
from tests.helpers.runs import hold, kill_when_held, run_cmd, run_to_end


@pytest.mark.parametrize("kind", [SqliteSink, JsonlSink])
def test_upsert_by_key_records_the_writing_attempt(tmp_path, kind):
    sink = kind(tmp_path / "m")
    sink.write(points_of("j", 3, attempt=1, lineage_id="L", values={"loss": 2.0, "lr": 0.1}))
    sink.write(points_of("j", 3, attempt=2, lineage_id="L", values={"loss": 1.5}))
    sink.write(points_of("other", 3, attempt=1, lineage_id="M", values={"loss": 9.0}))
    points = sink.read("j")
    assert [(p.key, p.value, p.attempt) for p in points] == [("j/3/loss", 1.5, 2), ("j/3/lr", 0.1, 1)]
    sink.close()


def test_tensorboard_purges_what_a_lost_attempt_wrote_past_its_restore(tmp_path):
    """Attempt 1 writes updates 1-8 and dies; attempt 2 restored bundle 5 and writes 6-10 with other
    values: TensorBoard's reader shows each update once, 6-8 as attempt 2 wrote them."""
    first = TensorBoardSink(tmp_path / "tb")
    for u in range(1, 9):
        first.write(points_of("j", u, 1, "L", {"loss": 100.0 + u, "lr": 0.5}))
    # never closed: a SIGKILLed writer; each write was flushed
    second = TensorBoardSink(tmp_path / "tb")
    for u in range(6, 11):
        second.write(points_of("j", u, 2, "L", {"loss": 200.0 + u, "lr": 0.25}))
    second.close()
    loss = [(p.update, p.value, p.attempt) for p in TensorBoardSink(tmp_path / "tb").read("j") if p.name == "loss"]
    assert loss == [*((u, 100.0 + u, 1) for u in range(1, 6)), *((u, 200.0 + u, 2) for u in range(6, 11))]


def test_fanout_and_null():
    assert NullSink().read("j") == []
    fan = FanOut([NullSink()])
    fan.write(points_of("j", 1, 1, "L", {"loss": 1.0}))
    assert fan.read("j") == []


def test_killed_job_has_one_point_per_update_equal_to_reference(tmp_path):
    """A job SIGKILLed after update 17 (held before update 18's first microstep) and resumed: exactly
    one loss point per update, each the value of the final attempt's trace (which equals the
    uninterrupted run)."""
    trace = tmp_path / "t.jsonl"
    cmd = run_cmd(tmp_path / "runs", "m", trace, "train.updates=25", "metrics.sinks=[sqlite, jsonl]",
                  f"faults=[{hold(18, site='microstep')}]")
    assert kill_when_held(cmd, tmp_path / "runs", "m") == -9
    assert run_to_end(cmd).returncode == 0
    final = latest_per_update(read_trace(trace))
    for sink in (SqliteSink(tmp_path / "runs/m/metrics.sqlite"), JsonlSink(tmp_path / "runs/m/metrics.jsonl")):
        loss = [p for p in sink.read("m") if p.name == "loss"]
        assert [p.update for p in loss] == list(range(1, 26))
        assert all(p.value == pytest.approx(final[p.update].loss, rel=0, abs=1e-12) for p in loss)
        assert {p.attempt for p in loss if p.update > 20} == {2}
