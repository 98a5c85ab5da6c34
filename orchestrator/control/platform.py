"""What the supervisor is built from besides the spec: the platform it places ranks on, and its options
(runs in the driver).

:class:`Platform` is where ranks live: a factory for an attempt's worker group, the capacity there
is now, and two capabilities only some platforms have, each an optional part typed by a Protocol
(never looked up with ``hasattr``): an autoscaler to ask for capacity (:class:`Scaler`) and a source
of nodes the cluster is draining. :class:`Options` gathers the knobs of one run (its trace, an
``--init-from`` bundle, the seams a test swaps: sleep and clock).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from spotrun.orchestrator.control.progress import Progress, echo_rank_output
from spotrun.orchestrator.workers.groups import WorkerGroup
from spotrun.trainer.data.planner import RestoreMode
from spotrun.trainer.observe.ranklog import RankLine

# make_group(world_size, attempt, lineage_id, recovery_label, restore_mode) -> a started-to-be group
GroupFactory = Callable[[int, int, str, str, RestoreMode], WorkerGroup]


class Scaler(Protocol):
    """An autoscaler the supervisor asks for capacity (Ray's ``request_resources``)."""

    def request(self, ranks: int) -> None:
        """Ask for room for ``ranks`` ranks in all (0: nothing more is needed)."""

    def room_for(self, extra: int) -> bool:
        """Can ``extra`` more ranks really be placed now (resource counts cannot see other jobs)?"""


@dataclass(frozen=True)
class Platform:
    """Where the job's ranks run. ``make_group`` builds an attempt's group (it raises
    ``CapacityUnavailable`` when it cannot be placed in time); ``capacity()`` says how many ranks fit
    now. ``scaler``: None where nothing scales (the job's capacity is what there is; growth is always
    allowed to try). ``drains``: the node ids the cluster reports as draining, None where none does."""

    make_group: GroupFactory
    capacity: Callable[[], int]
    scaler: Scaler | None = None
    drains: Callable[[], set[str]] | None = None

    def request_capacity(self, ranks: int) -> None:
        if self.scaler is not None:
            self.scaler.request(ranks)

    def room_for(self, extra: int) -> bool:
        return True if self.scaler is None else self.scaler.room_for(extra)


@dataclass(frozen=True)
class Options:
    """One run's options. ``trace_path``/``record_ids``: the trace to write; ``init_from``: (storage uri,
    bundle key) of another job's bundle a fresh lineage starts from, with the state categories in
    ``reset`` left fresh; ``progress``: what the terminal shows; ``echo``: where the ranks' output lines
    go. ``oracle_acts`` and ``send_at_publish`` are False only for ``verify --mutate``'s deliberately broken
    build (its restore oracle only records; its MLflow points are sent as written). ``sleep`` and
    ``clock``: the seams a test replaces."""

    trace_path: str | None = None
    record_ids: bool = False
    init_from: tuple[str, str] | None = None
    reset: tuple[str, ...] = ()
    progress: Progress | None = None
    echo: Callable[[list[RankLine]], None] = echo_rank_output
    oracle_acts: bool = True
    send_at_publish: bool = True
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.monotonic
