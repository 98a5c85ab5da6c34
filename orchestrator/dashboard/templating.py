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


def restart_cell(value: Any, field: str) -> Any:
    """A cell of the restart history table, by the name of its ``history --json`` field."""
    if value is None:
        return {"lost_updates": "not recorded", "restored_from": "none: started afresh"}.get(field, DASH)
    if field.endswith("_seconds"):
        return secs(value)
    if field.endswith("_at"):
        return clock(value)
    if field == "restored_from":
        return short(value)
    return value


def percent(value: float | None) -> str:
    """A ratio as a percentage (goodput)."""
    return DASH if not isinstance(value, (int, float)) else f"{100 * value:.1f}%"


FILTERS = {"percent": percent, "dash": dash,
           "secs": secs, "size": size, "clock": clock, "short": short, "restart_cell": restart_cell}
