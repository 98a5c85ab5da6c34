"""The rank marks its beacon as it trains, and its poll carries the reading (trainer/run/beacon.py): where a
held rank stands is named by its update, microstep and phase."""

from __future__ import annotations

import threading

from spotrun.trainer.run.beacon import Phase
from spotrun.trainer.run.context import AttemptContext
from spotrun.trainer.run.rank import RankRunner
from spotrun.trainer.runtime.collective import LocalCollective
from tests.conftest import make_spec


def test_a_held_rank_reads_as_where_it_stopped_and_a_finished_one_as_done(tmp_path):
    spec = make_spec(tmp_path, "train.updates=3", "data.workers=0", "checkpoint.every_updates=100",
                     "faults=[{site: backward, signal: HOLD, update: 2, microstep: 0}]")
    ctx = AttemptContext(spec=spec, attempt=1, world_size=1, lineage_id="L", recovery_label="fresh")
    runner = RankRunner(ctx, rank=0, collective=LocalCollective())
    before = runner.poll().reading
    assert before is not None and before.phase is Phase.START
    held = threading.Event()

    def hold() -> None:  # the HOLD fault's wait, telling the test that the rank is at its site
        held.set()
        runner._asked.wait()

    runner.session.faults.hold_with(hold)
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    assert held.wait(timeout=60), "the rank never reached its HOLD"
    reading = runner.poll().reading
    assert reading is not None
    assert (reading.update, reading.microstep, reading.phase) == (2, 0, Phase.BACKWARD)
    assert len(reading.recent) == 1  # update 1 is over; 2 is not
    runner.request(checkpoint=False, stop=False)  # ends the hold; the run goes on to its end
    thread.join(timeout=60)
    assert not thread.is_alive()
    done = runner.poll().reading
    assert done is not None and (done.update, done.phase) == (3, Phase.DONE)
    assert len(done.recent) == 2
