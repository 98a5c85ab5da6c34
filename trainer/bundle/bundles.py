"""Bundles: write a rank's capture in the background, publish the manifest, find and load (the compatibility
contract they are loaded under is :mod:`spotrun.trainer.bundle.compat`).

Layout under the storage root::

    <job_id>/bundles/u<attempted:010d>-a<attempt>/
        rank-<r>/...        written by each rank (background thread)
        manifest.json       written last, create-only, by one publisher

Each payload ``<stem>.pt`` of a capture is written as two files: its tensors,
as raw bytes streamed from the host buffers, in ``<stem>.safetensors``, and
the rest of it (the skeleton) as a small ``torch.save`` in ``<stem>.pt``
(:mod:`spotrun.trainer.bundle.tensorfile` says why the split). Bundles of manifest
schema 2 hold whole payloads in their ``.pt`` files and load as before.

Loading reads the manifest first (schema, then the compatibility contract),
and only then the files, each checked against its recorded size and digest
(:mod:`spotrun.trainer.storage.digest`) before it is deserialised. Tensor files are
parsed without unpickling and skeletons load with ``weights_only=True``: a
bundle is data, never code.
"""

from __future__ import annotations

import io
import json
import logging
import re
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import torch

from spotrun.trainer.bundle.compat import check_compatible  # noqa: E402
from spotrun.trainer.bundle.description import Description
from spotrun.trainer.bundle.errors import BundleCorrupt
from spotrun.trainer.bundle.manifest import (
    FileEntry,
    Manifest,
    ManifestError,
    UnknownSchemaError,
    parse_manifest,
)
from spotrun.trainer.bundle.tensorfile import TensorFileError, join, split
from spotrun.trainer.bundle.tensorfile import chunks as tensorfile_chunks
from spotrun.trainer.bundle.tensorfile import decode as decode_tensors
from spotrun.trainer.job.contract import check_weights_only
from spotrun.trainer.observe.faults import FaultInjector
from spotrun.trainer.runtime.sharding import Pieces, ShardError
from spotrun.trainer.state.training import Capture
from spotrun.trainer.storage import Outage, Storage, StorageError, StorageFullError
from spotrun.trainer.storage.digest import DEFAULT as DEFAULT_DIGEST
from spotrun.trainer.storage.digest import digest_of

log = logging.getLogger(__name__)
BUNDLE_DIR = re.compile(r"^u(\d{10})-a(\d+)$")


def bundles_prefix(job_id: str) -> str:
    return f"{job_id}/bundles/"


def bundle_dir(job_id: str, update: int, attempt: int) -> str:
    return f"{bundles_prefix(job_id)}u{update:010d}-a{attempt}"


@dataclass(frozen=True)
class BundleRef:
    """A bundle directory, published (its manifest exists) or not."""

    key: str
    update: int
    attempt: int
    published: bool


def list_bundles(storage: Storage, job_id: str) -> list[BundleRef]:
    """Every bundle directory of the job, newest first (by update, then attempt)."""
    prefix = bundles_prefix(job_id)
    dirs: dict[str, tuple[int, int, bool]] = {}  # name -> (update, attempt, published)
    for key in storage.list(prefix):
        name, _, rest = key[len(prefix):].partition("/")
        m = BUNDLE_DIR.match(name)
        if m:
            published = (name in dirs and dirs[name][2]) or rest == "manifest.json"
            dirs[name] = (int(m.group(1)), int(m.group(2)), published)
    refs = [BundleRef(prefix + name, update, attempt, published)
            for name, (update, attempt, published) in dirs.items()]
    return sorted(refs, key=lambda r: (r.update, r.attempt), reverse=True)


# -- writing ----------------------------------------------------------------------------


# Files whose content the job's own code produced (registered objects, a stream's state): what they
# hold may change as training goes on, so each write proves it loads back as data.
_JOB_STATE_FILES = ("/user.pt", "/stream.pt")
TENSORS_SUFFIX = ".safetensors"

Encoded = dict[str, list[bytes | memoryview]]


