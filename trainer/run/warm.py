"""Warm recovery: a published bundle put back from host memory instead of storage.

When a rank is lost, the surviving ranks keep their processes and everything built in them (the
job, its model and optimizer, the data pipeline, warm host buffers) and go back to the newest
published bundle from memory; a spare that stepped in gets it from them. Where each file of that
bundle is found:

- the replicated model and optimizer (``rank-0/model.pt``, ``rank-0/optimizer.pt``): in every
  rank's own :class:`Kept` capture (ranks other than 0 hold a copy they do not write,
  :attr:`~spotrun.trainer.state.training.Capture.held`), or a survivor's, sent to a spare;
- every other file (each rank's random streams and registered state, the counters and data
  position): in the driver, which keeps the bytes each rank wrote of the newest published bundle
  (:func:`shipped`: small, and sent with the write's report).

The payloads so put together are those a read of the bundle from storage gives (the files the
driver holds are checked against the manifest's digests), and they go through the same restore
and the same restore oracle: a warm restart is the same restart as a cold one, without the start
of a process, the build of the job and the read of the bundle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from spotrun.trainer.bundle.bundles import TENSORS_SUFFIX, Encoded, decode_payloads
from spotrun.trainer.bundle.errors import BundleCorrupt
from spotrun.trainer.bundle.manifest import Manifest
from spotrun.trainer.job.spec import JobSpec
from spotrun.trainer.storage.digest import digest_of

# The most bytes of one rank's own state (its files other than a replicated model and optimizer)
# sent to the driver with each write: beyond it that rank's state comes back only from storage.
SHIPPED_MAX_BYTES = 64 << 20
REPLICATED = ("rank-0/model.", "rank-0/optimizer.")


class NotInMemory(RuntimeError):
    """A file of the bundle to restore is held in no memory that survived: restart from storage."""


@dataclass
class Kept:
    """The capture a rank's newest finished write was made from: bundle ``bundle_key`` as this rank
    holds it in host memory (its files' payloads by bundle path), until its next capture reuses
    the buffers."""

    bundle_key: str
    files: dict[str, Any]


class Held:
    """The captures one rank keeps, one per set of host buffers (``HostBuffers.generation``): each capture
    fills the set the one before it does not, so the newest write and the one before it are both
    held. The newest published bundle is one of them unless publication falls two checkpoints behind
    the ranks (a warm restart then finds it held nowhere and restarts cold)."""

    def __init__(self) -> None:
        self.by_generation: dict[int, Kept] = {}
        self._last = 1

    def next_generation(self, avoid: str | None = None) -> int:
        """The set the next capture fills (what it held is dropped): not the newest capture's or, with
        ``avoid``, not the one holding that bundle (a restore from it reads those buffers)."""
        keep = next((g for g, k in self.by_generation.items() if k.bundle_key == avoid), None) if avoid else None
        self._last = 1 - keep if keep is not None else 1 - self._last
        self.by_generation.pop(self._last, None)
        return self._last

    def add(self, generation: int, kept: Kept) -> None:
        self.by_generation[generation] = kept

    def get(self, bundle_key: str) -> Kept | None:
        return next((k for k in self.by_generation.values() if k.bundle_key == bundle_key), None)

    def keys(self) -> list[str]:
        return sorted(k.bundle_key for k in self.by_generation.values())


def ineligible(spec: JobSpec) -> str | None:
    """Why this job always restarts cold, or None when it may restart warm."""
    if not spec.world.warm_recovery:
        return "world.warm_recovery is off"
    if spec.train.parallelism == "fsdp":
        return "a sharded model (train.parallelism=fsdp): a lost rank's shard is held nowhere else"
    if spec.train.grad_sync == "ddp":
        return "train.grad_sync=ddp: torch's DDP is bound to the process group it was built in"
    return None


def shipped(files: Encoded) -> dict[str, bytes]:
    """The files of one rank's write the driver keeps: all but the replicated model and optimizer,
    joined into bytes; none when together they pass :data:`SHIPPED_MAX_BYTES`."""
    own = {p: chunks for p, chunks in files.items() if not p.startswith(REPLICATED)}
    if sum(memoryview(c).nbytes for chunks in own.values() for c in chunks) > SHIPPED_MAX_BYTES:
        return {}
    return {p: b"".join(chunks) for p, chunks in own.items()}


def payload_path(path: str) -> str:
    """The payload a bundle file belongs to (a tensor file to its ``.pt``)."""
    return path.removesuffix(TENSORS_SUFFIX) + ".pt" if path.endswith(TENSORS_SUFFIX) else path


def assemble(key: str, manifest: Manifest, want: Any, shipped_files: dict[str, bytes],
             kept: list[Kept]) -> dict[str, Any]:
    """The payloads of bundle ``key`` this rank's restore reads (``want(path)``, as
    :func:`~spotrun.trainer.bundle.bundles.load_bundle` reads them), from memory: the files the driver
    kept (verified against the manifest), then each other payload from the first of ``kept`` (this
    rank's own capture, a survivor's) that holds it for this bundle. :class:`NotInMemory` names
    the first payload none holds; :class:`BundleCorrupt` a kept file that does not match the manifest."""
    blobs: dict[str, bytes] = {}
    needed: set[str] = set()
    for f in manifest.files:
        if not want(f.path):
            continue
        needed.add(payload_path(f.path))
        blob = shipped_files.get(f.path)
        if blob is None:
            continue
        _, digest = digest_of(f.digest, [blob])
        if len(blob) != f.bytes or digest != f.sha256:
            raise BundleCorrupt(f"bundle {key}: the driver's copy of {f.path} does not match the manifest")
        blobs[f.path] = blob
    # a payload is whole or absent: its skeleton and its tensor file come from the same place
    blobs = {p: b for p, b in blobs.items() if all(q in blobs for q in _parts(p, manifest))}
    payloads = decode_payloads(key, blobs)
    for path in sorted(needed - set(payloads)):
        source = next((k.files[path] for k in kept if k.bundle_key == key and path in k.files), None)
        if source is None:
            raise NotInMemory(f"bundle {key}: {path} is held in no memory that survived")
        payloads[path] = source
    return payloads


def _parts(path: str, manifest: Manifest) -> list[str]:
    """The bundle files of the payload ``path`` belongs to."""
    stem = payload_path(path)
    return [f.path for f in manifest.files if payload_path(f.path) == stem]
