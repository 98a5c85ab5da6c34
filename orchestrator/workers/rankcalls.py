"""What a rank actor's answer means: its result, a lost rank, or a failure of the job's own.

A lost actor is noticed from the first failed call: an ``ActorDiedError`` (process killed, node
removed gracefully) or the first ``ActorUnavailableError`` (node unreachable), never Ray's ~15 s
death timeout. A survivor whose collective fails because a peer died raises too, often before Ray
reports the peer dead: such an error is blamed on the peer it points to (the job restarts), a
collective that timed out with every peer answering is a ``collective-timeout`` (a restart as well),
and only any other error fails the job.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError, RayTaskError

from spotrun.orchestrator.policy.recovery import LossCause
from spotrun.orchestrator.workers.groups import RankFailed, RankLost, refuses
from spotrun.trainer.bundle.errors import BundleError
from spotrun.trainer.bundle.manifest import ManifestError
from spotrun.trainer.run.visibility import StorageNotShared

# What a survivor's collective raises when a peer died or hung (gloo, NCCL, c10d).
COLLECTIVE_ERROR = re.compile(r"gloo|NCCL|c10d|Connection (closed|reset) by peer|[Tt]imed out")
# What Ray says of a worker its memory monitor killed (a kernel OOM kill is a plain SIGKILL: process-exit).
OOM_KILL = re.compile(r"running low on memory|OutOfMemoryError")
PEER_PROBE_S = 5.0  # long enough for Ray to report a SIGKILLed peer dead (well under a second here)


def settle(refs: list[Any], timeout: float = 0.0) -> None:
    """Read the results of ``refs`` that are in within ``timeout``, failed or not: an error nobody reads
    is printed by Ray, traceback and all, when its reference goes (after the one error that counts was
    already reported)."""
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout) if refs else ([], [])
    for ref in done:
        try:
            ray.get(ref, timeout=0)
        except (RayActorError, RayTaskError, GetTimeoutError):
            pass


def answer_of(rank: int, ref: Any, timeout: float | None, node_id: str | None) -> Any:
    """``ray.get`` rank ``rank``'s ``ref`` (the rank runs on node ``node_id``, when known). Raises
    :class:`RankLost` for a lost actor, :class:`RankFailed` for an error of the training code (or an
    actor that could not start), and a bundle, manifest or storage refusal as itself (the supervisor
    decides: fall back, or refuse the job)."""
    try:
        return ray.get(ref, timeout=timeout)
    except RayTaskError as e:
        cause = e.cause if getattr(e, "cause", None) is not None else e
        if isinstance(cause, (BundleError, ManifestError, StorageNotShared)):
            raise cause from e
        raise RankFailed(f"rank {rank} raised {type(cause).__name__}: {cause}", rank,
                         collective=bool(COLLECTIVE_ERROR.search(str(cause))), refusal=refuses(cause),
                         raised=cause) from e
    except (RayActorError, GetTimeoutError) as e:
        # its creation task raised: a bug or bad input (an import that fails), not a lost machine
        if isinstance(e, RayActorError) and e.actor_init_failed:
            raise RankFailed(f"rank {rank} could not start: {str(e).strip()[-1500:]}") from e
        raise loss_of(rank, e, node_id) from e


def loss_of(rank: int, e: BaseException, node_id: str | None) -> RankLost:
    """Rank ``rank``'s loss, its cause read from Ray's error ``e`` and whether its node is alive."""
    alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    if (isinstance(e, ActorUnavailableError) or (node_id is not None and node_id not in alive)
            or (isinstance(e, RayActorError) and e.preempted)):  # preempted: Ray drained the node for it
        cause = LossCause.NODE_LOST
    elif isinstance(e, GetTimeoutError):
        cause = LossCause.UNRESPONSIVE
    elif OOM_KILL.search(str(e)):  # Ray says so only in the error's text
        cause = LossCause.OOM
    else:
        cause = LossCause.PROCESS_EXIT
    return RankLost(rank, cause, str(e).splitlines()[0] if str(e) else type(e).__name__, node_id)


def blame(failure: RankFailed, actors: Sequence[Any], node_ids: Sequence[str]) -> RankFailed | RankLost:
    """A rank whose collective failed did so because a peer died or hung: find that peer among
    ``actors`` (the job restarts); a collective that timed out with every peer answering is a
    collective-timeout (a restart too). Any other error is the job's own and fails it."""
    if not failure.collective:
        return failure
    for rank, actor in enumerate(actors):
        if rank == failure.rank:
            continue
        try:
            ray.get(actor.poll.remote(), timeout=PEER_PROBE_S)
        except (RayActorError, GetTimeoutError) as e:
            return loss_of(rank, e, node_ids[rank] if rank < len(node_ids) else None)
        except RayTaskError:
            continue
    if re.search(r"[Tt]imed out", str(failure)):
        node = node_ids[failure.rank] if failure.rank is not None else None
        return RankLost(failure.rank, LossCause.COLLECTIVE_TIMEOUT, str(failure).splitlines()[0], node)
    return failure
