"""What ``spotrun verify`` compares, as small pure functions over what the two runs left behind.

- :func:`reach`: the interrupted run must reach the reference's last update, and the
  reference must have every update the spec asks for (a short or empty run never passes).
- :func:`span_balance`: occurrence spans missing from, or extra in, the final run.
- :func:`compare_metrics`: metric points per (update, name) against the reference, in every
  sink's final view and in the raw writes of every attempt.
- :func:`fault_delivery`: the planned faults against the ones recorded as delivered.
- :func:`final_bundle_diff`, :func:`first_differing_tensor`: the two runs' bundles, tensor by tensor.

Each returns plain figures; :mod:`spotrun.orchestrator.verify.oracle` turns them into the verdict.
"""

from __future__ import annotations

import struct
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from spotrun.trainer.bundle.bundles import list_bundles, load_bundle
from spotrun.trainer.job.sections import FaultSpec
from spotrun.trainer.metrics import MetricPoint
from spotrun.trainer.observe.faults import FaultFired
from spotrun.trainer.observe.trace import UpdateRecord

NODE_SITE = "node-removed"  # only on a multi-node cluster (verify --nodes N)
WARM_SITE = "warm-rejoin"  # only where a restart can be warm (verify.restarts_warm)
HANG_SITE = "hang"  # a rank SIGSTOPped mid-update: only on Ray with 2 or more ranks (sites.unavailable_sites)
SHOWN = 5  # problems named in a report; the counts cover all of them


def site_name(site: str, signal: str, microstep: int) -> str:
    """The fault site as verify's report names it (a SIGTERM anywhere is a preemption notice, a SIGSTOP
    anywhere a hang)."""
    if signal == "SIGTERM":
        return "notice"
    if signal == "SIGSTOP":
        return HANG_SITE
    return {"microstep": "mid-accumulation" if microstep else "microstep-start", "backward": "mid-microstep",
            "bundle_write": "bundle-write", "after_publish": "publish-to-offsets",
            "before_update": "before-update", "rejoin": WARM_SITE}[site]


# -- progress ------------------------------------------------------------------------------------


def reach(ref: Mapping[int, UpdateRecord], chaos: Mapping[int, UpdateRecord], updates: int) -> list[str]:
    """Why the runs are too short to compare (empty when both have updates 1..``updates``)."""
    problems = []
    expected = set(range(1, updates + 1))
    if set(ref) != expected:
        problems.append(f"the reference run has {len(set(ref) & expected)} of the spec's {updates} updates "
                        f"(last: {max(ref, default=0)}): there is nothing trustworthy to compare with")
    missing = sorted(set(ref) - set(chaos))
    if missing:
        problems.append(f"the interrupted run never completed {len(missing)} of the reference's updates "
                        f"(first: {missing[0]}; it reached {max(chaos, default=0)} of {max(ref, default=0)})")
    return problems


def span_balance(ref: Mapping[int, UpdateRecord], chaos: Mapping[int, UpdateRecord]) -> tuple[int, int]:
    """(gaps, duplicates): occurrence spans of the reference missing from, or extra in, the final run."""
    want = Counter(s for r in ref.values() for s in (r.occurrences or []))
    got = Counter(s for r in chaos.values() for s in (r.occurrences or []))
    return sum((want - got).values()), sum((got - want).values())


# -- metric points -------------------------------------------------------------------------------


@dataclass
class MetricComparison:
    """Metric points of the interrupted run against the reference's, per (update, name).

    ``duplicates_written`` counts the writes of every attempt beyond the first of each point: what a
    consumer that appends instead of upserting would show (a replayed update writes its points
    again, so it is above 0 whenever a restart replayed updates). Every other count must be 0."""

    sinks: list[str]
    writes: int = 0  # points written by every attempt (the raw log)
    duplicates_written: int = 0
    duplicates: int = 0  # points of one (update, name) more than once in a sink's final view
    missing: int = 0  # reference points absent from a final view
    extra: int = 0  # final points the reference does not have
    mismatches: int = 0  # final values that differ from the reference's (beyond the contract's tolerance)
    stale: int = 0  # final points other than the latest write of their key (the upsert kept an older one)
    problems: list[str] = field(default_factory=list)  # the first few, named

    @property
    def ok(self) -> bool:
        return not (self.duplicates or self.missing or self.extra or self.mismatches or self.stale)

    def _note(self, text: str) -> None:
        if len(self.problems) < SHOWN:
            self.problems.append(text)


FLOAT32_SINKS = frozenset({"tensorboard"})  # sinks that store values as float32


def _as_stored(value: float, sink: str) -> float:
    """``value`` as ``sink`` stores it, so a bitwise comparison compares like with like."""
    return struct.unpack("f", struct.pack("f", value))[0] if sink in FLOAT32_SINKS else value


def _close(a: float, b: float, tolerance: float) -> bool:
    return a == b if tolerance == 0 else abs(a - b) <= tolerance * max(1.0, abs(a))


