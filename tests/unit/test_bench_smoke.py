"""The benchmarks still run: each bench script in its tiny ``--quick`` mode (no timing is asserted).

The Ray parts (restart breakdown, Ray Train side by side) need a local Ray instance and half a
minute each, so here the restart bench runs without them and the side-by-side comparison's
arithmetic (gaps, duplicates, lost updates, checkpoint cost, verdicts) runs on made-up runs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest

from bench.report import assemble
from bench.runs import Run, Step, checkpoint_figures, restart_figures
from tests.conftest import ROOT


@pytest.mark.parametrize("module, extra", [
    ("bench.checkpoint_stall", []),
    ("bench.training_overhead", []),
    ("bench.restart_cost", ["--no-ray"]),
    ("bench.steady_speed", ["--json"]),
    ("bench.trace_cost", []),
    ("bench.sharded_bundles", []),
    ("bench.auto_interval", []),
    ("bench.data_identity", []),
])
def test_bench_runs_in_quick_mode(tmp_path, module, extra):
    r = subprocess.run([sys.executable, "-m", module, "--quick", "--out", str(tmp_path), *extra],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    section = next(tmp_path.glob("*.json"))
    data = json.loads(section.read_text())
    md = section.with_suffix(".md").read_text()
    assert data["title"] and md.startswith(f"<!-- section: {section.stem} -->\n## ")
    assert "_Measured " in md and " cores, " in md  # each section says when and on what it ran
    assemble(tmp_path, tmp_path / "RESULTS.md", 1.0, [], ran=(section.stem,))
    assert md in (tmp_path / "RESULTS.md").read_text()
    if "--json" in extra:  # the last line of stdout is the document, one row per job and world size
        rows = json.loads(r.stdout.strip().splitlines()[-1])["jobs"]
        assert rows and {"name", "world_size", "plain_updates_per_s", "spotrun_updates_per_s", "ratio"} <= set(rows[0])
        assert rows[0]["ratio"] == pytest.approx(rows[0]["spotrun_updates_per_s"] / rows[0]["plain_updates_per_s"])


def test_steady_speed_ratios_are_paired_and_verdicts_name_the_jobs_below_target():
    """Each repetition's spotrun rate over the same round's plain (or Ray Train) rate, the median of
    those; a job below 98 % is named in the verdict, and a job without a Ray Train run has no such ratio."""
    from bench.steady_speed import PLAIN, RAY_TRAIN, SPOTRUN, summary, tables

    results = {"shape": {"timed": 150, "warmup": 10, "reps": 3}, "uptime_before": "u0", "uptime_after": "u1",
               "rates": {"tiny/2": {PLAIN: [100.0, 50.0, 80.0], SPOTRUN: [99.0, 49.0, 60.0],
                                    RAY_TRAIN: [90.0, 45.0, 80.0]},
                         "digits/1": {PLAIN: [200.0, 200.0, 200.0], SPOTRUN: [198.0, 199.0, 197.0]}}}
    rows = {(r["name"], r["world_size"]): r for r in summary(results)}
    assert rows["tiny", 2]["ratio"] == pytest.approx(0.98)  # median of 0.99, 0.98, 0.75: not 79 / 80
    assert rows["tiny", 2]["ratio_vs_ray_train"] == pytest.approx(49 / 45)
    assert "ratio_vs_ray_train" not in rows["digits", 1] and rows["digits", 1]["ratio"] == pytest.approx(0.99)
    table, verdicts = tables(results)
    assert "**MET**" in verdicts[0] and "**MET**" in verdicts[1]
    results["rates"]["digits/1"][SPOTRUN] = [150.0, 190.0, 190.0]
    _, verdicts = tables(results)
    assert "**NOT MET** (digits ×1 95.0 %)" in verdicts[0]
    assert "uptime before: u0" in table.notes[1]


def test_the_cpu_meter_counts_the_cpu_time_spent_between_two_stamps_of_either_clock():
    """A thread that spins for 0.3 s of its own CPU time between two stamps: the machine was busy for at
    least that long between them (less a tick at each end), by wall-clock and by monotonic stamps."""
    import os
    import time

    from bench.observe import CpuMeter

    with CpuMeter(every_s=0.01) as meter:
        time.sleep(0.05)  # samples before the first stamp
        wall0, mono0, cpu0 = time.time(), time.perf_counter(), time.thread_time()
        while time.thread_time() - cpu0 < 0.3:
            pass
        wall1, mono1, spun = time.time(), time.perf_counter(), time.thread_time() - cpu0
        time.sleep(0.05)
    tick = 1 / os.sysconf("SC_CLK_TCK")  # /proc/stat's unit
    assert meter.busy_seconds(wall0, wall1) >= spun - 3 * tick
    assert meter.busy_seconds(mono0, mono1, monotonic=True) >= spun - 3 * tick
    with pytest.raises(ValueError, match="not inside the samples"):
        meter.busy_seconds(wall0 - 60, wall1)


def _run(steps: list[tuple[int, int, float, list[str]]], killed_at=None, restarts=0, upsert=True) -> Run:
    runs = [Step(s, a, t, ids) for s, a, t, ids in steps]
    written = Counter((s.step, "loss") for s in runs)
    read = Counter({k: 1 for k in written}) if upsert else written
    return Run(runs, read, written, [0.01, 0.02, 0.03], killed_at, restarts)


def test_side_by_side_figures_count_gaps_duplicates_and_lost_updates():
    """6 steps of 2 ids, checkpoint every 2, killed before step 5: step 5 and 6 redone after a restore
    at step 4 (spotrun-like, exact), or from the start of the data (a naive resume)."""
    ids = {s: [f"0/{2 * s}", f"0/{2 * s + 1}"] for s in range(1, 7)}
    done = {1: 1.0, 2: 2.0, 3: 3.5, 4: 4.5, 5: 6.0, 6: 7.0}  # the step after each checkpoint takes 1.5, others 1
    ref = _run([(s, 1, done[s], ids[s]) for s in range(1, 7)])
    exact = _run([(s, 1, float(s), ids[s]) for s in range(1, 5)]
                 + [(s, 2, 10.0 + s, ids[s]) for s in (3, 4, 5, 6)], killed_at=5.0, restarts=1)
    naive = _run([(s, 1, float(s), ids[s]) for s in range(1, 5)]
                 + [(s, 2, 10.0 + s, ids[s - 4]) for s in (5, 6)], killed_at=5.0, restarts=1, upsert=False)
    f = restart_figures(exact, ref, kill_at=5)
    assert (f["gaps"], f["duplicates"], f["updates_lost"], f["kill_to_next_update_s"]) == (0, 0, 2, 8.0)
    assert f["resumed_from"] == 2
    assert f["kill_to_killed_update_s"] == 10.0 and f["metric_duplicates_read"] == 0
    assert f["metric_duplicates_written"] == 2
    g = restart_figures(naive, ref, kill_at=5)
    assert (g["gaps"], g["duplicates"], g["updates_lost"]) == (4, 4, 0)
    c = checkpoint_figures(ref, every=2)
    assert c["extra_updates"] == pytest.approx(0.5) and c["wall_s"] == 6.0


def test_side_by_side_tables_give_spread_ratios_and_where_ray_train_is_ahead():
    from bench.ray_train_side_by_side import (
        CHECKPOINT_ROWS,
        PEER,
        RESTART_ROWS,
        SPOTRUN,
        SPOTRUN_SPARE,
        VARIANTS,
        tables,
    )

    def figures(next_s: float, step_s: float) -> dict:
        return {"kill_to_next_update_s": next_s, "kill_to_killed_update_s": next_s + 0.1, "resumed_from": 10,
                "updates_lost": 6, "gaps": 0, "duplicates": 0, "metric_duplicates_read": 0,
                "metric_duplicates_written": 18, "restarts": 1, "block_s": 0.001, "extra_updates": 0.5,
                "step_s": step_s, "wall_s": 100 * step_s, "interval_s": 10 * step_s}

    spot = [figures(t, 0.019) for t in (4.0, 3.5, 5.0)]
    peer = [figures(t, 0.0115) for t in (7.0, 8.0, 7.5)]
    results = {"shape": {"updates": 100, "kill_at": 77, "reps": 3}, "fast_poll_s": 0.2,
               "fair": {"10": {SPOTRUN.label: spot, PEER.label: peer}},
               "variants": {PEER.label: peer, **{v.label: peer for v in VARIANTS}},
               "warm": {SPOTRUN.label: spot, SPOTRUN_SPARE.label: [figures(t, 0.019) for t in (0.5, 0.3, 0.4)],
                        PEER.label: peer}}
    (main, settings, spare), verdicts = tables(results)
    rows = {r[0]: r[1:] for r in main.rows}
    assert len(main.rows) == len(RESTART_ROWS) + len(CHECKPOINT_ROWS) and len(settings.rows) == len(RESTART_ROWS)
    assert rows["kill → next completed update (s)"] == ["4.00 (3.50–5.00)", "7.50 (7.00–8.00)", "0.533×"]
    assert rows["updates lost (done after that checkpoint, redone)"] == ["6", "6", ""]
    assert "**MET**" in verdicts[0] and "spotrun 4.00 s, Ray Train 7.50 s" in verdicts[0]
    assert "**MET**" in verdicts[1]
    # Ray Train's uninterrupted updates are faster here: the verdicts say so
    assert "median update (s), every 10: 0.0115 vs spotrun 0.0190" in verdicts[2]
    assert "kill → next update" not in verdicts[2]
    # with a spare: its own table and verdict, against the same Ray Train runs
    assert [r[1:] for r in spare.rows][0] == ["4.00 (3.50–5.00)", "0.400 (0.300–0.500)", "7.50 (7.00–8.00)"]
    assert "spotrun 0.400 s, Ray Train 7.50 s (18.8× as long), 3 killed runs with 0 gaps" in verdicts[3]


SECTION = """<!-- section: {name} -->
## {title}

