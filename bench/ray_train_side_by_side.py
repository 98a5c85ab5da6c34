"""Bench 4 — spotrun and Ray Train at its best, side by side: the same job, one worker SIGKILLed at the same update.

Both run 2 workers on one local Ray instance (started here, 127.0.0.1), the
same model, optimizer, global batch and records (bench/peer_loop.py says
exactly what the Ray Train loop does), at two checkpoint intervals: one inside
the peer's controller poll and one well beyond it. spotrun runs with its
defaults; Ray Train with asynchronous checkpoint upload, a 0.2 s controller
poll and its DataLoader workers dying with their rank (the fix spotrun's own
loader has). Ray Train's own settings are then varied one at a time: the
loader without that fix, and the default 2 s poll. In each killed run, rank 1's
process SIGKILLs itself at the start of the same update (spotrun: a
``microstep`` fault; Ray Train: ``os.kill`` in the loop), and the bench sees the
death from ``/proc`` the same way for both. Every figure is against an
uninterrupted run of the same system in the same repetition; each cell is the
median (min–max) over the repetitions.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.observe import DeathWatch
from bench.runs import Run, checkpoint_figures, first_attempt_pid, peer_pid, peer_run, restart_figures, spotrun_run
from bench.tables import ROOT, Section, Stopwatch, Table, cli, fmt, median, work_folder


@dataclass(frozen=True)
class Shape:
    updates: int
    kill_at: int
    intervals: tuple[int, ...]  # checkpoint every k updates: inside, then well beyond the peer's poll
    reps: int


# ~15 ms an update here: every 10 updates is inside the 0.2 s poll, every 50 several polls apart
FULL = Shape(updates=100, kill_at=77, intervals=(10, 50), reps=3)
QUICK = Shape(updates=14, kill_at=11, intervals=(4, 8), reps=1)
WORLD = 2
FAST_POLL_S = 0.2


@dataclass(frozen=True)
class System:
    label: str
    poll_s: float | None = None  # Ray Train's controller poll; None: its default, 2 s
    loader_fix: bool = True  # Ray Train: PR_SET_PDEATHSIG in the DataLoader's worker_init_fn
    spares: int = 0  # spotrun: world.spares (a spare steps in warm for the killed rank)


SPOTRUN = System("spotrun")
SPOTRUN_SPARE = System("spotrun, a spare (world.spares=1)", spares=1)
PEER = System("Ray Train", poll_s=FAST_POLL_S)
VARIANTS = (System("Ray Train, loader without the fix", poll_s=FAST_POLL_S, loader_fix=False),
            System("Ray Train, default poll (2 s)"))


def spotrun_job(root: Path, job_id: str, shape: Shape, every: int, kill: bool, spares: int = 0) -> Run:
    """spotrun with its defaults (restart backoff included) and ``spares`` spares; the JSONL sink keeps the
    timed write log."""
    from spotrun.orchestrator.control.launch import run_on_ray
    from spotrun.orchestrator.control.specfile import load_spec
    from spotrun.trainer.storage import open_storage

    sets = [f"storage=file://{root}", f"data.shards={ROOT / 'configs/data/tiny'}", f"world.size={WORLD}",
            f"train.updates={shape.updates}", f"checkpoint.every_updates={every}", "data.workers=1",
            "metrics.sinks=[sqlite, jsonl]", f"world.spares={spares}"]
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
    return spotrun_run(spec, trace, outcome.restarts, watch.died_at if watch else None)


def peer_config(out: Path, shape: Shape, every: int, kill: bool, system: System) -> dict:
    """The same job as configs/tiny.yaml at world size 2 (model, seq_len, micro-batch, accumulation, lr)."""
    from spotrun.orchestrator.control.specfile import load_spec

    spec = load_spec(ROOT / "configs/tiny.yaml", [f"data.shards={ROOT / 'configs/data/tiny'}"], "peer")
    return {"out": str(out), "shards": spec.data.shards, "vocab": spec.data.vocab, "seq_len": spec.data.seq_len,
            "micro_batch": spec.train.micro_batch, "accum_steps": spec.train.accum_steps,
            "updates": shape.updates, "every": every, "kill_at": shape.kill_at if kill else 0,
            "kill_rank": 1, "lr": spec.train.lr, "seed": spec.seed, "model": spec.model.model_dump(),
            "workers": 1, "loader_fix": system.loader_fix, "world_size": WORLD}


def peer_job(root: Path, name: str, shape: Shape, every: int, kill: bool, system: System) -> Run:
    from bench.peer_loop import fit

    out = root / name
    out.mkdir(parents=True)
    watch = DeathWatch(peer_pid(out, 1)) if kill else None
    if watch:
        watch.start()
    result = fit(peer_config(out, shape, every, kill, system), root / "ray-train-storage", name, system.poll_s)
    if watch:
        watch.stop()
    if result.error is not None:
        raise RuntimeError(f"Ray Train run {name} failed: {result.error}")
    reported = [] if result.metrics_dataframe is None else result.metrics_dataframe.to_dict("records")
    return peer_run(out, WORLD, watch.died_at if watch else None, reported)


def one_run(system: System, scratch: Path, name: str, shape: Shape, every: int, kill: bool) -> Run:
    clock = Stopwatch()
    if system in (SPOTRUN, SPOTRUN_SPARE):
        run = spotrun_job(scratch / name, "job", shape, every, kill, system.spares)
    else:
        run = peer_job(scratch, name, shape, every, kill, system)
    print(f"{name} ({system.label}): {clock.seconds:.1f} s", flush=True)  # progress: ~30 runs in all
    return run


def run(shape: Shape, scratch: Path) -> dict:
    """Every repetition runs every configuration once, interleaved: drift in the machine's load hits all alike."""
    import ray

    fair: dict[str, dict[str, list[dict]]] = {str(k): {SPOTRUN.label: [], PEER.label: []} for k in shape.intervals}
    variants: dict[str, list[dict]] = {PEER.label: [], **{v.label: [] for v in VARIANTS}}
    warm: dict[str, list[dict]] = {SPOTRUN.label: [], SPOTRUN_SPARE.label: [], PEER.label: []}
    # spotrun's ranks undo Ray's worker niceness 15 (orchestrator/workers/priority.py); Ray Train's workers
    # get niceness 0 too, as a user can give them, so that neither side yields the CPU to the other.
    os.environ["RAY_worker_niceness"] = "0"
    ray.init(address="local", num_cpus=WORLD + 1, include_dashboard=False, log_to_driver=False,
             logging_level=logging.WARNING)
    try:
        for rep in range(shape.reps):
            refs = {}
            for every in shape.intervals:
                for system in (SPOTRUN, PEER):
                    tag = f"{'spot' if system is SPOTRUN else 'peer'}-{every}-{rep}"
                    ref = refs[(system.label, every)] = one_run(system, scratch, f"{tag}-ref", shape, every, False)
                    killed = one_run(system, scratch, f"{tag}-kill", shape, every, True)
                    cost = checkpoint_figures(ref, every)
                    fair[str(every)][system.label].append(
                        {**restart_figures(killed, ref, shape.kill_at), **cost, "interval_s": every * cost["step_s"]})
            first = shape.intervals[0]
            variants[PEER.label].append(fair[str(first)][PEER.label][-1])
            for i, system in enumerate(VARIANTS):  # against this repetition's uninterrupted Ray Train run
                killed = one_run(system, scratch, f"variant{i}-{rep}", shape, first, True)
                variants[system.label].append(restart_figures(killed, refs[(PEER.label, first)], shape.kill_at))
            # the spare's run against this repetition's uninterrupted spotrun run (a spare changes no update)
            killed = one_run(SPOTRUN_SPARE, scratch, f"spare-{rep}", shape, first, True)
            warm[SPOTRUN_SPARE.label].append(restart_figures(killed, refs[(SPOTRUN.label, first)], shape.kill_at))
            warm[SPOTRUN.label].append(fair[str(first)][SPOTRUN.label][-1])
            warm[PEER.label].append(fair[str(first)][PEER.label][-1])
    finally:
        ray.shutdown()
        os.environ.pop("RAY_worker_niceness", None)
    return {"shape": shape.__dict__, "fast_poll_s": FAST_POLL_S, "fair": fair, "variants": variants, "warm": warm}


