"""Bench 4 — spotrun and Ray Train side by side: the same job, one worker SIGKILLed at the same update.

Both run 2 workers on one local Ray instance (started here, 127.0.0.1), the
same model, optimizer, global batch and records (see bench/peer_loop.py for
exactly what the Ray Train loop does), a checkpoint every 10 updates, and 60
updates. In each killed run, rank 1's process SIGKILLs itself at the start of
update 27 (spotrun: a ``microstep`` fault; Ray Train: ``os.kill`` in the loop),
and the bench sees the death from ``/proc`` the same way for both. Every
figure is against an uninterrupted run of the same system in this bench.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.observe import DeathWatch
from bench.runs import Run, checkpoint_figures, first_attempt_pid, peer_pid, peer_run, restart_figures, spotrun_run
from bench.tables import ROOT, Section, Stopwatch, Table, cli, fmt, ratio, work_folder


@dataclass(frozen=True)
class Shape:
    updates: int
    every: int
    kill_at: int


FULL = Shape(updates=60, every=10, kill_at=27)
QUICK = Shape(updates=14, every=5, kill_at=12)
WORLD = 2
RESUMES = ("epoch-restart", "skip-steps")


def spotrun_job(root: Path, job_id: str, shape: Shape, kill: bool) -> Run:
    from spotrun.orchestrator.launch import run_on_ray
    from spotrun.orchestrator.specfile import load_spec
    from spotrun.trainer.storage import open_storage

    sets = [f"storage=file://{root}", f"data.shards={ROOT / 'configs/data/tiny'}", f"world.size={WORLD}",
            f"train.updates={shape.updates}", f"checkpoint.every_updates={shape.every}", "data.workers=1",
            "world.restart_backoff_s=0", "metrics.sinks=[sqlite, jsonl]"]
    if kill:
        sets.append(f"faults=[{{site: microstep, update: {shape.kill_at}, microstep: 0, rank: 1}}]")
    spec = load_spec(ROOT / "configs/tiny.yaml", sets, job_id)
    watch = DeathWatch(first_attempt_pid(open_storage(spec.storage), job_id, 1)) if kill else None
    if watch:
        watch.start()
    trace = root / f"{job_id}.trace.jsonl"
    outcome = run_on_ray(spec, trace_path=str(trace), record_ids=True)
    if watch:
        watch.stop()
    return spotrun_run(spec, trace, outcome, watch.died_at if watch else None)


def peer_config(out: Path, shape: Shape, kill: bool, resume: str) -> dict:
    """The same job as configs/tiny.yaml at world size 2 (model, seq_len, micro-batch, accumulation, lr)."""
    from spotrun.orchestrator.specfile import load_spec

    spec = load_spec(ROOT / "configs/tiny.yaml", [f"data.shards={ROOT / 'configs/data/tiny'}"], "peer")
    return {"out": str(out), "shards": spec.data.shards, "vocab": spec.data.vocab, "seq_len": spec.data.seq_len,
            "micro_batch": spec.train.micro_batch, "accum_steps": spec.train.accum_steps,
            "updates": shape.updates, "every": shape.every, "kill_at": shape.kill_at if kill else 0,
            "kill_rank": 1, "lr": spec.train.lr, "seed": spec.seed, "model": spec.model.model_dump(),
            "workers": 1, "resume": resume, "world_size": WORLD}


def peer_job(root: Path, name: str, shape: Shape, kill: bool, resume: str) -> Run:
    from bench.peer_loop import fit

    out = root / name
    out.mkdir(parents=True)
    watch = DeathWatch(peer_pid(out, 1)) if kill else None
    if watch:
        watch.start()
    result = fit(peer_config(out, shape, kill, resume), root / "ray-train-storage", name)
    if watch:
        watch.stop()
    if result.error is not None:
        raise RuntimeError(f"Ray Train run {name} failed: {result.error}")
    return peer_run(out, WORLD, watch.died_at if watch else None)


def run(shape: Shape, scratch: Path) -> dict[str, dict]:
    import ray

    ray.init(address="local", num_cpus=WORLD + 1, include_dashboard=False, log_to_driver=False,
             logging_level=logging.WARNING)
    try:
        spot_ref = spotrun_job(scratch / "spot-ref", "ref", shape, kill=False)
        peer_ref = peer_job(scratch, "peer-ref", shape, kill=False, resume=RESUMES[0])
        spot = spotrun_job(scratch / "spot-kill", "kill", shape, kill=True)
        peers = {r: peer_job(scratch, f"peer-kill-{r}", shape, kill=True, resume=r) for r in RESUMES}
    finally:
        ray.shutdown()
    out = {"spotrun": {**restart_figures(spot, spot_ref, shape.kill_at),
                       **{f"ckpt_{k}": v for k, v in checkpoint_figures(spot_ref, shape.every).items()}}}
    for r, p in peers.items():
        out[f"Ray Train ({r})"] = {**restart_figures(p, peer_ref, shape.kill_at),
                                   **{f"ckpt_{k}": v for k, v in checkpoint_figures(peer_ref, shape.every).items()}}
    return out


ROWS = (
    ("kill_to_next_update_s", "kill → next completed update (s)"),
    ("kill_to_killed_update_s", "kill → the killed update completed (s)"),
    ("resumed_from", "resumed from the checkpoint of update"),
    ("updates_lost", "updates lost (done after that checkpoint, redone)"),
    ("gaps", "occurrence gaps vs the uninterrupted run"),
    ("duplicates", "occurrence duplicates vs the uninterrupted run"),
    ("metric_duplicates_read", "metric points duplicated (same step and name), as read"),
    ("metric_duplicates_written", "metric points duplicated, as written"),
    ("restarts", "restarts"),
    ("ckpt_block_s", "checkpoint: loop blocked per checkpoint (s, median)"),
    ("ckpt_extra_updates", "checkpoint: extra time per checkpoint (update-times)"),
    ("ckpt_wall_s", "uninterrupted: update 1 → last update (s)"),
)


def tables(results: dict[str, dict]) -> tuple[list[Table], list[str]]:
    systems = list(results)
    peers = [s for s in systems if s != "spotrun"]
    t = Table("The same 2-worker job, rank 1 SIGKILLed at the same update",
              ["", *systems, *(f"spotrun / {p.split('(')[1].rstrip(')')}" for p in peers)])
    for key, label in ROWS:
        vals = [results[s][key] for s in systems]
        rel = [fmt(ratio(results["spotrun"][key], results[p][key])) + "×"
               if key.endswith("_s") and results[p][key] else "" for p in peers]
        t.add(label, *(fmt(v) for v in vals), *rel)
    t.notes += [
        "occurrences: spotrun's are token spans of records (epoch/shard:line[start:end]); the Ray Train loop's "
        "are fixed-length chunks of the token stream (epoch/chunk). Each system is compared with its own "
        "uninterrupted run, step by step, keeping the latest attempt of every redone step",
        "metric points: spotrun's default SQLite sink upserts by <job>/<update>/<name> (its raw JSONL log keeps "
        "every write); the Ray Train loop appends a point per step, as a tracker's log_metric(step=) does",
        "checkpoint blocked: spotrun's capture (the stall; writing happens in the background); Ray Train's "
        "torch.save into a temporary directory plus ray.train.report (synchronous upload, the default). "
        "extra time per checkpoint: the step after a checkpoint minus the median step, in the uninterrupted run",
        "Ray Train's report() returns only once its controller has taken the previous report (a queue of one, "
        "read at the controller's poll, every RAY_TRAIN_HEALTH_CHECK_INTERVAL_S = 2 s by default). Checkpoints "
        "here are a fraction of a second apart, so every report waits for that poll, and a checkpoint reported "
        "shortly before the kill may not be registered yet: Ray Train then resumes from the one before. Both "
        "effects shrink when checkpoints are further apart than the poll interval",
        "world.restart_backoff_s=0 for spotrun (its default 0.5 s would add); Ray Train restarts without a "
        "backoff by default. Both loops use one DataLoader worker process per rank",
    ]
    return [t], verdicts(results, peers)


def verdicts(results: dict[str, dict], peers: list[str]) -> list[str]:
    s = results["spotrun"]
    faster = all((s["kill_to_next_update_s"] or 1e9) < (results[p]["kill_to_next_update_s"] or 0) for p in peers)
    times = ", ".join(f"{p}: {fmt(results[p]['kill_to_next_update_s'])} s" for p in peers)
    clean = s["gaps"] == 0 and s["duplicates"] == 0 and s["metric_duplicates_read"] == 0
    shown = [p for p in peers if results[p]["gaps"] or results[p]["duplicates"] or results[p]["metric_duplicates_read"]]
    return [
        f"restart faster than Ray Train's on the same kill: **{'MET' if faster else 'NOT MET'}** "
        f"(kill → next update: spotrun {fmt(s['kill_to_next_update_s'])} s; {times})",
        f"0 gaps and 0 duplicates where Ray Train shows some: **{'MET' if clean else 'NOT MET'}** (spotrun: "
        f"{s['gaps']} gaps, {s['duplicates']} duplicate occurrences, {s['metric_duplicates_read']} duplicate "
        f"metric points; Ray Train shows some in: {', '.join(shown) or 'none'})",
    ]


INTRO = """The same job — spotrun's `tiny` model (1-layer char GPT), AdamW, a global batch of 2 workers ×
4 sequences × 2 accumulation steps of 33 tokens, the `configs/data/tiny` records, a checkpoint every
10 updates, 60 updates — on spotrun (`run_on_ray`) and on Ray Train's `TorchTrainer` with
`FailureConfig(max_failures=3)` and `CheckpointConfig(num_to_keep=3)`, on one local Ray instance.
Rank 1's process is SIGKILLed at the start of update 27 in each killed run. The Ray Train loop
(bench/peer_loop.py) follows Ray Train's checkpointing and fault-tolerance guides; its resume of the
data position is the part users write themselves, so it runs twice: `epoch-restart` (re-enter the
saved epoch from its first batch: the guides' per-epoch pattern applied to checkpoints taken inside
an epoch, which is what the guides' example becomes when checkpoints are every K steps) and
`skip-steps` (also skip the batches of the steps already done in that epoch: exact here, because the
distributed sampler's order is a function of seed and epoch and the world size did not change)."""


def main(argv: Sequence[str] | None = None) -> None:
    args = cli(__doc__.splitlines()[0], argv)
    clock = Stopwatch()
    with work_folder("sidebyside") as folder:
        results = run(QUICK if args.quick else FULL, folder)
    tabs, verdict_lines = tables(results)
    Section("4-ray-train-side-by-side", "4. Ray Train side by side", INTRO, tabs, verdict_lines, clock.seconds,
            results, clock.measured).emit(args.out)


if __name__ == "__main__":
    main()
