"""``spotrun verify``: prove the recovery contract on the user's own job.

1. Run the job uninterrupted (the reference), recording per update the occurrence
   ids and the stage digests (batch and loss per micro-batch, gradient and parameters
   per rank: :mod:`spotrun.trainer.observe.trace`).
2. Run it again with N faults spread over the run from seeded random points (the first
   after the second checkpoint, one in its last third, one whose restore goes back across an
   epoch boundary where the reference's trace shows one: :mod:`spotrun.orchestrator.verify.faultplan`;
   the seed is reported, ``--seed`` plans the same faults again), cycling through every
   fault site: a rank's process SIGKILLed mid-accumulation, mid-microstep (after
   the forward pass) and during a background bundle write; a kill between
   manifest publish and offsets commit; a preemption notice (SIGTERM); and, on Ray with
   2 or more ranks, a rank stopped mid-update (SIGSTOP) until the health watch finds it
   hung and kills it. ``--sites`` keeps only the sites it names. A killed
   driver is started again with the same command, as a user would. Each fault
   records itself in the job's storage before its signal is sent; only those
   records count as delivered. All runs of a verify on Ray share one local Ray instance.
3. Compare update by update: the interrupted run must reach the reference's last
   update; occurrences (gaps, duplicates), parameters (bitwise, or the policy's
   tolerance), metric points per (update, name) in every sink's final view and in
   the raw writes of every attempt, counters; and collect the restore oracle's
   findings (state categories that differed right after a restore). The first update
   that differs is traced to its first differing stage, occurrences -> batch -> loss ->
   gradient -> parameters, and to the restore before it (:mod:`spotrun.orchestrator.verify.divergence`).

Both runs also write the ``jsonl`` metric sink (added when the spec lacks it): its
log keeps every point every attempt wrote, which is what the raw counts are read from.

The verdict passes only when at least one fault fired and at least one restart restored a
published bundle (otherwise nothing was tested:
:func:`~spotrun.orchestrator.verify.verdict.proof_failures` says which numbers to change), the
contract that held is at least the declared one (strict: ``exact``; elastic: ``exact-data``;
fresh-epoch: ``fresh-epoch``), the run reached its end, every metric check is 0,
the final counters are equal and every planned fault site was hit. ``failures`` says which did not
hold. With ``--mutate`` the build is broken on purpose and verify succeeds (exit 0) only when
it fails that build after a restore exercised it (``Report.mutation_caught``).

This module holds :class:`Verifier`, which runs the two jobs (on a local Ray it starts, an existing
cluster, or without Ray) from the process that ran ``spotrun verify``, and compares them; the
report it returns and its rendering are :mod:`spotrun.orchestrator.verify.report`, the contracts
and the checks a pass needs :mod:`spotrun.orchestrator.verify.verdict`.
"""

from __future__ import annotations

import bisect
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spotrun.orchestrator.control.launch import embedded_cpus
from spotrun.orchestrator.control.specfile import SpecError
from spotrun.orchestrator.control.supervisor import JobFailedError
from spotrun.orchestrator.ledger.events import AttemptStarted, Restored, WorkerLost
from spotrun.orchestrator.ledger.history import history
from spotrun.orchestrator.ledger.store import Ledger
from spotrun.orchestrator.verify.comparison import (
    NODE_SITE,
    MetricComparison,
    compare_metrics,
    fault_delivery,
    final_bundle_diff,
    first_differing_tensor,
    locate,
    reach,
    site_name,
    span_balance,
)
from spotrun.orchestrator.verify.divergence import (
    Divergence,
    Stage,
    explain,
    first_stage,
    restore_before,
)
from spotrun.orchestrator.verify.faultplan import NodeRemoval, fault_rows, fixed_interval, plan_faults
from spotrun.orchestrator.verify.report import Report
from spotrun.orchestrator.verify.sites import check_sites, unavailable_sites
from spotrun.orchestrator.verify.verdict import (
    DECLARED,
    METRIC_TOLERANCE,
    PARAM_TOLERANCE,
    proof_failures,
    restart_figures,
    verdict_failures,
)
from spotrun.trainer.bundle.bundles import list_bundles, read_manifest
from spotrun.trainer.bundle.errors import BundleError
from spotrun.trainer.bundle.manifest import DataInfo, ManifestError
from spotrun.trainer.job.sections import FaultSpec
from spotrun.trainer.job.spec import JobSpec
from spotrun.trainer.metrics import JsonlSink, MetricPoint, metrics_dir, open_sinks
from spotrun.trainer.metrics.mlflow_sink import Tracker
from spotrun.trainer.observe.faults import FaultLog
from spotrun.trainer.observe.trace import UpdateRecord, last_update, latest_per_update, read_trace, update_epochs
from spotrun.trainer.storage import Storage, open_storage

