"""Inline SVG for the job page: the attempts timeline and the loss curve.

Plain markup built from the view models, every text escaped; styling comes from
classes in ``static/dashboard.css`` (no inline style, no chart library). Elements
carry ``data-*`` attributes (attempt, update) so tests and readers can query them.
"""

from __future__ import annotations

import math
from datetime import datetime
from html import escape
from typing import Any

TIME_STEPS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 43200, 86400)


def _a(n: int) -> str:
    """The colour class of attempt ``n`` (six colours, cycled)."""
    return f"a{(n - 1) % 6 + 1}"


def _nice(span: float, ticks: int = 6) -> float:
    raw = span / max(1, ticks)
    mag = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
    return next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)


def _fmt(x: float) -> str:
    return f"{x:.4g}"


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"+{seconds:g}s"
    if seconds < 7200:
        return f"+{seconds / 60:g}m"
    return f"+{seconds / 3600:g}h"


def timeline(spans: list[dict[str, Any]], width: int = 900) -> str:
    """One bar per attempt on a shared time axis; world size on the left, how it ended on the right."""
    if not spans:
        return '<p class="empty">No attempt has started yet.</p>'
    left, right, top, row = 130, 190, 26, 30
    starts = [datetime.fromisoformat(s["start"]) for s in spans]
    ends = [datetime.fromisoformat(s["end"]) for s in spans]
    t0 = min(starts)
    span = max(1.0, max((e - t0).total_seconds() for e in ends))
    plot = width - left - right
    x = lambda t: left + plot * (t - t0).total_seconds() / span  # noqa: E731
    height = top + row * len(spans) + 8
    out = [f'<svg class="timeline" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
           f'role="img" aria-label="attempts on a time axis">']
    step = next((s for s in TIME_STEPS if span / s <= 8), TIME_STEPS[-1])
    for k in range(int(span // step) + 1):
        tx = left + plot * k * step / span
        out.append(f'<line class="grid" x1="{tx:.1f}" y1="{top - 6}" x2="{tx:.1f}" y2="{height - 8}"/>'
                   f'<text class="tick" x="{tx:.1f}" y="{top - 10}">{_duration(k * step)}</text>')
    for i, (s, start, end) in enumerate(zip(spans, starts, ends, strict=True)):
        y = top + i * row
        x0, x1 = x(start), x(end)
        world = s["world_size"] if s["world_size"] is not None else "?"
        title = (f"attempt {s['attempt']}: {start:%H:%M:%S} to {end:%H:%M:%S}, world size {world}, "
                 f"reached update {s['reached_update'] or 0}, ended: {s['ended']}")
        out.append(f'<text class="label" x="{left - 8}" y="{y + 17}">attempt {s["attempt"]} · world {world}</text>')
        if i and ends[i - 1] < start:  # the time nobody trained: from the last sign of life to this start
            g0, gap = x(ends[i - 1]), (start - ends[i - 1]).total_seconds()
            out.append(f'<line class="gap" x1="{g0:.1f}" y1="{y + row / 2:.1f}" x2="{x0:.1f}" y2="{y + row / 2:.1f}">'
                       f'<title>{gap:.2f} s without a live attempt</title></line>')
            if x0 - g0 > 70:
                out.append(f'<text class="gap-label tick" x="{(g0 + x0) / 2:.1f}" y="{y + row / 2 - 4:.1f}">'
                           f'gap {gap:.1f} s</text>')
        out.append(f'<rect class="attempt {_a(s["attempt"])}" data-attempt="{s["attempt"]}" '
                   f'data-world-size="{world}" x="{x0:.1f}" y="{y + 4}" width="{max(3.0, x1 - x0):.1f}" '
                   f'height="{row - 10}"><title>{escape(title)}</title></rect>')
        ended = str(s["ended"])
        mark = ("✓" if ended == "finished" else "…" if ended == "running"
                else "↗" if ended.startswith(("scale-up", "straggler")) else "✕")  # a chosen restart is no failure
        out.append(f'<text class="cause" data-attempt="{s["attempt"]}" x="{max(x1, x0 + 3) + 6:.1f}" '
                   f'y="{y + 17}">{mark} {escape(str(s["ended"]))}</text>')
    out.append("</svg>")
    return "".join(out)


def loss_curve(curve: dict[str, Any], width: int = 900, height: int = 300) -> str:
    """The final loss per update (one point each), restarts marked, replaced writes hollow."""
    pts, old = curve["points"], curve["replaced"]
    if not pts:
        return '<p class="empty">No loss points yet.</p>'
    ml, mr, mt, mb = 60, 16, 24, 36
    u_lo = min(0, min(p["update"] for p in pts))
    u_hi = max(p["update"] for p in pts + old)
    values = [p["value"] for p in pts + old]
    v_lo, v_hi = min(values), max(values)
    pad = (v_hi - v_lo) * 0.06 or 0.5
    v_lo, v_hi = v_lo - pad, v_hi + pad
    x = lambda u: ml + (width - ml - mr) * (u - u_lo) / max(1, u_hi - u_lo)  # noqa: E731
    y = lambda v: mt + (height - mt - mb) * (v_hi - v) / (v_hi - v_lo)  # noqa: E731
    out = [f'<svg class="loss" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
           f'role="img" aria-label="loss by update">']
    ustep = max(1, int(_nice(u_hi - u_lo)))
    for u in range(u_lo - u_lo % ustep, u_hi + 1, ustep):
        out.append(f'<line class="grid" x1="{x(u):.1f}" y1="{mt}" x2="{x(u):.1f}" y2="{height - mb}"/>'
                   f'<text class="tick" x="{x(u):.1f}" y="{height - mb + 16}">{u}</text>')
    vstep = _nice(v_hi - v_lo, 5)
    v = math.ceil(v_lo / vstep) * vstep
    while v <= v_hi:
        out.append(f'<line class="grid" x1="{ml}" y1="{y(v):.1f}" x2="{width - mr}" y2="{y(v):.1f}"/>'
                   f'<text class="tick ytick" x="{ml - 6}" y="{y(v) + 4:.1f}">{_fmt(v)}</text>')
        v += vstep
    out.append(f'<text class="axis" x="{width - mr}" y="{height - 4}">update</text>')
    for r in curve["restarts"]:
        if r["lost_range"]:
            lo, hi = r["lost_range"]
            out.append(f'<rect class="replay-band" data-attempt="{r["attempt"]}" x="{x(lo - 0.5):.1f}" y="{mt}" '
                       f'width="{x(hi + 0.5) - x(lo - 0.5):.1f}" height="{height - mt - mb}"><title>updates '
                       f'{lo}–{hi} replayed by attempt {r["attempt"]}</title></rect>')
        rx = x(r["restored_update"])
        out.append(f'<line class="restart-mark" data-attempt="{r["attempt"]}" x1="{rx:.1f}" y1="{mt - 4}" '
                   f'x2="{rx:.1f}" y2="{height - mb}"/><text class="restart-label" x="{rx + 3:.1f}" '
                   f'y="{mt - 8}">↻ attempt {r["attempt"]} from u{r["restored_update"]} '
                   f'({escape(str(r["cause"]))})</text>')
    line = " ".join(f"{x(p['update']):.1f},{y(p['value']):.1f}" for p in sorted(pts, key=lambda p: p["update"]))
    out.append(f'<polyline class="curve" points="{line}"/>')
    for p in old:
        out.append(f'<circle class="replaced {_a(p["attempt"])}" data-update="{p["update"]}" '
                   f'data-attempt="{p["attempt"]}" cx="{x(p["update"]):.1f}" cy="{y(p["value"]):.1f}" r="4.5">'
                   f'<title>update {p["update"]}: attempt {p["attempt"]} wrote {_fmt(p["value"])}, replaced by '
                   f'attempt {p["replaced_by_attempt"]}</title></circle>')
    for p in pts:
        out.append(f'<circle class="point {_a(p["attempt"])}" data-update="{p["update"]}" '
                   f'data-attempt="{p["attempt"]}" cx="{x(p["update"]):.1f}" cy="{y(p["value"]):.1f}" r="2.8">'
                   f'<title>update {p["update"]}: loss {_fmt(p["value"])} (attempt {p["attempt"]})</title></circle>')
    out.append("</svg>")
    return "".join(out)


GOODPUT_TERMS = (("productive_seconds", "productive"), ("replayed_seconds", "replayed"),
                 ("checkpoint_stall_seconds", "checkpoint stall"), ("capacity_wait_seconds", "capacity wait"),
                 ("downtime_seconds", "downtime"))


def goodput_bars(goodput: dict[str, Any], width: int = 900) -> str:
    """One stacked bar per attempt and one for the job: each term's share of the wall time."""
    rows = [(f"attempt {a['attempt']}", a) for a in goodput["attempts"]] + [("job", goodput)]
    if not goodput["attempts"]:
        return '<p class="empty">No attempt has started yet.</p>'
    left, right, row = 90, 70, 24
    plot = width - left - right
    height = row * len(rows) + 4
    out = [f'<svg class="goodput" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
           f'role="img" aria-label="where the wall time went">']
    for i, (label, doc) in enumerate(rows):
        y, wall, x = 2 + i * row, doc["wall_seconds"], float(left)
        out.append(f'<text class="label" x="{left - 8}" y="{y + 15}">{escape(label)}</text>')
        for term, name in GOODPUT_TERMS:
            w = plot * doc[term] / wall if wall > 0 else 0.0
            if w > 0:
                out.append(f'<rect class="term {term.removesuffix("_seconds")}" data-term="{term}" x="{x:.1f}" '
                           f'y="{y}" width="{w:.1f}" height="{row - 6}"><title>{escape(name)}: '
                           f'{doc[term]:.3f} s of {wall:.3f} s</title></rect>')
            x += w
        ratio = "–" if doc["goodput"] is None else f"{100 * doc['goodput']:.1f}%"
        out.append(f'<text class="ratio" x="{left + plot + 6}" y="{y + 15}">{ratio}</text>')
    out.append("</svg>")
    return "".join(out)
