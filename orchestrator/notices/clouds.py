"""Each cloud's preemption notice, read from the node's own metadata endpoint, and the one watcher
that polls them.

- ``aws``: IMDSv2 (a session token from ``PUT /latest/api/token``).
  ``/latest/meta-data/spot/instance-action`` holds ``{"action", "time"}`` once the spot instance is
  to be interrupted, 2 minutes ahead (``time``); ``/latest/meta-data/events/recommendations/rebalance``
  holds ``{"noticeTime"}`` when the instance is at elevated risk of interruption, often minutes
  earlier and sometimes with none following: an *early checkpoint* (publish, keep training).
- ``gcp``: the metadata server's ``/computeMetadata/v1/instance/preempted`` (``Metadata-Flavor:
  Google``) answers ``TRUE`` once the VM is being preempted; it stops ~30 s later.
- ``azure``: Scheduled Events, ``/metadata/scheduledevents`` (``Metadata: true``), lists a ``Preempt``
  event naming this VM with its ``NotBefore`` time (≥ 30 s ahead).

A source answers with what each of its endpoints holds now (:meth:`CloudSource.ask`) and turns one
answer into sightings (:meth:`CloudSource.parse`); :class:`CloudWatcher` does the rest for all of
them alike: it polls on a daemon thread, hands each new answer on once (an answer polled again is the
same notice), reports an answer it cannot understand as a *malformed* notice (ignored, recorded) and
the first failure to reach a source as an *unreachable* one (later failures are logged at DEBUG).
Where the spec names no source and sets no endpoint, the watcher first asks each cloud's endpoint
whether it is there (:meth:`CloudSource.present`) and watches the one that is, quietly watching
nothing on a machine that has none."""

from __future__ import annotations

import http.client
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from email.utils import parsedate_to_datetime
from typing import Protocol

from spotrun.orchestrator.notices.notice import CloudName, Notice, NoticeCallback
from spotrun.trainer.job.sections import PreemptionSpec

log = logging.getLogger("spotrun.clouds")
LINK_LOCAL = "http://169.254.169.254"  # every cloud's metadata endpoint, as seen from one of its VMs
GCP_WARNING_S = 30.0  # GCP stops a preempted VM about this long after instance/preempted turns TRUE
PROBE_TIMEOUT_S = 1.0  # detection: an endpoint that does not answer this fast is taken as absent
ASK_TIMEOUT_S = 2.0
AZURE_API = "api-version=2020-07-01"
# what asking an endpoint raises when it cannot be asked (refused, timed out, a broken HTTP answer)
UNREACHABLE = (OSError, http.client.HTTPException)


@dataclass(frozen=True)
class Sighting:
    """One notice as a source understood it."""

    event: str  # the cloud's identity of the event: the same one seen again (or by another rank) is one
    deadline: datetime | None  # when the machine goes; None: not a deadline (an early checkpoint)
    detail: str
    early: bool = False  # checkpoint at the next boundary and keep training (AWS's rebalance recommendation)
    ack: str | None = None  # the event to acknowledge once its bundle is published (Azure, when turned on)


class CloudSource(Protocol):
    name: CloudName
    url: str
    what: str  # how the endpoint is called in messages

    def present(self) -> bool:
        """Whether this cloud's endpoint answers here (detection; never raises)."""

    def ask(self) -> list[tuple[str, bytes]]:
        """(endpoint, body) for each of the source's endpoints that holds something now; raises
        one of :data:`UNREACHABLE` when the source cannot be asked."""

    def parse(self, endpoint: str, body: bytes, received: datetime) -> list[Sighting]:
        """The notices in one answer (none: nothing scheduled); raises ``ValueError`` when malformed."""

    def acknowledge(self, event: str) -> None:
        """Tell the cloud the machine is done with ``event`` (raises ``OSError``; a no-op where the cloud
        has no such thing)."""


def _get(url: str, headers: dict[str, str], timeout: float = ASK_TIMEOUT_S, method: str = "GET",
         data: bytes | None = None) -> tuple[bytes, dict[str, str]] | None:
    """The body and headers of a 2xx answer; None for a 404 (nothing there). Other failures raise OSError."""
    req = urllib.request.Request(url, headers=headers, method=method, data=data)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.read(), dict(r.headers)
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return None
        raise


def _iso(text: str, what: str) -> datetime:
    try:
        at = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError as e:
        raise ValueError(f"{what} {text!r} is not an ISO timestamp") from e
    return at if at.tzinfo is not None else at.replace(tzinfo=UTC)


