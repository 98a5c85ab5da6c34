"""Shared fixtures: specs under a temporary storage root, reference runs, and the oracle."""

from __future__ import annotations

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
