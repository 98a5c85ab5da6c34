"""Storage every rank can see: a probe at the start of each attempt.

The driver publishes bundles from the files its ranks wrote, so the driver and every rank must
see the same storage. ``storage: file://./runs`` on a multi-node cluster breaks that quietly:
each node resolves the path on its own disk, ranks write their bundle files there, and the
driver can never publish them (or, worse, publishes from a disk a restarted rank cannot read).

So before any restore or update, each attempt proves the storage is shared, in both directions:

1. the driver writes its probe, ``<job>/probes/<attempt>-<nonce>/driver.json``
   (:func:`post_driver_probe`);
2. each rank reads that probe back from the storage as the rank resolved it, then writes its
   own, ``.../rank-<r>.json`` (:func:`answer_probe`, called where the rank is set up);
3. the driver finds every rank's probe there (:func:`check_answers`), then removes the
   attempt's probes (:func:`remove_probes`, best effort).

A failure in either direction raises :class:`StorageNotShared` naming the rank, its node, the
storage as the rank and as the driver resolved it, and the fix. The nonce makes every probe
unique: a probe left behind (a driver killed between steps 1 and 3) can never stand in for
this attempt's, and nothing reads ``<job>/probes/`` but this module (bundles live under
``<job>/bundles/``; listing, restore and retention look nowhere else), so such a leftover is
inert and may be deleted at any time.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from spotrun.trainer.job.contract import JobError
from spotrun.trainer.storage import Storage, StorageError, StorageUnavailableError

log = logging.getLogger("spotrun.visibility")

FIX = ("Every rank and the driver must see the same files: use `storage: s3://BUCKET/PREFIX` (with "
       "`storage_endpoint_url` for an S3-compatible service), or a file system mounted at the same path on "
       "every node (NFS, EFS, Lustre, ...).")


class StorageNotShared(JobError):
    """A rank and the driver do not see the same storage; the message names the node and the fix."""


class Node(BaseModel):
    """Where a process runs: its Ray node and that node's address."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    node_id: str
    ip: str
    host: str

    def __str__(self) -> str:
        return f"node {self.node_id} ({self.host}, {self.ip})"


class Probe(BaseModel):
    """The body of one probe object: who wrote it, for which attempt, and the storage as it resolved it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: Literal[1] = 1
    job_id: str
    attempt: int
    nonce: str  # fresh per attempt: a probe left by another driver or attempt never matches
    role: Literal["driver", "rank"]
    rank: int | None = None  # role == "rank" only
    node: Node
    storage: str  # the storage URI as this writer resolved it (:func:`resolved`)

    @property
    def key(self) -> str:
        name = "driver" if self.role == "driver" else f"rank-{self.rank}"
        return f"{attempt_prefix(self.job_id, self.attempt, self.nonce)}{name}.json"

    def who(self) -> str:
        return f"the driver on {self.node}" if self.role == "driver" else f"rank {self.rank} on {self.node}"


class RankProbe(BaseModel):
    """What a rank is given at setup: the driver's probe to read back, and where the rank runs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    driver: Probe
    rank: int
    node: Node


def probes_prefix(job_id: str) -> str:
    return f"{job_id}/probes/"


def attempt_prefix(job_id: str, attempt: int, nonce: str) -> str:
    return f"{probes_prefix(job_id)}{attempt}-{nonce}/"


def resolved(storage: Storage) -> str:
    """The storage as this process resolved it: its URI (an absolute path for ``file://``) and, for
    S3, the endpoint its client talks to (which a node's environment may set: ``AWS_ENDPOINT_URL``)."""
    endpoint = getattr(storage, "endpoint", None)
    return f"{storage.uri} (endpoint {endpoint})" if endpoint else storage.uri


def post_driver_probe(storage: Storage, job_id: str, attempt: int, node: Node) -> Probe:
    """Step 1, on the driver: write a fresh probe and return it (each rank gets it in a :class:`RankProbe`)."""
    probe = Probe(job_id=job_id, attempt=attempt, nonce=uuid.uuid4().hex[:12], role="driver", node=node,
                  storage=resolved(storage))
    storage.put(probe.key, probe.model_dump_json().encode())
    return probe


def answer_probe(storage: Storage, request: RankProbe) -> Probe:
    """Step 2, on a rank: read the driver's probe back from this rank's ``storage``, then write the rank's
    own probe and return it (the driver checks it with :func:`check_answers`). Raises
    :class:`StorageNotShared` when the driver's probe is not there, writing nothing."""
    driver = request.driver
    mine = Probe(job_id=driver.job_id, attempt=driver.attempt, nonce=driver.nonce, role="rank", rank=request.rank,
                 node=request.node, storage=resolved(storage))
    missing = _unseen(storage, driver)
    if missing:
        raise StorageNotShared(_refusal(reader=mine, writer=driver, why=missing))
    storage.put(mine.key, mine.model_dump_json().encode())
    return mine


def check_answers(storage: Storage, driver: Probe, answers: Sequence[Probe]) -> None:
    """Step 3, on the driver: find every rank's probe in one listing of the attempt's probes (one request
    whatever the world size; the nonce in their keys means only this attempt's ranks wrote them);
    :class:`StorageNotShared` names the first rank whose probe the driver cannot see."""
    seen = set(storage.list(attempt_prefix(driver.job_id, driver.attempt, driver.nonce)))
    for answer in answers:
        if answer.key not in seen:
            raise StorageNotShared(_refusal(reader=driver, writer=answer, why="it is not there"))


def remove_probes(storage: Storage, driver: Probe) -> None:
    """Delete the attempt's probes (best effort: a probe left behind is inert, see the module docstring)."""
    try:
        storage.delete_prefix(attempt_prefix(driver.job_id, driver.attempt, driver.nonce))
    except (OSError, StorageError) as e:
        log.warning("could not remove the storage probes of attempt %d: %s", driver.attempt, e)


def _unseen(storage: Storage, probe: Probe) -> str | None:
    """Why ``probe`` cannot be read back from ``storage`` as it was written; None when it can."""
    try:
        found = Probe.model_validate_json(storage.get(probe.key))
    except FileNotFoundError:
        return "it is not there"
    except StorageUnavailableError:
        raise  # an outage, not another storage: the attempt is placed again once storage answers
    except (OSError, StorageError) as e:
        return f"reading it failed: {e}"
    except ValidationError:
        found = None
    return None if found == probe else "what is there is not this probe"


def _refusal(*, reader: Probe, writer: Probe, why: str) -> str:
    """The refusal: who could not see whose probe, the storage as each resolved it, and the fix."""
    rank = reader if reader.role == "rank" else writer
    driver = writer if reader.role == "rank" else reader
    same = rank.storage == driver.storage and rank.storage.startswith("file://")
    hint = (f" The same path, but not the same files: rank {rank.rank}'s node has a disk (or mount) of its own "
            "there." if same else "")
    return (f"storage is not shared: {reader.who()} cannot see the probe {writer.who()} wrote at the start of "
            f"attempt {writer.attempt} ({writer.key}: {why}). Rank {rank.rank} resolved storage to {rank.storage}; "
            f"the driver resolved it to {driver.storage}.{hint} Nothing was trained. {FIX}")
