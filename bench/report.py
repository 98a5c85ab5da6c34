"""Assemble bench/RESULTS.md: the machine, the date, the targets, then each bench's section."""

from __future__ import annotations

import json
from pathlib import Path

from bench.machine import describe
from bench.tables import WORK

SECTIONS = ("1-checkpoint-stall", "2-training-overhead", "3-restart-cost", "4-ray-train-side-by-side")

HEADER = """# spotrun benchmarks

Written by `make bench` (bench/__main__.py runs bench/checkpoint_stall.py, training_overhead.py,
restart_cost.py and ray_train_side_by_side.py, each in its own process). Every figure that matters
is a ratio against a baseline measured in the same process and run: the machine is shared and
noisy, so the absolute times in these tables are context, not comparable across runs.
"""


def assemble(results: Path, target: Path, total_seconds: float | None, failed: list[str]) -> str:
    machine = describe(WORK)
    if total_seconds is not None:
        machine["`make bench` wall time"] = f"{total_seconds / 60:.1f} min"
    sections, verdicts = [], []
    for name in SECTIONS:
        md, js = results / f"{name}.md", results / f"{name}.json"
        if name in failed or not md.exists():
            sections.append(f"## {name}\n\n_This bench did not complete in the last run; see its output._\n")
            continue
        sections.append(md.read_text())
        verdicts += json.loads(js.read_text()).get("verdicts", [])
    parts = [HEADER, "| machine | |", "| --- | --- |", *(f"| {k} | {v} |" for k, v in machine.items()), ""]
    if verdicts:
        parts += ["## Targets at a glance", "", *(f"- {v}" for v in verdicts), ""]
    parts += sections
    text = "\n".join(parts).rstrip() + "\n"
    target.write_text(text)
    return text