if TYPE_CHECKING:
    from ray.cluster_utils import Cluster


# verify's own local clusters start no dashboard: nothing reads it, and its processes (about ten on
# Ray 2.60) cost a second or more of a 2-core machine at each start
NO_DASHBOARD = {"include_dashboard": False}


def local_gpus() -> int:
    """The CUDA devices this process's torch sees (0 with a CPU build); NVML answers, CUDA stays uninitialised."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def head_node_args(spec: JobSpec, nodes: int, gpus_here: int) -> dict[str, Any]:
    """The resources of the one-node local cluster verify starts: the CPUs the embedded Ray of ``spotrun
    run`` would declare and, for ranks that take GPUs, this machine's ``gpus_here`` GPUs (Ray's local
    cluster declares none unless told, so such ranks never placed). Raises :class:`SpecError` where the
    job cannot run here: more GPU ranks than GPUs, or GPUs with ``--nodes``, whose simulated nodes all
    share this machine's GPUs (each would hand out its "GPU 0", the same device, which NCCL refuses)."""
    args: dict[str, Any] = {"num_cpus": embedded_cpus(spec), **NO_DASHBOARD}
    if spec.world.num_gpus_per_rank <= 0:
        return args
    if nodes:
        raise SpecError(f"spotrun verify --nodes {nodes} simulates nodes on this machine, and their ranks would all "
                        "be given its first GPU (NCCL refuses two ranks on one GPU): run verify without --nodes (one "
                        "local node with this machine's GPUs), or with world.num_gpus_per_rank=0")
    need = (spec.world.size + spec.world.spares) * int(spec.world.num_gpus_per_rank)
    if need > gpus_here:
        raise SpecError(f"spotrun verify runs world.size={spec.world.size} rank(s) and world.spares="
                        f"{spec.world.spares} on GPUs (world.num_gpus_per_rank="
                        f"{spec.world.num_gpus_per_rank:g}): {need} GPU(s), and this machine shows torch {gpus_here}. "
                        "Lower world.size and world.spares to fit, run one rank without Ray (verify --no-ray), or "
                        "set world.num_gpus_per_rank=0 to verify on CPUs")
    return {**args, "num_gpus": gpus_here}