Some {what} text.

Targets:

- {what} target: **MET** (42 %)

_Measured {when}; this bench ran in 9 s._
"""


def _section(name: str, what: str, when: str) -> str:
    return SECTION.format(name=name, title=name, what=what, when=when)


def test_a_partial_run_keeps_the_other_sections_as_they_were(tmp_path):
    """`python -m bench --only 2-training-overhead`: section 2 is new, every other section keeps its text
    and its own date; the targets at a glance come from every section; a failed bench keeps its last
    complete section, saying so."""
    from bench.report import SECTIONS, assemble, sections_of

    target = tmp_path / "RESULTS.md"
    assemble_old = tmp_path / "old"
    assemble_old.mkdir()
    for name in SECTIONS:
        (assemble_old / f"{name}.md").write_text(_section(name, f"old {name}", "2026-11-29"))
    assemble(assemble_old, target, 300.0, [])
    before = sections_of(target.read_text())
    new = tmp_path / "new"
    new.mkdir()
    (new / "2-training-overhead.md").write_text(_section("2-training-overhead", "new", "2026-12-01"))
    text = assemble(new, target, None, ["3-restart-cost"], ran=("2-training-overhead", "3-restart-cost"))
    after = sections_of(text)
    assert after["1-checkpoint-stall"] == before["1-checkpoint-stall"]
    assert after["4-ray-train-side-by-side"] == before["4-ray-train-side-by-side"]
    assert "2026-12-01" in after["2-training-overhead"] and "2026-11-29" not in after["2-training-overhead"]
    assert "did not complete in the latest run" in after["3-restart-cost"]
    assert "2026-11-29" in after["3-restart-cost"]
    assert "- new target: **MET** (42 %)" in text and "- old 1-checkpoint-stall target" in text
    assert "The last full `make bench` took 5.0 min." in text  # from the full run, not this partial one


def test_the_readme_quotes_only_what_results_holds():
    """The README's block is what `make bench` writes from the committed bench/RESULTS.md, and no
    percentage or ratio elsewhere in its Performance section is missing from RESULTS.md."""
    from bench.readme import BEGIN, END, block, figures_missing

    readme, results = (ROOT / "README.md").read_text(), (ROOT / "bench/RESULTS.md").read_text()
    assert readme[readme.index(BEGIN):readme.index(END) + len(END)] == block(results)
    assert figures_missing(readme, results) == []
    assert figures_missing(readme.replace(END, END + "\nspotrun is 2,400× faster."), results) == ["2,400×"]
