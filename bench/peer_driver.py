"""The peer's driver as its own process: ``python -m bench.peer_driver CONFIG.json``.

It connects to an existing Ray cluster (``ray.init(address=...)``), runs bench/peer_loop.py's ``fit``
with the run name and storage path the file names, and exits 0 once the run has finished (1 when Ray
Train gave up, with its error on stderr; 2 when the file is not a valid config).

A driver killed mid-run (SIGKILL: no handler runs) is continued by running the same command again.
Ray Train V2 does this itself, as its docs say a user relies on it: its checkpoint manager writes a
snapshot of every committed checkpoint report into ``<storage>/<name>/`` and, when a controller starts
with the same ``RunConfig(name, storage_path)``, loads it, so ``ray.train.get_checkpoint()`` in the
rerun's workers returns the newest checkpoint committed before the kill; the loop resumes from it as
after any restart. Nothing here looks for checkpoints in storage. A checkpoint still uploading when the
driver died was never committed and is not resumed from. When the driver dies, Ray ends the
controller and workers it owns, so two runs never train side by side.

The config file is one JSON object (``DriverConfig``): ``loop`` is the peer loop's config, the rest says
where and how ``fit`` runs.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class DriverConfig(BaseModel):
    """What the driver runs; unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")

    address: str = Field(description="the cluster's address, as ray.init(address=...) takes it")
    storage: Path = Field(description="RunConfig.storage_path: an absolute local folder every node can reach")
    name: str = Field(min_length=1, description="RunConfig.name: the same on a rerun, so that it resumes")
    loop: dict[str, Any] = Field(description="the config bench/peer_loop.py's train_func takes")
    poll_s: float | None = Field(None, gt=0, description="the controller's worker poll (None: 2 s)")
    preemption_poll_s: float | None = Field(None, gt=0, description="the drain watcher's poll (None: 5 s)")
    max_failures: int = Field(-1, ge=-1, description="FailureConfig.max_failures (-1: unlimited)")
    max_preemption_failures: int = Field(-1, ge=-1, description="FailureConfig.max_preemption_failures")


def load(path: Path) -> DriverConfig:
    """The config at ``path``; a ValueError naming the problem and the fix when it is not one."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read it as JSON ({e}); pass the path of a JSON object file") from e
    try:
        config = DriverConfig.model_validate(raw)
    except ValidationError as e:
        raise ValueError(f"{path} is not a peer driver config; fix these keys:\n{e}") from e
    if not config.storage.is_absolute():
        raise ValueError(f"{path}: storage {config.storage} is relative; Ray Train needs an absolute path "
                         "(every rerun must name the same folder)")
    return config


def run(config: DriverConfig) -> int:
    """Connect, fit, disconnect; 0 when the run finished, 1 when Ray Train gave up."""
    import ray

    from bench.peer_loop import fit

    ray.init(address=config.address, log_to_driver=False, logging_level=logging.WARNING)
    try:
        result = fit(config.loop, config.storage, config.name, config.poll_s,
                     max_failures=config.max_failures, max_preemption_failures=config.max_preemption_failures,
                     preemption_poll_s=config.preemption_poll_s)
    finally:
        ray.shutdown()
    if result.error is not None:
        print(f"Ray Train run {config.name} failed: {result.error}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m bench.peer_driver CONFIG.json", file=sys.stderr)
        return 2
    try:
        config = load(Path(args[0]))
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    return run(config)


if __name__ == "__main__":
    sys.exit(main())
