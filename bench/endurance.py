"""Bench 17 — a compressed week: hundreds of faults on one job, and what they leave behind.

One 2-rank job with a spare (``world.spares=1``, a bundle every update) runs on a local multi-node Ray
(``ray.cluster_utils.Cluster``, kept by a process of its own so that this one is only the driver: a head
with no CPUs and three one-CPU nodes, one rank or spare each).
Every attempt trains a few updates and holds (a ``HOLD`` fault per attempt, so that each fault lands at a
known boundary and the run is deterministic); the bench then injects the next fault of a fixed rotation:
SIGKILL of rank 1 with the spare ready (warm-spare) and at once, before a spare is ready again, SIGKILL of
both ranks (no survivor: cold), SIGSTOP of rank 1 (a hang the health watch must find), removal of rank 1's
node and its return, and each cloud's notice (AWS's spot interruption, GCP's preemption, Azure's Preempt
scheduled event: stand-ins of their metadata endpoints on 127.0.0.1, which every node polls). After each
restart, at the next hold, it samples the driver (this process), Ray's GCS and raylets, the spare, the
object store, /dev/shm, the disk and the job's storage; the ranks measure themselves (the ledger's
``footprints`` event). At the end: bitwise equality of every update with an uninterrupted run of the same
job, goodput, each long-lived process's growth per restart, fault → next update against restart number,
and the restarts that went cold, with their recorded reasons.

    python -m bench.endurance [--faults 300] [--minutes 40]
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from bench.cluster_process import ClusterProcess
from bench.growth import holdings, pids_named, thread_names, tree_bytes, used_bytes
from bench.tables import ROOT, Section, Stopwatch, cli, work_folder
from spotrun.orchestrator.control.launch import check_entrypoint, ray_platform
from spotrun.orchestrator.control.platform import Options
from spotrun.orchestrator.control.progress import NullProgress
from spotrun.orchestrator.control.specfile import load_spec
from spotrun.orchestrator.control.supervisor import Supervisor
from spotrun.orchestrator.ledger.events import AttemptStarted, BundlePublished, NoticeHandled, NoticeSeen
from spotrun.orchestrator.ledger.store import Ledger
from spotrun.trainer.observe.faults import FaultLog
from spotrun.trainer.observe.trace import UpdateRecord
from spotrun.trainer.run.context import Instrumentation
from spotrun.trainer.storage import open_storage

# The rotation of fault kinds, by fault number; kills (the commonest loss on spot) come most often.
ROTATION = ("kill-warm", "hang", "kill-now", "kill-all", "node", "kill-warm", "notice-aws", "kill-now",
            "notice-gcp", "notice-azure")
NOT_RUN = ("storage outages (bench 16 runs one long one)", "driver kills (a new driver: another run of the "
           "command, not a restart inside one)")
PER_ATTEMPT = 2  # updates each attempt trains before it holds
SETS = ("world.size=2", "world.spares=1", "checkpoint.every_updates=1", "data.workers=1",
        "world.restart_backoff_s=0", "world.max_restarts=100000", "preemption.imds_poll_s=0.2",
        "preemption.drain_poll_s=0.2")
LOOK_S = 0.02  # how often the bench looks at the job's records (a bench measures; a test never sleeps)
SPARE_WAIT_S = 60.0  # a kill meant for warm-spare waits this long for a spare; then it goes ahead without
HOLD_WAIT_S = 120.0  # no hold in this long: the job is stuck; the bench stops it and reports what it had
NOTICE_WAIT_S = 60.0  # a notice the driver has not recorded in this long is reported as not seen


def hold_at(attempt: int) -> int:
    """The update before which attempt ``attempt`` holds (attempt a restores the bundle before the last
    hold and trains :data:`PER_ATTEMPT` updates)."""
    return 1 + PER_ATTEMPT * attempt


def fault_sets(faults: int) -> tuple[str, ...]:
    holds = ", ".join(f"{{site: before_update, signal: HOLD, update: {hold_at(a)}, rank: 0, attempt: {a}}}"
                      for a in range(1, faults + 1))
    return (f"train.updates={hold_at(faults) + PER_ATTEMPT}", f"faults=[{holds}]")


@dataclass
class Watched:
    """Per attempt, when its first update reached the driver (wall time)."""

    first_update: dict[int, float] = field(default_factory=dict)


class Recording(NullProgress):
    def __init__(self, watched: Watched) -> None:
        self.watched = watched

    def updates(self, records: Sequence[UpdateRecord], world_size: int) -> None:
        now = time.time()
        for r in records:
            self.watched.first_update.setdefault(r.attempt, now)


@dataclass
class Injected:
    """One fault: its number, kind, the attempt it hit, when, and what the bench saw while injecting it."""

    n: int
    kind: str
    attempt: int
    at: float
    note: str = ""


class Clouds:
    """Stand-ins of the three clouds' metadata endpoints (tests/helpers/imds.py), each node polling all."""

    def __init__(self) -> None:
        from tests.helpers.imds import AzureEvents, GcpMetadata, Imds

        self.aws, self.gcp, self.azure = Imds(), GcpMetadata(), AzureEvents()

    def sets(self) -> tuple[str, ...]:
        return (f"preemption.imds_url={self.aws.url}", f"preemption.gcp_metadata_url={self.gcp.url}",
                f"preemption.azure_metadata_url={self.azure.url}")

    def announce(self, cloud: str, n: int, when: datetime) -> None:
        if cloud == "aws":
            self.aws.set(json.dumps({"action": "terminate",
                                     "time": when.isoformat().replace("+00:00", "Z")}).encode())
        elif cloud == "gcp":
            self.gcp.set(b"TRUE")
        else:
            self.azure.preempt(f"evt-{n}", when)  # a new event id: Azure's notices are told apart by it

    def clear(self, cloud: str) -> None:
        if cloud == "aws":
            self.aws.set(None)
        elif cloud == "gcp":
            self.gcp.set(b"FALSE")
        else:
            self.azure.incarnation += 1
            self.azure.set(json.dumps({"DocumentIncarnation": self.azure.incarnation, "Events": []}).encode())

    def close(self) -> None:
        for server in (self.aws, self.gcp, self.azure):
            server.close()