def encode(capture: Capture) -> Encoded:
    """Each bundle file of ``capture`` as a list of chunks whose concatenation is the file.

    A torch payload ``<stem>.pt`` becomes two files (:mod:`~spotrun.trainer.bundle.tensorfile`): its
    tensors in ``<stem>.safetensors``, as views of the capture's host buffers (nothing is copied:
    the writer streams them to storage), and the small rest, the skeleton, ``torch.save``-d to
    ``<stem>.pt``. A payload without tensors has no tensor file."""
    out: Encoded = {}
    for path, payload in capture.torch_files.items():
        skeleton, tensors = split(payload)
        buf = io.BytesIO()
        torch.save(skeleton, buf)
        blob = buf.getvalue()
        if path.endswith(_JOB_STATE_FILES):
            _check_loads_as_data(path, payload, blob)
        if tensors:
            out[path.removesuffix(".pt") + TENSORS_SUFFIX] = tensorfile_chunks(tensors)
        out[path] = [blob]
    for path, payload in capture.json_files.items():
        out[path] = [json.dumps(payload, sort_keys=True).encode()]
    return out


def _check_loads_as_data(path: str, payload: dict[str, Any], blob: bytes) -> None:
    """Raise a :class:`JobError` naming the object whose state a weights-only load refuses (the
    bundle is not written: a restore could never read it). Tensors always load as data; what
    needs proof is the skeleton ``blob``."""
    try:
        torch.load(io.BytesIO(blob), weights_only=True)
    except Exception:  # noqa: BLE001 - name the culprit below
        parts = payload.get("objects", {"stream": payload.get("stream")})
        for name, state in parts.items():
            owner = "the StreamData stream" if path.endswith("/stream.pt") else f"spotrun.Job(state={{{name!r}: ...}})"
            check_weights_only(f"{owner} (at a checkpoint)", state)
        raise


def _size(chunks: list[bytes | memoryview]) -> int:
    return sum(memoryview(c).nbytes for c in chunks)


@dataclass(frozen=True)
class WriteResult:
    bundle_key: str
    update: int
    files: list[FileEntry]
    write_seconds: float
    capture: Capture | None = None  # what was written (its buffers hold it until the next capture)
    shipped: dict[str, bytes] = field(default_factory=dict)  # the files the driver keeps (trainer/run/warm.py)


