"""What a rank's state is, as a manifest records it and a restore expects it (runs on each rank).

:func:`describe` computes a :class:`Description` of a job's state without training: its code and data
identity, model and optimizer layout, runtime and world size; :func:`build_manifest` turns it and the
state at a boundary into rank 0's manifest draft. The compatibility checks that compare a
Description with a manifest are :func:`spotrun.trainer.bundle.compat.check_compatible`'s.
"""

from __future__ import annotations

import json
import platform
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torchdata

from spotrun.trainer import __version__ as spotrun_version
from spotrun.trainer.bundle.manifest import (
    SCHEMA_VERSION,
    DataInfo,
    ManifestDraft,
    ModelInfo,
    OptimizerInfo,
    Precision,
    TensorInfo,
    Versions,
    WorldInfo,
)
from spotrun.trainer.data.identity import DataIdentity
from spotrun.trainer.data.listing import ShardInfo, version_of
from spotrun.trainer.data.planner import Cursor
from spotrun.trainer.job.code_identity import CodeInfo, code_identity
from spotrun.trainer.runtime.device import gpu_facts
from spotrun.trainer.state.counters import LOOP_CONVENTION
from spotrun.trainer.state.training import TrainState


@dataclass(frozen=True)
class Description:
    """The compatibility-relevant facts of a job's state, computed without training."""

    job_id: str
    spec_compat: dict[str, Any]
    code: CodeInfo
    model: ModelInfo
    optimizer: OptimizerInfo
    data: DataIdentity
    policy: str  # world.policy: strict restores only on the runtime that wrote the bundle
    runtime: Versions  # this rank's device model and library versions (what its manifests record)
    world_size: int  # the spec's world.size (fixed for the job's life), not this attempt's


def describe(state: TrainState) -> Description:
    spec, feed = state.spec, state.feed
    params = tuple(
        TensorInfo(name=k, shape=tuple(v.shape), dtype=str(v.dtype).removeprefix("torch."))
        for k, v in state.model.state_dict().items()
    )
    groups = tuple(
        {**{k: v for k, v in g.items() if k != "params"}, "params": names}
        for g, names in zip(state.optimizer.param_groups, state.group_names, strict=True)
    )
    kind = spec.model.kind if spec.job is None else type(state.model).__qualname__
    return Description(
        job_id=spec.job_id,
        spec_compat=spec.compat_view(),
        code=code_identity(spec),
        model=ModelInfo(kind=kind, config_hash=spec.model_config_hash(), params=params),
        optimizer=OptimizerInfo(type=type(state.optimizer).__name__, groups=_jsonable(groups)),
        data=feed.identity(),
        policy=spec.world.policy,
        runtime=versions(state.device),
        world_size=spec.world.size,
    )


def _jsonable(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=float))


def versions(device: str = "cpu") -> Versions:
    return Versions(python=platform.python_version(), torch=torch.__version__,
                    torchdata=torchdata.__version__, numpy=np.__version__, spotrun=spotrun_version,
                    **gpu_facts(device))


def build_manifest(desc: Description, state: TrainState, *, bundle_key: str, lineage_id: str,
                   attempt: int, recovery_label: str, accum_steps: int, prefetched_ahead: int,
                   stall_seconds: float, shards: Sequence[ShardInfo],
                   source_offsets: dict[str, int] | None = None) -> ManifestDraft:
    """Rank 0's draft at a boundary; the publisher adds every rank's files (:class:`Manifest`)."""
    spec = state.spec
    return ManifestDraft(
        schema_version=SCHEMA_VERSION,
        job_id=desc.job_id,
        bundle_id=bundle_key.rsplit("/", 1)[-1],
        lineage_id=lineage_id,
        attempt=attempt,
        loop_convention=LOOP_CONVENTION if state.feed.seed_globals else 1,
        counters=state.counters.value.model_copy(),  # a snapshot: the loop goes on counting
        recovery_label=recovery_label,
        train_mode=state.model.training,
        deterministic=torch.are_deterministic_algorithms_enabled(),
        spec_compat=desc.spec_compat,
        spec=spec.model_dump(mode="json"),
        code=desc.code,
        model=desc.model,
        optimizer=desc.optimizer,
        data=DataInfo(kind=desc.data.kind,
                      dataset_version=version_of(shards) if desc.data.kind == "token" else desc.data.dataset_version,
                      fingerprint=desc.data.fingerprint, cautions=desc.data.cautions,
                      tokenizer_version=desc.data.tokenizer_version, records=state.planner_state["records"],
                      shards=tuple(shards), cursor=Cursor(**state.planner_state["cursor"]),
                      prefetched_ahead=prefetched_ahead, source_offsets=source_offsets or {},
                      repeats_on_restore=state.planner_state["low_water"]["repeats"]),
        world=WorldInfo(size=state.world_size, accum_steps=accum_steps,
                        micro_batch=spec.train.micro_batch, policy=spec.world.policy,
                        parallelism=spec.train.parallelism),
        precision=Precision(stored="fp32", compute=spec.train.precision,
                            master_weights="the fp32 parameters are the masters"),
        versions=desc.runtime,
        stall_seconds=stall_seconds,
    )
