"""``spotrun verify``: prove the recovery contract on the user's own job.

1. Run the job uninterrupted (the reference), recording per update the occurrence
   ids and a parameter digest.
2. Run it again with N faults at seeded random points, cycling through every
   fault site: a rank's process SIGKILLed mid-accumulation, mid-microstep (after
   the forward pass) and during a background bundle write; a kill between
   manifest publish and offsets commit; a preemption notice (SIGTERM). A killed
   driver is started again with the same command, as a user would.
3. Compare update by update: occurrences (gaps, duplicates), parameters (bitwise,
   or the policy's tolerance), metric points, counters; and collect the restore
   oracle's findings (state categories that differed right after a restore).

The verdict passes only when the contract that held is at least the declared one
(strict: ``exact``; elastic: ``exact-data``; fresh-epoch: ``fresh-epoch``).
"""

from __future__ import annotations

import bisect
import json
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spotrun.trainer.bundle import list_bundles, load_bundle
from spotrun.trainer.metrics import metrics_dir, open_sinks
from spotrun.trainer.spec import FaultSpec, JobSpec
from spotrun.trainer.storage import open_storage
from spotrun.trainer.trace import UpdateRecord, latest_per_update, read_trace

from spotrun.orchestrator.history import history
from spotrun.orchestrator.ledger import AttemptStarted, Ledger, Restored
from spotrun.orchestrator.supervisor import JobFailedError

CONTRACTS = ("exact", "exact-data", "fresh-epoch")  # strongest first
DECLARED = {"strict": "exact", "elastic": "exact-data", "fresh-epoch": "fresh-epoch"}
SITES = ("mid-accumulation", "mid-microstep", "bundle-write", "publish-to-offsets", "notice")
NODE_SITE = "node-removed"  # only on a multi-node cluster (verify --nodes N)
PARAM_TOLERANCE = 1e-3  # exact-data: max |param difference| after the run


@dataclass
class Divergence:
    update: int
    what: str  # occurrences | params
    detail: str


@dataclass
class Report:
    verdict: str
    declared_contract: str
    observed_contract: str
    kills_injected: int
    fault_sites: list[str]
    fault_sites_not_applicable: dict[str, str]
    restarts: int
    occurrence_gaps: int
    occurrence_duplicates: int
    updates_compared: int
    params_bitwise_equal: bool
    params_max_abs_diff: float
    metric_duplicates: int
    metric_mismatches: int
    counters_equal: bool
    lost_updates: int
    restart_seconds: list[float]
    restore_oracle: list[str]
    first_divergence: dict[str, Any] | None
    reference_job: str
    chaos_job: str
    faults: list[dict[str, Any]] = field(default_factory=list)
    mutated: list[str] = field(default_factory=list)  # a deliberately broken build lost these at every restore


@dataclass(frozen=True)
class NodeRemoval:
    """Remove the node hosting ``rank`` once ``attempt`` has completed ``update`` (verify does it)."""

    attempt: int
    update: int
    rank: int


