"""Loading a job spec: YAML file, then ``--set dotted.key=value`` overrides, then validation.

Errors name the key, the bad value and what is allowed; an unknown key also
names its nearest valid spelling.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from spotrun.trainer.job.sections import DataSpec
from spotrun.trainer.job.spec import JobSpec
from spotrun.trainer.job.specdoc import nearest, recipe_keys_set


class SpecError(ValueError):
    """The spec cannot run; the message says which key and how to fix it."""


def parse_override(item: str) -> tuple[list[str], Any]:
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise SpecError(f"--set {item!r}: expected dotted.key=value, e.g. --set train.updates=50")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise SpecError(f"--set {item!r}: the value is not valid YAML ({e})") from e
    return key.strip().split("."), value


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for item in overrides:
        path, value = parse_override(item)
        node = raw
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise SpecError(f"--set {item!r}: {part!r} is a value, not a section")
            node = child
        node[path[-1]] = value
    return raw


def _fields_at(loc: tuple[Any, ...]) -> list[str]:
    model: type[BaseModel] = JobSpec
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        ann = getattr(field, "annotation", None)
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return []
        model = ann
    return list(model.model_fields)


def explain(err: ValidationError, source: str) -> str:
    lines = [f"invalid job spec {source}:"]
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(top level)"
        if e["type"] == "extra_forbidden":
            valid = _fields_at(e["loc"])
            near = nearest(str(e["loc"][-1]), valid)
            hint = f"; did you mean {'.'.join([*map(str, e['loc'][:-1]), near])!r}?" if near else ""
            lines.append(f"  {key}: unknown key{hint} (valid here: {', '.join(valid)})")
        else:
            lines.append(f"  {key}: {e['msg']} (got {e.get('input')!r})")
    return "\n".join(lines)


def absolute_paths(raw: dict[str, Any]) -> dict[str, Any]:
    """Local paths (``data.shards``, ``file://`` storage) resolved against the working directory here:
    ranks run in other processes, with other working directories."""
    raw.setdefault("storage", JobSpec.model_fields["storage"].default)
    data = raw.setdefault("data", {})
    if isinstance(data, dict):
        data.setdefault("shards", DataSpec.model_fields["shards"].default)
    if isinstance(data, dict) and isinstance(data.get("shards"), str) and "://" not in data["shards"]:
        data["shards"] = str(Path(data["shards"]).resolve())
    storage = raw.get("storage")
    if isinstance(storage, str) and (storage.startswith("file://") or "://" not in storage):
        raw["storage"] = f"file://{Path(storage.removeprefix('file://')).resolve()}"
    return raw


def load_spec(path: str | Path | None, overrides: Sequence[str] = (), job_id: str | None = None, *,
              text: str | None = None) -> JobSpec:
    """Read, override, validate. ``job_id`` defaults to the file's stem; local paths become absolute.

    ``text`` is a spec given inline instead of a file (YAML, so JSON too): what ``spotrun submit``
    sends, so that the head needs no copy of the file."""
    raw: Any = {}
    source = "(command line)"
    if text is not None:
        source = "(inline spec)"
        try:
            raw = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise SpecError(f"the inline spec is not valid YAML or JSON: {e}") from e
    elif path is not None:
        path = Path(path)
        source = str(path)
        try:
            raw = yaml.safe_load(path.read_text())
        except FileNotFoundError as e:
            raise SpecError(f"spec file {path} does not exist") from e
        except yaml.YAMLError as e:
            raise SpecError(f"spec file {path} is not valid YAML: {e}") from e
    if raw is not None and not isinstance(raw, dict):
        raise SpecError(f"spec {source} must be a mapping of keys, got {type(raw).__name__}")
    raw = raw or {}
    if path is not None and text is None:
        raw.setdefault("job_id", Path(path).stem)
    raw = absolute_paths(apply_overrides(raw, list(overrides)))
    if job_id:
        raw["job_id"] = job_id
    try:
        spec = JobSpec.model_validate(raw)
    except ValidationError as e:
        raise SpecError(explain(e, source)) from e
    warn_recipe_keys(spec, source)
    return spec


def warn_recipe_keys(spec: JobSpec, source: str) -> None:
    """Name, on stderr, the built-in recipe's keys a spec with ``job.entrypoint`` sets: spotrun passes none of
    them to a user's job, so a user who sets ``train.lr`` there would otherwise believe it took effect.

    A warning, not a refusal: none of them changes what the engine does to the user's data or updates,
    and an entrypoint may read them from ``ctx.spec`` on purpose."""
    names = recipe_keys_set(spec)
    if names:
        sys.stderr.write(
            f"spotrun: warning: spec {source} runs your own job (job.entrypoint) but sets {', '.join(names)}, "
            "which only the built-in character LM reads: spotrun does not apply them to your job (it sees them "
            "only if your entrypoint reads ctx.spec). Set the equivalent in your job, or drop them "
            "(`spotrun spec --explain KEY` says who reads a key).\n")