class Verifier:
    def __init__(self, config: str, overrides: list[str], *, kills: int, seed: int, no_ray: bool,
                 workdir: Path, load, nodes: int = 0, mutate: tuple[str, ...] = (), address: str | None = None,
                 sites: tuple[str, ...] = ()) -> None:
        if address and (nodes or no_ray):
            raise SpecError("verify --address runs on an existing Ray cluster: it cannot also start a local "
                            "multi-node one (--nodes) or run without Ray (--no-ray); drop one of them")
        self.address = address  # an existing cluster the runs connect to (none started, none shut down)
        self.config, self.overrides = config, list(overrides)
        self.mutate = mutate  # a deliberately broken chaos run: its restores lose these categories
        self.kills, self.seed, self.no_ray = kills, seed, no_ray
        self.nodes = nodes  # > 0: run on a local multi-node cluster and remove nodes too
        self.cluster: Cluster | None = None
        self.removed = 0  # node removals carried out (each is a delivered fault)
        self.workdir = workdir
        self.load = load  # load_spec
        spec: JobSpec = load(config, self.overrides)
        fixed_interval(spec)  # refuses auto before anything runs
        if "jsonl" not in spec.metrics.sinks:
            # the JSONL sink's log keeps every write of every attempt: the raw view of the metric points
            self.overrides.append(f"metrics.sinks=[{', '.join([*spec.metrics.sinks, 'jsonl'])}]")
            spec = load(config, self.overrides)
        self.spec = spec
        # refused here, before any run, where the job's GPU ranks cannot be placed on this machine
        self.head_args: dict[str, Any] = {} if no_ray else head_node_args(spec, nodes, local_gpus())
        self.sites = sites  # verify --sites: plan only these (none: every site this job can have)
        check_sites(sites, unavailable_sites(spec, nodes > 0, not no_ray))

    def _cmd(self, job: str, trace: Path, extra: list[str], drop: tuple[str, ...] = ()) -> list[str]:
        build = ["spotrun.orchestrator.cli.mutant", "--drop", ",".join(drop)] if drop else ["spotrun"]
        cmd = [sys.executable, "-m", *build, "run", self.config, "--job-id", job, "--trace", str(trace),
               "--trace-ids"]
        for s in [*self.overrides, *extra]:
            cmd += ["--set", s]
        if self.address or self.cluster is not None:
            return [*cmd, "--address", self.address or self.cluster.address]  # type: ignore[union-attr]
        return [*cmd, "--no-ray"] if self.no_ray else cmd

    def _run(self, job: str, trace: Path, extra: list[str], max_runs: int,
             removals: Sequence[NodeRemoval] = (), drop: tuple[str, ...] = ()) -> int:
        """Run (and rerun after a driver death) until the job ends; returns how many runs it took.
        Meanwhile remove the planned nodes (and add a fresh one each time: capacity comes back)."""
        storage = open_storage(self.spec.storage, self.spec.storage_endpoint_url)
        storage.delete_prefix(job)
        # on non-file storage the local sinks live elsewhere: a previous verify's points must go too
        shutil.rmtree(metrics_dir(self.spec.storage, job, self.spec.metrics.local_dir), ignore_errors=True)
        if "mlflow" in self.spec.metrics.sinks:  # and its MLflow runs (MLflow would otherwise show both)
            Tracker.of(self.spec.metrics.mlflow, job).forget()
        trace.unlink(missing_ok=True)
        pending = list(removals)
        ledger = Ledger(storage, job)  # one for the whole job: it parses each event once
        for n in range(1, max_runs + 1):
            # stderr to a file, not a pipe: nobody reads a pipe while the job runs, and a driver that
            # outlives many restarts could fill it and block
            with tempfile.TemporaryFile("w+") as log:
                proc = subprocess.Popen(self._cmd(job, trace, extra, drop), stdout=subprocess.DEVNULL, stderr=log)
                while proc.poll() is None:
                    if pending and self._remove_if_due(ledger, trace, pending[0]):
                        pending.pop(0)
                    time.sleep(0.05)  # polling the job's progress: the removal point is a condition
                log.seek(0)
                err = log.read()
            if proc.returncode == 0:
                return n
            if proc.returncode not in (-9, 143):  # SIGKILLed, or drained after a notice to the driver
                raise JobFailedError(f"job {job} failed (exit {proc.returncode}): {err.strip()[-2000:]}")
        raise JobFailedError(f"job {job} did not finish in {max_runs} runs")

    def _remove_if_due(self, ledger: Ledger, trace: Path, removal: NodeRemoval) -> bool:
        # polled 20 times a second while the job runs: the trace's last line first (the cheap test)
        last = last_update(trace)
        if last is None or last < removal.update:
            return False
        started = [e for e in ledger.read() if isinstance(e, AttemptStarted)]
        if not started or started[-1].attempt != removal.attempt:
            return False
        cluster = self.cluster
        if cluster is None:
            raise RuntimeError("a node removal needs the multi-node cluster (verify --nodes N)")
        node_id = started[-1].node_ids[removal.rank]
        node = next((n for n in cluster.worker_nodes if n.node_id == node_id), None)
        if node is not None:
            cluster.remove_node(node)
            self.removed += 1
            cluster.add_node(num_cpus=self.spec.world.cpus_per_rank)
        return True

    def run(self, faults: list[FaultSpec] | None = None) -> Report:
        """Both runs and their comparison. ``faults``: the chaos run's faults, when the caller pins
        them (tests that need a restore from a given bundle); by default :func:`plan_faults`."""
        ref_job, chaos_job = f"{self.spec.job_id}.verify-ref", f"{self.spec.job_id}.verify-chaos"
        ref_trace, chaos_trace = self.workdir / f"{ref_job}.jsonl", self.workdir / f"{chaos_job}.jsonl"
        removals: list[NodeRemoval] = []
        if not self.no_ray and not self.address:
            self._start_cluster()
        try:
            self._run(ref_job, ref_trace, [], max_runs=1)
            if faults is None:  # planned once the reference has shown where its epochs begin
                faults, removals = plan_faults(self.spec, self.kills, self.seed, nodes=self.nodes > 0,
                                               warm=not self.no_ray, epochs=update_epochs(_final_trace(ref_trace)),
                                               only=self.sites)
            fault_set = "faults=[" + ", ".join(f.model_dump_json() for f in faults) + "]"
            # Every planned fault may end an attempt as a failure, several before one bundle is published:
            # the chaos run's budgets leave room for all of them (they are verify's doing, not the job's)
            n = len(faults) + len(removals)
            budgets = [f"world.max_restarts={max(self.spec.world.max_restarts, n)}",
                       f"world.crash_loop_failures={max(self.spec.world.crash_loop_failures, n + 1)}"]
            self._run(chaos_job, chaos_trace, [fault_set, *budgets], max_runs=len(faults) + 2, removals=removals,
                      drop=self.mutate)
        finally:
            if self.cluster is not None:
                self.cluster.shutdown()
        return self.compare(ref_job, chaos_job, ref_trace, chaos_trace, faults, removals)

    def _start_cluster(self) -> None:
        """One local Ray for every run of this verify (each run connects with ``--address``: a run
        that starts its own pays Ray's start, seconds, again at every driver death). With
        ``nodes``, a multi-node cluster (ray.cluster_utils): a head with no CPUs and ``nodes``
        workers with one rank's resources each, so every rank has a node of its own to lose;
        without, one node with the resources the embedded Ray of ``spotrun run`` would have
        (:func:`head_node_args`: its GPUs too, for ranks that take them)."""
        from ray.cluster_utils import Cluster

        if not self.nodes:
            self.cluster = Cluster(initialize_head=True, head_node_args=self.head_args)
            return
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, **NO_DASHBOARD})
        self.cluster = cluster
        for _ in range(self.nodes):
            cluster.add_node(num_cpus=self.spec.world.cpus_per_rank)

    # -- comparison -------------------------------------------------------------------------

    def compare(self, ref_job: str, chaos_job: str, ref_trace: Path, chaos_trace: Path,
                faults: list[FaultSpec], removals: Sequence[NodeRemoval] = ()) -> Report:
        spec = self.spec
        storage = open_storage(spec.storage, spec.storage_endpoint_url)
        ref, chaos = _final_trace(ref_trace), _final_trace(chaos_trace)
        epochs = update_epochs(ref)
        short = reach(ref, chaos, spec.train.updates)
        gaps, dups = span_balance(ref, chaos)
        occurrences_equal = not short and all(ref[u].occurrences_sha256 == chaos[u].occurrences_sha256 for u in ref)
        bitwise = occurrences_equal and all(ref[u].params_sha256 == chaos[u].params_sha256 for u in ref)
        max_diff, counters_equal = final_bundle_diff(storage, ref_job, chaos_job)
        events = Ledger(storage, chaos_job).read()
        fired = FaultLog(storage, chaos_job).read()
        oracle = sorted({m for e in events if isinstance(e, Restored) for m in e.roundtrip_mismatches})
        if bitwise and not gaps and not dups and not oracle:
            observed = "exact"
        elif occurrences_equal and not gaps and not dups and max_diff <= PARAM_TOLERANCE:
            observed = "exact-data"
        elif not dups:
            observed = "fresh-epoch" if spec.world.policy == "fresh-epoch" else "none"
        else:
            observed = "none"
        declared = DECLARED[spec.world.policy]
        divergence = self._first_divergence(ref, chaos, storage, ref_job, chaos_job, declared, events, fired)
        metrics = self._metrics(storage, ref_job, chaos_job, METRIC_TOLERANCE[declared])
        delivery = fault_delivery(faults, fired, len(removals), self.removed)
        figures = restart_figures(history(storage, chaos_job))
        restores = figures["restores_from_bundle"]
        unproven = proof_failures(spec, self.kills, self.seed, self.nodes > 0, delivery.planned, delivery.delivered,
                                  restores, warm=not self.no_ray, epochs=epochs, only=self.sites)
        failures = unproven + verdict_failures(declared, observed, short, metrics, counters_equal,
                                               delivery.sites_missed)
        return Report(
            verdict="fail" if failures else "pass", failures=failures,
            declared_contract=declared, observed_contract=observed,
            seed=self.seed, faults_planned=delivery.planned, faults_delivered=delivery.delivered,
            kills_injected=delivery.kills, notices_injected=delivery.notices, hangs_injected=delivery.hangs,
            fault_sites_planned=delivery.sites_planned,
            fault_sites_hit=delivery.sites_hit,
            fault_sites_not_applicable=self._not_applicable(faults, removals),
            faults_not_delivered=delivery.not_delivered,
            **figures,
            reference_updates=len(ref), chaos_last_update=max(chaos, default=0),
            occurrence_gaps=gaps, occurrence_duplicates=dups,
            updates_compared=len(set(ref) & set(chaos)), params_bitwise_equal=bitwise, params_max_abs_diff=max_diff,
            metric_sinks=metrics.sinks, metric_writes=metrics.writes,
            metric_duplicates_written=metrics.duplicates_written, metric_duplicates=metrics.duplicates,
            metric_missing=metrics.missing, metric_extra=metrics.extra, metric_mismatches=metrics.mismatches,
            metric_stale=metrics.stale, metric_problems=metrics.problems,
            counters_equal=counters_equal,
            restore_oracle=oracle,
            first_divergence=None if divergence is None else divergence.as_dict(),
            reference_job=ref_job, chaos_job=chaos_job,
            faults=fault_rows(faults, removals, fired, self.removed, fixed_interval(spec), epochs,
                              [e for e in events if isinstance(e, WorkerLost)]),
            mutated=list(self.mutate),
            # caught: it failed, and not only because nothing was exercised (that proves nothing either way)
            mutation_caught=bool(failures) and not unproven if self.mutate else None,
        )

    def _not_applicable(self, faults: Sequence[FaultSpec], removals: Sequence[NodeRemoval]) -> dict[str, str]:
        """The sites the plan left out because this job or this verify cannot have them, each with why and
        how to exercise it."""
        planned = {site_name(f.site, f.signal, f.microstep) for f in faults} | ({NODE_SITE} if removals else set())
        return {s: why for s, why in unavailable_sites(self.spec, self.nodes > 0, not self.no_ray).items()
                if s not in planned}

    def _first_divergence(self, ref: dict[int, UpdateRecord], chaos: dict[int, UpdateRecord], storage,
                          ref_job: str, chaos_job: str, declared: str, events: list,
                          fired: list) -> Divergence | None:
        """The first update where anything differs, at its first differing stage (occurrences ->
        batch -> loss -> gradient -> parameters), with the restore that preceded it."""
        for u in sorted(ref):
            r, c = ref[u], chaos.get(u)
            if c is None:
                stage: Stage | None = Stage("missing", None, None, "the update is missing from the interrupted run")
            elif r.occurrences != c.occurrences:
                rank, detail = self._where_occurrences_differ(r, c)
                stage = Stage("occurrences", rank, None, detail)
            else:
                stage = first_stage(r, c)
            if stage is None:
                continue
            if stage.stage == "parameters":
                stage.detail += "; " + first_differing_tensor(storage, ref_job, chaos_job, u)
            attempt = c.attempt if c else 0
            data = None
            if stage.stage == "batch":  # what the bundle says of the data may name the cause
                restore = restore_before(attempt, events, fired)
                data = data_info(storage, chaos_job, restore["bundle"] if restore else None)
            return explain(u, stage, declared=declared, world_sizes=(r.world_size, c.world_size if c else None),
                           attempt=attempt, events=events, fired=fired, data=data)
        return None

    def _where_occurrences_differ(self, r: UpdateRecord, c: UpdateRecord) -> tuple[int | None, str]:
        """The first differing occurrence, with the rank and microstep that trained on it."""
        spec = self.spec
        ref_ids, chaos_ids = r.occurrences, c.occurrences
        if ref_ids is None or chaos_ids is None:  # verify's own runs always record them (--trace-ids)
            return None, "only one of the two traces records the occurrence ids (run both with --trace-ids)"
        for i, (a, b) in enumerate(zip(ref_ids, chaos_ids, strict=False)):
            if a != b:
                seq = bisect.bisect_right(r.sequence_starts or [0], i) - 1
                rank, micro = locate(seq, c.world_size or spec.world.size, spec.train.micro_batch)
                return rank, f"rank {rank}, microstep {micro}: expected occurrence {a}, got {b}"
        return None, f"expected {len(ref_ids)} occurrence spans, got {len(chaos_ids)}"

    def _metrics(self, storage: Storage, ref_job: str, chaos_job: str, tolerance: float | None) -> MetricComparison:
        """Every sink's final view of the interrupted run and the raw log of its writes, against the
        reference's points (as its first sink reads them)."""
        spec = self.spec
        kinds = list(spec.metrics.sinks)
        reference = read_sink(spec, storage, kinds[0], ref_job)
        finals: dict[str, list[MetricPoint]] = {kind: read_sink(spec, storage, kind, chaos_job) for kind in kinds}
        log = metrics_dir(spec.storage, chaos_job, spec.metrics.local_dir) / "metrics.jsonl"
        return compare_metrics(reference, finals, JsonlSink(log).writes(chaos_job), tolerance)


