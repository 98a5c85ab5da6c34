"""The ledger's segments: folding keeps every event once and in order, through crashes, races,
old ledgers of singles and damaged objects, and a warm reader fetches only what is new."""

from __future__ import annotations

import logging
import threading
from collections import Counter

import pytest

from spotrun.orchestrator.dashboard.views import Reader
from spotrun.orchestrator.ledger.access import ReadOnlyLocalStorage
from spotrun.orchestrator.ledger.events import CorruptEvent
from spotrun.orchestrator.ledger.store import Ledger
from spotrun.trainer.storage import LocalStorage, StorageError
from tests.helpers.ledger import POLICY, event, names, segment, singles


class Crash(BaseException):
    """The writer's process dies here (nothing catches it)."""


class CrashingDelete(LocalStorage):
    """Local storage whose first ``delete`` kills the writer: after a segment is created, before
    anything it replaces is removed."""

    crashed = False

    def delete(self, keys):
        if not self.crashed:
            self.crashed = True
            raise Crash
        super().delete(keys)


class CountingGets(ReadOnlyLocalStorage):
    """The dashboard's read-only storage, counting the objects it fetches."""

    def __init__(self, root) -> None:
        super().__init__(root)
        self.gets: Counter[str] = Counter()

    def get(self, key: str) -> bytes:
        self.gets[key] += 1
        return super().get(key)


def test_folding_keeps_every_event_in_order(tmp_path):
    """The same 70 events, written with and without folding, read back the same, in order; folded,
    they are 4 top-level segments, 1 segment of the open top-level block, and 2 singles."""
    plain, folded = LocalStorage(tmp_path / "plain"), LocalStorage(tmp_path / "folded")
    a, b = Ledger(plain, "j", fold=None), Ledger(folded, "j", fold=POLICY)
    written = [event(i) for i in range(70)]
    for e in written:
        a.append(e)
        b.append(e)
    assert names(folded) == [*singles(68, 69), segment(0, 15), segment(16, 31), segment(32, 47), segment(48, 63),
                             segment(64, 67)]
    assert names(plain) == singles(*range(70))
    assert Ledger(folded, "j").read() == written == Ledger(plain, "j").read()
    assert b.read() == written  # the writer's own reads too


def test_a_crash_between_segment_and_removal_reads_each_event_once(tmp_path):
    storage = CrashingDelete(tmp_path)
    writer = Ledger(storage, "j", fold=POLICY)
    written = [event(i) for i in range(5)]
    for e in written[:4]:
        writer.append(e)
    with pytest.raises(Crash):
        writer.append(written[4])  # seq 4 closes block 0-3: its segment is written, then the crash
    assert names(storage) == [*singles(0, 1, 2, 3, 4), segment(0, 3)]  # segment and the singles it holds
    assert Ledger(storage, "j").read() == written

    later = [event(i) for i in range(5, 9)]
    successor = Ledger(storage, "j", fold=POLICY)  # the next supervisor, after the crash
    for e in later:
        successor.append(e)
    assert names(storage) == [*singles(8), segment(0, 7)]  # the leftovers removed, then folded on
    assert Ledger(storage, "j").read() == written + later


def test_a_writer_behind_another_never_loses_its_event(tmp_path):
    """An old supervisor, paused while a new one wrote and folded past it, writes into a slot whose
    single was folded away: it sees the segment holding another event there and writes again further on."""
    storage = LocalStorage(tmp_path)
    old, new = Ledger(storage, "j", fold=POLICY), Ledger(storage, "j", fold=POLICY)
    old.append(event(0, "old"))
    theirs = [event(i, "new") for i in range(1, 21)]
    for e in theirs:
        new.append(e)
    assert singles(1)[0] not in names(storage)  # folded into segment 0-15 and removed
    late = event(1, "late")
    key = old.append(late)
    assert key.endswith(singles(21)[0])
    assert Ledger(storage, "j").read() == [event(0, "old"), *theirs, late]


def test_concurrent_writers_lose_and_duplicate_nothing(tmp_path):
    storage = LocalStorage(tmp_path)
    start = threading.Barrier(3)
    errors: list[BaseException] = []

    def write(w: int) -> None:
        ledger = Ledger(storage, "j", fold=POLICY)
        start.wait()
        try:
            for i in range(40):
                ledger.append(event(i, f"w{w}-"))
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=write, args=(w,)) for w in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    got = Ledger(storage, "j").read()
    assert len(got) == 120 and not any(isinstance(e, CorruptEvent) for e in got)
    for w in range(3):  # each writer's events all there, once each, in the order it wrote them
        assert [e for e in got if f"w{w}-" in (getattr(e, "bundle", "") + getattr(e, "lineage_id", ""))] == \
            [event(i, f"w{w}-") for i in range(40)]
    assert len(names(storage)) < 20  # and folded


