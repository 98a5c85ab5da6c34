"""The endurance bench's figures and tables (bench/endurance.py runs the job; this reads what it left).

:func:`figures` turns the run's raw record (faults injected, samples, the job's storage and traces) into
the section's numbers, from the ledger and the job's history (the same readers ``spotrun history`` uses);
:func:`tables` lays them out with the verdicts.
"""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any

from bench.growth import growth, longest_lived, slope, trend
from bench.tables import Table, fmt, mib, pct
from spotrun.orchestrator.ledger.events import Footprints, Restored, WorkerLost
from spotrun.orchestrator.ledger.history import history
from spotrun.orchestrator.ledger.store import Ledger
from spotrun.trainer.observe.trace import first_divergence, latest_per_update, read_trace
from spotrun.trainer.storage import open_storage

SETTLE = 5  # restarts left out of a growth fit: a process's first restarts allocate what it then reuses
RSS_LIMIT = 256 << 10  # bytes per restart: 75 MiB over 300 restarts, more than noise stays under
COUNT_LIMIT = 0.02  # fds, threads per restart: 6 over 300 restarts
TREND_LIMIT = 1.25  # the last third's median fault -> next update over the first third's


def figures(raw: dict[str, Any]) -> dict[str, Any]:
    storage = open_storage(raw["storage"])
    events = Ledger(storage, "endure").read()
    ref = read_trace(raw["reference"])
    final = latest_per_update(read_trace(raw["trace"]))
    divergence = first_divergence(ref, [final[u] for u in sorted(final)])
    # a run stopped early is compared as far as it went: every update up to its last, none missing
    exact = sorted(final) == list(range(1, len(final) + 1)) and divergence is None
    hist = history(storage, "endure", metrics_local_dir=raw["metrics_dir"])
    restored = {e.attempt: e for e in events if isinstance(e, Restored)}
    lost = {e.attempt: e for e in events if isinstance(e, WorkerLost)}
    first = {int(k): v for k, v in raw["first_update"].items()}
    faults = []
    for f in raw["injected"]:
        after = [first[a] for a in first if a > f["attempt"]]
        nxt = restored.get(f["attempt"] + 1)
        why = lost.get(f["attempt"])
        faults.append({**f, "to_next_update_s": min(after) - f["at"] if after else None,
                       "path": nxt.recovery_path if nxt else None, "cold_because": nxt.cold_because if nxt else None,
                       "cause": why.cause if why else None})
    hit = {f["attempt"] for f in raw["injected"]}
    unplanned = [{"attempt": a, "cause": e.cause, "detail": e.detail[:200]} for a, e in lost.items() if a not in hit]
    return {"faults_asked": raw["faults"], "faults": faults, "wall_s": raw["wall_s"], "state": raw["state"],
            "error": raw["error"], "stuck": raw["stuck"], "restarts": raw["restarts"], "exact": exact,
            "updates": len(final),
            "divergence": str(divergence) if divergence else None,
            "goodput": hist.goodput.model_dump(exclude={"attempts"}),
            "cold": [{"attempt": r.attempt, "cause": r.cause, "because": r.cold_because}
                     for r in hist.restarts if r.recovery_path == "cold"],
            "restarts_recorded": len(hist.restarts), "unplanned": unplanned,
            "ranks": rank_growth(events), "outside": outside_growth(raw["samples"]), "samples": raw["samples"],
            "driver_threads_grown": threads_grown(raw["samples"])}


def threads_grown(samples: list[dict[str, Any]]) -> dict[str, int]:
    """The driver's threads, by name, that the last sample has more of than the first after the job
    settled (:data:`SETTLE` restarts): which kind of thread piles up, if any does."""
    named = [s["driver_threads_named"] for s in samples if s["restarts"] >= SETTLE and "driver_threads_named" in s]
    return dict(Counter(named[-1]) - Counter(named[0])) if len(named) > 1 else {}


def rank_growth(events: list) -> dict[str, Any]:
    """Per rank, the process warm recovery kept longest (from each attempt's ``footprints``): its growth
    per restart in each measure, and how many processes held the rank over the run."""
    out: dict[str, Any] = {}
    prints = [e for e in events if isinstance(e, Footprints)]
    for rank in sorted({r for e in prints for r in e.ranks}):
        by_pid = longest_lived((e.attempt - 1, f.pid, f.model_dump(exclude={"pid"}))
                               for e in prints if (f := e.ranks.get(rank)) is not None)
        pid, seen = max(by_pid.items(), key=lambda kv: len(kv[1]))
        out[f"rank {rank}"] = {"pid": pid, "processes": len(by_pid), "measures": {
            m: vars(growth([(n, float(v[m])) for n, v in seen], SETTLE))
            for m in ("rss_bytes", "fds", "threads", "process_groups")}}
    return out


