"""Worker groups: the ranks of one attempt, in this process or as Ray actors.

The supervisor drives either through the same small interface, so its state
machine is tested with the in-process group and runs real jobs on Ray.
A lost rank surfaces as :class:`RankLost` (restart from the last bundle); an
error raised by training code surfaces as :class:`RankFailed`: bad input that
spotrun refused fails the job at once, anything else is a failure the job may
restart from, within its budget (orchestrator/policy/budgets.py).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from spotrun.orchestrator.notices.notice import Notice
from spotrun.orchestrator.policy.health import Pace
from spotrun.orchestrator.policy.recovery import RecoveryPath
from spotrun.trainer.bundle.manifest import Manifest, Versions
from spotrun.trainer.observe.ranklog import RankLog
from spotrun.trainer.observe.redirect import working_for
from spotrun.trainer.run.context import AttemptContext
from spotrun.trainer.run.rank import RankRunner, Report
from spotrun.trainer.runtime.collective import LocalCollective
from spotrun.trainer.runtime.device import rank_device
from spotrun.trainer.storage import open_storage


@dataclass(frozen=True)
class Evidence:
    """What the ledger keeps of a hung or stuck rank: which signal found it, where it stood (its last
    reading; None: it never answered), the storage key of its stacks (how they were taken), and the host
    its process ran on."""

    signal: str  # hang | stuck
    phase: str | None
    update: int | None
    stacks_key: str | None
    stacks_how: str
    host: str | None = None


class RankLost(RuntimeError):
    def __init__(self, rank: int | None, cause: str, detail: str = "", node_id: str | None = None,
                 evidence: Evidence | None = None) -> None:
        super().__init__(f"rank {rank} lost ({cause}): {detail}")
        self.rank = rank
        self.cause = cause
        self.detail = detail
        self.node_id = node_id
        self.evidence = evidence  # a hung or stuck rank's: where it stood, its stacks


class RankFailed(RuntimeError):
    """Training code raised.

    ``collective`` marks an error raised inside a collective (gloo, NCCL): a dead or hung peer
    causes those, so the group looks for one before it calls it a failure. ``refusal`` marks bad
    input spotrun refused (:func:`refuses`): the job fails with it at once instead of restarting.
    ``raised``: the exception the rank's code raised, where the group has it, so that a caller asks
    its type (``isinstance(e.raised, NotInMemory)``) instead of reading the message."""

    def __init__(self, message: str, rank: int | None = None, collective: bool = False,
                 refusal: bool = False, raised: BaseException | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.collective = collective
        self.refusal = refusal
        self.raised = raised


def refuses(error: BaseException) -> bool:
    """Is ``error`` spotrun refusing bad input (a JobError, a corrupt file, an unsafe key, a state of an
    unknown version)? Each of those is a ValueError of spotrun's own; the same input fails the same way
    on every attempt, so restarting could only repeat it. A user's subclass of JobError counts too."""
    return isinstance(error, ValueError) and any(
        c.__module__.startswith("spotrun.") for c in type(error).__mro__ if issubclass(c, ValueError))


class CapacityUnavailable(RuntimeError):
    """The placement group could not be placed in time."""


@dataclass
class Reformed:
    """A warm restart done (:meth:`RayGroup.reform`)."""

    path: RecoveryPath  # warm-spare | warm-replace | warm-shrink
    world_size: int
    label: str  # the recovery label the ranks were given
    restore_seconds: float  # the slowest rank's state load (as a cold restore's: the bundle's assembly and the
    # restore oracle are the rest of the restart's restore_wall_seconds)
    mismatches: list[str]  # the restore oracle's ("rank r: category")


class WarmUnavailable(RuntimeError):
    """A warm restart cannot be done here; the message says why (the restart goes cold)."""


class WorkerGroup(Protocol):
    world_size: int
    node_ids: list[str]
    runtimes: list[Versions]  # each rank's device model and library versions, as its manifests record them
    poll_interval_s: float  # how long the supervisor waits between polls (a poll's cost differs by group)
    timings: dict[str, float]  # how long the attempt's start took, by phase (the ledger's attempt_started)

    def restore(self, bundle_key: str, storage_uri: str | None = None,
                reset: tuple[str, ...] = ()) -> tuple[float, list[str]]:
        """Every rank verifies and loads the bundle (from ``storage_uri`` when it is another job's).
        Returns the seconds it took and the restore oracle's mismatches ("rank r: category")."""

    def start(self) -> None: ...

    def poll(self) -> list[Report]:
        """Reports of every rank since the last poll; raises RankLost or RankFailed."""

    def wait(self, seconds: float, wake: threading.Event) -> None:
        """Block for up to ``seconds``; return sooner when a rank's run ends (it finished, stopped,
        raised or died), a rank has news the supervisor acts on at once (a written bundle, a
        notice) or ``wake`` is set (a notice to the driver), so that the next poll sees it at once,
        however long the interval."""

    def request(self, checkpoint: bool = True, stop: bool = False) -> None: ...

    def salvage(self) -> list[Report]:
        """After a loss, the last reports of the ranks that still answer."""

    def take_notices(self) -> list[Notice]:
        """Preemption notices the ranks' watchers saw since the last call."""

    def acknowledge(self, notice: Notice) -> None:
        """The bundle ``notice`` asked for is published: the watcher of the rank that saw it tells its
        cloud (Azure's ``StartRequests``). Raises ``OSError`` when the endpoint refuses, ``RankLost``
        when the rank is gone."""

    def pids(self) -> list[int]: ...

    def teardown(self) -> None: ...