def data_info(storage: Storage, job: str, restored: str | None) -> DataInfo | None:
    """The job's data as the manifest of the bundle ``restored`` records it, else as the newest published
    bundle of ``job`` does (retention may have removed the restored one by the end of the run; the data's
    kind and cautions are the job's, the same in every bundle of a run). None: no manifest to read."""
    keys = ([restored] if restored else []) + [b.key for b in list_bundles(storage, job) if b.published]
    for key in keys:
        try:
            return read_manifest(storage, key).data
        except (BundleError, ManifestError):  # purged after the run, or unreadable: the next one
            continue
    return None


def read_sink(spec: JobSpec, storage: Storage, kind: str, job_id: str) -> list[MetricPoint]:
    """What the ``kind`` sink of ``job_id`` reads back (one point per key for an upserting sink)."""
    sink = open_sinks([kind], metrics_dir(spec.storage, job_id, spec.metrics.local_dir), storage,
                      mlflow=spec.metrics.mlflow, job_id=job_id)
    try:
        return sink.read(job_id)
    finally:
        sink.close()


def _final_trace(path: Path) -> dict[int, UpdateRecord]:
    """Each update as the latest attempt did it; no file (the run never completed an update): none."""
    return latest_per_update(read_trace(path)) if path.exists() else {}


