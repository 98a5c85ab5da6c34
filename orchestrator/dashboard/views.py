"""View models: the plain dicts behind every page and every ``/api`` answer.

:class:`Reader` holds what outlives a request (the storage, the checksum verdicts,
the sinks' parsed points, each job's ledger, and what each job's page derives from them,
:mod:`.derived`). Each view reads the job afresh, so a refresh shows a running job's
progress, fetching only what was written since the last one and deriving again only
when something was.
``history`` is the JSON dump of :func:`spotrun.orchestrator.ledger.history.history`'s model: the
document ``spotrun history --json`` prints; the views themselves read the model's attributes.
"""

from __future__ import annotations

import re
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import numpy as np

from spotrun.orchestrator.dashboard.checksums import ChecksumCache
from spotrun.orchestrator.dashboard.curve import PAGE_POINTS, check_range, curve
from spotrun.orchestrator.dashboard.derived import Derived, DerivedCache, derive
from spotrun.orchestrator.dashboard.queries import check_page, check_window, paged, window
from spotrun.orchestrator.ledger.access import JobNotFound, job_ids, require_job
from spotrun.orchestrator.ledger.columns import PointColumns, from_us
from spotrun.orchestrator.ledger.events import CorruptEvent, LedgerEvent
from spotrun.orchestrator.ledger.history import history
from spotrun.orchestrator.ledger.history_model import History
from spotrun.orchestrator.ledger.points import (
    LogCache,
    ObjectCache,
    Points,
    SqliteCache,
    read_points,
    replaced,
)
from spotrun.orchestrator.ledger.store import Ledger
from spotrun.trainer.bundle.bundles import BundleRef, list_bundles, read_manifest
from spotrun.trainer.bundle.errors import BundleError
from spotrun.trainer.bundle.manifest import ManifestError
from spotrun.trainer.observe.ranklog import list_rank_logs, read_rank_log
from spotrun.trainer.observe.stacks import stacks_key
from spotrun.trainer.storage import Storage, StorageError

QUIET_AFTER_S = 300.0  # a "running" job silent this long is flagged: its driver may be gone
_NUMBER = re.compile(r"^[0-9]{1,9}$")  # an attempt or a rank in an address: digits only, no sign, no path


def stacks_url(job_id: str, attempt: int, rank: int | None) -> str | None:
    """Where the job page links the stacks of ``rank`` of ``attempt`` (served by :meth:`Reader.stacks`)."""
    return None if rank is None else f"/jobs/{job_id}/stacks/{attempt}/{rank}"


