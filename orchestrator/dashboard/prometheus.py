"""``GET /metrics``: every job's progress and goodput in the Prometheus text format.

One sample per job and metric, labelled ``job="<id>"``, built from the same summaries the jobs
page shows (so a scrape reads storage like one page view). A metric whose value is unknown (a
job with no published bundle has no ``spotrun_last_published_update``) has no sample for that
job rather than a made-up zero.

``spotrun_storage_up`` is the dashboard's own word, not the job's: whether its last read of the job's
storage succeeded. When it did not, the job's other samples are those of its last successful read (none
before there was one): the job's own paths ride the same outage out and record it once it is over.

Per-rank gauges (:data:`RANK_GAUGES`) carry a ``rank`` label besides: one sample per rank the job's
newest attempt has a figure for, none while it has none.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# name -> (help, how to read it from a jobs-page summary)
GAUGES: dict[str, tuple[str, Callable[[dict[str, Any]], float | None]]] = {
    "spotrun_updates_done": ("Updates the job has completed (the furthest seen)", lambda s: s["updates_done"]),
    "spotrun_updates_total": ("Updates the job is to run (train.updates)", lambda s: s["updates_total"]),
    "spotrun_restarts_total": ("Restarts so far", lambda s: s["restarts"]),
    "spotrun_goodput_ratio": ("Productive update time over wall time (README: Goodput)", lambda s: s["goodput"]),
    "spotrun_time_lost_seconds": ("Wall time restarts lost: downtime plus work thrown away "
                                  "(README: What a restart cost)",
                                  lambda s: s["time_lost_seconds"]),
    "spotrun_lost_updates": ("Updates restarts threw away, to be computed again (README: What a restart cost); "
                             "no sample while one restart's is not known", lambda s: s["lost_updates"]),
    "spotrun_replayed_updates": ("Updates computed again after a restart so far", lambda s: s["replayed_updates"]),
    "spotrun_last_published_update": ("Update of the newest published bundle",
                                      lambda s: s["last_published"]["update"] if s["last_published"] else None),
    "spotrun_seconds_since_last_bundle": ("Seconds since the newest bundle was published (its bundle_published "
                                          "event); no sample before the first",
                                          lambda s: _since(s["newest_published_at"])),
    "spotrun_storage_up": ("1 when the dashboard's last read of the job's storage succeeded, 0 when storage refused "
                           "it (an outage as the dashboard sees it: the job rides it out and records it once over)",
                           lambda s: s["storage_up"]),
    "spotrun_attempt_running": ("1 while an attempt of the job is running and has shown signs of life",
                                lambda s: int(s["state"] == "running" and not s["quiet"])),
}

# name -> (help, how to read {rank: value} from a jobs-page summary)
RANK_GAUGES: dict[str, tuple[str, Callable[[dict[str, Any]], dict[str, float]]]] = {
    "spotrun_rank_slowdown": ("A rank's median own-work time over the median of its peers' (the newest attempt's "
                              "newest slowdowns event); 1 is the pace of its peers", lambda s: s["rank_slowdown"]),
}


def _since(iso: str | None) -> float | None:
    return None if iso is None else round((datetime.now(UTC) - datetime.fromisoformat(iso)).total_seconds(), 3)


def _read(read: Callable[[dict[str, Any]], Any], summary: dict[str, Any]) -> Any:
    """``read(summary)``; None for a job the dashboard could never read (only its ``storage_up`` is known)."""
    try:
        return read(summary)
    except KeyError:
        return None


class _Jobs(Collector):
    def __init__(self, summaries: Callable[[], list[dict[str, Any]]]) -> None:
        self.summaries = summaries

    def collect(self) -> Iterable[Metric]:
        jobs = self.summaries()
        for name, (help_, read) in GAUGES.items():
            family = GaugeMetricFamily(name, help_, labels=["job"])
            for s in jobs:
                value = _read(read, s)
                if value is not None:
                    family.add_metric([s["job_id"]], float(value))
            yield family
        for name, (help_, per_rank) in RANK_GAUGES.items():
            family = GaugeMetricFamily(name, help_, labels=["job", "rank"])
            for s in jobs:
                for rank, value in sorted((_read(per_rank, s) or {}).items(), key=lambda kv: int(kv[0])):
                    family.add_metric([s["job_id"], rank], float(value))
            yield family


def exposition(summaries: Callable[[], list[dict[str, Any]]]) -> bytes:
    """The text a scrape gets: each gauge in :data:`GAUGES`, one sample per job; each in :data:`RANK_GAUGES`,
    one per job and rank."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Jobs(summaries))
    return generate_latest(registry)
