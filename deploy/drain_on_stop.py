"""The preStop hook of spotrun's KubeRay worker pods: a pod termination becomes a Ray drain.

Why: Kubernetes signals the container's main process (KubeRay's ``ray start --block``), not
spotrun's training ranks, which go down with it; when the grace period ends, everything is
SIGKILLed. Karpenter (or the AWS node termination handler) evicts the pods of a spot node as soon
as its 2-minute interruption notice arrives, so that eviction is the notice.

What: mark this pod's Ray node DRAINING with a deadline, as ``ray drain-node`` and Ray's autoscaler
do. spotrun's supervisor watches for that state (``preemption.watch_ray_drain``): it takes an
emergency bundle at the next boundary, stops the ranks and places the next attempt on the nodes
that are not draining. Then wait until no spotrun rank is left on this node, or the deadline
passes, so the pod is not killed while a rank is still writing its part of the bundle. Kubernetes
counts this hook's time in ``terminationGracePeriodSeconds``: keep that above ``--deadline-s``.

Usage (deploy/kuberay-rayjob.yaml):
    python /home/ray/spotrun/deploy/drain_on_stop.py --deadline-s 100

Exit status 0 when the node is drained and the ranks have left it (or none was there), 1 when the
deadline passed first or the drain was refused. It never raises past ``main``: a preStop hook that
fails only shortens the pod's life, and the message says why in the pod's events.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import threading
import time

RANK_CLASS = "RankActor"  # orchestrator.rankactor.RankActor: one per rank


def _ranks_on(node_id: str) -> list[str]:
    """Ids of the live spotrun rank actors on ``node_id`` (read from the GCS, no dashboard needed)."""
    import ray._private.state as state

    return [actor_id for actor_id, a in state.actors().items()
            if a.get("ActorClassName") == RANK_CLASS and a.get("State") == "ALIVE"
            and (a.get("Address") or {}).get("NodeID") == node_id]


def _connect(address: str, timeout_s: float) -> None:
    """``ray.init``, unless the GCS does not even accept a TCP connection within ``timeout_s`` (ray.init
    would retry for minutes, e.g. while KubeRay deletes a finished job's cluster and its head is gone)."""
    import ray
    from ray._private.services import canonicalize_bootstrap_address_or_die

    gcs = canonicalize_bootstrap_address_or_die(address)  # "auto": this node's /tmp/ray/ray_current_cluster
    host, _, port = gcs.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ConnectionError(f"the Ray GCS at {gcs} does not answer ({e})") from e
    ray.init(address=gcs, log_to_driver=False, logging_level=logging.ERROR, namespace="spotrun-drain-on-stop")


def _watchdog(seconds: float, out) -> None:
    """End this process after ``seconds`` whatever it is doing (a native call can ignore signals)."""
    def expire() -> None:
        out.write(f"drain_on_stop: gave up after {seconds:g}s\n")
        out.flush()
        os._exit(1)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()


def drain_and_wait(address: str, node_id: str | None, deadline_s: float, poll_s: float,
                   reason: str, connect_timeout_s: float = 10.0, out=sys.stderr) -> int:
    import ray
    from ray.core.generated import autoscaler_pb2

    start = time.monotonic()
    _watchdog(deadline_s + connect_timeout_s + 10, out)
    _connect(address, connect_timeout_s)
    try:
        ctx = ray.get_runtime_context()
        node_id = node_id or ctx.get_node_id()  # a driver attaches to the raylet of its own node
        gcs = ray._raylet.GcsClient(address=ctx.gcs_address)
        deadline_ms = int(time.time() * 1000 + deadline_s * 1000)
        accepted, why = gcs.drain_node(node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
                                       reason, deadline_ms)
        if not accepted:
            out.write(f"drain_on_stop: Ray refused to drain node {node_id}: {why}\n")
            return 1
        out.write(f"drain_on_stop: node {node_id} is draining (deadline in {deadline_s:g}s)\n")
        while True:
            left = _ranks_on(node_id)
            waited = time.monotonic() - start
            if not left:
                out.write(f"drain_on_stop: no spotrun rank left on node {node_id} after {waited:.1f}s\n")
                return 0
            if waited >= deadline_s:
                out.write(f"drain_on_stop: {len(left)} rank(s) still on node {node_id} at the deadline\n")
                return 1
            time.sleep(poll_s)  # polling the actor table
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--deadline-s", type=float, default=100.0,
                   help="seconds until the node goes away (the spec's preemption.grace_s)")
    p.add_argument("--poll-s", type=float, default=1.0)
    p.add_argument("--address", default="auto", help="the Ray cluster (default: the one this node belongs to)")
    p.add_argument("--node-id", help="the Ray node to drain (default: this pod's)")
    p.add_argument("--connect-timeout-s", type=float, default=10.0, help="give up when Ray does not answer")
    p.add_argument("--reason", default="Kubernetes is terminating this pod (spot interruption or eviction)")
    a = p.parse_args(argv)
    try:
        return drain_and_wait(a.address, a.node_id, a.deadline_s, a.poll_s, a.reason, a.connect_timeout_s)
    except Exception as e:  # a hook must not hang or crash loudly; say why and let the pod go
        sys.stderr.write(f"drain_on_stop: {type(e).__name__}: {e}\n")
        return 1


if __name__ == "__main__":
    sys.exit(main())
