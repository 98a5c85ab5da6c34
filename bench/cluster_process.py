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
from multiprocessing.connection import Connection
from typing import Any


def _keep(conn: Connection, workers: int, cpus: int) -> None:
    """The child: start the cluster, then do what the parent asks until it says ``shutdown``."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        for _ in range(workers):
            cluster.add_node(num_cpus=cpus)
        cluster.wait_for_nodes()
        conn.send(cluster.address)
        while True:
            verb, arg = conn.recv()
            if verb == "shutdown":
                break
            if verb == "nodes":
                conn.send([n.node_id for n in cluster.worker_nodes])
            elif verb in ("replace", "remove"):  # replace: a new machine takes each lost one's place
                gone = [n for n in cluster.worker_nodes if n.node_id in arg]
                for node in gone:
                    cluster.remove_node(node)
                if verb == "replace":
                    for _ in gone:
                        cluster.add_node(num_cpus=cpus)
                cluster.wait_for_nodes()
                conn.send(len(gone))
            elif verb == "add":
                added = [cluster.add_node(num_cpus=cpus) for _ in range(arg)]
                cluster.wait_for_nodes()
                conn.send([n.node_id for n in added])
    finally:
        cluster.shutdown()
        conn.send("down")


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
        return self._conn.recv()

    def worker_node_ids(self) -> list[str]:
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
