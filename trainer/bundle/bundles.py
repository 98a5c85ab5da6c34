"""Bundles: write a rank's capture in the background, publish the manifest, find and load.

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
import re
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import torch

from spotrun.trainer.bundle.description import Description
from spotrun.trainer.bundle.manifest import (
    FileEntry,
    Manifest,
    ManifestError,
    UnknownSchemaError,
    parse_manifest,
    runtime_differences,
)
from spotrun.trainer.bundle.tensorfile import TensorFileError, join, split
from spotrun.trainer.bundle.tensorfile import chunks as tensorfile_chunks
from spotrun.trainer.bundle.tensorfile import decode as decode_tensors
from spotrun.trainer.data.identity import DataIdentity, fingerprint_difference
from spotrun.trainer.data.listing import changed_shards
from spotrun.trainer.job.code_identity import CodeInfo, code_problem
from spotrun.trainer.job.contract import check_weights_only
from spotrun.trainer.observe.faults import FaultInjector
from spotrun.trainer.runtime.sharding import Pieces, ShardError
from spotrun.trainer.state.counters import READABLE_CONVENTIONS
from spotrun.trainer.state.training import Capture
from spotrun.trainer.storage import Outage, Storage
from spotrun.trainer.storage.digest import DEFAULT as DEFAULT_DIGEST
from spotrun.trainer.storage.digest import digest_of

BUNDLE_DIR = re.compile(r"^u(\d{10})-a(\d+)$")


class BundleError(RuntimeError):
    """Base of every reason a bundle cannot be restored."""


class BundleCorrupt(BundleError):
    """A file is missing, truncated or does not match its checksum; an older bundle may still serve."""


class BundleIncompatible(BundleError):
    """The bundle belongs to another job, model, dataset or tokenizer; no older bundle will do either."""


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


def check_compatible(manifest: Manifest, desc: Description, where: str, *, same_job: bool = True,
                     root: str | None = None, reset: tuple[str, ...] = ()) -> None:
    """Raise :class:`BundleIncompatible` naming both sides of every difference: first those the spec
    and code alone decide (:func:`spec_problems`, which the driver also checks before it starts
    anything), then those only a built job knows (runtime, data, parameters). ``root``: the storage
    URI the bundle lies under, so that a hint names the bundle's real address. ``reset``: what a new
    lineage (``same_job=False``) starts afresh (``data``: it may train on other data)."""
    problems = spec_problems(manifest, job_id=desc.job_id, code=desc.code, spec_compat=desc.spec_compat,
                             model_config_hash=desc.model.config_hash, world_size=desc.world_size, where=where,
                             root=root, same_job=same_job)
    differences = runtime_differences(manifest.versions, desc.runtime) if desc.policy == "strict" else []
    if differences:
        problems.append(
            "; ".join(differences) + "; world.policy=strict promises bitwise-equal parameters, which kernels give "
            "only on the same device model with the same library versions. Restore it on a runtime that matches "
            "the bundle's, or declare world.policy: elastic (it restores across them, labelled exact-data: the same "
            "occurrences, close parameters)")
    new_data = not same_job and "data" in reset  # a new lineage that starts its data afresh may change it
    if not new_data:
        problems += data_problems(manifest, desc.data, sequential=desc.spec_compat["data"]["order"] == "sequential",
                                  where=where, root=root, same_job=same_job)
    saved = {p.name: p for p in manifest.model.params}
    ours = {p.name: p for p in desc.model.params}
    if saved.keys() != ours.keys():
        problems.append(f"parameter names: bundle only {sorted(saved.keys() - ours.keys())}, "
                        f"model only {sorted(ours.keys() - saved.keys())}")
    for name in sorted(saved.keys() & ours.keys()):
        p, q = saved[name], ours[name]
        if (p.shape, p.dtype) != (q.shape, q.dtype):
            problems.append(f"parameter {name}: bundle {p.shape} {p.dtype}, model {q.shape} {q.dtype}")
    if problems:
        raise incompatible(where, problems)


def data_problems(manifest: Manifest, data: DataIdentity, *, sequential: bool, where: str, root: str | None,
                  same_job: bool = True) -> list[str]:
    """How the data ``data`` differs from what the bundle of ``manifest`` was trained on, each in one
    sentence that names the dataset and what differs, with the ways forward (empty: the same data).
    The one definition: the ranks check it at every restore, the driver before it starts anything.
    ``sequential``: a streaming token source, which may have grown (its read shards must be unchanged)."""
    recorded = manifest.data
    if recorded.kind != data.kind:
        return [f"data kind: the bundle was trained on {recorded.kind} data, the job now has {data.label} "
                f"({data.kind}); {_data_ways(where, root, same_job)}"]
    problems: list[str] = []
    if recorded.tokenizer_version != data.tokenizer_version:
        problems.append(f"tokenizer: bundle {recorded.tokenizer_version}, job {data.tokenizer_version} "
                        "(another vocabulary or tokenizer file; restore with the tokenizer the bundle was trained "
                        "with)")
    if data.kind == "token" and sequential and recorded.shards:
        # a streaming source may have grown: the shards the bundle read must be there, unchanged
        changed = changed_shards(recorded.shards, data.shards)
        if changed:
            problems.append(f"dataset ({data.label}): " + "; ".join(changed))
        return problems
    if recorded.dataset_version == data.dataset_version or recorded.dataset_version in data.legacy_versions:
        return problems
    if data.kind == "token":
        added = sorted({s.name for s in data.shards} - {s.name for s in recorded.shards})
        what = "; ".join([*changed_shards(recorded.shards, data.shards, sentence_end=False),
                          *([f"shards {', '.join(added)} were added (a permuted order spans every shard)"]
                            if added else [])]) or (
            f"its shards are not the ones the bundle read (version {recorded.dataset_version}, now "
            f"{data.dataset_version})")
    elif recorded.fingerprint is not None and data.fingerprint is not None:
        what = fingerprint_difference(recorded.fingerprint, data.fingerprint) or "its identity differs"
    else:
        what = (f"its identity is {data.dataset_version}, the bundle was trained on {recorded.dataset_version} "
                "(another declared version=, another length or another class)")
    problems.append(f"dataset: the job's {data.label} is not the data the bundle was trained on: {what}; "
                    + _data_ways(where, root, same_job))
    return problems


def _data_ways(where: str, root: str | None, same_job: bool) -> str:
    if not same_job:
        return "to train this new lineage on other data, add --reset data (its data then starts afresh)"
    key = where.removeprefix("bundle ")
    return ("restore the data the bundle was trained on and run again, or start a new lineage on this data from "
            f"the bundle: spotrun run CONFIG --job-id NEW_ID --init-from {bundle_address(root, key)} --reset data "
            "(labelled new-experiment)")


def incompatible(where: str, problems: list[str]) -> BundleIncompatible:
    """The refusal of bundle ``where`` for ``problems``: one paragraph, whoever checked (a rank, the driver)."""
    return BundleIncompatible(f"{where} cannot be restored into this job: " + "; ".join(problems))


def bundle_address(root: str | None, key: str) -> str:
    """Where bundle ``key`` lies, as ``spotrun run --init-from`` and ``spotrun inspect`` take it: under
    file storage the plain path, otherwise the storage URI (``s3://...``); ``<storage>/key`` only when the
    caller does not know the root."""
    if root is None:
        return f"<storage>/{key}"
    return f"{root.removeprefix('file://').rstrip('/')}/{key}"


def spec_problems(manifest: Manifest, *, job_id: str, code: CodeInfo, spec_compat: dict[str, Any],
                  model_config_hash: str, world_size: int, where: str, root: str | None,
                  same_job: bool = True) -> list[str]:
    """The differences between ``manifest`` and a job that the job's spec and code alone decide, each
    naming both sides (empty: none): the job id, the job's code (the entrypoint and every user module it
    imports, :mod:`~spotrun.trainer.job.code_identity`), the loop convention, the world size, the model
    config and every other key of :meth:`JobSpec.compat_view`.

    This is the one definition of these checks: the ranks make them as part of
    :func:`check_compatible`, and the driver makes them before it starts anything, from the newest
    manifest alone. ``world_size``: the spec's ``world.size`` (not the attempt's: an elastic restart
    runs on another). ``root``: the storage URI of the bundle ``where`` names, for the hint."""
    problems: list[str] = []
    key = where.removeprefix("bundle ")
    new_lineage = (f"to train on with this job as it is now, start a new lineage from the bundle: spotrun run "
                   f"CONFIG --job-id NEW_ID --init-from {bundle_address(root, key)} (add --reset "
                   "optimizer,scheduler to start those afresh)")
    if same_job and manifest.job_id != job_id:
        problems.append(f"it belongs to job {manifest.job_id!r}, this job is {job_id!r}")
    changed = code_problem(manifest.code, code) if same_job else None  # a new lineage is how code moves on
    if changed is not None:
        problems.append(f"job code: {changed} since the bundle was written, and other code may not take the same "
                        f"next updates; put the code back as it was, or {new_lineage}")
    if manifest.loop_convention not in READABLE_CONVENTIONS:
        problems.append(f"loop convention {manifest.loop_convention}: written by another spotrun release (this one "
                        f"trains under {', '.join(map(str, READABLE_CONVENTIONS))}); use the release that wrote it")
    world = world_problem(manifest, world_size) if same_job else None  # a new lineage: the spec keys say it
    if world is not None:
        problems.append(world)
    if manifest.model.config_hash != model_config_hash:
        problems.append(f"model config: bundle {manifest.spec_compat.get('model')}, job {spec_compat.get('model')}")
    for name in sorted(set(manifest.spec_compat) | set(spec_compat)):
        a, b = manifest.spec_compat.get(name), spec_compat.get(name)
        if name == "train" and not same_job and isinstance(a, dict) and isinstance(b, dict):
            # a new lineage may change how the state is laid out: the rows are put together either way
            a, b = ({k: v for k, v in d.items() if k != "parallelism"} for d in (a, b))
        if name == "global_sequences" and world is not None:
            continue  # the world size problem above says it in the user's words
        if a != b and name != "model" and (same_job or name != "job"):
            problems.append(f"spec {name}: bundle {_diff(a, b)}" + (f"; {new_lineage}" if name == "job" else ""))
    return problems


def world_problem(manifest: Manifest, world_size: int) -> str | None:
    """Why a job whose spec says ``world.size: world_size`` cannot resume from ``manifest``, or None when
    it can. A job's global batch (``world.size`` x ``train.accum_steps`` x ``train.micro_batch``
    sequences) is fixed for its life, so its ``world.size`` is too: a restart on another number of
    ranks is the policy's to make (``world.policy: elastic``), never a new spec's."""
    size = manifest.spec.get("world", {}).get("size")
    if size is None or size == world_size:
        return None
    then = manifest.spec_compat.get("global_sequences")
    return (f"world size: the job was started with world.size={size} (a global batch of {then} sequences, fixed "
            f"for the job's life) and this run asks world.size={world_size}. Resume it with world.size={size}; "
            f"to let it run on other numbers of ranks, keep world.size={size} and declare world.policy: elastic "
            f"with world.min_size/world.max_size (a restore at another size is labelled exact-data); or start a "
            f"new job with another --job-id")


def _diff(a: Any, b: Any) -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        return ", ".join(f"{k}={a.get(k)!r} vs job {k}={b.get(k)!r}" for k in keys)
    return f"{a!r} vs job {b!r}"


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

    def poll(self) -> WriteResult | None:
        """The finished write, without blocking; ``None`` while none finished."""
        if self._pending is not None and self._pending.done():
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
        for path in order:
            entries.append(FileEntry(path=path, bytes=_size(files[path]), sha256=digests[path].result(),
                                     digest=self.digest))
            self.faults.hit("bundle_write", capture.update)  # a file written, the bundle unpublished
        return WriteResult(bundle_key, capture.update, entries, time.perf_counter() - t0, capture,
                           self.ship(files) if self.ship is not None else {})

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