def plan_faults(spec: JobSpec, kills: int, seed: int,
                nodes: bool = False) -> tuple[list[FaultSpec], list[NodeRemoval]]:
    """``kills`` faults at increasing updates, one per attempt, cycling through the fault sites
    (with node removals among them when the job runs on several nodes)."""
    rng = random.Random(seed)  # verify's own generator, never the job's streams
    every, last = spec.checkpoint.every_updates, spec.train.updates
    accum = spec.train.accum_steps
    sites = (*SITES, NODE_SITE) if nodes else SITES
    faults: list[FaultSpec] = []
    removals: list[NodeRemoval] = []
    update = every  # from the first bundle on, so that every fault is followed by a real restore
    for i in range(kills):
        site = sites[i % len(sites)]
        if site in ("bundle-write", "publish-to-offsets"):
            u = (update // every + 1) * every  # the next checkpoint boundary
        else:
            u = update + 1 + rng.randrange(2)
        if u >= last:
            break
        attempt, rank = i + 1, rng.randrange(spec.world.size)
        if site == NODE_SITE:
            removals.append(NodeRemoval(attempt, u, rank))
            # the removal is triggered from the trace, which lags the ranks: they may publish the
            # next bundle first, and a fault planned before it would never be reached
            update = u + every
            continue
        fault = {
            "mid-accumulation": dict(site="microstep", microstep=rng.randrange(1, accum) if accum > 1 else 0),
            "mid-microstep": dict(site="backward", microstep=rng.randrange(accum)),
            "bundle-write": dict(site="bundle_write"),
            "publish-to-offsets": dict(site="after_publish", rank=0),
            "notice": dict(site="microstep", microstep=rng.randrange(accum), signal="SIGTERM"),
        }[site]
        faults.append(FaultSpec(update=u, attempt=attempt, **{"rank": rank, **fault}))
        # a notice's emergency bundle is taken at the boundary the ranks reach when the request
        # arrives, which may be an update or two later: the next fault goes past it
        update = u + every if site == "notice" else u
    return faults, removals


def site_name(f: FaultSpec) -> str:
    if f.signal == "SIGTERM":
        return "notice"
    return {"microstep": "mid-accumulation" if f.microstep else "microstep-start", "backward": "mid-microstep",
            "bundle_write": "bundle-write", "after_publish": "publish-to-offsets",
            "before_update": "before-update"}[f.site]


class Verifier:
    def __init__(self, config: str, overrides: list[str], *, kills: int, seed: int, no_ray: bool,
                 workdir: Path, load, nodes: int = 0, mutate: tuple[str, ...] = ()) -> None:
        self.config, self.overrides = config, list(overrides)
        self.mutate = mutate  # a deliberately broken chaos run: its restores lose these categories
        self.kills, self.seed, self.no_ray = kills, seed, no_ray
        self.nodes = nodes  # > 0: run on a local multi-node cluster and remove nodes too
        self.cluster = None
        self.workdir = workdir
        self.load = load  # load_spec
        self.spec: JobSpec = load(config, overrides)

    def _cmd(self, job: str, trace: Path, extra: list[str], drop: tuple[str, ...] = ()) -> list[str]:
        build = ["spotrun.orchestrator.mutant", "--drop", ",".join(drop)] if drop else ["spotrun"]
        cmd = [sys.executable, "-m", *build, "run", self.config, "--job-id", job, "--trace", str(trace),
               "--trace-ids"]
        for s in [*self.overrides, *extra]:
            cmd += ["--set", s]
        if self.cluster is not None:
            return [*cmd, "--address", self.cluster.address]
        return [*cmd, "--no-ray"] if self.no_ray else cmd

    def _run(self, job: str, trace: Path, extra: list[str], max_runs: int,
             removals: list[NodeRemoval] = (), drop: tuple[str, ...] = ()) -> int:
        """Run (and rerun after a driver death) until the job ends; returns how many runs it took.
        Meanwhile remove the planned nodes (and add a fresh one each time: capacity comes back)."""
        storage = open_storage(self.spec.storage, self.spec.storage_endpoint_url)
        storage.delete_prefix(job)
        trace.unlink(missing_ok=True)
        pending = list(removals)
        for n in range(1, max_runs + 1):
            # stderr to a file, not a pipe: nobody reads a pipe while the job runs, and a driver that
            # outlives many restarts could fill it and block
            with tempfile.TemporaryFile("w+") as log:
                proc = subprocess.Popen(self._cmd(job, trace, extra, drop), stdout=subprocess.DEVNULL, stderr=log)
                while proc.poll() is None:
                    if pending and self._remove_if_due(storage, job, trace, pending[0]):
                        pending.pop(0)
                    time.sleep(0.05)  # polling the job's progress: the removal point is a condition
                log.seek(0)
                err = log.read()
            if proc.returncode == 0:
                return n
            if proc.returncode not in (-9, 143):  # SIGKILLed, or drained after a notice to the driver
                raise JobFailedError(f"job {job} failed (exit {proc.returncode}): {err.strip()[-2000:]}")
        raise JobFailedError(f"job {job} did not finish in {max_runs} runs")

    def _remove_if_due(self, storage, job: str, trace: Path, removal: NodeRemoval) -> bool:
        started = [e for e in Ledger(storage, job).read() if isinstance(e, AttemptStarted)]
        if not started or started[-1].attempt != removal.attempt or not trace.exists():
            return False
        done = [json.loads(line)["update"] for line in trace.read_text().splitlines() if line.strip()]
        if not done or done[-1] < removal.update:
            return False
        node_id = started[-1].node_ids[removal.rank]
        node = next((n for n in self.cluster.worker_nodes if n.node_id == node_id), None)
        if node is not None:
            self.cluster.remove_node(node)
            self.cluster.add_node(num_cpus=self.spec.world.cpus_per_rank)
        return True

    def run(self) -> Report:
        ref_job, chaos_job = f"{self.spec.job_id}.verify-ref", f"{self.spec.job_id}.verify-chaos"
        ref_trace, chaos_trace = self.workdir / f"{ref_job}.jsonl", self.workdir / f"{chaos_job}.jsonl"
        faults, removals = plan_faults(self.spec, self.kills, self.seed, nodes=self.nodes > 0)
        fault_set = "faults=[" + ", ".join(f.model_dump_json() for f in faults) + "]"
        if self.nodes:
            self._start_cluster()
        try:
            self._run(ref_job, ref_trace, [], max_runs=1)
            self._run(chaos_job, chaos_trace, [fault_set], max_runs=len(faults) + 2, removals=removals,
                      drop=self.mutate)
        finally:
            if self.cluster is not None:
                self.cluster.shutdown()
        return self.compare(ref_job, chaos_job, ref_trace, chaos_trace, faults, removals)

    def _start_cluster(self) -> None:
        """A local multi-node Ray cluster (ray.cluster_utils): a head with no CPUs, ``nodes`` workers
        with one rank's resources each, so every rank has a node of its own to lose."""
        from ray.cluster_utils import Cluster

        self.cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
        for _ in range(self.nodes):
            self.cluster.add_node(num_cpus=self.spec.world.cpus_per_rank)

    # -- comparison -------------------------------------------------------------------------

    def compare(self, ref_job: str, chaos_job: str, ref_trace: Path, chaos_trace: Path,
                faults: list[FaultSpec], removals: list[NodeRemoval] = ()) -> Report:
        spec = self.spec
        storage = open_storage(spec.storage, spec.storage_endpoint_url)
        ref = {r.update: r for r in read_trace(ref_trace)}
        chaos = latest_per_update(read_trace(chaos_trace))
        gaps, dups = span_balance(ref, chaos)
        divergence = self._first_divergence(ref, chaos, storage, ref_job, chaos_job)
        occurrences_equal = all(ref[u].occurrences_sha256 == chaos.get(u, ref[u]).occurrences_sha256 for u in ref) \
            and set(chaos) == set(ref)
        bitwise = occurrences_equal and all(ref[u].params_sha256 == chaos[u].params_sha256 for u in ref)
        max_diff, counters_equal = final_bundle_diff(storage, ref_job, chaos_job)
        metric_dups, metric_mismatches = self._metrics(ref_job, chaos_job, chaos)
        events = Ledger(storage, chaos_job).read()
        restores = [e for e in events if isinstance(e, Restored)]
        oracle = sorted({m for r in restores for m in r.roundtrip_mismatches})
        if bitwise and not gaps and not dups and not oracle:
            observed = "exact"
        elif occurrences_equal and not gaps and not dups and max_diff <= PARAM_TOLERANCE:
            observed = "exact-data"
        elif not dups:
            observed = "fresh-epoch" if spec.world.policy == "fresh-epoch" else "none"
        else:
            observed = "none"
        declared = DECLARED[spec.world.policy]
        holds = observed in CONTRACTS and CONTRACTS.index(observed) <= CONTRACTS.index(declared)
        passed = holds and metric_dups == 0 and counters_equal
        rows = history(storage, chaos_job)["restarts"]
        attempts = sum(1 for e in events if isinstance(e, AttemptStarted))
        return Report(
            verdict="pass" if passed else "fail",
            declared_contract=declared, observed_contract=observed,
            kills_injected=max(0, attempts - 1),
            fault_sites=sorted({site_name(f) for f in faults} | ({NODE_SITE} if removals else set())),
            fault_sites_not_applicable={} if removals else {
                NODE_SITE: "the job runs on a single node; run verify --nodes N to exercise it"},
            restarts=len(rows), occurrence_gaps=gaps, occurrence_duplicates=dups,
            updates_compared=len(set(ref) & set(chaos)), params_bitwise_equal=bitwise, params_max_abs_diff=max_diff,
            metric_duplicates=metric_dups, metric_mismatches=metric_mismatches, counters_equal=counters_equal,
            lost_updates=sum(r["lost_updates"] or 0 for r in rows),
            restart_seconds=[r["downtime_seconds"] if r["downtime_seconds"] is not None else r["restore_seconds"]
                             for r in rows],
            restore_oracle=oracle,
            first_divergence=None if divergence is None else divergence.__dict__,
            reference_job=ref_job, chaos_job=chaos_job,
            faults=[f.model_dump() for f in faults],
            mutated=list(self.mutate),
        )

    def _first_divergence(self, ref: dict[int, UpdateRecord], chaos: dict[int, UpdateRecord], storage,
                          ref_job: str, chaos_job: str) -> Divergence | None:
        for u in sorted(ref):
            r, c = ref[u], chaos.get(u)
            if c is None:
                return Divergence(u, "occurrences", "the update is missing from the interrupted run")
            if r.occurrences != c.occurrences:
                return Divergence(u, "occurrences", self._where_occurrences_differ(r, c))
            if r.params_sha256 != c.params_sha256:
                return Divergence(u, "params", first_differing_tensor(storage, ref_job, chaos_job, u))
        return None

    def _where_occurrences_differ(self, r: UpdateRecord, c: UpdateRecord) -> str:
        """The first differing occurrence, with the rank and microstep that trained on it."""
        spec = self.spec
        for i, (a, b) in enumerate(zip(r.occurrences, c.occurrences)):
            if a != b:
                seq = bisect.bisect_right(r.sequence_starts or [0], i) - 1
                rank, micro = locate(seq, spec.world.size, spec.train.micro_batch)
                return f"rank {rank}, microstep {micro}: expected occurrence {a}, got {b}"
        return f"expected {len(r.occurrences)} occurrence spans, got {len(c.occurrences)}"

    def _metrics(self, ref_job: str, chaos_job: str, chaos: dict[int, UpdateRecord]) -> tuple[int, int]:
        spec = self.spec
        ref_sink = open_sinks(spec.metrics.sinks, metrics_dir(spec.storage, ref_job, spec.metrics.local_dir))
        chaos_sink = open_sinks(spec.metrics.sinks, metrics_dir(spec.storage, chaos_job, spec.metrics.local_dir))
        try:
            ref_points = {(p.update, p.name): p.value for p in ref_sink.read(ref_job)}
            chaos_points = chaos_sink.read(chaos_job)
        finally:
            ref_sink.close()
            chaos_sink.close()
        counts = Counter((p.update, p.name) for p in chaos_points)
        dups = sum(n - 1 for n in counts.values() if n > 1)
        mismatches = sum(1 for p in chaos_points if ref_points.get((p.update, p.name)) != p.value)
        return dups, mismatches


def locate(sequence: int, world_size: int, micro_batch: int) -> tuple[int, int]:
    """(rank, microstep) that trains on the ``sequence``-th sequence of an update's global batch."""
    block = sequence // micro_batch  # the inverse of trainer.data.planner.slice_for
    return block % world_size, block // world_size


def span_balance(ref: dict[int, UpdateRecord], chaos: dict[int, UpdateRecord]) -> tuple[int, int]:
    """(gaps, duplicates): occurrence spans of the reference missing from, or extra in, the final run."""
    want = Counter(s for r in ref.values() for s in (r.occurrences or []))
    got = Counter(s for r in chaos.values() for s in (r.occurrences or []))
    return sum((want - got).values()), sum((got - want).values())


def _final_model(storage, job: str):
    newest = next((r for r in list_bundles(storage, job) if r.published), None)
    if newest is None:
        return None, None
    bundle = load_bundle(storage, newest.key, None)
    return bundle.payloads["rank-0/model.pt"], bundle.manifest.counters


def final_bundle_diff(storage, ref_job: str, chaos_job: str) -> tuple[float, bool]:
    (a, ca), (b, cb) = _final_model(storage, ref_job), _final_model(storage, chaos_job)
    if a is None or b is None:
        return float("inf"), False
    diff = max(float((a["model"][k].float() - b["model"][k].float()).abs().max()) for k in a["model"])
    return diff, ca == cb


def first_differing_tensor(storage, ref_job: str, chaos_job: str, update: int) -> str:
    """Name the first tensor that differs at the first boundary at or after ``update`` both runs kept."""
    ref = {r.update: r.key for r in list_bundles(storage, ref_job) if r.published}
    chaos = {r.update: r.key for r in list_bundles(storage, chaos_job) if r.published}
    common = sorted(u for u in set(ref) & set(chaos) if u >= update)
    if not common:
        return "parameter digest differs (no common bundle to name the tensor)"
    u = common[0]
    a = load_bundle(storage, ref[u], None).payloads["rank-0/model.pt"]
    b = load_bundle(storage, chaos[u], None).payloads["rank-0/model.pt"]
    for part in ("model", "ema"):
        for name in sorted(a[part]):
            if not a[part][name].equal(b[part][name]):
                diff = float((a[part][name].float() - b[part][name].float()).abs().max())
                return f"tensor {part}.{name} differs by up to {diff:.3g} (compared at the bundle of update {u})"
    return f"parameter digest differs at update {update}"


def render(report: Report, console) -> None:
    """The human report: what was injected, what was compared, and the first divergence, if any."""
    from rich.table import Table

    ok = report.verdict == "pass"
    if report.mutated:
        lost = ", ".join(report.mutated)
        console.print(f"[bold]mutant build[/]: every restore of the chaos run lost {lost} on purpose: "
                      + ("verify caught it (the FAIL below is the expected outcome)" if not ok else
                         "[bold red]not caught[/]: losing it had no observable effect on this job's updates"))
    console.print(f"[bold]{'PASS' if ok else 'FAIL'}[/]: declared contract [bold]{report.declared_contract}[/], "
                  f"observed [bold]{report.observed_contract}[/] ({report.kills_injected} faults injected, "
                  f"{report.restarts} restarts, {report.updates_compared} updates compared)")
    t = Table(title="comparison with the uninterrupted run")
    t.add_column("check")
    t.add_column("result")
    for name, value in (
        ("fault sites hit", ", ".join(report.fault_sites)),
        ("occurrence gaps / duplicates", f"{report.occurrence_gaps} / {report.occurrence_duplicates}"),
        ("parameters bitwise equal", str(report.params_bitwise_equal)),
        ("max |param difference| at the end", f"{report.params_max_abs_diff:.3g}"),
        ("metric duplicates / mismatches", f"{report.metric_duplicates} / {report.metric_mismatches}"),
        ("final counters equal", str(report.counters_equal)),
        ("updates lost to kills (replayed)", str(report.lost_updates)),
        ("restart seconds", ", ".join(f"{x:.2f}" for x in report.restart_seconds)),
        ("restore oracle (state differing right after a restore)", ", ".join(report.restore_oracle) or "none"),
    ):
        t.add_row(name, value)
    console.print(t)
    if report.first_divergence:
        d = report.first_divergence
        console.print(f"first divergence: update {d['update']} ({d['what']}): {d['detail']}")
        if report.restore_oracle:
            console.print("state categories lost at a restore: " + ", ".join(report.restore_oracle)
                          + " (see docs/STATE.md for each category's owner and restore action)")