class Endurance:
    """The job on the cluster, and the bench's hands on it: groups (for the spares), faults, samples."""

    def __init__(self, cluster: ClusterProcess, folder: Path, faults: int, clouds: Clouds) -> None:
        self.cluster, self.folder, self.clouds = cluster, folder, clouds
        self.spec = load_spec(ROOT / "configs/tiny.yaml", [
            f"storage=file://{folder / 'runs'}", f"data.shards={ROOT / 'configs/data/tiny'}",
            f"metrics.local_dir={folder / 'metrics'}", *clouds.sets(), *SETS,
            *fault_sets(faults)], "endure")
        self.storage = open_storage(self.spec.storage)
        self.ledger, self.faults = Ledger(self.storage, "endure"), FaultLog(self.storage, "endure")
        self.watched = Watched()
        self.groups: list[Any] = []
        self.injected: list[Injected] = []
        self.samples: list[dict[str, Any]] = []
        self.result: dict[str, Any] = {}
        self.stuck: str | None = None  # why the run stopped before its last fault, with the ledger's tail

    def start(self) -> None:
        check_entrypoint(self.spec)
        platform = ray_platform(self.spec, Instrumentation.of(trace=True))

        def make_group(*args: Any) -> Any:
            # the newest only (the spares are asked through it): the bench keeping every group would keep
            # every lost actor's handle in the driver it measures
            self.groups[:] = [platform.make_group(*args)]
            return self.groups[0]

        sup = Supervisor(self.spec, replace(platform, make_group=make_group),
                         Options(trace_path=str(self.folder / "trace.jsonl"), progress=Recording(self.watched)))
        self.sup = sup
        self.thread = threading.Thread(target=self._run, args=(sup,), daemon=True, name="endure job")
        self.thread.start()

    def _run(self, sup: Supervisor) -> None:
        try:
            self.result["outcome"] = sup.run()
        except BaseException as e:  # the bench reports it; the job's thread must not die silently
            self.result["error"] = repr(e)

    def wait_for_hold(self, after: int) -> int | None:
        """The newest attempt past ``after`` that holds, once the bundle before its hold is published (a
        held rank reports the write in flight); None when the job ended first."""
        deadline = time.monotonic() + HOLD_WAIT_S
        while True:
            held = [f.attempt for f in self.faults.read() if f.signal == "HOLD" and f.attempt > after]
            if held and self._published(hold_at(max(held)) - 1):
                return max(held)
            if not self.thread.is_alive():
                return None
            if time.monotonic() > deadline:
                tail = [f"{type(e).__name__} {e.model_dump(mode='json', exclude_none=True)}"[:300]
                        for e in self.ledger.read()[-8:]]
                self.stuck = f"no hold after attempt {after} in {HOLD_WAIT_S:g} s; the ledger ends: {tail}"
                self.stop()
                return None
            time.sleep(LOOK_S)

    def stop(self) -> None:
        """A stop notice to the driver (as SIGTERM gives it): the ranks publish and the run ends."""
        from spotrun.orchestrator.notices.notice import Notice

        self.sup.notify(Notice(source="sigterm", node_id=None, deadline=None, detail="the bench stops the job"))
        self.thread.join(timeout=180)

    def _published(self, update: int) -> bool:
        return any(isinstance(e, BundlePublished) and e.update >= update for e in self.ledger.read())

    def started(self, attempt: int) -> AttemptStarted:
        return next(e for e in reversed(self.ledger.read()) if isinstance(e, AttemptStarted) and e.attempt == attempt)

    def inject(self, n: int, kind: str, attempt: int) -> None:
        started = self.started(attempt)
        note = self._wait_for_spare() if kind == "kill-warm" else ""
        at = time.time()
        if kind in ("kill-warm", "kill-now"):
            note += send(started.rank_pids[1], signal.SIGKILL)
        elif kind == "kill-all":
            note += "".join(send(pid, signal.SIGKILL) for pid in started.rank_pids)
        elif kind == "hang":
            note += send(started.rank_pids[1], signal.SIGSTOP)
        elif kind == "node":
            self.cluster.replace({started.node_ids[1]})  # the node returns (a new machine in the lost one's place)
        elif kind.startswith("notice-"):
            note = self._notice(kind.removeprefix("notice-"), n)
        self.injected.append(Injected(n, kind, attempt, at, note))

    def _wait_for_spare(self) -> str:
        deadline = time.monotonic() + SPARE_WAIT_S
        while self.groups[-1].spares_ready() < 1:
            if time.monotonic() > deadline:
                return f"no spare ready in {SPARE_WAIT_S:g} s"
            time.sleep(LOOK_S)
        return ""

    def _notice(self, cloud: str, n: int) -> str:
        """``cloud``'s notice, 2 minutes ahead, until the driver records it; then cleared and, once the bundle
        it asks for is published, every node that reported it is replaced (the cloud takes those machines
        back: a node kept after its notice is one no cloud would keep). Says what went wrong, if anything."""
        before = len(self.ledger.read())
        self.clouds.announce(cloud, n, datetime.now(UTC) + timedelta(seconds=120))
        deadline = time.monotonic() + NOTICE_WAIT_S
        try:
            while not any(isinstance(e, NoticeSeen) for e in self.ledger.read()[before:]):
                if not self.thread.is_alive() or time.monotonic() > deadline:
                    return f"the notice was not recorded in {NOTICE_WAIT_S:g} s"
                time.sleep(LOOK_S)
        finally:
            self.clouds.clear(cloud)
        while not any(isinstance(e, NoticeHandled) for e in self.ledger.read()[before:]):
            if not self.thread.is_alive() or time.monotonic() > deadline:
                return f"no bundle published for the notice in {NOTICE_WAIT_S:g} s"
            time.sleep(LOOK_S)
        named = {e.node_id for e in self.ledger.read()[before:] if isinstance(e, NoticeSeen) and e.node_id}
        return f"{self.cluster.replace(named)} node(s) replaced"

    def sample(self, restarts: int) -> None:
        """Everything long-lived outside the ranks, at a hold (nothing in flight)."""
        import ray

        driver = holdings(os.getpid())
        session = ray_session_dir(ray)  # this cluster's processes only: the machine may run other Rays
        gcs = [holdings(p) for p in pids_named("gcs_server", session)]
        raylets = [holdings(p) for p in pids_named("raylet", session)]
        spares = [pid for g in self.groups[-1:] for s in g.spares if (pid := ready_pid(ray, s)) is not None]
        spare = holdings(spares[0]) if spares else None
        self.samples.append({
            "restarts": restarts, "at": time.time(),
            "driver_rss": driver.rss_bytes, "driver_fds": driver.fds, "driver_threads": driver.threads,
            "gcs_rss": sum(h.rss_bytes for h in gcs), "raylets_rss": sum(h.rss_bytes for h in raylets),
            "raylets": len(raylets), "raylet_fds": sum(h.fds for h in raylets),
            "spare_pid": spares[0] if spares else None, "spare_rss": spare.rss_bytes if spare else None,
            "spare_fds": spare.fds if spare else None, "spare_threads": spare.threads if spare else None,
            "object_store_used": object_store_used(self.cluster.address),
            "shm_used": used_bytes("/dev/shm"), "disk_used": used_bytes(self.folder),
            "ray_logs": tree_bytes(Path(session) / "logs"),
            "storage_bytes": tree_bytes(self.folder / "runs"), "metrics_bytes": tree_bytes(self.folder / "metrics"),
            "driver_threads_named": thread_names(os.getpid()),
            "driver_python_threads": dict(Counter(t.name.rstrip("0123456789_-") for t in threading.enumerate()))})


