"""The ledger through a storage outage: events wait in order in memory and are written, sequence numbers
contiguous, once the storage answers; a job's last event waits for it; nothing is lost or written twice."""

from __future__ import annotations

import re

import pytest

from spotrun.orchestrator.ledger.backlog import Backlog
from spotrun.orchestrator.ledger.events import JobFinished
from spotrun.orchestrator.ledger.store import Ledger
from spotrun.trainer.storage import StoragePermanentError
from tests.helpers.ledger import POLICY, event, names
from tests.helpers.outage import Flaky, quick


def ledger(storage: Flaky, **kw: object) -> Ledger:
    led = Ledger(storage, "j", fold=POLICY, **kw)
    led.outage = quick(led.outage)
    return led


def test_events_wait_in_order_through_an_outage_and_are_written_once_it_ends(tmp_path):
    storage = Flaky(tmp_path)
    told = []
    led = ledger(storage)
    led.on_append = told.append
    written = [event(i) for i in range(11)]
    for e in written[:3]:
        assert led.append(e) is not None
    storage.down = True
    for e in written[3:9]:
        assert led.append(e) is None  # kept, not raised
    assert led.pending == 6 and led.outage.down and storage.refused >= 6
    storage.down = False
    assert led.read() == written[:9]  # the waiting events are read, after the written ones
    assert led.pending == 6  # a read writes nothing
    assert led.append(written[9]) is not None
    assert led.pending == 0 and not led.outage.down
    led.append(written[10])
    assert told == written  # the progress display hears of each once it is written, in order
    assert Ledger(Flaky(tmp_path), "j", fold=None).read() == written  # a new reader: all of them, once, in order
    held = set()
    for name in names(storage.inner):  # singles and the segments folded from them: numbers 0..10, no gap
        nums = [int(n) for n in re.findall(r"\d{12}", name)]
        held |= set(range(nums[0], nums[-1] + 1))
    assert held == set(range(11))


def test_a_write_that_landed_before_its_reply_was_lost_is_not_written_twice(tmp_path):
    storage = Flaky(tmp_path)
    led = ledger(storage)
    led.append(event(0))
    storage.down, storage.land = True, True
    assert led.append(event(1)) is None  # it landed as 000000000001.json, but the writer heard a failure
    storage.down = storage.land = False
    led.append(event(2))
    assert Ledger(Flaky(tmp_path), "j", fold=None).read() == [event(0), event(1), event(2)]


def test_the_last_event_waits_for_the_storage_and_writes_everything_before_it(tmp_path):
    storage = Flaky(tmp_path)
    led = ledger(storage)
    storage.down = True
    led.append(event(0))
    led.append(event(1))
    storage.up_after = 5  # it comes back after five more refusals
    last = JobFinished(attempt=1, counters={"attempted_updates": 3})
    assert led.append(last) is not None
    assert Ledger(Flaky(tmp_path), "j", fold=None).read() == [event(0), event(1), last]
    assert storage.refused >= 7


def test_a_permanent_refusal_is_raised_only_once_it_has_persisted(tmp_path):
    storage = Flaky(tmp_path)
    led = ledger(storage, outage_s=30)
    now = [0.0]
    led.outage.clock = lambda: now[0]
    storage.down, storage.error = True, StoragePermanentError
    led.append(event(0))  # believed not yet: a refreshed credential may come
    now[0] = 29
    led.append(event(1))
    now[0] = 30
    with pytest.raises(StoragePermanentError):
        led.append(event(2))


def test_a_long_outage_spills_the_waiting_events_to_disk_past_the_memory_bound_and_loses_none(tmp_path):
    """A bound of ~3 events: the rest of a long outage's events wait in a local file, in order; the driver's
    memory holds no more than the bound meanwhile, and once storage answers every event is written once, in
    order, and the file is gone."""
    storage = Flaky(tmp_path / "store")
    led = ledger(storage)
    spill = tmp_path / "spill"
    spill.mkdir()
    size = len(event(0).model_dump_json())
    led._pending = Backlog(memory_bytes=3 * size, spill_dir=str(spill))
    written = [event(i) for i in range(40)]
    storage.down = True
    for e in written:
        led.append(e)
    assert led.pending == 40 and led._pending.spilled == 37 and led._pending.held_bytes <= 3 * size
    assert len(list(spill.iterdir())) == 1
    storage.down = False
    assert led.read() == written  # the waiting events, the spilled ones too, in order (a read writes nothing)
    led.outage.recovered()
    assert len(led.flush(wait=True)) == 40 and led.pending == 0
    assert Ledger(Flaky(tmp_path / "store"), "j", fold=None).read() == written
    assert list(spill.iterdir()) == []  # drained: the file is removed


def test_the_backlog_keeps_order_across_memory_and_spill_however_they_interleave(tmp_path):
    size = len(event(0).model_dump_json())
    backlog = Backlog(memory_bytes=2 * size, spill_dir=str(tmp_path))
    out, n = [], 0
    for burst in (5, 1, 3, 7, 2):  # appends and writes interleaved: memory refilled from the file in between
        for _ in range(burst):
            backlog.append(event(n), event(n).model_dump_json().encode())
            n += 1
        for _ in range(burst // 2 + 1):
            e, blob = backlog.first()
            assert blob == e.model_dump_json().encode()
            out.append(e)
            backlog.pop()
            assert backlog.held_bytes <= 2 * size
    while len(backlog):
        out.append(backlog.first()[0])
        backlog.pop()
    assert out == [event(i) for i in range(n)]
