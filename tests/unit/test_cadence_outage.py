"""``checkpoint.every_updates: auto`` through a storage outage: a checkpoint the ranks skipped is asked for
again, and an interval the ledger could not be read for is decided again once it answers."""

from __future__ import annotations

from types import SimpleNamespace

from spotrun.orchestrator.control.cadence import REDECIDE_AFTER_OUTAGE_S, Cadence
from spotrun.trainer.storage import StorageUnavailableError
from tests.conftest import make_spec


class Ledger:
    def __init__(self) -> None:
        self.down = False
        self.reads = 0

    def read(self) -> list:
        self.reads += 1
        if self.down:
            raise StorageUnavailableError("SlowDown (HTTP 503)")
        return []


class Group:
    def __init__(self) -> None:
        self.asked = 0

    def request(self, checkpoint: bool = True, stop: bool = False) -> None:
        self.asked += 1


def setup(tmp_path):
    spec = make_spec(tmp_path, "checkpoint.every_updates=auto", "checkpoint.min_interval_s=10",
                     "checkpoint.max_interval_s=10")
    now = [0.0]
    recorded: list = []
    ctx = SimpleNamespace(spec=spec, clock=lambda: now[0], published=[], ledger=Ledger(), sec_per_update=0.1,
                          record=SimpleNamespace(interval_chosen=lambda *a: recorded.append(a)))
    st = SimpleNamespace(attempt=1, draining=None, growing=None, replacing=None, group=Group())
    return Cadence(ctx), ctx, st, now, recorded


def test_a_checkpoint_the_ranks_skipped_is_asked_for_again_an_interval_later(tmp_path):
    cadence, ctx, st, now, _ = setup(tmp_path)
    cadence.tick(st)  # the attempt starts: the interval is decided (10 s)
    now[0] = 10.0
    cadence.tick(st)
    assert st.group.asked == 1
    now[0] = 19.9  # nothing published (storage down: the ranks skipped it); not an interval yet
    cadence.tick(st)
    assert st.group.asked == 1
    now[0] = 20.0
    cadence.tick(st)
    assert st.group.asked == 2
    ctx.published.append(object())  # published at last: the interval counts from here
    now[0] = 21.0
    cadence.tick(st)
    assert st.group.asked == 2


def test_an_unreadable_ledger_keeps_the_interval_and_decides_again_soon(tmp_path):
    cadence, ctx, st, now, recorded = setup(tmp_path)
    ctx.ledger.down = True
    cadence.tick(st)  # the attempt starts during an outage: no decision, no crash
    assert cadence.auto.decision is None and recorded == []
    ctx.ledger.down = False  # storage answers again
    reads = ctx.ledger.reads
    now[0] = REDECIDE_AFTER_OUTAGE_S - 1
    cadence.tick(st)  # not yet: tried again REDECIDE_AFTER_OUTAGE_S after the failure, not at every look
    assert ctx.ledger.reads == reads and cadence.auto.decision is None
    now[0] = REDECIDE_AFTER_OUTAGE_S
    cadence.tick(st)
    assert ctx.ledger.reads == reads + 1 and cadence.auto.decision is not None and len(recorded) == 1