def send(pid: int, sig: signal.Signals) -> str:
    """``sig`` to a rank's process; a note when it is already gone (a node a notice named was replaced
    under it: the loss is the job's to find, and the section counts it as one no fault caused)."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return f"pid {pid} already gone; "
    return ""


def ready_pid(ray: Any, spare: Any) -> int | None:
    """A spare's process id once it has built the job (its ``prepare`` call answers where it runs);
    None while it builds, or if it failed."""
    done, _ = ray.wait([spare.ready], timeout=0)
    if not done:
        return None
    try:
        return int(ray.get(spare.ready, timeout=0)["pid"])
    except Exception:  # a spare that failed: the group drops it; the bench only has no figure
        return None


def object_store_used(address: str) -> int | None:
    """Bytes of objects in the object stores of the cluster at ``address`` (Ray's own memory summary; None
    if it cannot say). The address is named: without it Ray picks the newest cluster on the machine."""
    try:
        from ray._private.internal_api import memory_summary

        text = memory_summary(address=address, stats_only=True)
    except Exception:  # an internal API: its absence or failure costs the figure, not the run
        return None
    for line in text.splitlines():
        if "Plasma memory usage" in line:
            return int(float(line.split("Plasma memory usage")[1].split()[0]) * 2**20)
    return None


def ray_session_dir(ray: Any) -> str:
    """The connected cluster's session folder (its processes' command lines name it)."""
    return str(ray._private.worker._global_node.get_session_dir_path())


def endurance_run(faults: int, folder: Path, minutes: float) -> dict[str, Any]:
    """Start the cluster, run the job through ``faults`` faults (fewer if ``minutes`` pass first: then the
    job is stopped, and the section says how many fitted), then an uninterrupted reference; the raw
    figures (see :mod:`bench.endurance_report` for what is made of them)."""
    import ray

    clouds = Clouds()
    cluster = ClusterProcess(workers=3)  # its own process: this one is the driver, measured as such
    try:
        ray.init(address=cluster.address, log_to_driver=False, logging_level=logging.WARNING)
        run = Endurance(cluster, folder, faults, clouds)
        began = time.time()
        run.start()
        attempt = run.wait_for_hold(0)
        if attempt is not None:
            run.sample(0)
        n = 0
        while attempt is not None and n < faults:
            if time.time() - began > minutes * 60:
                run.stuck = f"the time budget ({minutes:g} min) ran out after {n} faults: the job was stopped"
                run.stop()
                break
            n += 1
            run.inject(n, ROTATION[(n - 1) % len(ROTATION)], attempt)
            attempt = run.wait_for_hold(attempt)
            if attempt is not None:
                run.sample(n)
            if n % 10 == 0:
                print(f"{n} faults, attempt {attempt}, {time.time() - began:.0f} s", flush=True)
        run.thread.join(timeout=600)
        ended = time.time()
        reference = reference_trace(folder, run.spec)
        return {"faults": faults, "injected": [vars(i) for i in run.injected], "samples": run.samples,
                "first_update": run.watched.first_update, "wall_s": ended - began,
                "error": run.result.get("error"), "stuck": run.stuck,
                "state": getattr(run.result.get("outcome"), "state", None),
                "restarts": getattr(run.result.get("outcome"), "restarts", None),
                "storage": run.spec.storage, "metrics_dir": str(folder / "metrics"),
                "trace": str(folder / "trace.jsonl"), "reference": reference}
    finally:
        ray.shutdown()
        cluster.shutdown()
        clouds.close()


def reference_trace(folder: Path, spec: Any) -> str:
    """The same job, uninterrupted, on the same cluster: the trace every update is compared with."""
    from spotrun.orchestrator.control.launch import run_on_ray

    ref = spec.model_copy(update={"job_id": "reference", "faults": ()})
    path = folder / "reference.jsonl"
    run_on_ray(ref, trace_path=str(path))
    return str(path)


def main(argv: Sequence[str] | None = None) -> None:
    import argparse

    from bench.endurance_report import figures, tables

    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--faults", type=int, default=300, help="faults to inject (--quick: 10)")
    p.add_argument("--minutes", type=float, default=40.0, help="stop injecting after this long, however many")
    known, rest = p.parse_known_args(argv)
    args = cli(__doc__.splitlines()[0], rest)
    clock = Stopwatch()
    with work_folder("endurance") as folder:
        raw = endurance_run(10 if args.quick else known.faults, folder, known.minutes)
        r = figures(raw)
    tabs, verdicts = tables(r)
    Section("17-endurance", "17. A compressed week of faults on one job", __doc__.split("\n", 2)[2]
            .split("\n\n    python")[0] + f"\n\nNot in this run: {'; '.join(NOT_RUN)}.", tabs, verdicts,
            clock.seconds, r, clock.measured).emit(args.out)
    if not r["exact"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
