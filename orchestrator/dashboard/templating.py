"""Jinja filters for the pages: how numbers, times and missing values read."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from jinja2 import Undefined

DASH = "–"


def dash(value: Any) -> Any:
    """``None`` (or a field the row lacks) reads as a dash, never as the word None."""
    return DASH if value is None or value == "" or isinstance(value, Undefined) else value


def secs(value: float | None) -> str:
    if not isinstance(value, (int, float)):
        return DASH
    if value < 1:
        return f"{value * 1000:.1f} ms"
    if value < 120:
        return f"{value:.2f} s"
    if value < 7200:
        return f"{value / 60:.1f} min"
    return f"{value / 3600:.1f} h"


def size(value: float | None) -> str:
    if not isinstance(value, (int, float)):
        return DASH
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return str(value)


def clock(value: str | None) -> str:
    """An ISO timestamp as the time of day (UTC), which is what a reader scans for."""
    if not value:
        return DASH
    return datetime.fromisoformat(value).strftime("%H:%M:%S")


def short(value: str | None) -> str:
    """A bundle key as its own name; the job is in the page title."""
    return value.rsplit("/", 1)[-1] if value else DASH


# The restart history table's columns (field of ``history --json``, header), narrow enough for a
# laptop's window: world sizes, the lost updates' source and range, and a cold restart's reason
# share a cell with what they qualify.
RESTART_COLUMNS = [
    ("attempt", "attempt"), ("cause", "cause"), ("loss", "class"), ("detected_at", "detected"),
    ("restored_from", "restored from"), ("recovery_label", "label"), ("recovery_path", "path"),
    ("world_size_after", "ranks"), ("lost_updates", "lost"), ("restore_seconds", "restore"),
    ("downtime_seconds", "downtime"), ("time_lost_seconds", "time lost"),
    ("notice_to_publish_seconds", "notice → published"),
]


def restart_cell(row: dict[str, Any], field: str) -> Any:
    """A cell of the restart history table: the row's ``field``, and what qualifies it."""
    value = row.get(field)
    if field == "lost_updates":
        if value is None:
            return "not known"
        lo_hi = row["lost_range"]
        return f"{value} (u{lo_hi[0]}–{lo_hi[1]}, {row['lost_updates_source']})" if lo_hi else "0"
    if field == "world_size_after":
        before = row.get("world_size_before")
        return f"{before} → {value}" if before not in (None, value) else dash(value)
    if field == "restored_from":
        return f"{short(value)} (u{row['restored_update']})" if value else "none: started afresh"
    if value is None:
        return DASH
    if field.endswith("_seconds"):
        return secs(value)
    if field.endswith("_at"):
        return clock(value)
    return value


def percent(value: float | None) -> str:
    """A ratio as a percentage (goodput)."""
    return DASH if not isinstance(value, (int, float)) else f"{100 * value:.1f}%"


FILTERS = {"percent": percent, "dash": dash,
           "secs": secs, "size": size, "clock": clock, "short": short, "restart_cell": restart_cell}