class BundleWriter:
    """Writes one rank's captures in a background thread, at most one capture in flight, its
    files several at a time (``files_in_flight``): each file's digest (``digest``, an algorithm of
    :mod:`spotrun.trainer.storage.digest`) hashes its chunks on every core while the file is written."""

    def __init__(self, storage: Storage, faults: FaultInjector, files_in_flight: int = 4,
                 digest: str = DEFAULT_DIGEST, ship: Callable[[Encoded], dict[str, bytes]] | None = None) -> None:
        """``ship``: which written files (as bytes) go back with the result, for the driver to keep."""
        self.storage = storage
        self.ship = ship
        self.faults = faults
        self.digest = digest
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bundle-writer")
        self._files = ThreadPoolExecutor(max_workers=files_in_flight, thread_name_prefix="bundle-file")
        self._pending: Future[WriteResult] | None = None

    def submit(self, capture: Capture, bundle_key: str, until: Outage | None = None) -> WriteResult | None:
        """Start writing ``capture``; returns the previous write's result if one was in flight. ``until``:
        a write the storage refuses is written again, whole, until it succeeds (the job's last bundle;
        :meth:`~spotrun.trainer.storage.Outage.call` raises a permanent refusal that persisted)."""
        previous = self.wait()
        write = partial(self._write, capture, bundle_key)
        self._pending = self._pool.submit(write if until is None else partial(until.call, write))
        return previous

    def wait(self) -> WriteResult | None:
        """Block until the write in flight (if any) is done; raises what it raised."""
        pending, self._pending = self._pending, None
        return pending.result() if pending is not None else None

    def poll(self, failed: bool = True) -> WriteResult | None:
        """The finished write, without blocking; ``None`` while none finished (or, with ``failed=False``,
        when it failed: it stays for a later :meth:`wait` or :meth:`poll` to raise)."""
        pending = self._pending
        if pending is not None and pending.done() and (failed or pending.exception() is None):
            return self.wait()
        return None

    def _write(self, capture: Capture, bundle_key: str) -> WriteResult:
        t0 = time.perf_counter()
        capture.wait()  # from a GPU: the copies into the host buffers may still be landing
        files = encode(capture)
        # largest first: the small files fill in beside the large ones instead of trailing them
        order = sorted(files, key=lambda p: _size(files[p]), reverse=True)
        digests = {p: self._files.submit(self.storage.put_chunks, f"{bundle_key}/{p}", files[p], self.digest)
                   for p in order}
        entries = []
        try:
            for path in order:
                entries.append(FileEntry(path=path, bytes=_size(files[path]), sha256=digests[path].result(),
                                         digest=self.digest))
                self.faults.hit("bundle_write", capture.update)  # a file written, the bundle unpublished
        except StorageFullError:
            self._remove_partial(bundle_key, list(digests.values()), [f"{bundle_key}/{p}" for p in order])
            raise
        return WriteResult(bundle_key, capture.update, entries, time.perf_counter() - t0, capture,
                           self.ship(files) if self.ship is not None else {})

    def _remove_partial(self, bundle_key: str, writes: list[Future[str]], keys: list[str]) -> None:
        """A write the storage refused for want of room: remove what it wrote of this unpublished bundle
        (``keys``, this rank's files only), once none of its ``writes`` is still going, so that the space
        goes to the next checkpoint rather than to a bundle that can never be published. Best effort: a
        removal that fails too is left to retention, which removes unpublished folders older than the
        newest published bundle. Only on a full disk: elsewhere the files take nothing the job needs, and
        a delete sent to a storage that is down would only wait out retries of its own."""
        wait_all(writes)
        try:
            self.storage.delete(keys)
        except StorageError as e:
            log.warning("the unfinished files of bundle %s were not removed (retention removes them): %s",
                        bundle_key, e)
            return
        log.warning("bundle %s: this rank's unfinished files removed (the storage is full)", bundle_key)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._files.shutdown(wait=True)


def publish(storage: Storage, manifest: Manifest, bundle_key: str) -> bool:
    """The commit point: create ``manifest.json``; False if another publisher already did."""
    return storage.put_new(f"{bundle_key}/manifest.json", manifest.to_json())


# -- reading ----------------------------------------------------------------------------


@dataclass
class LoadedBundle:
    key: str
    manifest: Manifest
    payloads: dict[str, Any]

    def whole(self, name: str) -> dict[str, Any]:
        """The payload ``name`` (``model.pt``, ``optimizer.pt``) with every tensor whole, as one rank
        holding every row would have written it: a sharded bundle's shards put together."""
        try:
            return Pieces(self.payloads, name, f"bundle {self.key}").whole()
        except ShardError as e:
            raise BundleCorrupt(str(e)) from e


def read_manifest(storage: Storage, bundle_key: str) -> Manifest:
    where = f"bundle {bundle_key}"
    try:
        blob = storage.get(f"{bundle_key}/manifest.json")
    except FileNotFoundError as e:
        raise BundleCorrupt(f"{where} has no manifest.json: it was never published") from e
    return parse_manifest(blob, where)