@dataclass
class Reader:
    storage: Storage
    metrics_local_dir: str = "./spotrun-metrics"  # where non-file storage keeps local sinks
    checks: ChecksumCache = field(default_factory=ChecksumCache)
    logs: LogCache = field(default_factory=LogCache)
    objects: ObjectCache = field(default_factory=ObjectCache)
    tables: SqliteCache = field(default_factory=SqliteCache)
    _cache: DerivedCache = field(default_factory=DerivedCache)  # per job: history, spans, loss rows, curves
    ledgers: dict[str, Ledger] = field(default_factory=dict)  # per job: a refresh fetches only new events
    scraped: dict[str, dict[str, Any]] = field(default_factory=dict)  # per job: what /metrics last read of it
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def jobs(self) -> list[dict[str, Any]]:
        return [self.job(j)["summary"] for j in job_ids(self.storage)]

    def scrape(self) -> list[dict[str, Any]]:
        """What ``/metrics`` exports: each job's summary, read now, with ``storage_up`` 1. A job whose storage
        refused this read keeps the summary last read of it (none when there is none) with ``storage_up``
        0; when the list of jobs itself is refused, so does every job read before."""
        try:
            ids = job_ids(self.storage)
        except StorageError:
            ids = list(self.scraped)
        out = []
        for job_id in ids:
            try:
                summary = {**self.job(job_id)["summary"], "storage_up": 1}
            except JobNotFound:  # listed, then deleted
                self.scraped.pop(job_id, None)
                continue
            except StorageError:
                summary = {**self.scraped.get(job_id, {"job_id": job_id}), "storage_up": 0}
            self.scraped[job_id] = summary
            out.append(summary)
        return out

    def points(self, job_id: str) -> Points:
        return read_points(self.storage, job_id, self.metrics_local_dir, self.logs, self.objects, self.tables)

    def ledger(self, job_id: str) -> Ledger:
        """The job's ledger, kept between requests (it only reads: it never folds)."""
        with self._lock:
            return self.ledgers.setdefault(job_id, Ledger(self.storage, job_id, fold=None))

    def _derived(self, job_id: str, points: Points | None = None,
                 listing: list[BundleRef] | None = None) -> tuple[Derived, Points, list[BundleRef]]:
        """The job's derived figures (kept while its events, points and newest bundle are unchanged), with
        the points and the bundle listing they came from; each is read here when not given."""
        ledger = self.ledger(job_id)
        with ThreadPoolExecutor(1, thread_name_prefix="spotrun-points") as pool:
            # the sinks read on a thread while this one lists the bundles and reads the ledger: at a week's
            # scale each takes a good part of a second, and most of it (file reads, SQLite's steps, Arrow's
            # parse, directory listings) runs without the GIL
            reading = pool.submit(self.points, job_id) if points is None else None
            bundles = list_bundles(self.storage, job_id) if listing is None else listing
            events = ledger.read()
            read = reading.result() if reading is not None else points
        assert read is not None  # given, or read just above

        def build() -> Derived:
            hist = history(self.storage, job_id, read, ledger=ledger, listing=bundles)
            # a hung or stuck rank's stacks: the loss was recorded by the attempt before
            return derive(hist, read, lambda r: stacks_url(job_id, r["attempt"] - 1, r["rank"])
                          if r["stacks"] else None)

        return self._cache.get(job_id, events, read, bundles, build), read, bundles

    def job(self, job_id: str, restart_page: int = 1, bundle_page: int = 1, lo: int | None = None,
            hi: int | None = None) -> dict[str, Any]:
        """Everything the job page shows: page ``restart_page`` of the restarts and ``bundle_page`` of the
        bundles (1: the newest :data:`~.queries.PER_PAGE`), the loss over updates ``[lo, hi]`` cut to
        :data:`~.curve.PAGE_POINTS`. Raises :class:`~.access.JobNotFound` for an unknown id and
        :class:`~.queries.BadQuery` for a page or range that does not exist."""
        require_job(self.storage, job_id)
        check_range(lo, hi, PAGE_POINTS)
        check_page(restart_page, "restart_page")
        check_page(bundle_page, "bundle_page")
        d, points, listing = self._derived(job_id)
        rows = self._bundle_rows(listing, d.history)
        shown_rows, bundles_page = paged(rows, bundle_page, "bundle_page")
        newest_restarts, restarts_page = paged(d.restarts[::-1], restart_page, "restart_page")
        return {
            "summary": _summary(d, rows, self._total_updates(rows)),
            "history": d.history_doc,
            "timeline": d.spans,
            "restarts": newest_restarts[::-1],  # the page's rows in the order they happened
            "restarts_page": restarts_page,
            "bundles": [self._bundle_detail(r, verify=False) for r in shown_rows],
            "bundles_page": bundles_page,
            "loss": {**d.curve(lo, hi, PAGE_POINTS),
                     "restarts": [{"attempt": r["attempt"], "restored_update": r["restored_update"],
                                   "lost_range": r["lost_range"], "cause": r["cause"]} for r in d.restarts],
                     "source": points.source, "has_log": points.log is not None},
        }

    def history(self, job_id: str) -> dict[str, Any]:
        """What ``spotrun history JOB_ID --json`` prints."""
        return self._derived(require_job(self.storage, job_id))[0].history_doc

    def bundles(self, job_id: str, verify: bool = False, offset: int = 0,
                limit: int | None = None) -> list[dict[str, Any]]:
        """The bundles table, newest first: ``limit`` rows (``None``: all) from ``offset``; only those rows'
        manifests are read (and with ``verify``, their checksums checked)."""
        require_job(self.storage, job_id)
        check_window(offset, limit, "bundles")
        d, _, listing = self._derived(job_id)
        rows = self._bundle_rows(listing, d.history)
        start, stop = window(len(rows), offset, limit)
        return [self._bundle_detail(r, verify) for r in rows[start:stop]]

    def metrics(self, job_id: str, name: str | None = None, lo: int | None = None, hi: int | None = None,
                n_out: int | None = None) -> dict[str, Any]:
        """Final points (one per update) and replaced writes of ``name`` (``None``: every metric). With a range
        ``[lo, hi]`` or ``n_out``, each metric's points in the range, cut to about ``n_out`` (restart edges
        kept: :func:`~.curve.curve`), its replaced writes in the range exact, and ``range`` per metric."""
        require_job(self.storage, job_id)
        check_range(lo, hi, n_out)
        points = self.points(job_id)
        final = points.final
        names = sorted(final.names[c] for c in np.unique(final.name))
        chosen = [name] if name else names
        doc: dict[str, Any] = {"job_id": job_id, "source": points.source, "has_log": points.log is not None,
                               "names": names}
        series = {n: final.named(n) for n in chosen}
        if lo is None and hi is None and n_out is None:  # every point, as this answer has always been
            return {**doc, "points": [_api_row(series[n], i) for n in chosen for i in range(len(series[n]))],
                    "replaced": {n: replaced(points, n) for n in chosen}}
        restarts = self._derived(job_id, points)[0].history_doc["restarts"]
        curves = {n: curve(series[n], replaced(points, n), restarts, lo=lo, hi=hi, n_out=n_out, row=_api_row)
                  for n in chosen}
        return {**doc, "points": [p for n in chosen for p in curves[n]["points"]],
                "replaced": {n: c["replaced"] for n, c in curves.items()},
                "range": {n: c["range"] for n, c in curves.items()}}

    def events(self, job_id: str) -> list[dict[str, Any]]:
        """Every ledger event in order; an unparsable file is an event of kind ``corrupt``."""
        require_job(self.storage, job_id)
        return [_event_doc(e) for e in self.ledger(job_id).read()]

    def events_tail(self, job_id: str, n: int) -> tuple[int, list[dict[str, Any]]]:
        """How many events the ledger holds, and the newest ``n`` of them as :meth:`events` gives them
        (the job page lists the newest few of a week's tens of thousands)."""
        require_job(self.storage, job_id)
        events = self.ledger(job_id).read()
        return len(events), [_event_doc(e) for e in events[max(0, len(events) - n):]] if n > 0 else []

    def rank_logs(self, job_id: str) -> list[dict[str, Any]]:
        """Every rank log of the job (what each rank's code wrote, per attempt), with the address of its text."""
        require_job(self.storage, job_id)
        return [{"attempt": ref.attempt, "rank": ref.label, "segments": len(ref.keys),
                 "url": f"/jobs/{job_id}/logs/{ref.attempt}/{ref.label.replace(' ', '-')}"}
                for ref in list_rank_logs(self.storage, job_id)]

    def rank_log(self, job_id: str, attempt: int, name: str) -> str:
        """The text of one rank log (``name``: ``rank-1``), found among the job's logs, never built into a
        key from the request: :class:`~.access.JobNotFound` when there is none of that attempt and name."""
        require_job(self.storage, job_id)
        for ref in list_rank_logs(self.storage, job_id):
            if ref.attempt == attempt and ref.label.replace(" ", "-") == name:
                return read_rank_log(self.storage, ref)
        raise JobNotFound(f"job {job_id!r} has no log of {name!r} in attempt {attempt}")

    def stacks(self, job_id: str, attempt: str, rank: str) -> str:
        """The stacks taken from ``rank`` of ``attempt`` before it was killed (hung or stuck), as text.

        The key is built here, from the job id (a job under the root) and two plain decimal numbers,
        never taken from the request: anything else (``..``, a sign, a path) is :class:`~.access.JobNotFound`,
        as is a rank whose stacks were never kept."""
        require_job(self.storage, job_id)
        if not (_NUMBER.fullmatch(attempt) and _NUMBER.fullmatch(rank)):
            raise JobNotFound(f"no stacks of rank {rank!r} in attempt {attempt!r}: both are plain numbers")
        key = stacks_key(job_id, int(attempt), int(rank))
        if not self.storage.exists(key):
            raise JobNotFound(f"job {job_id!r} kept no stacks of rank {int(rank)} in attempt {int(attempt)}")
        return self.storage.get(key).decode(errors="replace")

    @staticmethod
    def _bundle_rows(listing: list[BundleRef], hist: History) -> list[dict[str, Any]]:
        """Every bundle of the job (newest first) from its listing alone: name, update, attempt, status.
        No manifest is read here: a week's job has tens of thousands, a page shows fifty."""
        last_attempt = hist.attempts[-1].attempt if hist.attempts else None
        rows, newest_published = [], None
        for ref in listing:
            row: dict[str, Any] = {"bundle": ref.key, "name": ref.key.rsplit("/", 1)[-1], "update": ref.update,
                                   "attempt": ref.attempt, "published": ref.published}
            if ref.published:
                newest_published = newest_published or ref.update
                row["status"] = "published"
            else:
                writing = (hist.state == "running" and ref.attempt == last_attempt
                           and (newest_published is None or ref.update > newest_published))
                row["status"] = "writing" if writing else "orphaned"
            rows.append(row)
        return rows

    def _bundle_detail(self, row: dict[str, Any], verify: bool) -> dict[str, Any]:
        """A row of :meth:`_bundle_rows` with what its manifest says and its checksums' verdict."""
        row = dict(row)
        if not row["published"]:
            row.update(checksum="n/a", checksum_detail="no manifest: never published, never restored",
                       files=len(self.storage.list(row["bundle"] + "/")))
            return row
        try:
            m = read_manifest(self.storage, row["bundle"])
            row.update(bytes=m.total_bytes, stall_seconds=m.stall_seconds, capture_seconds=m.capture_seconds,
                       write_wait_seconds=m.write_wait_seconds, write_seconds=m.write_seconds,
                       cursor=m.data.cursor.model_dump(), recovery_label=m.recovery_label,
                       created_at=m.created_at.isoformat(), files=len(m.files))
        except (ManifestError, BundleError, OSError) as e:  # BundleError: collected meanwhile
            row["error"] = str(e)
        verdict = self.checks.verify(self.storage, row["bundle"]) if verify else self.checks.get(row["bundle"])
        if "error" in row:
            verdict = {"state": "corrupt", "detail": row["error"], "verified_at": None}
        row.update(checksum=verdict["state"], checksum_detail=verdict["detail"], verified_at=verdict["verified_at"])
        return row

    def _total_updates(self, rows: list[dict[str, Any]]) -> int | None:
        """The job's total updates (``train.updates``) from the newest readable manifest."""
        for row in rows:
            if not row["published"]:
                continue
            try:
                return read_manifest(self.storage, row["bundle"]).spec.get("train", {}).get("updates")
            except (ManifestError, BundleError, OSError):
                continue  # unreadable: the next one may say
        return None


