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
   manifest publish and offsets commit; a preemption notice (SIGTERM). A killed
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
published bundle (otherwise nothing was tested: :func:`proof_failures` says which numbers to
change), the contract that held is at least the declared one (strict: ``exact``; elastic:
``exact-data``; fresh-epoch: ``fresh-epoch``), the run reached its end, every metric check is 0,
the final counters are equal and every planned fault site was hit. ``failures`` says which did
not hold. With ``--mutate`` the build is broken on purpose and verify succeeds (exit 0) only when
it fails that build after a restore exercised it (``Report.mutation_caught``).
"""

from __future__ import annotations

import bisect
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spotrun.orchestrator.control.launch import embedded_cpus
from spotrun.orchestrator.control.specfile import SpecError
from spotrun.orchestrator.control.supervisor import JobFailedError
from spotrun.orchestrator.ledger.events import AttemptStarted, Restored
from spotrun.orchestrator.ledger.history import history
from spotrun.orchestrator.ledger.history_model import History
from spotrun.orchestrator.ledger.store import Ledger
from spotrun.orchestrator.verify.comparison import (
    NODE_SITE,
    WARM_SITE,
    MetricComparison,
    compare_metrics,
    fault_delivery,
    final_bundle_diff,
    first_differing_tensor,
    locate,
    reach,
    span_balance,
)
from spotrun.orchestrator.verify.divergence import (
    Divergence,
    Stage,
    divergence_rows,
    explain,
    first_stage,
    restore_before,
)
from spotrun.orchestrator.verify.faultplan import NodeRemoval, fault_rows, fixed_interval, plan_faults, sure_restore
from spotrun.trainer.bundle.bundles import BundleError, list_bundles, read_manifest
from spotrun.trainer.bundle.manifest import DataInfo, ManifestError
from spotrun.trainer.job.spec import FaultSpec, JobSpec
from spotrun.trainer.metrics import JsonlSink, MetricPoint, metrics_dir, open_sinks
from spotrun.trainer.metrics.mlflow_sink import SEND_AT_WRITE, Tracker
from spotrun.trainer.observe.faults import FaultLog
from spotrun.trainer.observe.trace import UpdateRecord, last_update, latest_per_update, read_trace, update_epochs
from spotrun.trainer.run.warm import ineligible
from spotrun.trainer.storage import Storage, open_storage

if TYPE_CHECKING:
    from ray.cluster_utils import Cluster

CONTRACTS = ("exact", "exact-data", "fresh-epoch")  # strongest first
DECLARED = {"strict": "exact", "elastic": "exact-data", "fresh-epoch": "fresh-epoch"}
PARAM_TOLERANCE = 1e-3  # exact-data: max |param difference| after the run, and relative metric difference
# the tolerance on metric values each contract promises (None: values are not promised equal)
METRIC_TOLERANCE = {"exact": 0.0, "exact-data": PARAM_TOLERANCE, "fresh-epoch": None}


@dataclass
class Report:
    verdict: str
    failures: list[str]  # one line per check that did not hold; empty on a pass
    declared_contract: str
    observed_contract: str
    seed: int  # the fault plan's seed (drawn when --seed was not given): --seed SEED plans the same faults
    faults_planned: int
    faults_delivered: int  # recorded by the fault as it fired (or a node removal verify carried out)
    kills_injected: int  # delivered SIGKILLs and node removals
    notices_injected: int  # delivered SIGTERMs
    fault_sites_planned: list[str]
    fault_sites_hit: list[str]
    fault_sites_not_applicable: dict[str, str]
    faults_not_delivered: list[dict[str, Any]]
    restarts: int
    restores_from_bundle: int  # restarts that restored a bundle (the others started from nothing)
    recovery_paths: dict[str, int]  # restores by path: cold, warm-spare, warm-replace, warm-shrink
    reference_updates: int
    chaos_last_update: int
    occurrence_gaps: int
    occurrence_duplicates: int
    updates_compared: int
    params_bitwise_equal: bool
    params_max_abs_diff: float
    metric_sinks: list[str]
    metric_writes: int  # points written by every attempt of the interrupted run (the raw log)
    metric_duplicates_written: int  # what a consumer that appends instead of upserting would hold twice
    metric_duplicates: int  # in the sinks' final views: must be 0
    metric_missing: int
    metric_extra: int
    metric_mismatches: int
    metric_stale: int
    metric_problems: list[str]
    counters_equal: bool
    lost_updates: int | None  # None: some restart's is not known (README: What a restart cost)
    lost_updates_known: int
    restart_seconds: list[float]
    restore_oracle: list[str]
    first_divergence: dict[str, Any] | None
    reference_job: str
    chaos_job: str
    # every planned fault in plan order: site, planned update, attempt, rank, the epoch its update's data
    # reached, whether it was delivered and whether its restore is sure to cross an epoch boundary
    faults: list[dict[str, Any]] = field(default_factory=list)
    mutated: list[str] = field(default_factory=list)  # a deliberately broken build lost these at every restore
    # with ``mutated``: whether verify failed the broken build after faults and restores that exercised it
    mutation_caught: bool | None = None

    def succeeded(self) -> bool:
        """Whether verify did what it promises (exit status 0): a pass, or, for a deliberately broken
        build (``--mutate``), catching it."""
        return bool(self.mutation_caught) if self.mutated else self.verdict == "pass"


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
                 workdir: Path, load, nodes: int = 0, mutate: tuple[str, ...] = (), address: str | None = None) -> None:
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
                                               warm=not self.no_ray, epochs=update_epochs(_final_trace(ref_trace)))
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
                                  restores, warm=not self.no_ray, epochs=epochs)
        failures = unproven + verdict_failures(declared, observed, short, metrics, counters_equal,
                                               delivery.sites_missed)
        return Report(
            verdict="fail" if failures else "pass", failures=failures,
            declared_contract=declared, observed_contract=observed,
            seed=self.seed, faults_planned=delivery.planned, faults_delivered=delivery.delivered,
            kills_injected=delivery.kills,
            notices_injected=delivery.notices, fault_sites_planned=delivery.sites_planned,
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
            faults=fault_rows(faults, removals, fired, self.removed, fixed_interval(spec), epochs),
            mutated=list(self.mutate),
            # caught: it failed, and not only because nothing was exercised (that proves nothing either way)
            mutation_caught=bool(failures) and not unproven if self.mutate else None,
        )

    def _not_applicable(self, faults: Sequence[FaultSpec], removals: Sequence[NodeRemoval]) -> dict[str, str]:
        """The sites the plan left out, each with why and how to exercise it."""
        out = {} if removals else {NODE_SITE: "the job runs on a single node; run verify --nodes N to exercise it"}
        if not any(f.site == "rejoin" for f in faults):
            why = ("without Ray every restart starts new processes" if self.no_ray
                   else ineligible(self.spec) or "one rank: no process survives its loss")
            out[WARM_SITE] = why
        return out

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


def restart_figures(hist: History) -> dict[str, Any]:
    """The report's restart figures, from the chaos job's history (each defined once, in
    :mod:`spotrun.orchestrator.ledger.losses`: the report shows what ``spotrun history`` shows)."""
    totals = hist.totals
    restored = [r for r in hist.restarts if r.restored_from is not None]
    return {"restarts": totals.restarts, "restores_from_bundle": len(restored),
            "recovery_paths": dict(Counter(r.recovery_path for r in restored)),
            "lost_updates": totals.lost_updates, "lost_updates_known": totals.lost_updates_known,
            "restart_seconds": totals.downtime_seconds}


def read_sink(spec: JobSpec, storage: Storage, kind: str, job_id: str) -> list[MetricPoint]:
    """What the ``kind`` sink of ``job_id`` reads back (one point per key for an upserting sink)."""
    sink = open_sinks([kind], metrics_dir(spec.storage, job_id, spec.metrics.local_dir), storage,
                      mlflow=spec.metrics.mlflow, job_id=job_id)
    try:
        return sink.read(job_id)
    finally:
        sink.close()


def proof_failures(spec: JobSpec, kills: int, seed: int, nodes: bool, planned: int, delivered: int,
                   restores: int, warm: bool = False, epochs: Mapping[int, int] | None = None) -> list[str]:
    """Why the interrupted run proved nothing, if it did not (empty: it did). A pass needs at least
    one fault that fired and one restart that restored a published bundle: without them no restore
    was compared with anything, and a run that nothing interrupted passes every other check. Each
    line names the numbers to change (``--kills``, ``checkpoint.every_updates``, ``train.updates``).
    ``epochs``: the reference's, which the plan it names is planned with (:func:`plan_faults`)."""
    every, last = fixed_interval(spec), spec.train.updates
    if kills < 1:
        return ["no fault was planned (--kills 0), so no restore was tested: run verify with --kills 1 or more"]
    if planned == 0:
        return [f"no fault was planned: train.updates={last} with checkpoint.every_updates={every} leaves room for "
                f"no fault after a published bundle (the first is published at update {every}, and a fault needs "
                f"an update after it); lower checkpoint.every_updates to <= {max(1, last - 1)} or raise "
                f"train.updates to >= {every + 1}"]
    if delivered == 0:
        return [f"none of the {planned} planned faults fired (a fault counts once it records itself as it fires; "
                "faults_not_delivered lists where they were planned), so no restore was tested"]
    if restores == 0:
        return [f"no restart restored a published bundle: the {delivered} fault(s) that fired all came before the "
                f"first bundle (update {every}) was published, so every restart began from nothing and no restore "
                f"was tested; {sure_restore(spec, kills, seed, nodes, warm, epochs)}"]
    return []




