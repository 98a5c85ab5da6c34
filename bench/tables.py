"""Tables printed with rich and written as markdown, and the per-bench result sections.

Each bench writes its section (markdown + the raw numbers as JSON) under a
results folder; :mod:`bench.report` assembles ``bench/RESULTS.md`` from them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table as RichTable

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
WORK = BENCH / ".work"
DEFAULT_RESULTS = WORK / "results"


@contextmanager
def work_folder(prefix: str) -> Iterator[Path]:
    """A bench's working folder on the repository's disk (not /tmp: disk figures must be of the
    disk the bundles go to), removed afterwards."""
    WORK.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=WORK, prefix=f"{prefix}-") as d:
        yield Path(d)


def console_for_output() -> Console:
    """A terminal keeps its width; a pipe or log file gets wide lines instead of wrapped cells."""
    console = Console()
    return console if console.is_terminal else Console(width=160)


@dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, *cells: Any) -> None:
        self.rows.append([c if isinstance(c, str) else fmt(c) for c in cells])

    def print(self, console: Console | None = None) -> None:
        console = console or console_for_output()
        t = RichTable(title=self.title, title_justify="left")
        for i, c in enumerate(self.columns):
            t.add_column(c, justify="left" if i == 0 else "right")
        for row in self.rows:
            t.add_row(*row)
        console.print(t)
        for n in self.notes:
            console.print(f"  [dim]{n}[/dim]")

    def markdown(self) -> str:
        out = [f"**{self.title}**", "", "| " + " | ".join(self.columns) + " |",
               "| " + " | ".join(["---"] + ["---:"] * (len(self.columns) - 1)) + " |"]
        out += ["| " + " | ".join(r) + " |" for r in self.rows]
        if self.notes:
            out.append("")
            out += [f"- {n}" for n in self.notes]
        return "\n".join(out) + "\n"


def fmt(x: Any, digits: int = 3) -> str:
    """A number with ``digits`` significant digits (no scientific notation for ordinary sizes)."""
    if x is None:
        return "—"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        if x != x:
            return "—"
        if x == 0:
            return "0"
        mag = abs(x)
        if mag >= 10 ** digits:
            return f"{x:,.0f}"
        decimals = max(0, digits - 1 - int(f"{mag:e}".split("e")[1]))
        return f"{x:.{decimals}f}"
    return str(x)


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def pct(x: float) -> str:
    return "—" if x != x else f"{100 * x:.1f} %"


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def mib(n: int | float) -> str:
    return f"{n / 2**20:,.1f} MiB"


@dataclass(frozen=True)
class Job:
    """A real job a bench times: its config and overrides, how many updates (the first ``warmup``
    outside the timed window), and how many repetitions."""

    label: str
    config: str
    sets: tuple[str, ...]
    updates: int
    warmup: int
    reps: int


@dataclass
class Section:
    """One bench's part of RESULTS.md."""

    name: str  # file stem, also the order key (e.g. "1-checkpoint-stall")
    title: str
    intro: str
    tables: list[Table]
    verdicts: list[str]  # one line per target: met or not, with the numbers
    seconds: float
    data: dict[str, Any]

    measured: str  # when it started, on what, and the machine's load then (Stopwatch.measured)

    def markdown(self) -> str:
        parts = [f"<!-- section: {self.name} -->", f"## {self.title}", "", self.intro.strip(), ""]
        for t in self.tables:
            parts += [t.markdown()]
        if self.verdicts:
            parts += ["Targets:", ""] + [f"- {v}" for v in self.verdicts] + [""]
        parts.append(f"_Measured {self.measured}; this bench ran in {self.seconds:.0f} s._\n")
        return "\n".join(parts)

    def emit(self, out: Path) -> None:
        console = console_for_output()
        for t in self.tables:
            t.print(console)
        for v in self.verdicts:
            console.print(f"[bold]target[/bold]: {v}")
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{self.name}.md").write_text(self.markdown())
        (out / f"{self.name}.json").write_text(json.dumps(
            {"title": self.title, "seconds": self.seconds, "verdicts": self.verdicts, "data": self.data},
            indent=1, default=str))


def _now_and_machine() -> str:
    """When, on what, and how loaded the machine was: each section of RESULTS.md carries its own."""
    from bench.machine import describe

    m = describe(BENCH)  # the disk the work folders are on
    return (f"{m['date']} on {m['cpu']}, {m['cores']} cores, {m['memory']}, {m['disk']}; kernel {m['kernel']}, "
            f"python {m['python']}, torch {m['torch']}, ray {m['ray']}; load average at start "
            f"{m['load average at start']}")


def cli(description: str, argv: Sequence[str] | None = None, *, json_summary: bool = False) -> argparse.Namespace:
    """The options every bench takes (``json_summary``: also ``--json``, a one-line summary printed last)."""
    p = argparse.ArgumentParser(description=description)
    if json_summary:
        p.add_argument("--json", action="store_true", help="print a one-line JSON summary as the last line")
    p.add_argument("--quick", action="store_true", help="a tiny run that only checks the bench still works")
    p.add_argument("--out", type=Path, default=DEFAULT_RESULTS, help="folder for this bench's result section")
    p.add_argument("--no-ray", action="store_true", help="skip the parts that need a local Ray instance")
    return p.parse_args(argv)


def cli_minutes(description: str, argv: Sequence[str] | None, default: float, what: str,
                quick: float = 0.25) -> tuple[argparse.Namespace, float]:
    """:func:`cli` for a bench that runs for minutes: its options, and the minutes to run (``--minutes``,
    ``what`` saying what lasts that long; ``quick`` under ``--quick``)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--minutes", type=float, default=default, help=what)
    known, rest = p.parse_known_args(argv)
    args = cli(description, rest)
    return args, quick if args.quick else known.minutes


class Stopwatch:
    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.measured = _now_and_machine()

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.t0
