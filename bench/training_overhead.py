"""Bench 2 — updates per second with checkpoints every 1, 10 and 100 updates, versus none.

Each job runs in this process (``run_in_process``, world size 1, the real
supervisor, rank runner, background writer and publisher). The rate is taken
from the rank's own metric points (one timestamped point per update in the
default SQLite sink) between a warm-up update and the last update, so start-up
and the final checkpoint at the end of the job are outside the window.
"No checkpoints" sets ``checkpoint.every_updates`` above the run length. The
variants run interleaved, and every ratio is against the no-checkpoint runs of
the same bench.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from bench.tables import ROOT, Job, Section, Stopwatch, Table, cli, fmt, median, pct, ratio, work_folder
from spotrun.orchestrator.control.launch import run_in_process
from spotrun.orchestrator.control.specfile import load_spec
from spotrun.orchestrator.ledger.events import BundlePublished
from spotrun.orchestrator.ledger.store import Ledger
from spotrun.trainer.metrics import SqliteSink, metrics_dir
from spotrun.trainer.storage import open_storage

FULL = (
    Job("tiny (1-layer GPT, micro-batch 4 × 2)", "configs/tiny.yaml", ("data.workers=1",), 300, 10, 3),
    Job("gpt-char (4-layer GPT, micro-batch 4 × 1, seq 64)", "configs/gpt-char.yaml",
        ("train.precision=fp32", "train.micro_batch=4", "train.accum_steps=1", "data.seq_len=64",
         "data.workers=1", "train.warmup_updates=10"), 200, 10, 2),
)
QUICK = (Job("tiny", "configs/tiny.yaml", ("data.workers=1",), 24, 3, 1),)
EVERY = (None, 1, 10, 100)
QUICK_EVERY = (None, 1, 10)


def run_once(job: Job, every: int | None, root: Path, tag: str) -> dict:
    """One job to its end; its update rate inside the window, and what its checkpoints cost."""
    job_id = f"ovh-{tag}"
    shards = ROOT / "configs/data" / Path(job.config).stem
    spec = load_spec(ROOT / job.config, [
        f"storage=file://{root}", f"data.shards={shards}", f"train.updates={job.updates}",
        f"checkpoint.every_updates={every or job.updates + 1}", *job.sets], job_id)
    outcome = run_in_process(spec)
    if outcome.state != "finished":
        raise RuntimeError(f"{job_id} ended {outcome.state}: {outcome.reason}")
    sink = SqliteSink(metrics_dir(spec.storage, job_id, spec.metrics.local_dir) / "metrics.sqlite")
    at = {p.update: p.at.timestamp() for p in sink.read(job_id) if p.name == "loss"}
    sink.close()
    seconds = at[job.updates] - at[job.warmup]
    published = [e for e in Ledger(open_storage(spec.storage), job_id).read() if isinstance(e, BundlePublished)]
    inside = [e for e in published if job.warmup <= e.update < job.updates]
    return {
        "updates_per_s": (job.updates - job.warmup) / seconds,
        "step_s": {u: at[u] - at[u - 1] for u in range(job.warmup + 1, job.updates + 1)},
        "checkpoints_in_window": len(inside),
        "stall_s": median([e.stall_seconds for e in inside]),
        "capture_s": median([e.capture_seconds for e in inside]),
        "write_s": median([e.write_seconds for e in inside]),
        "bundle_bytes": median([e.bytes for e in inside]),
    }


def run(jobs: Sequence[Job], every_set: Sequence[int | None], scratch: Path) -> dict[str, dict]:
    results: dict[str, dict] = {}
    for j, job in enumerate(jobs):
        runs: dict[str, list[dict]] = {str(e): [] for e in every_set}
        for rep in range(job.reps):
            for every in every_set:  # interleaved: drift in the machine's load hits every variant alike
                runs[str(every)].append(run_once(job, every, scratch / f"j{j}-{every}-{rep}", f"{j}-{every}-{rep}"))
        results[job.label] = {"updates": job.updates, "warmup": job.warmup, "reps": job.reps, "runs": runs}
    return results


def checkpoint_cost(run: dict, baseline: dict, every: int) -> float:
    """Update-times one checkpoint costs, from the update intervals (medians: robust to bursts of
    load from elsewhere). Every interval holds at most one checkpoint: the one at the update that
    opened it. At every=1 each interval holds one, so the baseline is the no-checkpoint run's
    median interval; otherwise the run's own intervals far from a checkpoint are, and a
    checkpoint's cost is the excess of the ``window`` intervals after it (its stall, its publish,
    its background write competing for the cores)."""
    steps = run["step_s"]
    if every == 1:
        return median(list(steps.values())) / median(list(baseline["step_s"].values())) - 1
    window = min(every - 1, 5)
    last = max(steps)
    ckpts = [u - 1 for u in steps if (u - 1) % every == 0 and u - 1 + window <= last]
    near = {c + j for c in ckpts for j in range(1, window + 1)} | {u for u in steps if (u - 1) % every == 0}
    plain = median([dt for u, dt in steps.items() if u not in near])
    return median([sum(steps[c + j] for j in range(1, window + 1)) / plain - window for c in ckpts])


def tables(results: dict[str, dict]) -> tuple[list[Table], dict]:
    t = Table("Training throughput with checkpoints, relative to the same job without",
              ["job", "checkpoint every", "updates/s vs none", "cost per checkpoint (update-times)",
               "throughput that cost implies", "stall per checkpoint (update-times)",
               "of which capture (update-times)", "checkpoints timed", "bundle"])
    summary: dict = {}
    for label, r in results.items():
        baselines = [x["updates_per_s"] for x in r["runs"]["None"]]
        base = median(baselines)
        t.add(label, "never", "100 %", "—", "—", "—", "—", 0, "—")
        for every, runs in r["runs"].items():
            if every == "None":
                continue
            # paired: each repetition against the no-checkpoint run of the same round
            rel = median([ratio(x["updates_per_s"], b) for x, b in zip(runs, baselines, strict=True)])
            cost = median([checkpoint_cost(x, b, int(every)) for x, b in zip(runs, r["runs"]["None"], strict=True)])
            stall = median([x["stall_s"] for x in runs]) * base
            capture = median([x["capture_s"] for x in runs]) * base
            nbytes = median([x["bundle_bytes"] for x in runs])
            t.add("", every, pct(rel), fmt(cost), pct(1 / (1 + cost / int(every))), fmt(stall), fmt(capture),
                  int(median([x["checkpoints_in_window"] for x in runs])), f"{nbytes / 1e6:.2f} MB")
            summary.setdefault(label, {})[every] = {"relative_rate": rel, "cost_per_checkpoint_updates": cost}
        summary.setdefault(label, {})["baseline_updates_per_s"] = base
    t.notes += [
        "updates/s vs none: the mean rate over the timed window, so one burst of load from elsewhere moves it; "
        "cost per checkpoint: from the update intervals' medians (see checkpoint_cost), robust to such bursts. "
        "A checkpoint costing c update-times slows training to about 1 / (1 + c / k) at an interval of k",
        "stall per checkpoint = the median stall recorded with each bundle (all the loop waited for: the "
        "previous write finishing, the capture, the manifest draft) × the baseline rate, in update-times; "
        "of which capture: the host copy alone",
        "each repetition is a round of every variant; a ratio is the median over rounds of the variant's rate "
        "over the same round's no-checkpoint rate. The first updates (warm-up) and the job's final "
        "checkpoint are outside the timed window",
    ]
    return [t], summary


INTRO = """Real jobs through `run_in_process` (supervisor, rank runner, background bundle writer,
publisher with retention `keep_last: 3`) at checkpoint intervals of 1, 10 and 100 updates,
against the same job with no checkpoint inside the timed window. A checkpoint's cost is the
stall (the wait when the next checkpoint comes before the previous write finished — at most one
write is in flight —, the host copy, the manifest draft) plus the background write competing with
training for the two cores."""


def main(argv: Sequence[str] | None = None) -> None:
    args = cli(__doc__.splitlines()[0], argv)
    clock = Stopwatch()
    with work_folder("overhead") as folder:
        results = run(QUICK if args.quick else FULL, QUICK_EVERY if args.quick else EVERY, folder)
    tabs, summary = tables(results)
    Section("2-training-overhead", "2. Training overhead of checkpointing", INTRO, tabs, [], clock.seconds,
            {"results": results, "summary": summary}, clock.measured).emit(args.out)


if __name__ == "__main__":
    main()
