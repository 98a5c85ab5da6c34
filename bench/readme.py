"""The README's benchmark figures, copied from bench/RESULTS.md so that the two never disagree.

The README's Performance section holds a block between ``BEGIN`` and ``END`` markers; ``make bench``
rewrites it from the latest RESULTS.md: the targets at a glance, verbatim, each section of RESULTS.md
saying when it was measured. Figures outside the block must be ones RESULTS.md holds too
(:func:`figures_missing` checks it; the tests run it).
"""

from __future__ import annotations

import re
from pathlib import Path

from bench.report import sections_of, targets_of
from bench.tables import ROOT

README = ROOT / "README.md"
BEGIN, END = "<!-- bench:begin (written by make bench from bench/RESULTS.md) -->", "<!-- bench:end -->"
_FIGURE = re.compile(r"\d[\d,.]*\s?(?:%|×)")  # a percentage or a ratio


def block(results: str) -> str:
    """What the README quotes from ``results`` (RESULTS.md's text)."""
    lines = [BEGIN, "", "Targets, as the latest [bench/RESULTS.md](bench/RESULTS.md) has them (each section there "
             "says when it was measured):", ""]
    lines += [f"- {v}" for s in sections_of(results).values() for v in targets_of(s)]
    return "\n".join([*lines, "", END])


def update_readme(readme: Path, results: str) -> None:
    """Replace the README's block with one built from ``results``; refuses a README without the markers."""
    text = readme.read_text()
    if BEGIN not in text or END not in text:
        raise ValueError(f"{readme} has no {BEGIN} ... {END} block in its Performance section: add one")
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    readme.write_text(head + block(results) + tail)


def performance(readme: str) -> str:
    """The README's Performance section."""
    return readme.split("## Performance", 1)[1].split("\n## ", 1)[0] if "## Performance" in readme else ""


def figures_missing(readme: str, results: str) -> list[str]:
    """Percentages and ratios the README's Performance section quotes that ``results`` does not hold."""
    held = results.replace(" ", "")
    return sorted({f for f in _FIGURE.findall(performance(readme)) if f.replace(" ", "") not in held})
