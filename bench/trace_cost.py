"""Bench 7 — what a trace costs per update: the stage digests verify compares, against no trace.

Each job runs in this process (``run_in_process``: the real supervisor, rank runner and
publisher, world size 1), once without a trace and once with the trace ``spotrun verify`` asks
for (``--trace`` with the occurrence ids: per micro-batch the batch and loss digests, per rank
the gradient and parameter digests, one JSON line per update). The rate is taken from the
rank's own metric points between a warm-up update and the last, as in bench 2; no checkpoint
falls inside that window. The two variants run interleaved, ``reps`` rounds; a ratio is the
trace run's rate over the same round's untraced rate. Inside the traced runs every digest
call is timed too, so the table says which stage's digest the cost goes to.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.tables import ROOT, Job, Section, Stopwatch, Table, cli, fmt, median, pct, ratio, work_folder
from spotrun.orchestrator.control.launch import run_in_process
from spotrun.orchestrator.control.specfile import load_spec
from spotrun.trainer.metrics import SqliteSink, metrics_dir
from spotrun.trainer.run import loop

FULL = (
    Job("tiny (1-layer GPT, micro-batch 4 × 2, seq 32)", "configs/tiny.yaml", ("data.workers=1",), 200, 10, 5),
    Job("gpt-char (4-layer GPT, 0.8 M parameters, micro-batch 4 × 1, seq 64)", "configs/gpt-char.yaml",
        ("train.precision=fp32", "train.micro_batch=4", "train.accum_steps=1", "data.seq_len=64",
         "data.workers=1", "train.warmup_updates=10"), 80, 10, 5),
)
QUICK = (Job("tiny", "configs/tiny.yaml", ("data.workers=1",), 12, 3, 1),)
STAGES = ("batch", "loss", "gradient", "parameters")


@contextmanager
def timed_digests() -> Iterator[dict[str, list[float]]]:
    """Time every stage digest the loop takes (seconds per call, by stage) while the block runs."""
    spent: dict[str, list[float]] = defaultdict(list)

    def timing(stage: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            spent[stage].append(time.perf_counter() - t0)
            return out
        return wrapped

    saved = loop.digest_batch, loop.digest_tensors, loop.TrainLoop.grad_digest, loop.TrainLoop.params_digest
    timed_loss = timing("loss", saved[1])

    def digest_tensors(named: Any) -> str:  # the gradient and parameter digests call it too: time the loss's
        return timed_loss(named) if list(named) == ["loss"] else saved[1](named)

    loop.digest_batch = timing("batch", saved[0])
    loop.digest_tensors = digest_tensors
    loop.TrainLoop.grad_digest = timing("gradient", saved[2])  # type: ignore[method-assign]
    loop.TrainLoop.params_digest = timing("parameters", saved[3])  # type: ignore[method-assign]
    try:
        yield spent
    finally:
        loop.digest_batch, loop.digest_tensors, loop.TrainLoop.grad_digest, loop.TrainLoop.params_digest = saved


def run_once(job: Job, traced: bool, root: Path, tag: str) -> dict:
    job_id = f"trace-{tag}"
    shards = ROOT / "configs/data" / Path(job.config).stem
    spec = load_spec(ROOT / job.config, [
        f"storage=file://{root}", f"data.shards={shards}", f"train.updates={job.updates}",
        f"checkpoint.every_updates={job.updates + 1}", *job.sets], job_id)
    with timed_digests() as spent:
        outcome = run_in_process(spec, trace_path=str(root / "trace.jsonl") if traced else None,
                                 record_ids=traced)
    if outcome.state != "finished":
        raise RuntimeError(f"{job_id} ended {outcome.state}: {outcome.reason}")
    sink = SqliteSink(metrics_dir(spec.storage, job_id, spec.metrics.local_dir) / "metrics.sqlite")
    at = {p.update: p.at.timestamp() for p in sink.read(job_id) if p.name == "loss"}
    sink.close()
    per_update = {stage: sum(spent[stage]) / job.updates for stage in STAGES}
    return {"updates_per_s": (job.updates - job.warmup) / (at[job.updates] - at[job.warmup]),
            "digest_s_per_update": per_update}


def run(jobs: Sequence[Job], scratch: Path) -> dict[str, dict]:
    results: dict[str, dict] = {}
    for j, job in enumerate(jobs):
        runs: dict[str, list[dict]] = {"off": [], "on": []}
        for rep in range(job.reps):
            for variant in ("off", "on"):  # interleaved: drift in the machine's load hits both alike
                runs[variant].append(run_once(job, variant == "on", scratch / f"j{j}-{variant}-{rep}",
                                              f"{j}-{variant}-{rep}"))
        results[job.label] = {"updates": job.updates, "warmup": job.warmup, "reps": job.reps, "runs": runs}
    return results


def spread(xs: Sequence[float]) -> str:
    return f"{fmt(min(xs))} / {fmt(median(xs))} / {fmt(max(xs))}"


def tables(results: dict[str, dict]) -> tuple[list[Table], dict]:
    t = Table("Updates per second with the verify trace on, relative to no trace",
              ["job", "updates/s, no trace (min / median / max)", "updates/s, trace on (min / median / max)",
               "trace on / off (min / median / max)", *(f"{s} digest, % of an update" for s in STAGES)])
    summary: dict = {}
    for label, r in results.items():
        off = [x["updates_per_s"] for x in r["runs"]["off"]]
        on = [x["updates_per_s"] for x in r["runs"]["on"]]
        ratios = [ratio(a, b) for a, b in zip(on, off, strict=True)]
        update_s = 1 / median(off)
        shares = {s: median([x["digest_s_per_update"][s] for x in r["runs"]["on"]]) / update_s for s in STAGES}
        t.add(label, spread(off), spread(on), f"{pct(min(ratios))} / {pct(median(ratios))} / {pct(max(ratios))}",
              *(pct(shares[s]) for s in STAGES))
        summary[label] = {"ratio_median": median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
                          "digest_share_of_update": shares}
    t.notes += [
        "trace on = what spotrun verify records: --trace with --trace-ids (occurrence ids, and the batch, loss, "
        "gradient and parameter digests of every update); each round runs both variants, a ratio is the "
        "round's traced rate over its untraced rate",
        "digest shares: the median (over rounds) of the seconds the loop spent in each stage's digest per update, "
        "over the untraced run's median seconds per update; the parameter digest was already taken before "
        "the stage digests (trace version 1), the other three are new",
    ]
    return [t], summary


INTRO = """Real jobs through `run_in_process` (world size 1), without a trace and with the trace
`spotrun verify` records (`--trace --trace-ids`): the occurrence ids, and per update the stage
digests (sha256 of the batch every micro-batch the model receives, of its loss, of the gradient
the optimizer step is given and of the parameters after it). No checkpoint inside the timed window."""


def main(argv: Sequence[str] | None = None) -> None:
    args = cli(__doc__.splitlines()[0], argv)
    clock = Stopwatch()
    with work_folder("trace") as folder:
        results = run(QUICK if args.quick else FULL, folder)
    tabs, summary = tables(results)
    Section("7-trace-cost", "7. What the verify trace costs per update", INTRO, tabs, [], clock.seconds,
            {"results": results, "summary": summary}, clock.measured).emit(args.out)


if __name__ == "__main__":
    main()