@runtime_checkable
class WarmGroup(Protocol):
    """What a group that can restart warm has besides :class:`WorkerGroup` (a Ray group): the supervisor
    asks ``isinstance(group, WarmGroup)``, never which attributes a group happens to have."""

    def reform(self, lost: set[int], bundle_key: str, manifest: Manifest, shipped_files: dict[str, bytes],
               sizes: list[int], attempt: int, lineage_id: str, label_for: Callable[[int], str]) -> Reformed:
        """Restart from ``bundle_key`` keeping the survivors (orchestrator/policy/recovery.py plans the path)."""

    def spares_ready(self) -> int:
        """Spares placed, built and waiting."""


@runtime_checkable
class WatchedGroup(Protocol):
    """A group whose ranks' health the driver watches (a Ray group: orchestrator/workers/watch.py)."""

    def paces(self) -> dict[int, Pace]:
        """Each rank's own work per update against its peers' (policy/health.py ``paces``) over the last
        ``world.straggler_window`` updates: empty until every rank's window is full."""


class InProcessGroup:
    """World size 1, in this process, training on a background thread (``spotrun run --no-ray``).

    What the rank's code writes while this group builds, restores and trains it goes to the rank log
    and back to the driver with each poll, as on Ray, where ``sys.stdout`` and ``sys.stderr`` are
    routed (:func:`~spotrun.trainer.observe.redirect.routed`, which ``spotrun run --no-ray`` sets up)."""

    poll_interval_s = 0.02  # a poll is a lock and a swap: polling often costs nothing
    timings: dict[str, float] = {}  # nothing to place: the rank is a thread of this process

    def __init__(self, ctx: AttemptContext) -> None:
        """Build the one rank of attempt ``ctx`` (its ``world_size`` is 1) on this thread."""
        if ctx.world_size != 1:
            raise ValueError(f"the in-process group trains one rank (the attempt asks for {ctx.world_size})")
        spec = ctx.spec
        self.world_size = 1
        self.node_ids = ["local"]
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is None and spec.world.num_gpus_per_rank:
            assigned = ["0"]
        else:
            assigned = [g for g in (visible or "").split(",") if g]
        device = rank_device(spec.world.num_gpus_per_rank, assigned, "local")  # DeviceError: exit 2
        self.output = RankLog()
        self.output.begin(open_storage(spec.storage, spec.storage_endpoint_url, check=False), spec.job_id,
                          ctx.attempt, "rank 0")
        try:
            with working_for(self.output):  # the job's build prints as the rank
                self.runner = RankRunner(ctx, rank=0, collective=LocalCollective(), device=device)
        except BaseException:
            self.output.close()
            raise
        self.runtimes = [self.runner.session.desc.runtime]
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def restore(self, bundle_key: str, storage_uri: str | None = None,
                reset: tuple[str, ...] = ()) -> tuple[float, list[str]]:
        with working_for(self.output):  # the job's load_state_dict prints as the rank
            seconds, mismatches = self.runner.restore(bundle_key, storage_uri=storage_uri, reset=reset)
        return seconds, [f"rank 0: {m}" for m in mismatches]

    def start(self) -> None:
        def target() -> None:
            try:
                with working_for(self.output):
                    self.runner.run()
            except BaseException as e:  # carried to the supervisor's thread by poll()
                self._error = e
            finally:
                self.output.flush()

        self._thread = threading.Thread(target=target, name="rank-0", daemon=True)
        self._thread.start()

    def poll(self) -> list[Report]:
        if self._error is not None:
            raise RankFailed(f"rank 0 raised {type(self._error).__name__}: {self._error}",
                             refusal=refuses(self._error), raised=self._error) from self._error
        report = self.runner.poll()
        report.output = self.output.take()
        return [report]

    def wait(self, seconds: float, wake: threading.Event) -> None:
        # ``wake`` is not watched: the interval is a fiftieth of a second
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(seconds)
        else:  # the run ended already: a plain interval, not a busy loop
            time.sleep(seconds)

    def request(self, checkpoint: bool = True, stop: bool = False) -> None:
        self.runner.request(checkpoint, stop)

    def salvage(self) -> list[Report]:
        """After the rank raised, its last report: how far it got (the update the job's code raised in
        follows it), what it wrote and printed since the last poll. A lost in-process rank took this
        whole process with it: there is no loss to salvage from."""
        report = self.runner.poll()
        report.output = self.output.take()
        return [report]

    def take_notices(self) -> list[Notice]:
        return []  # in this process, the supervisor's own watchers see everything

    def acknowledge(self, notice: Notice) -> None:
        return None  # the supervisor's own watchers saw it: they acknowledge it

    def pids(self) -> list[int]:
        return [os.getpid()]

    def teardown(self) -> None:
        """Stop the rank at its next boundary, without a checkpoint, and wait for it."""
        if self._thread is not None:
            self.runner.abort()
            self._thread.join()
        self.output.close()
