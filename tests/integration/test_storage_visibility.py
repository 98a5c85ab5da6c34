"""Storage every rank can see, on a real multi-node local cluster (ray.cluster_utils.Cluster).

The nodes of a local cluster share one disk, so a worker node is started here the way a real second
machine looks to a ``file://`` path: in a mount namespace of its own, where the job's storage path is
bind-mounted to another directory (that node's "own disk"). The job's spec is unchanged and every
process resolves the same absolute path; only that node's files are elsewhere. The job is refused
before any restore or update: exit 2, the node named, nothing trained, the refusal in the ledger.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster

from spotrun.orchestrator.ledger.events import AttemptStarted, JobFailed, RunRefused
from spotrun.orchestrator.ledger.store import Ledger
from spotrun.trainer.bundle.bundles import list_bundles
from spotrun.trainer.run.visibility import probes_prefix
from spotrun.trainer.storage import LocalStorage
from tests.helpers.ray_local import local_cluster
from tests.helpers.runs import run_cmd, run_to_end

pytestmark = pytest.mark.slow
RAY = Path(sys.executable).parent / "ray"
# A private mount namespace: as root, or as a user through a user namespace of their own.
UNSHARE = (["unshare", "--mount", "--propagation", "private"],
           ["unshare", "--user", "--map-root-user", "--mount", "--propagation", "private"])


def unshare_command() -> list[str]:
    for cmd in UNSHARE:
        try:
            if subprocess.run([*cmd, "true"], capture_output=True).returncode == 0:
                return cmd
        except FileNotFoundError:
            break
    pytest.skip("needs unshare(1) with mount namespaces, to give one node a disk of its own")


@pytest.fixture(scope="module")
def cluster():
    """A head that runs no ranks and one ordinary worker node (sharing the test's disk)."""
    with local_cluster(workers=1) as c:
        yield c


@contextmanager
def node_with_its_own_disk(cluster: Cluster, path: Path, own_disk: Path, log: Path) -> Iterator[str]:
    """Start a worker node (``ray start``, its output in ``log``) whose processes see ``own_disk`` at
    ``path``; yields its node id once it is alive, and stops it afterwards."""
    before = {n["NodeID"] for n in ray.nodes()}
    script = 'mount --bind "$1" "$2" && exec "$3" start --block --address "$4" --num-cpus 1 ' \
             '--object-store-memory 157286400 --disable-usage-stats'
    out = log.open("w")
    proc = subprocess.Popen([*unshare_command(), "sh", "-c", script, "sh", str(own_disk), str(path), str(RAY),
                             cluster.address], stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not (new := [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] not in before]):
            assert proc.poll() is None, f"the worker node did not start: {log.read_text()[-2000:]}"
            assert time.monotonic() < deadline, "the worker node did not join the cluster in 120 s"
            time.sleep(0.1)  # polling the cluster's node table
        yield new[0]
    finally:
        proc.terminate()  # ray start --block stops the node's processes on SIGTERM
        proc.wait(timeout=60)
        out.close()


def test_a_node_that_sees_another_disk_at_the_storage_path_is_refused(cluster, tmp_path):
    storage, own_disk = tmp_path / "runs", tmp_path / "worker-disk"
    storage.mkdir()
    own_disk.mkdir()
    trace = tmp_path / "t.jsonl"
    cmd = run_cmd(storage, "unshared", trace, "world.size=2", "world.placement=STRICT_SPREAD",
                  "world.capacity_timeout_s=120", ray=cluster.address)
    with node_with_its_own_disk(cluster, storage, own_disk, tmp_path / "node.log") as node_id:
        done = run_to_end(cmd)
    assert done.returncode == 2, done.stderr
    message = " ".join(done.stderr.split())  # rich wraps the paragraph
    ordinary = [n.node_id for n in cluster.worker_nodes]
    for needle in ("storage is not shared", f"on node {node_id}", f"resolved storage to file://{storage};",
                   f"the driver resolved it to file://{storage}.", "The same path, but not the same files",
                   "s3://", "mounted at the same path on every node"):
        assert needle in message, f"{needle!r} not in: {message}"
    assert not any(f"rank 0 on node {n}" in message or f"rank 1 on node {n}" in message for n in ordinary)

    runs = LocalStorage(storage)
    events = Ledger(runs, "unshared").read()
    refused = [e for e in events if isinstance(e, RunRefused)]  # a refusal of its own, not a failure
    assert len(refused) == 1 and node_id in refused[0].reason and "storage is not shared" in refused[0].reason
    assert refused[0].check == "start" and not [e for e in events if isinstance(e, JobFailed)]
    assert not [e for e in events if isinstance(e, AttemptStarted)]  # refused before any restore or update
    assert list_bundles(runs, "unshared") == []
    assert not trace.exists() or trace.read_text() == ""
    assert runs.list(probes_prefix("unshared")) == []  # the driver removed its probe and the other rank's
    assert LocalStorage(own_disk).list("") == []  # the refused rank wrote nothing on its own disk