def verdict_failures(declared: str, observed: str, short: list[str], metrics: MetricComparison,
                     counters_equal: bool, sites_missed: list[str]) -> list[str]:
    """One line per check that did not hold (an empty list is a pass)."""
    holds = observed in CONTRACTS and CONTRACTS.index(observed) <= CONTRACTS.index(declared)
    failures = [] if holds else [f"the contract that held ({observed}) is weaker than the declared {declared}"]
    failures += short
    if not metrics.ok:
        failures.append(f"metric points: {metrics.duplicates} duplicated, {metrics.missing} missing, "
                        f"{metrics.extra} unexpected, {metrics.mismatches} differing from the reference, "
                        f"{metrics.stale} older than their latest write ({'; '.join(metrics.problems)})")
    if not counters_equal:
        failures.append("the final bundles' counters differ (or a run published none)")
    if sites_missed:
        failures.append(f"planned fault sites never hit: {', '.join(sites_missed)} (no fault there fired)")
    return failures


def _final_trace(path: Path) -> dict[int, UpdateRecord]:
    """Each update as the latest attempt did it; no file (the run never completed an update): none."""
    return latest_per_update(read_trace(path)) if path.exists() else {}


def render(report: Report, console) -> None:
    """The human report: what was injected, what was compared, what failed, and the first divergence."""
    from rich.table import Table

    ok = report.verdict == "pass"
    if report.mutated:
        lost = ", ".join(report.mutated)
        if report.mutation_caught:
            outcome = "verify caught it (the FAIL below is the expected outcome)"
        elif ok:
            outcome = "[bold red]not caught[/]: losing it had no observable effect on this job's updates"
        else:
            outcome = ("[bold red]not tested[/]: no restart restored a bundle, so nothing was lost (the first "
                       "failure below says what to change)")
        broken = ("its mlflow sink sent each point as it was written instead of at publish" if lost == SEND_AT_WRITE
                  else f"every restore of the chaos run lost {lost}")
        console.print(f"[bold]mutant build[/]: {broken}, on purpose: {outcome}")
    # the contract can hold while verify fails on something else (metrics, counters, a site not hit):
    # the headline then says so, instead of two equal contracts under a FAIL
    held = (f"; the contract held, but {len(report.failures)} other check(s) failed (first: {report.failures[0]})"
            if not ok and report.failures and report.observed_contract == report.declared_contract else "")
    console.print(f"[bold]{'PASS' if ok else 'FAIL'}[/]: declared contract [bold]{report.declared_contract}[/], "
                  f"observed [bold]{report.observed_contract}[/] ({report.faults_delivered} of "
                  f"{report.faults_planned} planned faults delivered, {report.restarts} restarts, "
                  f"{report.updates_compared} updates compared; fault seed {report.seed}){held}")
    t = Table(title="comparison with the uninterrupted run")
    t.add_column("check")
    t.add_column("result")
    for name, value in (
        ("fault sites planned", ", ".join(report.fault_sites_planned)),
        ("fault sites hit (recorded as they fired)", ", ".join(report.fault_sites_hit) or "none"),
        ("kills / notices delivered", f"{report.kills_injected} / {report.notices_injected}"),
        ("restarts / of which from a bundle", f"{report.restarts} / {report.restores_from_bundle}"),
        ("restores by path (warm: the survivors' memory)",
         ", ".join(f"{p} {n}" for p, n in sorted(report.recovery_paths.items())) or "none"),
        ("updates: reference / reached", f"{report.reference_updates} / {report.chaos_last_update}"),
        ("occurrence gaps / duplicates", f"{report.occurrence_gaps} / {report.occurrence_duplicates}"),
        ("parameters bitwise equal", str(report.params_bitwise_equal)),
        ("max |param difference| at the end", f"{report.params_max_abs_diff:.3g}"),
        (f"metric points in {', '.join(report.metric_sinks)}: duplicated / missing / unexpected / differing / "
         "stale", f"{report.metric_duplicates} / {report.metric_missing} / {report.metric_extra} / "
                  f"{report.metric_mismatches} / {report.metric_stale}"),
        ("metric points written by every attempt / written again (an appending consumer's duplicates)",
         f"{report.metric_writes} / {report.metric_duplicates_written}"),
        ("final counters equal", str(report.counters_equal)),
        ("updates restarts lost (computed again)", str(report.lost_updates) if report.lost_updates is not None
         else f"{report.lost_updates_known} known, and restarts whose lost attempt's reach is not known"),
        ("restart seconds (history's downtime: loss → restored)",
         ", ".join(f"{x:.2f}" for x in report.restart_seconds)),
        ("restore oracle (state differing right after a restore)", ", ".join(report.restore_oracle) or "none"),
    ):
        t.add_row(name, value)
    console.print(t)
    if report.faults:
        console.print(fault_table(report))
    for line in report.failures:
        console.print(f"[red]failed[/]: {line}", highlight=False)
    if report.first_divergence:
        d = Table(title="where the interrupted run first differs (occurrences -> batch -> loss -> gradient -> "
                        "parameters)")
        d.add_column("")
        d.add_column("")
        for name, value in divergence_rows(report.first_divergence):
            d.add_row(name, value)
        console.print(d)
        if report.restore_oracle:
            console.print("state categories lost at a restore: " + ", ".join(report.restore_oracle)
                          + " (`spotrun inventory` gives each category's owner and restore action)")


def fault_table(report: Report):
    """The planned faults, one row each: where, when (update and the epoch its data reached), whether
    it was delivered and whether its restore crosses an epoch boundary."""
    from rich.table import Table

    t = Table(title=f"faults planned with seed {report.seed} (verify --seed {report.seed} plans the same ones)")
    for name in ("site", "update", "epoch", "attempt", "rank", "delivered", "restore crosses epoch"):
        t.add_column(name, no_wrap=name != "restore crosses epoch")  # 80 columns: only that header wraps
    for f in report.faults:
        crosses = {True: "yes", False: "no", None: "-"}[f.get("restore_crosses_epoch")]
        t.add_row(f["name"], str(f["update"]), "-" if f.get("epoch") is None else str(f["epoch"]),
                  str(f["attempt"]), str(f["rank"]), "yes" if f["delivered"] else "no", crosses)
    return t