OUTSIDE = {"driver": ("driver_rss", "driver_fds", "driver_threads"), "GCS": ("gcs_rss",),
           "raylets (all nodes)": ("raylets_rss", "raylet_fds"), "object store": ("object_store_used",),
           "/dev/shm": ("shm_used",), "local disk": ("disk_used",), "Ray's session logs": ("ray_logs",),
           "job storage": ("storage_bytes",), "metric sinks (local)": ("metrics_bytes",)}


def outside_growth(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Each thing outside the ranks that the bench sampled after every restart: growth per restart."""
    out: dict[str, Any] = {}
    for who, keys in OUTSIDE.items():
        out[who] = {k: vars(growth([(s["restarts"], float(s[k])) for s in samples if s.get(k) is not None], SETTLE))
                    for k in keys}
    spares = longest_lived((s["restarts"], s["spare_pid"], {k: s[k] for k in ("spare_rss", "spare_fds",
                                                                                "spare_threads")})
                           for s in samples if s.get("spare_pid"))
    if spares:
        pid, seen = max(spares.items(), key=lambda kv: len(kv[1]))
        out["spare (longest waiting)"] = {k: vars(growth([(n, float(v[k])) for n, v in seen], SETTLE))
                                          for k in ("spare_rss", "spare_fds", "spare_threads")}
    return out


def _is_bytes(measure: str) -> bool:
    return any(w in measure for w in ("rss", "used", "bytes", "logs"))


def _cell(measure: str, x: float) -> str:
    return mib(x) if _is_bytes(measure) and x == x else fmt(x)


def _per_restart(measure: str, x: float) -> str:
    return f"{x / 1024:,.1f} KiB" if _is_bytes(measure) and x == x else fmt(x)


def tables(r: dict[str, Any]) -> tuple[list[Table], list[str]]:
    return [fault_table(r), growth_table(r), cold_table(r), summary_table(r)], verdicts(r)


def fault_table(r: dict[str, Any]) -> Table:
    t = Table(f"{len(r['faults'])} faults on one 2-rank job with a spare (local Ray cluster: 3 one-CPU nodes): "
              "fault → next update reaching the driver", ["fault", "n", "restart paths", "median s", "max s",
                                                         "first third, median s", "last third, median s",
                                                         "last / first", "slope, s per fault"])
    for kind in sorted({f["kind"] for f in r["faults"]}):
        mine = [f for f in r["faults"] if f["kind"] == kind]
        secs = [f["to_next_update_s"] for f in mine if f["to_next_update_s"] is not None]
        paths = Counter(f["path"] or "none" for f in mine)
        early, late, ratio = trend(secs)
        t.add(kind, len(mine), ", ".join(f"{p} {c}" for p, c in paths.most_common()),
              statistics.median(secs) if secs else None, max(secs, default=None), early, late,
              f"{fmt(ratio)}×", slope(secs))
    t.notes += ["kill-warm: SIGKILL of rank 1 once the spare is ready; kill-now: SIGKILL of rank 1 as soon as "
                "the ranks hold, the spare ready or not; kill-all: SIGKILL of both ranks (no survivor); hang: "
                "SIGSTOP of rank 1 (found by the health watch); node: rank 1's node removed and a new one added; "
                "notice-aws/-gcp/-azure: that cloud's notice, seen by every node (all poll one stand-in)",
                "each fault lands while the ranks hold at a boundary with its bundle published, so no update is "
                "lost to it: the cost measured is the restart's, not lost work"]
    return t


def growth_table(r: dict[str, Any]) -> Table:
    t = Table(f"Growth per restart of what lives through them (least squares after the first {SETTLE} restarts)",
              ["process / resource", "measure", "first", "after settling", "last", "per restart", "samples"])
    for who, g in r["ranks"].items():
        for m, v in g["measures"].items():
            t.add(f"{who} (pid {g['pid']}, 1 of {g['processes']} processes)", m, _cell(m, v["first"]),
                  _cell(m, v["settled"]), _cell(m, v["last"]), _per_restart(m, v["per_restart"]), v["points"])
    for who, measures in r["outside"].items():
        for m, v in measures.items():
            t.add(who, m, _cell(m, v["first"]), _cell(m, v["settled"]), _cell(m, v["last"]),
                  _per_restart(m, v["per_restart"]), v["points"])
    t.notes += ["ranks: the ledger's footprints event (each rank measures itself at its first poll of an attempt); "
                "the rest: sampled by the bench at the next hold after each restart",
                "GCS and raylets: summed over this cluster's processes (a removed node's raylet goes, its "
                "replacement's comes)"]
    return t


def cold_table(r: dict[str, Any]) -> Table:
    t = Table(f"Restarts that went cold: {len(r['cold'])} of {r['restarts_recorded']} "
              f"({pct(len(r['cold']) / r['restarts_recorded']) if r['restarts_recorded'] else '—'})",
              ["recorded reason", "restarts"])
    for why, n in Counter(_first_line(c["because"]) for c in r["cold"]).most_common():
        t.add(why, n)
    t.notes.append("each reason's first line (an actor's death goes on to name its ids: one row each otherwise); "
                   "a rank lost while restarting warm after a notice is the bench replacing the noticed node")
    return t


def _first_line(reason: str | None) -> str:
    return (reason or "(none recorded)").splitlines()[0].replace("|", "/")[:200]


def summary_table(r: dict[str, Any]) -> Table:
    g = r["goodput"]
    t = Table("The run", ["measure", "value"])
    t.add("faults injected / asked", f"{len(r['faults'])} / {r['faults_asked']}")
    t.add("restarts (the job's outcome) / recorded in its history", f"{r['restarts']} / {r['restarts_recorded']}")
    t.add("losses no fault of the bench caused", len(r["unplanned"]))
    t.add("job's end", r["state"] or r["error"])
    if r["stuck"]:
        t.add("stopped early", r["stuck"])
    t.add("wall time of the faulted run (min)", r["wall_s"] / 60)
    t.add("faults per minute", len(r["faults"]) / (r["wall_s"] / 60))
    t.add(f"every one of {r['updates']} updates bitwise equal to an uninterrupted run's", r["exact"])
    t.add("goodput (productive / wall)", pct(g["goodput"]) if g["goodput"] is not None else "—")
    for term in ("productive_seconds", "replayed_seconds", "checkpoint_stall_seconds", "downtime_seconds"):
        t.add(f"  {term.replace('_', ' ')}", g[term])
    return t


def _flat(g: dict[str, Any]) -> float:
    return g["per_restart"] if g["per_restart"] == g["per_restart"] else 0.0


def growers(r: dict[str, Any]) -> list[str]:
    """Each long-lived process's measure that grows per restart past its limit."""
    out = []
    processes = {**{who: g["measures"] for who, g in r["ranks"].items()},
                 **{who: m for who, m in r["outside"].items() if who in ("driver", "GCS", "raylets (all nodes)",
                                                                          "spare (longest waiting)")}}
    for who, measures in processes.items():
        for m, g in measures.items():
            limit = RSS_LIMIT if _is_bytes(m) else COUNT_LIMIT
            if _flat(g) > limit:
                out.append(f"{who} {m} +{_per_restart(m, g['per_restart'])}/restart")
    return out


def verdicts(r: dict[str, Any]) -> list[str]:
    n = len(r["faults"])
    out = [f"{n} faults, then every update bitwise equal to an uninterrupted run's: "
           f"**{'MET' if r['exact'] and n >= r['faults_asked'] else 'NOT MET'}** ({n} of {r['faults_asked']} "
           f"faults injected; {r['updates']} updates"
           f"{'; first divergence ' + r['divergence'] if r['divergence'] else ''})"]
    grew = growers(r)
    threads = ", ".join(f"{name} +{k}" for name, k in sorted(r.get("driver_threads_grown", {}).items()))
    out.append(f"no long-lived process (surviving ranks, spare, driver, GCS, raylets) grows per restart "
               f"(≤ {RSS_LIMIT >> 10} KiB resident, ≤ {COUNT_LIMIT:g} fds or threads): "
               f"**{'MET' if not grew else 'NOT MET'}**{' (' + '; '.join(grew) + ')' if grew else ''}"
               f"{'; the driver threads that grew, by name: ' + threads if threads else ''}")
    drifting = []
    for kind in sorted({f["kind"] for f in r["faults"]}):
        secs = [f["to_next_update_s"] for f in r["faults"] if f["kind"] == kind and f["to_next_update_s"] is not None]
        early, late, ratio = trend(secs)
        if ratio == ratio and ratio > TREND_LIMIT:
            drifting.append(f"{kind} {fmt(early)} → {fmt(late)} s")
    out.append(f"fault → next update shows no upward trend over the run (last third's median ≤ {TREND_LIMIT:g}× "
               f"the first's, per kind): **{'MET' if not drifting else 'NOT MET'}**"
               f"{' (' + '; '.join(drifting) + ')' if drifting else ''}")
    unexplained = [c for c in r["cold"] if not c["because"]]
    out.append(f"every cold restart has its reason recorded: **{'MET' if not unexplained else 'NOT MET'}** "
               f"({len(r['cold'])} cold of {r['restarts_recorded']} restarts; {len(unexplained)} without a reason)")
    return out