def _json_object(body: bytes, what: str) -> dict:
    try:
        doc = json.loads(body)
    except ValueError as e:
        raise ValueError(f"{what} body is not JSON: {body[:80]!r}") from e
    if not isinstance(doc, dict):
        raise ValueError(f"{what} body is not a JSON object: {body[:80]!r}")
    return doc


def parse_instance_action(body: bytes) -> tuple[str, datetime]:
    """``{"action": "terminate", "time": "2026-11-29T10:22:00Z"}`` -> (action, deadline). Raises ValueError."""
    doc = _json_object(body, "instance-action")
    if not isinstance(doc.get("action"), str) or not isinstance(doc.get("time"), str):
        raise ValueError(f"instance-action body lacks string 'action' and 'time': {body[:80]!r}")
    return doc["action"], _iso(doc["time"], "instance-action time")


class AwsSource:
    """EC2's IMDSv2: the spot interruption notice and the rebalance recommendation. The session token
    is asked for once and reused until ``TOKEN_RENEW_S`` before it expires (or until the service
    refuses it with a 401: replaced once)."""

    name: CloudName = "aws"
    what = "instance metadata service"
    TOKEN_TTL_S = 300
    TOKEN_RENEW_S = 30  # a token this close to its expiry is renewed before use
    ENDPOINTS = {"instance-action": "/latest/meta-data/spot/instance-action",
                 "rebalance": "/latest/meta-data/events/recommendations/rebalance"}

    def __init__(self, url: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.url = url.rstrip("/")
        self.clock = clock
        self._token: str | None = None
        self._token_expires = 0.0

    def present(self) -> bool:
        try:
            self._session_token(timeout=PROBE_TIMEOUT_S)
            return True
        except UNREACHABLE:
            return False

    def _session_token(self, timeout: float = ASK_TIMEOUT_S) -> str:
        if self._token is None or self.clock() >= self._token_expires - self.TOKEN_RENEW_S:
            asked_at = self.clock()
            got = _get(f"{self.url}/latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds": str(self.TOKEN_TTL_S)},
                       timeout, method="PUT")
            if got is None:
                raise OSError(f"{self.url} has no IMDSv2 token endpoint (404)")
            self._token = got[0].decode()
            self._token_expires = asked_at + self.TOKEN_TTL_S
        return self._token

    def ask(self) -> list[tuple[str, bytes]]:
        out = []
        for endpoint, path in self.ENDPOINTS.items():
            try:
                got = self._ask(path)
            except urllib.error.HTTPError as e:
                if e.code != 401:
                    raise
                self._token = None  # expired early, or the service restarted
                got = self._ask(path)
            if got is not None:
                out.append((endpoint, got))
        return out

    def _ask(self, path: str) -> bytes | None:
        got = _get(f"{self.url}{path}", {"X-aws-ec2-metadata-token": self._session_token()})
        return None if got is None else got[0]

    def parse(self, endpoint: str, body: bytes, received: datetime) -> list[Sighting]:
        if endpoint == "instance-action":
            action, deadline = parse_instance_action(body)
            return [Sighting(f"instance-action {deadline.isoformat()}", deadline, action)]
        doc = _json_object(body, "rebalance recommendation")
        if not isinstance(doc.get("noticeTime"), str):
            raise ValueError(f"rebalance recommendation lacks a string 'noticeTime': {body[:80]!r}")
        at = _iso(doc["noticeTime"], "rebalance noticeTime")
        return [Sighting(f"rebalance {at.isoformat()}", None, "rebalance recommendation: checkpoint early",
                         early=True)]

    def acknowledge(self, event: str) -> None:
        return None  # EC2 has nothing to acknowledge


class GcpSource:
    """GCE's metadata server: ``instance/preempted`` turns ``TRUE`` when a spot or preemptible VM is
    being preempted; the VM stops ~30 s later (:data:`GCP_WARNING_S`, counted from when this node saw
    it: the answer carries no time)."""

    name: CloudName = "gcp"
    what = "GCP metadata server"
    HEADERS = {"Metadata-Flavor": "Google"}
    PATH = "/computeMetadata/v1/instance/preempted"

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def present(self) -> bool:
        try:
            got = _get(f"{self.url}{self.PATH}", self.HEADERS, PROBE_TIMEOUT_S)
        except UNREACHABLE:
            return False
        return got is not None and got[1].get("Metadata-Flavor") == "Google"

    def ask(self) -> list[tuple[str, bytes]]:
        got = _get(f"{self.url}{self.PATH}", self.HEADERS)
        return [] if got is None else [("preempted", got[0])]

    def parse(self, endpoint: str, body: bytes, received: datetime) -> list[Sighting]:
        answer = body.strip()
        if answer == b"FALSE":
            return []
        if answer != b"TRUE":
            raise ValueError(f"instance/preempted answered {body[:80]!r}, not TRUE or FALSE")
        return [Sighting("preempted", received + timedelta(seconds=GCP_WARNING_S),
                         f"preempted: the VM stops ~{GCP_WARNING_S:.0f}s after this")]

    def acknowledge(self, event: str) -> None:
        return None  # GCE has nothing to acknowledge