def compare_metrics(reference: Iterable[MetricPoint], finals: Mapping[str, Sequence[MetricPoint]],
                    writes: Sequence[MetricPoint], tolerance: float | None) -> MetricComparison:
    """Compare each sink's final view (``finals``: sink kind -> points as the sink reads them) with the
    reference's points, and with ``writes``, every point each attempt wrote, in order.

    ``tolerance``: 0 for bitwise-equal values, a relative bound for close ones, None when the contract
    promises no equal values (fresh-epoch): then values are not compared, only presence and count."""
    ref = {(p.update, p.name): p.value for p in reference}
    latest_attempt = {(p.update, p.name): p.attempt for p in writes}  # later writes win
    written = Counter((p.update, p.name) for p in writes)
    out = MetricComparison(sinks=list(finals), writes=len(writes),
                           duplicates_written=sum(n - 1 for n in written.values()))
    for sink, points in finals.items():
        seen = Counter((p.update, p.name) for p in points)
        for (u, name), n in sorted(seen.items()):
            if n > 1:
                out.duplicates += n - 1
                out._note(f"{sink}: update {u} {name} appears {n} times")
        for key in sorted(set(ref) - set(seen)):
            out.missing += 1
            out._note(f"{sink}: update {key[0]} {key[1]} is missing")
        for p in points:
            key = (p.update, p.name)
            if key not in ref:
                out.extra += 1
                out._note(f"{sink}: update {p.update} {p.name} is not in the reference")
            elif tolerance is not None and not _close(_as_stored(ref[key], sink), p.value, tolerance):
                out.mismatches += 1
                out._note(f"{sink}: update {p.update} {p.name} = {p.value!r}, the reference has {ref[key]!r}")
            if latest_attempt.get(key) != p.attempt:
                out.stale += 1
                out._note(f"{sink}: update {p.update} {p.name} holds attempt {p.attempt}'s point, the latest "
                          f"write is attempt {latest_attempt.get(key)}'s")
    return out


# -- faults --------------------------------------------------------------------------------------


@dataclass
class FaultDelivery:
    """The planned faults against those recorded as delivered (``FaultFired`` records, node removals
    verify itself carried out)."""

    planned: int
    delivered: int
    kills: int  # SIGKILLs and node removals delivered
    notices: int  # SIGTERMs delivered
    hangs: int  # SIGSTOPs delivered (the health watch then finds the rank hung and kills it)
    sites_planned: list[str]
    sites_hit: list[str]
    not_delivered: list[dict] = field(default_factory=list)

    @property
    def sites_missed(self) -> list[str]:
        return sorted(set(self.sites_planned) - set(self.sites_hit))


def fault_delivery(planned: Sequence[FaultSpec], fired: Sequence[FaultFired], removals_planned: int,
                   removals_done: int) -> FaultDelivery:
    hit = [f for f in planned if any(r.matches(f) for r in fired)]
    missed = [f for f in planned if f not in hit]
    sites_planned = {site_name(f.site, f.signal, f.microstep) for f in planned}
    sites_hit = {site_name(f.site, f.signal, f.microstep) for f in hit}
    if removals_planned:
        sites_planned.add(NODE_SITE)
    if removals_done:
        sites_hit.add(NODE_SITE)
    # each named as the report names sites, with the planned fault's fields
    not_delivered = [{"name": site_name(f.site, f.signal, f.microstep), **f.model_dump()} for f in missed]
    if removals_done < removals_planned:
        not_delivered.append({"name": NODE_SITE, "count": removals_planned - removals_done})
    notices = sum(f.signal == "SIGTERM" for f in hit)
    hangs = sum(f.signal == "SIGSTOP" for f in hit)
    return FaultDelivery(
        planned=len(planned) + removals_planned, delivered=len(hit) + removals_done,
        kills=len(hit) - notices - hangs + removals_done, notices=notices, hangs=hangs,
        sites_planned=sorted(sites_planned), sites_hit=sorted(sites_hit), not_delivered=not_delivered)


def _final_model(storage, job: str):
    newest = next((r for r in list_bundles(storage, job) if r.published), None)
    if newest is None:
        return None, None
    bundle = load_bundle(storage, newest.key, None)
    return bundle.whole("model.pt"), bundle.manifest.counters


def final_bundle_diff(storage, ref_job: str, chaos_job: str) -> tuple[float, bool]:
    (a, ca), (b, cb) = _final_model(storage, ref_job), _final_model(storage, chaos_job)
    if a is None or b is None:
        return float("inf"), False
    diff = max(float((a["model"][k].float() - b["model"][k].float()).abs().max()) for k in a["model"])
    return diff, ca == cb


def first_differing_tensor(storage, ref_job: str, chaos_job: str, update: int) -> str:
    """Name the first tensor that differs at the first boundary at or after ``update`` both runs kept."""
    ref = {r.update: r.key for r in list_bundles(storage, ref_job) if r.published}
    chaos = {r.update: r.key for r in list_bundles(storage, chaos_job) if r.published}
    common = sorted(u for u in set(ref) & set(chaos) if u >= update)
    if not common:
        return "parameter digest differs (no common bundle to name the tensor)"
    u = common[0]
    a = load_bundle(storage, ref[u], None).whole("model.pt")
    b = load_bundle(storage, chaos[u], None).whole("model.pt")
    for part in ("model", "ema"):
        for name in sorted(a[part]):
            if not a[part][name].equal(b[part][name]):
                diff = float((a[part][name].float() - b[part][name].float()).abs().max())
                return f"tensor {part}.{name} differs by up to {diff:.3g} (compared at the bundle of update {u})"
    return f"parameter digest differs at update {update}"


def locate(sequence: int, world_size: int, micro_batch: int) -> tuple[int, int]:
    """(rank, microstep) that trains on the ``sequence``-th sequence of an update's global batch."""
    block = sequence // micro_batch  # the inverse of trainer.data.planner.slice_for
    return block % world_size, block // world_size
