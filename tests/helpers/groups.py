"""A worker group whose ranks are scripted, to drive the supervisor one transition at a time."""

from __future__ import annotations

from spotrun.orchestrator.workers.groups import RankLost
from spotrun.trainer.bundle.description import versions
from spotrun.trainer.bundle.manifest import Versions
from spotrun.trainer.run.rank import Report


class ScriptedGroup:
    """A worker group whose ranks' reports are scripted: each poll returns the next list of reports,
    raises :class:`RankLost` where the script says ``"lost"``, or raises the script's exception;
    ``salvage`` is what survivors say."""

    poll_interval_s = 0.0

    def __init__(self, world_size: int, polls: list, salvage: list[Report] = ()) -> None:
        self.world_size = world_size
        self.node_ids = [f"node-{r}" for r in range(world_size)]
        self.runtimes: list[Versions] = [versions()] * world_size  # CPU ranks of this process's runtime
        self.timings: dict[str, float] = {}
        self.polls = list(polls)
        self._salvage = list(salvage)
        self.restored: list[str] = []

    def restore(self, bundle_key, storage_uri=None, reset=()):
        self.restored.append(bundle_key)
        return 0.0, []

    def start(self) -> None:
        pass

    def poll(self) -> list[Report]:
        nxt = self.polls.pop(0)
        if isinstance(nxt, BaseException):  # what a rank raised (RankFailed), how it was lost, an interrupt
            raise nxt
        if nxt == "lost":
            raise RankLost(1 - self._salvage[0].rank, "process-exit", "SIGKILL", self.node_ids[0])
        return nxt

    def wait(self, seconds: float, wake=None) -> None:
        pass  # the script's next poll is ready at once

    def salvage(self) -> list[Report]:
        return self._salvage

    def request(self, checkpoint=True, stop=False) -> None:
        pass

    def take_notices(self):
        return []

    def pids(self):
        return list(range(self.world_size))

    def teardown(self) -> None:
        pass
