"""Whether a bundle can restore into this job: the compatibility contract, checked before any file is read
(spec and code in the driver before anything starts; runtime, data and parameters on each rank), each
difference named with both sides and the way forward.
"""

from __future__ import annotations

from typing import Any

from spotrun.trainer.bundle.description import Description
from spotrun.trainer.bundle.errors import BundleIncompatible
from spotrun.trainer.bundle.manifest import (
    Manifest,
    runtime_differences,
)
from spotrun.trainer.data.identity import DataIdentity, fingerprint_difference
from spotrun.trainer.data.listing import changed_shards
from spotrun.trainer.job.code_identity import CodeInfo, code_problem
from spotrun.trainer.state.counters import READABLE_CONVENTIONS


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