RESTART_ROWS = (
    ("kill_to_next_update_s", "kill → next completed update (s)"),
    ("kill_to_killed_update_s", "kill → the killed update completed (s)"),
    ("resumed_from", "resumed from the checkpoint of update"),
    ("updates_lost", "updates lost (done after that checkpoint, redone)"),
    ("gaps", "occurrence gaps vs the uninterrupted run"),
    ("duplicates", "occurrence duplicates vs the uninterrupted run"),
    ("metric_duplicates_read", "metric points a reader sees twice (same step and name)"),
    ("metric_duplicates_written", "metric points written twice"),
    ("restarts", "restarts"),
)
CHECKPOINT_ROWS = (
    ("interval_s", "checkpoint: time between checkpoints (s, interval × median update)"),
    ("block_s", "checkpoint: loop blocked in the checkpoint call (s, median)"),
    ("extra_updates", "checkpoint: extra time per checkpoint (update-times)"),
    ("step_s", "uninterrupted: median update (s)"),
    ("wall_s", "uninterrupted: update 1 → last update (s)"),
)
# lower is better for each of these: where Ray Train's median is lower, it is ahead
COMPARED = {"kill_to_next_update_s": "kill → next update (s)", "kill_to_killed_update_s": "kill → killed update (s)",
            "updates_lost": "updates lost", "block_s": "loop blocked per checkpoint (s)",
            "extra_updates": "extra time per checkpoint (update-times)", "step_s": "median update (s)",
            "wall_s": "uninterrupted run (s)"}


