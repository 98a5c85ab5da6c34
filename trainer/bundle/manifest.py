"""The bundle manifest: the commit marker of a bundle, and its contract.

A bundle is *published* when its ``manifest.json`` exists; nothing else is ever
read on restore. The manifest is written last, create-only, by one writer. A
reader rejects an unknown ``schema_version`` before reading anything else.
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from spotrun.trainer.data.identity import DataFingerprint
from spotrun.trainer.data.listing import ShardInfo
from spotrun.trainer.data.planner import Cursor
from spotrun.trainer.job.code_identity import CodeInfo
from spotrun.trainer.state.counters import Counters
from spotrun.trainer.storage import UnsafeKeyError, check_key
from spotrun.trainer.storage.digest import SHA256, chunk_bytes_of

# 2: the job's code (entrypoint, fingerprint) and data kind; 3: tensors in <stem>.safetensors;
# 4: world.parallelism, and sharded bundles (every rank's model.pt/optimizer.pt with a layout);
# 5: each file's digest algorithm (FileEntry.digest: the chunked sha256 tree, hashed on every core);
# 6: the data's content fingerprint and cautions, the code identity's files, loop convention 2
SCHEMA_VERSION = 6
# Schemas this release reads: a schema-2 bundle holds its tensors inside the .pt files, which the
# loader reads as before (a .pt without a tensor file beside it is a whole payload); schemas 2 and 3
# are replicated bundles (no world.parallelism: "ddp"); schemas 2 to 4 have no digest field, so
# their files verify with plain sha256 (the field's default).
READABLE_SCHEMAS = (2, 3, 4, 5, 6)
_RANK_DIR = re.compile(r"^rank-(\d+)/")
# The world side (fresh | exact | exact-data | fresh-epoch | new-experiment), then "+<data side>"
# when the data side is not exact, e.g. "exact+bounded-repetition".
RecoveryLabel = str


class ManifestError(ValueError):
    """A manifest that cannot be trusted: unknown schema, unparsable, or unsafe paths."""


class UnknownSchemaError(ManifestError):
    """The manifest was written by a spotrun this one cannot read; older bundles will not help."""


class _M(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FileEntry(_M):
    path: str  # relative to the bundle directory
    bytes: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")  # the file's digest under ``digest`` (a sha256 either way)
    digest: str = SHA256  # the algorithm (spotrun.trainer.storage.digest); an unknown one is refused, naming it

    @field_validator("digest")
    @classmethod
    def _known_digest(cls, v: str) -> str:
        chunk_bytes_of(v)  # raises UnknownDigestError (a ValueError) naming the algorithm
        return v

    @field_validator("path")
    @classmethod
    def _inside_bundle(cls, v: str) -> str:
        try:
            return check_key(v)
        except UnsafeKeyError as e:
            raise ValueError(f"file path {v!r} escapes the bundle directory") from e


class TensorInfo(_M):
    name: str
    shape: tuple[int, ...]
    dtype: str



class ModelInfo(_M):
    kind: str
    config_hash: str
    params: tuple[TensorInfo, ...]


class OptimizerInfo(_M):
    type: str
    groups: tuple[dict[str, Any], ...]  # settings and parameter *names* of each group


class DataInfo(_M):
    kind: str = "token"  # map | token | stream: the job's data kind
    dataset_version: str  # token data: over the listed shards' contents, in order; map: class, length and
    # declared version or content fingerprint; stream: class and declared version
    fingerprint: DataFingerprint | None = None  # map data without a declared version (schema 6 on)
    # what spotrun cannot capture of this data (a stream's own loader workers): said at start, kept here
    # so that verify's reading of a divergence can name it
    cautions: tuple[str, ...] = ()
    tokenizer_version: str  # "" without a tokenizer
    records: int  # token/map: listed when the boundary's last update was planned; stream: elements read
    shards: tuple[ShardInfo, ...] = ()  # those records' shards, in the order they were discovered
    cursor: Cursor
    prefetched_ahead: int  # micro-batches fetched past the cursor when saved; replayed on restore
    source_offsets: dict[str, int] = {}  # streaming reader: records fully consumed per shard (this epoch)
    repeats_on_restore: int = 0  # occurrences a bounded-repetition restore from here delivers again


class Versions(_M):
    """The runtime a bundle was written on (and, in a rank's :class:`Description`, the one it runs
    on). The GPU-side fields are None on a CPU rank, and in manifests written before they existed."""

    python: str
    torch: str  # torch.__version__, with its build suffix (+cpu, +cu126)
    torchdata: str
    numpy: str
    spotrun: str
    gpu: str | None = None  # the GPU model the bundle was written on (None: CPU)
    cuda: str | None = None  # torch's CUDA runtime
    cudnn: str | None = None  # torch.backends.cudnn.version(), e.g. "90100"
    nccl: str | None = None  # torch.cuda.nccl.version(), e.g. "2.21.5"
    driver: str | None = None  # the NVIDIA driver


# What the bits of an update depend on besides the job itself: the device model and the builds whose
# kernels compute it. world.policy=strict restores only where all of them match; elsewhere a
# restore is at most exact-data. (label, the field, how a None reads, the verb's preposition)
_EXACTNESS = (("device", "gpu", "CPUs", "on"), ("torch", "torch", "none", "with"),
              ("CUDA", "cuda", "none", "with"), ("cuDNN", "cudnn", "none", "with"),
              ("NCCL", "nccl", "none", "with"))


def runtime_differences(written: Versions, here: Versions) -> list[str]:
    """Where the runtime ``here`` differs from the one a bundle was ``written`` on, in the facts
    bitwise-equal parameters depend on (device model; torch, CUDA, cuDNN and NCCL versions), each
    naming both sides. Empty: a restore here can be ``exact``. A fact an older manifest did not
    record (None) differs from any recorded value: equality cannot be shown."""
    out = []
    for label, field, none, prep in _EXACTNESS:
        a, b = getattr(written, field), getattr(here, field)
        if a != b:
            out.append(f"{label}: the bundle was written {prep} {a or none}, this rank has {b or none}")
    return out


class Precision(_M):
    stored: str
    compute: str
    master_weights: str


class WorldInfo(_M):
    size: int
    accum_steps: int
    micro_batch: int
    policy: str
    # ddp: rank 0's files hold the whole model and optimizer; fsdp: every rank's hold its shard of them
    parallelism: Literal["ddp", "fsdp"] = "ddp"


class ManifestDraft(_M):
    """Rank 0's part of a manifest, taken at the boundary: everything but the files, which every
    rank reports once its background write is done."""

    schema_version: int
    job_id: str
    bundle_id: str
    lineage_id: str
    attempt: int
    created_at: datetime = Field(default_factory=lambda: datetime.now(UTC))
    loop_convention: int
    counters: Counters
    recovery_label: RecoveryLabel  # how the attempt that wrote this bundle began
    train_mode: bool
    deterministic: bool
    spec_compat: dict[str, Any]
    spec: dict[str, Any]  # the whole JobSpec that wrote it
    code: CodeInfo
    model: ModelInfo
    optimizer: OptimizerInfo
    data: DataInfo
    world: WorldInfo
    precision: Precision
    versions: Versions
    # What rank 0's training loop waited for at this boundary, in seconds. The stall is all of it:
    # the previous bundle's write finishing, the capture to host memory, the manifest draft, the
    # hand-off to the background writer, and (CPU) the wait at the next optimizer step for the
    # capture's deferred copies. (Manifests written before capture_seconds existed hold the
    # capture alone here.)
    stall_seconds: float = 0.0
    write_wait_seconds: float = 0.0  # of the stall: waiting for the previous write to finish
    capture_seconds: float = 0.0  # of the stall: the copies to host memory made at the boundary
    copy_wait_seconds: float = 0.0  # of the stall: the next optimizer step waiting for the deferred copies


class Manifest(ManifestDraft):
    """A published bundle: the draft with the files of every rank (merged by the publisher)."""

    files: tuple[FileEntry, ...]
    write_seconds: float = 0.0

    @model_validator(mode="after")
    def _every_rank_wrote(self) -> Manifest:
        """A bundle of N ranks holds files of every rank 0..N-1 and of no other: a manifest that lists
        fewer was merged from a dead attempt's partial reports and must never be published or read."""
        ranks = {int(m.group(1)) for f in self.files if (m := _RANK_DIR.match(f.path))}
        expected = set(range(self.world.size))
        if ranks != expected:
            raise ValueError(f"the files cover ranks {sorted(ranks)} of a bundle written by {self.world.size} "
                             f"rank(s) (missing {sorted(expected - ranks)}, extra {sorted(ranks - expected)})")
        return self

    @property
    def total_bytes(self) -> int:
        return sum(f.bytes for f in self.files)

    def to_json(self) -> bytes:
        return self.model_dump_json(indent=2).encode()


def parse_manifest(blob: bytes, where: str) -> Manifest:
    """Parse and validate; an unknown schema is refused before any other field is read."""
    try:
        raw = json.loads(blob)
    except ValueError as e:
        raise ManifestError(f"{where}: manifest is not JSON ({e})") from e
    if not isinstance(raw, dict):
        raise ManifestError(f"{where}: manifest is not a JSON object")
    version = raw.get("schema_version")
    if version not in READABLE_SCHEMAS:
        raise UnknownSchemaError(
            f"{where}: manifest schema_version {version!r} is unknown to this spotrun "
            f"(reads {', '.join(map(str, READABLE_SCHEMAS))}); use the spotrun release that wrote it"
        )
    try:
        return Manifest.model_validate(raw)
    except ValueError as e:
        raise ManifestError(f"{where}: manifest is invalid: {e}") from e
