"""A survivor's collective error when a peer dies is that peer's loss, not the job's own error (RayGroup.poll).

The ranks are stand-in actors whose ``run`` raises what a real survivor's gloo all-reduce raises
when its peer is gone; the peer is a real actor, really killed. The old order-dependent settling
(the first finished rank in rank order decided) failed the job here whenever rank 0's error was
seen before rank 1's death.
"""

from __future__ import annotations

import threading

import pytest
import ray

from spotrun.orchestrator.workers.groups import RankFailed, RankLost
from spotrun.orchestrator.workers.raygroup import RayGroup
from spotrun.trainer.run.rank import Report
from tests.helpers.ray_local import ray_for_module  # noqa: F401 - the module's local Ray

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_for_module")]
GLOO_RESET = ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:11927: "
              "Connection reset by peer.")


@ray.remote(max_concurrency=4)
class StandIn:
    def __init__(self) -> None:
        self.release = threading.Event()

    def run(self, error: str | None) -> str:
        if error is not None:
            raise RuntimeError(error)
        self.release.wait(120)  # a rank still training
        return "finished"

    def poll(self, rank: int = 0) -> tuple[Report, list]:
        return Report(rank=rank, last_update=0), []


def group_of(errors: list[str | None]) -> RayGroup:
    """A RayGroup over stand-in actors, started (its runs in flight)."""
    g = RayGroup.__new__(RayGroup)
    g.actors = [StandIn.remote() for _ in errors]
    g.node_ids = [ray.get_runtime_context().get_node_id()] * len(errors)
    g.notices = []
    g._runs = [a.run.remote(e) for a, e in zip(g.actors, errors, strict=True)]
    return g


def settle(g: RayGroup) -> BaseException:
    ray.wait([g._runs[0]], timeout=30)
    with pytest.raises((RankLost, RankFailed)) as e:
        g.poll()
    return e.value


def test_rank_0s_collective_error_with_rank_1_dead_is_rank_1_lost():
    g = group_of([GLOO_RESET, None])
    ray.kill(g.actors[1], no_restart=True)
    ray.wait([g._runs[1]], timeout=30)  # both runs have ended: rank 0's error comes first in rank order
    lost = settle(g)
    assert isinstance(lost, RankLost) and lost.rank == 1 and lost.cause == "process-exit"


def test_a_collective_that_timed_out_with_every_peer_alive_is_a_collective_timeout():
    g = group_of(["[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 120000ms for recv operation", None])
    lost = settle(g)
    assert isinstance(lost, RankLost) and lost.cause == "collective-timeout" and lost.rank == 0
    ray.get(g.actors[1].poll.remote(1))  # the peer was alive all along


def test_the_jobs_own_error_is_its_failure_not_a_lost_peer():
    g = group_of(["ValueError-like bug in the step: shapes (4, 8) and (9, 2) do not match", None])
    failed = settle(g)
    assert isinstance(failed, RankFailed) and "shapes" in str(failed)
