"""Topology policies: the restart decision, and when a running elastic job grows back."""

from __future__ import annotations

from spotrun.orchestrator.policy import topology as policy
from tests.conftest import make_spec


def test_elastic_grows_to_the_largest_allowed_world_that_fits(tmp_path):
    spec = make_spec(tmp_path, "world.policy=elastic", "world.size=4", "world.min_size=1", "train.updates=100",
                     "checkpoint.every_updates=10", "train.micro_batch=1", "train.accum_steps=12")
    assert spec.allowed_world_sizes() == [1, 2, 3, 4]
    d = policy.grow(spec, world_size=1, available_ranks=3, updates_left=50)
    assert d is not None and d.world_size == 3 and "grows from 1 to 3" in d.reason
    assert policy.grow(spec, 1, 5, 50).world_size == 4
    assert policy.grow(spec, 3, 3, 50) is None  # no larger allowed size fits
    assert policy.grow(spec, 4, 8, 50) is None  # already at max_size
    assert policy.grow(spec, 1, 4, 10) is None  # one interval left: a restart would not pay off


def test_only_elastic_grows(tmp_path):
    for name in ("strict", "fresh-epoch"):
        spec = make_spec(tmp_path, f"world.policy={name}", "world.size=2", "train.updates=100")
        assert policy.grow(spec, 1, 2, 50) is None, name


class _Group:
    def __init__(self):
        self.requests = []

    def request(self, checkpoint: bool = True, stop: bool = False) -> None:
        self.requests.append((checkpoint, stop))


def test_a_running_elastic_job_grows_only_when_the_scheduler_has_room(tmp_path):
    from spotrun.orchestrator.control.platform import Options, Platform
    from spotrun.orchestrator.control.supervisor import Running, Supervisor
    from spotrun.orchestrator.ledger.events import Resizing
    from spotrun.orchestrator.ledger.store import Ledger

    spec = make_spec(tmp_path, "world.policy=elastic", "world.size=2", "train.updates=100",
                     "world.grow_check_s=5", job_id="g")
    now = [0.0]
    room = [False]
    class Scheduler:
        def request(self, ranks: int) -> None:
            pass

        def room_for(self, extra: int) -> bool:
            return room[0]

    def no_groups(*args):
        raise AssertionError("nothing is placed here")

    sup = Supervisor(spec, Platform(no_groups, capacity=lambda: 2, scaler=Scheduler()), Options(clock=lambda: now[0]))
    st = Running(group=_Group(), attempt=2, world_size=1, last_update=40)
    st = sup.cadence.consider_growing(st)
    assert st.growing is None  # not yet: a fresh attempt waits world.grow_check_s
    now[0] = 6.0
    st = sup.cadence.consider_growing(st)
    assert st.growing is None and not st.group.requests  # capacity says 2, the scheduler says no
    now[0] = 12.0
    room[0] = True
    st = sup.cadence.consider_growing(st)
    assert st.growing == 2 and st.group.requests == [(True, True)]  # checkpoint at the next boundary, stop
    events = [e for e in Ledger(sup.storage, "g").read() if isinstance(e, Resizing)]
    assert [(e.world_size_before, e.world_size_target) for e in events] == [(1, 2)]