def load_bundle(storage: Storage, bundle_key: str, desc: Description | None, *,
                same_job: bool = True, want: Callable[[Manifest], Callable[[str], bool]] | None = None,
                reset: tuple[str, ...] = ()
                ) -> LoadedBundle:
    """Verify then deserialise a published bundle. Raises a :class:`BundleError` or ``ManifestError``.

    ``want(manifest)`` returns which file paths to read (default: all), decided once per bundle: a
    rank of a sharded job reads its own shard, not every rank's. Whatever is read is verified
    against the manifest first."""
    manifest = read_manifest(storage, bundle_key)
    if desc is not None:
        check_compatible(manifest, desc, f"bundle {bundle_key}", same_job=same_job, root=storage.uri, reset=reset)
    keep = want(manifest) if want is not None else None
    blobs = {}
    for f in manifest.files:
        if keep is not None and not keep(f.path):
            continue
        key = f"{bundle_key}/{f.path}"
        try:
            blob = storage.get(key)
        except FileNotFoundError as e:
            raise BundleCorrupt(f"bundle {bundle_key}: file {f.path} is missing "
                                f"(manifest lists {f.bytes} bytes)") from e
        if len(blob) != f.bytes:
            raise BundleCorrupt(f"bundle {bundle_key}: file {f.path} has {len(blob)} bytes, manifest says "
                                f"{f.bytes} (truncated or overwritten)")
        _, digest = digest_of(f.digest, [blob])
        if digest != f.sha256:
            raise BundleCorrupt(f"bundle {bundle_key}: file {f.path} has {f.digest} digest {digest[:12]}..., "
                                f"manifest says {f.sha256[:12]}... (corrupt)")
        blobs[f.path] = blob
    return LoadedBundle(bundle_key, manifest, decode_payloads(bundle_key, blobs))


def decode_payloads(bundle_key: str, blobs: dict[str, bytes]) -> dict[str, Any]:
    """The payloads of a bundle's verified files, by payload path (``rank-0/model.pt``: its
    skeleton joined with its tensor file, when it has one; bundles of schema 2 have none)."""
    payloads: dict[str, Any] = {}
    for path, blob in blobs.items():
        if path.endswith(".pt"):
            skeleton = torch.load(io.BytesIO(blob), weights_only=True)
            tensor_path = path.removesuffix(".pt") + TENSORS_SUFFIX
            tensors: dict[str, torch.Tensor] = {}
            if tensor_path in blobs:
                where = f"bundle {bundle_key}: file {tensor_path}"
                try:
                    tensors = decode_tensors(blobs[tensor_path], where)
                except TensorFileError as e:
                    raise BundleCorrupt(str(e)) from e
            try:
                payloads[path] = join(skeleton, tensors, f"bundle {bundle_key}: file {path}")
            except TensorFileError as e:
                raise BundleCorrupt(str(e)) from e
        elif path.endswith(".json"):
            payloads[path] = json.loads(blob)
    return payloads


@dataclass(frozen=True)
class Rejected:
    bundle_key: str
    reason: str


T = TypeVar("T")


def first_that_loads(keys: list[str], load: Callable[[str], T], on_reject: Callable[[Rejected], object] = lambda r: None
                     ) -> tuple[str | None, T | None, list[Rejected]]:
    """Try ``load`` on each key in turn (newest first); the first that loads, and why newer ones did not.

    A corrupt bundle is skipped for the previous one. An unknown manifest schema stops
    the search (older bundles will not help), and so does an incompatible bundle, which
    ``load`` raises as :class:`BundleIncompatible`. If every key was rejected, raises
    :class:`BundleCorrupt`: silently starting over would lose the run."""
    rejected: list[Rejected] = []
    for key in keys:
        try:
            return key, load(key), rejected
        except UnknownSchemaError:
            raise
        except (BundleCorrupt, ManifestError) as e:
            rejected.append(Rejected(key, str(e)))
            on_reject(rejected[-1])
    if rejected:
        raise BundleCorrupt(
            "every published bundle failed verification, so resuming would silently start over: "
            + "; ".join(r.reason for r in rejected)
            + ". Repair or remove the storage of this job, or run with another --job-id."
        )
    return None, None, rejected


def load_latest(storage: Storage, job_id: str, desc: Description) -> tuple[LoadedBundle | None, list[Rejected]]:
    """The newest published bundle that verifies, and why newer ones were passed over."""
    keys = [r.key for r in list_bundles(storage, job_id) if r.published]
    _, bundle, rejected = first_that_loads(keys, lambda key: load_bundle(storage, key, desc))
    return bundle, rejected
