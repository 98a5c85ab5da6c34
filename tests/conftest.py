"""Shared fixtures: specs under a temporary storage root, reference runs, and the oracle."""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

import pytest

from spotrun.orchestrator.specfile import load_spec
from spotrun.trainer.spec import JobSpec

ROOT = Path(__file__).resolve().parent.parent


def make_spec(tmp_path: Path, *overrides: str, config: str = "configs/tiny.yaml", job_id: str = "job") -> JobSpec:
    """The named config with its storage under ``tmp_path`` and its data addressed absolutely."""
    base = [f"storage=file://{tmp_path / 'runs'}", f"data.shards={ROOT / 'configs/data/tiny'}"]
    return load_spec(ROOT / config, [*base, *overrides], job_id)


@pytest.fixture
def spec_factory(tmp_path: Path):
    def factory(*overrides: str, **kw) -> JobSpec:
        return make_spec(tmp_path, *overrides, **kw)

    return factory


def chunked_sha256(data: bytes, chunk: int) -> str:
    """The ``sha256-chunks-<chunk>`` digest of ``data`` as trainer/digest.py documents it, computed here
    on one thread without that module's code: the reference every writer and verifier must equal."""
    chunks = [data[i:i + chunk] for i in range(0, len(data), chunk)]
    head, tail = b"spotrun sha256-chunks v1\n" + struct.pack(">Q", chunk), struct.pack(">Q", len(data))
    return hashlib.sha256(head + b"".join(hashlib.sha256(c).digest() for c in chunks) + tail).hexdigest()