def _api_row(points: PointColumns, i: int) -> dict[str, Any]:
    """A final point as ``/api/jobs/{id}/metrics`` lists it."""
    return {"update": int(points.update[i]), "name": points.names[points.name[i]], "value": float(points.value[i]),
            "attempt": int(points.attempt[i]), "at": from_us(int(points.at_us[i])).isoformat()}


def _event_doc(e: LedgerEvent | CorruptEvent) -> dict[str, Any]:
    """An event as the API lists it: kind, attempt and time first (a corrupt one as it is)."""
    doc = e.model_dump(mode="json")
    if not isinstance(e, CorruptEvent):
        doc = {"kind": doc.pop("kind"), "attempt": doc.pop("attempt"), "at": doc.pop("at"), **doc}
    return doc


def _summary(d: Derived, rows: list[dict[str, Any]], total: int | None) -> dict[str, Any]:
    """One jobs-page row: state, attempts, restarts, updates done of total, last bundle, time lost."""
    hist, attempt_spans = d.history, d.spans
    published = [r for r in rows if r["published"]]
    last_seen = max((s["end"] for s in attempt_spans if s["end"]), default=None)
    quiet = (datetime.now(UTC) - datetime.fromisoformat(last_seen)).total_seconds() if last_seen else None
    done = max([d.max_update,
                *(s["reached_update"] or 0 for s in attempt_spans), *(r["update"] for r in published)])
    return {
        "job_id": hist.job_id,
        "state": hist.state,
        "quiet": hist.state == "running" and quiet is not None and quiet > QUIET_AFTER_S,
        "quiet_seconds": round(quiet, 1) if quiet is not None else None,
        "attempts": len(hist.attempts),
        "restarts": len(hist.restarts),
        "updates_done": done,
        "updates_total": total,
        "last_published": {"bundle": published[0]["bundle"], "update": published[0]["update"]} if published else None,
        "time_lost_seconds": hist.totals.time_lost_seconds,
        "lost_updates": hist.totals.lost_updates,
        "replayed_updates": hist.goodput.replayed_updates,
        "goodput": hist.goodput.goodput,
        "badput_usd": hist.goodput.badput_usd,
        "started_at": attempt_spans[0]["start"] if attempt_spans else None,
        "last_seen_at": last_seen,
        "corrupt_events": len(hist.corrupt_events),
        "orphaned_bundles": sum(r["status"] == "orphaned" for r in rows),
        # the newest attempt's newest figures, by rank (empty: none recorded): /metrics' spotrun_rank_slowdown
        "rank_slowdown": {str(x.rank): x.slowdown for x in hist.slowdowns},
        "newest_published_at": hist.newest_published_at,  # /metrics' spotrun_seconds_since_last_bundle
    }
