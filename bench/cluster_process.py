"""A local multi-node Ray cluster (``ray.cluster_utils.Cluster``) kept by a child process, for benches that
measure the driver.

``Cluster.add_node`` builds the new node's handle in the calling process, and with it a GCS client whose
polling thread (``client.poll``) and memory stay after the node is removed: in the driver's process, a
bench that replaces nodes hundreds of times measured its own harness as the driver's growth (a thread per
node added). Here the cluster lives in a process of its own; the driver only connects to it, as a driver
connects to a real cluster whose nodes come and go without it.
"""

from __future__ import annotations

import multiprocessing
import time
from multiprocessing.connection import Connection
from typing import Any


def _keep(conn: Connection, workers: int, cpus: int) -> None:
    """The child: start the cluster, then do what the parent asks until it says ``shutdown``. A verb that
    fails answers ``("error", why)``: the cluster stays up for the next."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        _wait_alive(cluster, [cluster.add_node(num_cpus=cpus) for _ in range(workers)])
        conn.send(cluster.address)
        while True:
            verb, arg = conn.recv()
            if verb == "shutdown":
                break
            try:
                conn.send(_do(cluster, cpus, verb, arg))
            except Exception as e:  # the parent reports it; one failed verb must not take the cluster down
                conn.send(("error", repr(e)))
    finally:
        cluster.shutdown()
        conn.send("down")


def _do(cluster: Any, cpus: int, verb: str, arg: Any) -> Any:
    if verb == "nodes":  # the live ones: Ray may have let a drained node go by itself
        live = set(cluster.global_state._live_node_ids())
        return [n.node_id for n in cluster.worker_nodes if n.node_id in live]
    if verb in ("replace", "remove"):  # replace: a new machine takes each lost one's place
        gone = [n for n in cluster.worker_nodes if n.node_id in arg]
        for node in gone:
            cluster.remove_node(node)
        if verb == "replace":
            _wait_alive(cluster, [cluster.add_node(num_cpus=cpus) for _ in gone])
        return len(gone)
    if verb == "add":
        added = [cluster.add_node(num_cpus=cpus) for _ in range(arg)]
        _wait_alive(cluster, added)
        return [n.node_id for n in added]
    raise ValueError(f"no verb {verb!r}")


def _wait_alive(cluster: Any, nodes: list[Any], timeout_s: float = 120.0) -> None:
    """Until Ray's GCS has every one of ``nodes`` alive. Not ``Cluster.wait_for_nodes``: it counts every node
    the cluster started and not removed, and a node Ray let go of by itself (a drained node at its deadline)
    is one it waits for forever."""
    want = {n.node_id for n in nodes}
    deadline = time.monotonic() + timeout_s
    while not want <= set(cluster.global_state._live_node_ids()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(want)} new node(s) not alive in Ray's GCS after {timeout_s:g} s")
        time.sleep(0.1)


class ClusterProcess:
    """A head with no CPUs and ``workers`` nodes of ``cpus`` CPUs each, kept by a child process; the caller
    connects with ``ray.init(address=cluster.address)``. A context manager: the cluster is shut down at the
    block's end."""

    def __init__(self, workers: int, cpus: int = 1) -> None:
        ctx = multiprocessing.get_context("spawn")  # a fork would copy this process's Ray state
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(target=_keep, args=(child, workers, cpus), daemon=True, name="ray cluster")
        self._process.start()
        self.address: str = self._answer()

    def _answer(self) -> Any:
        if not self._conn.poll(180):
            raise RuntimeError("the cluster's process did not answer in 180 s")
        answer = self._conn.recv()
        if isinstance(answer, tuple) and answer[:1] == ("error",):
            raise RuntimeError(f"the cluster's process failed: {answer[1]}")
        return answer

    def worker_node_ids(self) -> list[str]:
        """The worker nodes alive in Ray's GCS."""
        self._conn.send(("nodes", None))
        return self._answer()

    def replace(self, node_ids: set[str]) -> int:
        """Remove the worker nodes ``node_ids`` names and add as many new ones; how many were replaced."""
        self._conn.send(("replace", set(node_ids)))
        return self._answer()

    def remove(self, node_ids: set[str]) -> int:
        """Remove the worker nodes ``node_ids`` names (none in their place); how many were removed."""
        self._conn.send(("remove", set(node_ids)))
        return self._answer()

    def add(self, count: int = 1) -> list[str]:
        """Add ``count`` worker nodes; their node ids, once the cluster has them."""
        self._conn.send(("add", count))
        return self._answer()

    def shutdown(self) -> None:
        if self._process.is_alive():
            self._conn.send(("shutdown", None))
            self._answer()
        self._process.join(timeout=60)

    def __enter__(self) -> ClusterProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
