"""Assemble bench/RESULTS.md: the machine, the targets, then each bench's section, each with its own date.

A run of some benches only (``python -m bench --only ...``) replaces those benches' sections and keeps
every other section as the previous RESULTS.md had it, with the date it was measured on: a section is
never relabelled with a date it was not measured on. Each section starts with a marker naming it.
"""

from __future__ import annotations

import re
from pathlib import Path

SECTIONS = ("1-checkpoint-stall", "2-training-overhead", "3-restart-cost", "4-ray-train-side-by-side", "5-grad-sync",
            "6-s3-metrics", "7-trace-cost", "8-steady-speed", "9-sharded-bundles", "10-ledger-week",
            "11-auto-interval", "12-data-identity", "13-health-poll", "14-false-alarms",
            "15-hang-recovery", "16-storage-outage", "17-endurance", "18-week-page",
            "19-week-history", "20-trace-goodput")
MARKER = "<!-- section: {} -->"
_MARKED = re.compile(r"^<!-- section: ([\w-]+) -->$", re.M)

HEADER = """# spotrun benchmarks

Written by `make bench` (bench/__main__.py runs bench/checkpoint_stall.py, training_overhead.py,
restart_cost.py, ray_train_side_by_side.py, grad_sync.py, s3_metrics.py, trace_cost.py, steady_speed.py,
sharded_bundles.py, ledger_week.py, auto_interval.py, data_identity.py, health_poll.py, false_alarms.py,
hang_recovery.py, storage_outage.py, endurance.py, week_page.py, week_history.py and trace_goodput.py, each
in its own process;
`--only NAME...` reruns some and keeps the others' sections). Every figure that matters is a ratio
against a baseline measured in the same process and run: the machine is shared and noisy, so the
absolute times in these tables are context, not comparable across runs. Each section says when and on
what it was measured.
"""
WALL = "The last full `make bench` took "  # the header's line on the whole run's wall time


def sections_of(text: str) -> dict[str, str]:
    """The marked sections of a RESULTS.md, by name (each from its marker to the next)."""
    marks = list(_MARKED.finditer(text))
    return {m.group(1): text[m.start():marks[i + 1].start() if i + 1 < len(marks) else len(text)].rstrip() + "\n"
            for i, m in enumerate(marks)}


def targets_of(section: str) -> list[str]:
    """The section's verdict lines (the bullets after its ``Targets:`` line)."""
    _, found, rest = section.partition("\nTargets:\n")
    return [line[2:] for line in rest.strip().splitlines() if line.startswith("- ")] if found else []


def assemble(results: Path, target: Path, total_seconds: float | None, failed: list[str],
             ran: tuple[str, ...] = SECTIONS) -> str:
    """Write ``target`` from the sections of the benches in ``ran`` (their files under ``results``) and,
    for every other bench, its section in the existing ``target``."""
    old = target.read_text() if target.exists() else ""
    previous = sections_of(old)
    wall = next((line for line in old.splitlines() if line.startswith(WALL)), None)
    if total_seconds is not None:
        wall = f"{WALL}{total_seconds / 60:.1f} min."
    sections = [_section(name, results, previous.get(name), name in ran, name in failed) for name in SECTIONS]
    verdicts = [v for s in sections for v in targets_of(s)]
    parts = [HEADER, *([wall, ""] if wall else [])]
    if verdicts:
        parts += ["## Targets at a glance", "", *(f"- {v}" for v in verdicts), ""]
    parts += sections
    text = "\n".join(parts).rstrip() + "\n"
    target.write_text(text)
    return text


def _section(name: str, results: Path, previous: str | None, ran: bool, failed: bool) -> str:
    md = results / f"{name}.md"
    if ran and not failed and md.exists():
        return md.read_text()
    if previous is not None:
        if not ran:
            return previous
        marker, heading, body = previous.split("\n", 2)
        return (f"{marker}\n{heading}\n\n_This bench did not complete in the latest run; this section is from "
                f"its last complete run._\n{body}")
    return f"{MARKER.format(name)}\n## {name}\n\n_This bench has not completed yet; see its output._\n"