def test_an_old_ledger_of_singles_reads_and_is_folded_one_block_per_append(tmp_path):
    """A ledger written before segments is read as it is; a folding writer then folds one closed block
    per append from its first append on (41 is no block boundary), largest blocks first."""
    storage = LocalStorage(tmp_path)
    written = [event(i) for i in range(41)]
    old = Ledger(storage, "j", fold=None)  # as the ledger was written before segments
    for e in written:
        old.append(e)
    assert Ledger(storage, "j").read() == written
    writer = Ledger(storage, "j", fold=POLICY)
    folded_after = []
    for i in range(41, 45):
        written.append(event(i))
        writer.append(written[-1])
        folded_after.append([n for n in names(storage) if n.startswith("segments/")])
        assert Ledger(storage, "j").read() == written
    every = [segment(0, 15), segment(16, 31), segment(32, 39), segment(40, 43)]
    assert folded_after == [every[:1], every[:2], every[:3], every]
    assert names(storage) == [*singles(44), *every]


def test_a_single_that_is_not_one_line_of_json_stays_a_single(tmp_path):
    storage = LocalStorage(tmp_path)
    writer = Ledger(storage, "j", fold=POLICY)
    written = [event(i) for i in range(6)]
    for e in written[:2]:
        writer.append(e)
    storage.put_new("j/events/000000000002.json", written[2].model_dump_json(indent=1).encode())  # by hand
    for e in written[3:]:
        writer.append(e)
    assert names(storage) == [*singles(2, 4, 5), segment(0, 3)]
    assert Ledger(storage, "j").read() == written


def test_a_corrupt_segment_is_a_corrupt_event(tmp_path):
    storage = LocalStorage(tmp_path)
    written = [event(i) for i in range(6)]
    for e in written:
        Ledger(storage, "j", fold=None).append(e)
    storage.put(f"j/events/{segment(0, 3)}", b"\x00\xff not a segment\n")  # holds none of 0-3
    got = Ledger(storage, "j").read()
    assert isinstance(got[0], CorruptEvent) and got[0].key == f"j/events/{segment(0, 3)}"
    assert got[1:] == written  # the singles it does not hold are still read

    folded = LocalStorage(tmp_path / "folded")
    for e in written:
        Ledger(folded, "j", fold=POLICY).append(e)
    key = f"j/events/{segment(0, 3)}"
    lines = folded.get(key).splitlines()
    lines[2] = b'{"seq":2,"event":{"kind":"no-such-kind"}}'
    folded.put(key, b"\n".join(lines) + b"\n")
    got = Ledger(folded, "j").read()
    assert isinstance(got[2], CorruptEvent) and got[2].key == "j/events/000000000002.json"
    assert key in got[2].error
    assert got[:2] + got[3:] == written[:2] + written[3:]


def test_next_attempt_counts_attempts_in_segments_and_singles(tmp_path):
    storage = LocalStorage(tmp_path)
    writer = Ledger(storage, "j", fold=POLICY)
    for i in range(43):  # attempts at 0, 10, 20, 30 (folded) and 40 (a single)
        writer.append(event(i))
    assert any(n.startswith("segments/") for n in names(storage)) and singles(40)[0] in names(storage)
    assert writer.next_attempt() == Ledger(storage, "j").next_attempt() == 6


def test_a_warm_reader_fetches_only_new_objects(tmp_path):
    writer = Ledger(LocalStorage(tmp_path), "j", fold=POLICY)
    for i in range(22):
        writer.append(event(i))
    storage = CountingGets(tmp_path)
    reader = Ledger(storage, "j", fold=None)
    assert len(reader.read()) == 22
    first = set(storage.gets)
    assert first == {f"j/events/{n}" for n in [segment(0, 15), segment(16, 19), *singles(20, 21)]}
    storage.gets.clear()
    for i in range(22, 25):  # 24 closes block 16-23: segment 16-19 and singles 20-23 folded into one
        writer.append(event(i))
    assert reader.read() == [event(i) for i in range(25)]
    assert set(storage.gets) == {f"j/events/{segment(16, 23)}", f"j/events/{singles(24)[0]}"}


def test_a_dashboard_refresh_fetches_only_new_events(tmp_path):
    writer = Ledger(LocalStorage(tmp_path), "j", fold=POLICY)
    for i in range(22):
        writer.append(event(i))
    storage = CountingGets(tmp_path)
    reader = Reader(storage)
    reader.job("j")
    assert {k for k in storage.gets if "/events/" in k}  # the cold load read the ledger
    storage.gets.clear()
    writer.append(event(22))
    assert len(reader.events("j")) == 23 and len(reader.job("j")["history"]["attempts"]) == 3
    assert {k for k in storage.gets if "/events/" in k} == {f"j/events/{singles(22)[0]}"}


class FailingDelete(LocalStorage):
    def delete(self, keys):
        raise StorageError("cannot delete objects: AccessDenied (HTTP 403)")


def test_a_fold_that_fails_loses_nothing_and_says_so(tmp_path, caplog):
    storage = FailingDelete(tmp_path)
    writer = Ledger(storage, "j", fold=POLICY)
    written = [event(i) for i in range(6)]
    with caplog.at_level(logging.WARNING, logger="spotrun.orchestrator.ledger.store"):
        for e in written:
            writer.append(e)
    assert "folding stopped" in caplog.text and "AccessDenied" in caplog.text
    assert Ledger(storage, "j").read() == written
