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


MARKERS = 500  # up to this many points and replaced writes, each is a circle with its own tooltip
LABELLED = 12  # up to this many restarts in view, each mark is labelled; beyond, its tooltip says it


def loss_curve(curve: dict[str, Any], width: int = 900, height: int = 300) -> str:
    """The final loss per update (one point each, or the downsampled curve :mod:`.curve` made), restarts
    marked, replaced writes hollow. A curve of more than :data:`MARKERS` points and replaced writes is
    drawn as a line, its replaced writes as dots (one path per attempt), so that a week's job stays a
    page's size; each restart keeps its mark, and links to the range around it (the page's ``from``/``to``)."""
    pts, old = curve["points"], curve["replaced"]
    if not pts:
        return '<p class="empty">No loss points yet.</p>'
    ml, mr, mt, mb = 60, 16, 24, 36
    asked = curve.get("range", {})
    u_lo = asked.get("from") if asked.get("from") is not None else min(0, min(p["update"] for p in pts))
    u_hi = asked.get("to") if asked.get("to") is not None else max(p["update"] for p in pts + old)
    values = [p["value"] for p in pts + old if math.isfinite(p["value"])] or [0.0]
    v_lo, v_hi = min(values), max(values)
    pad = (v_hi - v_lo) * 0.06 or 0.5
    v_lo, v_hi = v_lo - pad, v_hi + pad
    x = lambda u: ml + (width - ml - mr) * (u - u_lo) / max(1, u_hi - u_lo)  # noqa: E731
    y = lambda v: mt + (height - mt - mb) * (v_hi - min(max(v, v_lo), v_hi)) / (v_hi - v_lo)  # noqa: E731
    out = [f'<svg class="loss" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
           f'role="img" aria-label="loss by update" data-points="{len(pts)}" data-replaced="{len(old)}">']
    ustep = max(1, int(_nice(u_hi - u_lo)))
    for u in range(u_lo - u_lo % ustep, u_hi + 1, ustep):
        if u >= u_lo:
            out.append(f'<line class="grid" x1="{x(u):.1f}" y1="{mt}" x2="{x(u):.1f}" y2="{height - mb}"/>'
                       f'<text class="tick" x="{x(u):.1f}" y="{height - mb + 16}">{u}</text>')
    vstep = _nice(v_hi - v_lo, 5)
    v = math.ceil(v_lo / vstep) * vstep
    while v <= v_hi:
        out.append(f'<line class="grid" x1="{ml}" y1="{y(v):.1f}" x2="{width - mr}" y2="{y(v):.1f}"/>'
                   f'<text class="tick ytick" x="{ml - 6}" y="{y(v) + 4:.1f}">{_fmt(v)}</text>')
        v += vstep
    out.append(f'<text class="axis" x="{width - mr}" y="{height - 4}">update</text>')
    seen = [r for r in curve["restarts"] if u_lo <= r["restored_update"] <= u_hi
            or (r["lost_range"] and r["lost_range"][0] <= u_hi and r["lost_range"][1] >= u_lo)]
    out += _restart_marks(seen, x, mt, height - mb, labelled=len(seen) <= LABELLED)
    line = " ".join(f"{x(p['update']):.1f},{y(p['value']):.1f}" for p in pts)
    out.append(f'<polyline class="curve" points="{line}"/>')
    out += _markers(pts, old, x, y) if len(pts) + len(old) <= MARKERS else _dots(old, x, y)
    out.append("</svg>")
    return "".join(out)


def _restart_marks(restarts: list[dict[str, Any]], x: Any, top: int, bottom: int, labelled: bool) -> list[str]:
    """Each restart's replayed band and its mark, a link to the updates around it."""
    out = []
    for r in restarts:
        a, at = r["attempt"], r["restored_update"]
        lo, hi = r["lost_range"] or (at, at)
        what = f"↻ attempt {a} from u{at} ({escape(str(r['cause']))})"
        span = max(10, hi - lo)  # zoomed in: the restart in the middle, a few of its own widths around
        out.append(f'<a class="zoom" href="?from={max(0, at - 2 * span)}&amp;to={hi + 2 * span}#loss">')
        if r["lost_range"]:
            out.append(f'<rect class="replay-band" data-attempt="{a}" x="{x(lo - 0.5):.1f}" y="{top}" '
                       f'width="{max(1.0, x(hi + 0.5) - x(lo - 0.5)):.1f}" height="{bottom - top}"><title>updates '
                       f'{lo}–{hi} replayed by attempt {a}</title></rect>')
        title = "" if labelled else f"<title>{what}</title>"
        out.append(f'<line class="restart-mark" data-attempt="{a}" data-update="{at}" x1="{x(at):.1f}" '
                   f'y1="{top - 4}" x2="{x(at):.1f}" y2="{bottom}">{title}</line>')
        if labelled:
            out.append(f'<text class="restart-label" x="{x(at) + 3:.1f}" y="{top - 8}">{what}</text>')
        out.append("</a>")
    return out


def _markers(pts: list[dict[str, Any]], old: list[dict[str, Any]], x: Any, y: Any) -> list[str]:
    """A circle per replaced write (hollow) and per point, each with its tooltip."""
    out = []
    for p in old:
        out.append(f'<circle class="replaced {_a(p["attempt"])}" data-update="{p["update"]}" '
                   f'data-attempt="{p["attempt"]}" cx="{x(p["update"]):.1f}" cy="{y(p["value"]):.1f}" r="4.5">'
                   f'<title>update {p["update"]}: attempt {p["attempt"]} wrote {_fmt(p["value"])}, replaced by '
                   f'attempt {p["replaced_by_attempt"]}</title></circle>')
    for p in pts:
        out.append(f'<circle class="point {_a(p["attempt"])}" data-update="{p["update"]}" '
                   f'data-attempt="{p["attempt"]}" cx="{x(p["update"]):.1f}" cy="{y(p["value"]):.1f}" r="2.8">'
                   f'<title>update {p["update"]}: loss {_fmt(p["value"])} (attempt {p["attempt"]})</title></circle>')
    return out


def _dots(old: list[dict[str, Any]], x: Any, y: Any) -> list[str]:
    """Every replaced write as a dot, one path per attempt that wrote them (a few bytes a write)."""
    by_attempt: dict[int, list[dict[str, Any]]] = {}
    for p in old:
        by_attempt.setdefault(p["attempt"], []).append(p)
    out = []
    for a, writes in sorted(by_attempt.items()):
        d = "".join(f"M{x(p['update']):.1f} {y(p['value']):.1f}h0" for p in writes)
        out.append(f'<path class="replaced dots {_a(a)}" data-attempt="{a}" data-writes="{len(writes)}" d="{d}">'
                   f'<title>{len(writes)} write(s) of attempt {a} that a restart replaced (updates '
                   f'{writes[0]["update"]}–{writes[-1]["update"]})</title></path>')
    return out


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