class AzureSource:
    """Azure's Scheduled Events: a ``Preempt`` event that names this VM (its name from the instance
    metadata, asked once) with the time it may start (``NotBefore``, RFC 1123; blank once it began).
    Scheduled Events reach every VM of an availability set or scale-set placement group, so events
    for other VMs are skipped. With ``ack`` the event is acknowledged (``StartRequests``) once its
    bundle is published, handing the VM back sooner."""

    name: CloudName = "azure"
    what = "Azure Scheduled Events"
    HEADERS = {"Metadata": "true"}
    EVENTS = f"/metadata/scheduledevents?{AZURE_API}"
    NAME = "/metadata/instance/compute/name?api-version=2021-02-01&format=text"

    def __init__(self, url: str, ack: bool = False) -> None:
        self.url = url.rstrip("/")
        self.ack = ack
        self._vm: str | None = None

    def present(self) -> bool:
        try:
            self._vm_name(PROBE_TIMEOUT_S)
            return True
        except UNREACHABLE:
            return False

    def _vm_name(self, timeout: float = ASK_TIMEOUT_S) -> str:
        if self._vm is None:
            got = _get(f"{self.url}{self.NAME}", self.HEADERS, timeout)
            if got is None:
                raise OSError(f"{self.url} has no Azure instance metadata (404)")
            self._vm = got[0].decode().strip()
        return self._vm

    def ask(self) -> list[tuple[str, bytes]]:
        vm = self._vm_name()
        got = _get(f"{self.url}{self.EVENTS}", self.HEADERS)
        return [] if got is None else [(vm, got[0])]

    def parse(self, endpoint: str, body: bytes, received: datetime) -> list[Sighting]:
        doc = _json_object(body, "scheduledevents")
        events = doc.get("Events")
        if not isinstance(events, list) or not all(isinstance(e, dict) for e in events):
            raise ValueError(f"scheduledevents lacks a list of 'Events': {body[:80]!r}")
        out = []
        for e in events:
            if e.get("EventType") != "Preempt" or endpoint not in (e.get("Resources") or []):
                continue  # another kind of event, or another VM's
            if not isinstance(e.get("EventId"), str) or not isinstance(e.get("NotBefore", ""), str):
                raise ValueError(f"a Preempt event lacks a string 'EventId' or 'NotBefore': {e!r:.120}")
            out.append(Sighting(e["EventId"], self._not_before(e.get("NotBefore", ""), received),
                                f"Preempt {e['EventId']}", ack=e["EventId"] if self.ack else None))
        return out

    @staticmethod
    def _not_before(text: str, received: datetime) -> datetime:
        if not text.strip():
            return received  # the event has begun: no time left
        try:
            at = parsedate_to_datetime(text)
        except (TypeError, ValueError) as e:
            raise ValueError(f"Preempt NotBefore {text!r} is not an RFC 1123 time") from e
        return at if at.tzinfo is not None else at.replace(tzinfo=UTC)

    def acknowledge(self, event: str) -> None:
        body = json.dumps({"StartRequests": [{"EventId": event}]}).encode()
        _get(f"{self.url}{self.EVENTS}", {**self.HEADERS, "Content-Type": "application/json"}, method="POST",
             data=body)


def sources_for(p: PreemptionSpec) -> tuple[list[CloudSource], bool]:
    """The sources a node watches under ``p``, and whether they are only candidates to detect: the ones
    ``preemption.sources`` names (at their URL key, or the link-local endpoint); without that key, the
    ones whose URL key is set; with neither, every cloud at the link-local endpoint, to detect."""
    urls = {"aws": p.imds_url, "gcp": p.gcp_metadata_url, "azure": p.azure_metadata_url}
    names = list(p.sources) if p.sources is not None else [n for n, u in urls.items() if u]
    detect = p.sources is None and not names
    make: dict[str, Callable[[str], CloudSource]] = {
        "aws": AwsSource, "gcp": GcpSource, "azure": lambda u: AzureSource(u, ack=p.azure_ack)}
    return [make[n](urls[n] or LINK_LOCAL) for n in (list(urls) if detect else names)], detect