def spread(values: Sequence) -> str:
    """median (min–max) over the repetitions; one figure when they agree."""
    values = [v for v in values if v is not None]
    if not values:
        return "—"
    lo, mid, hi = min(values), median(values), max(values)
    return fmt(mid) if lo == hi else f"{fmt(mid)} ({fmt(lo)}–{fmt(hi)})"


def _med(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return median(values) if values else None


def tables(results: dict) -> tuple[list[Table], list[str]]:
    fair, shape = results["fair"], results["shape"]
    columns = [""]
    for every in fair:
        columns += [f"spotrun, every {every}", f"Ray Train, every {every}", f"spotrun / Ray Train, every {every}"]
    main = Table(f"The same 2-worker job, rank 1 SIGKILLed at update {shape['kill_at']} of {shape['updates']}: "
                 f"median (min–max) of {shape['reps']} runs each", columns)
    for key, label in (*RESTART_ROWS, *CHECKPOINT_ROWS):
        cells = [label]
        for runs in fair.values():
            s, p = _med(runs[SPOTRUN.label], key), _med(runs[PEER.label], key)
            rel = f"{fmt(s / p)}×" if key.endswith("_s") and s is not None and p else ""
            cells += [spread([r.get(key) for r in runs[SPOTRUN.label]]),
                      spread([r.get(key) for r in runs[PEER.label]]), rel]
        main.add(*cells)
    main.notes += NOTES
    first = next(iter(fair))
    variants = results["variants"]
    settings = Table(f"Ray Train's settings one at a time, checkpoint every {first} updates: median (min–max) of "
                     f"{shape['reps']} runs each", ["", *variants])
    for key, label in RESTART_ROWS:
        settings.add(label, *(spread([r.get(key) for r in runs]) for runs in variants.values()))
    settings.notes.append(f"Ray Train: asynchronous upload, a {results['fast_poll_s']} s controller poll and the "
                          "loader fix, as in the table above; then the loader without the fix (its killed rank's "
                          "forked worker holds the rank's sockets open until PyTorch's 5 s watchdog fires), then "
                          "the default 2 s poll. Gaps and duplicates against the uninterrupted Ray Train run")
    warm = results["warm"]
    spare = Table(f"spotrun with a spare, the same kill, checkpoint every {first} updates: median (min–max) of "
                  f"{shape['reps']} runs each", ["", *warm])
    for key, label in RESTART_ROWS:
        spare.add(label, *(spread([r.get(key) for r in runs]) for runs in warm.values()))
    spare.notes.append("world.spares=1: a third rank process builds the job and waits; the killed rank's place goes "
                       "to it, and rank 0 keeps its process and restores the bundle from its own memory (warm-spare). "
                       "spotrun without a spare and Ray Train are the runs of the first table. Gaps and duplicates "
                       "against the uninterrupted spotrun run")
    return [main, settings, spare], verdicts(results)


NOTES = [
    "spotrun runs with its defaults (no spare: rank 0 keeps its process and the killed rank's place goes to a new "
    "process in its slot, warm-replace; world.restart_backoff_s 0.5 s with jitter; the supervisor polls the ranks "
    "every 0.1 s while a trace is written, as here, and a rank's news, a bundle written or its run ended, ends its "
    "wait at once); "
    "Ray Train with ray.train.report(..., checkpoint_upload_mode=CheckpointUploadMode.ASYNC), "
    f"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S={FAST_POLL_S} (its default is 2 s: second table) and "
    "FailureConfig(max_failures=3), no backoff. Both loops use one DataLoader worker process per rank, which "
    "dies with its rank (PR_SET_PDEATHSIG)",
    "loop blocked in the checkpoint call: wall time on rank 0 from the loop's side. spotrun: the full stall "
    "recorded with each bundle (the previous write finishing, the capture, the manifest draft); Ray Train: "
    "torch.save into a temporary directory plus ray.train.report (the upload and the wait for the controller "
    "run on its background thread). extra time per checkpoint: the step after a checkpoint minus the median "
    "step, in the uninterrupted run",
    "occurrences: spotrun's are token spans of records (epoch/shard:line[start:end]); the Ray Train loop's are "
    "fixed-length chunks of the token stream (epoch/chunk), resumed by skipping the batches of the steps done "
    "in the saved epoch. Each system is compared with its own uninterrupted run, step by step, keeping the "
    "latest attempt of every redone step",
    "metric points as Ray Train keeps them: Result.metrics_dataframe (one row per checkpoint report, every "
    "checkpoint kept); spotrun's: read from its SQLite sink (upserted by <job>/<update>/<name>), written as its "
    "JSONL log keeps every write",
]


def verdicts(results: dict) -> list[str]:
    fair = results["fair"]
    every = list(fair)
    s_next = {k: _med(fair[k][SPOTRUN.label], "kill_to_next_update_s") for k in every}
    p_next = {k: _med(fair[k][PEER.label], "kill_to_next_update_s") for k in every}
    faster = all(s_next[k] is not None and p_next[k] is not None and s_next[k] < p_next[k] for k in every)
    spot_runs = [r for k in every for r in fair[k][SPOTRUN.label]]
    clean = all(r["gaps"] == 0 and r["duplicates"] == 0 and r["metric_duplicates_read"] == 0 for r in spot_runs)
    peer_runs = [r for k in every for r in fair[k][PEER.label]]
    wins = [f"{what}, every {k}: {fmt(p)} vs spotrun {fmt(s)}"
            for k in every for key, what in COMPARED.items()
            if (s := _med(fair[k][SPOTRUN.label], key)) is not None
            and (p := _med(fair[k][PEER.label], key)) is not None and p < s]
    return [
        f"restart faster than Ray Train's (async upload, {results['fast_poll_s']} s poll, loader fix) on the same "
        f"kill: **{'MET' if faster else 'NOT MET'}** (kill → next update, medians: "
        + "; ".join(f"every {k}: spotrun {fmt(s_next[k])} s, Ray Train {fmt(p_next[k])} s" for k in every) + ")",
        f"0 gaps and 0 duplicates: **{'MET' if clean else 'NOT MET'}** (spotrun, {len(spot_runs)} killed runs: "
        f"{sum(r['gaps'] for r in spot_runs)} gaps, {sum(r['duplicates'] for r in spot_runs)} duplicate "
        f"occurrences, {sum(r['metric_duplicates_read'] for r in spot_runs)} duplicate metric points read; "
        f"Ray Train, {len(peer_runs)} killed runs: {sum(r['gaps'] for r in peer_runs)} gaps, "
        f"{sum(r['duplicates'] for r in peer_runs)} duplicate occurrences, "
        f"{sum(r['metric_duplicates_read'] for r in peer_runs)} duplicate metric points reported)",
        "where Ray Train is ahead (lower median): " + ("; ".join(wins) if wins else "nowhere in this run"),
        *_spare_verdict(results),
    ]


def _spare_verdict(results: dict) -> list[str]:
    warm = results.get("warm")
    if not warm:
        return []
    s, p = _med(warm[SPOTRUN_SPARE.label], "kill_to_next_update_s"), _med(warm[PEER.label], "kill_to_next_update_s")
    runs = warm[SPOTRUN_SPARE.label]
    clean = all(r["gaps"] == 0 and r["duplicates"] == 0 and r["metric_duplicates_read"] == 0 for r in runs)
    return [f"with a spare (warm-spare), kill → next update: spotrun {fmt(s)} s, Ray Train {fmt(p)} s "
            f"({fmt(p / s) if s and p else '—'}× as long), {len(runs)} killed runs with "
            f"{'0 gaps and 0 duplicates' if clean else 'GAPS OR DUPLICATES'}"]


def intro(shape: Shape) -> str:
    return f"""The same job — spotrun's `tiny` model (1-layer char GPT), AdamW, a global batch of 2 workers ×
4 sequences × 2 accumulation steps of 33 tokens, the `configs/data/tiny` records — on spotrun
(`run_on_ray`, its defaults) and on Ray Train's `TorchTrainer` set up at its best (bench/peer_loop.py:
asynchronous checkpoint upload, a {FAST_POLL_S} s controller poll, DataLoader workers that die with their rank,
an exact resume of the data position), on one local Ray instance. Rank 1's process is SIGKILLed at
the start of update {shape.kill_at} of {shape.updates} in each killed run, with checkpoints every
{shape.intervals[0]} updates (inside Ray Train's {FAST_POLL_S} s poll) and every {shape.intervals[-1]} \
(several polls apart)."""


def main(argv: Sequence[str] | None = None) -> None:
    args = cli(__doc__.splitlines()[0], argv)
    clock = Stopwatch()
    shape = QUICK if args.quick else FULL
    with work_folder("sidebyside") as folder:
        results = run(shape, folder)
    tabs, verdict_lines = tables(results)
    Section("4-ray-train-side-by-side", "4. Ray Train side by side", intro(shape), tabs, verdict_lines, clock.seconds,
            results, clock.measured).emit(args.out)


if __name__ == "__main__":
    main()