class CloudWatcher:
    """Polls ``sources`` every ``poll_s`` seconds on a daemon thread and hands each notice to
    ``on_notice`` (``node_id=None``: the driver's own machine, ``--no-ray``).

    Each answer is handed on once (polled again, it is the same notice). An answer a source cannot
    understand becomes a notice with ``malformed`` set (once per distinct answer); the first time a
    source cannot be reached, one with ``unreachable`` set (and a warning), later failures only a DEBUG
    line: a machine without that cloud's endpoint leaves one line in the ledger, not one per poll.
    With ``detect``, the thread first keeps only the sources whose endpoint answers
    (:meth:`CloudSource.present`) and, where none does, ends without a word above DEBUG."""

    def __init__(self, sources: list[CloudSource], poll_s: float, node_id: str | None, rank: int | None,
                 on_notice: NoticeCallback, detect: bool = False) -> None:
        self.sources = sources
        self.poll_s = poll_s
        self.node_id = node_id
        self.rank = rank
        self.on_notice = on_notice
        self.detect = detect
        self._unreachable: set[str] = set()  # source names reported so
        self._seen: set[tuple[str, str, bytes]] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="cloud-watcher", daemon=True)

    def start(self) -> CloudWatcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def acknowledge(self, notice: Notice) -> None:
        """Tell the cloud the bundle ``notice`` asked for is published (raises ``OSError``)."""
        for s in self.sources:
            if s.name == notice.source and notice.ack is not None:
                try:
                    s.acknowledge(notice.ack)
                except http.client.HTTPException as e:  # a broken answer: refused, as far as we can tell
                    raise OSError(f"{s.what} answered the acknowledgement of {notice.ack} badly: {e!r}") from e

    def poll(self) -> None:
        """:meth:`poll_once` on every source, an unreachable one reported (the first time), not raised."""
        for source in self.sources:
            try:
                self.poll_once(source)
            except UNREACHABLE as e:  # URLError and HTTPError are OSErrors; timeouts too
                if source.name in self._unreachable:
                    log.debug("%s %s still unreachable: %s", source.what, source.url, e)
                    continue
                self._unreachable.add(source.name)
                reason = f"{source.what} {source.url} unreachable: {e}"
                log.warning("%s; %s notices will not be seen from it (still polling)", reason, source.name)
                self.on_notice(self._notice(source.name, None, unreachable=reason))

    def poll_once(self, source: CloudSource) -> None:
        """One poll of ``source``; raises one of :data:`UNREACHABLE` when it cannot be asked."""
        for endpoint, body in source.ask():
            if (source.name, endpoint, body) in self._seen:
                continue  # the same answer polled again
            self._seen.add((source.name, endpoint, body))
            received = datetime.now(UTC)
            try:
                sightings = source.parse(endpoint, body, received)
            except ValueError as e:
                self.on_notice(self._notice(source.name, None, malformed=str(e), received_at=received))
                continue
            for s in sightings:
                self.on_notice(self._notice(source.name, s.deadline, event=s.event, detail=s.detail, early=s.early,
                                            ack=s.ack, received_at=received))

    def _notice(self, source: CloudName, deadline: datetime | None, **fields) -> Notice:
        return Notice(source=source, node_id=self.node_id, rank=self.rank, deadline=deadline, **fields)

    def _loop(self) -> None:
        if self.detect:
            self.sources = [s for s in self.sources if s.present()]
            log.debug("cloud notice sources detected: %s", [s.name for s in self.sources] or "none")
            if not self.sources:
                return
        while not self._stop.is_set():
            try:
                self.poll()
            except Exception:  # a bug in one poll must not end the watching: log it and poll again
                log.exception("polling for cloud notices failed")
            self._stop.wait(self.poll_s)


def watch_clouds(p: PreemptionSpec, node_id: str | None, rank: int | None,
                 on_notice: NoticeCallback) -> CloudWatcher | None:
    """Start watching the cloud notice sources ``p`` asks for (see :func:`sources_for`) on this node;
    None when it asks for none (``preemption.sources: []``)."""
    sources, detect = sources_for(p)
    if not sources:
        return None
    return CloudWatcher(sources, p.imds_poll_s, node_id, rank, on_notice, detect=detect).start()
