"""The job spec as a reference: every key of :class:`~spotrun.trainer.job.spec.JobSpec` with its type,
default, unit, meaning and who reads it.

Everything here is read from the models themselves (each field's ``description`` and the
``applies`` in its own or its section's ``json_schema_extra``), so ``spotrun spec --explain KEY``,
``spotrun spec --defaults`` and the generated ``docs/SPEC.md`` cannot drift from what the loader
accepts.
"""

from __future__ import annotations

import difflib
import json
import re
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Union, get_args, get_origin

import annotated_types
import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined, to_jsonable_python

from spotrun.trainer.job.spec import JobSpec

APPLIES_TO = {
    "both": "any job (read by the engine)",
    "recipe": "the built-in character LM only (a spec without job.entrypoint)",
    "job": "a user's job only (job.entrypoint)",
}
_BOUNDS = ((annotated_types.Ge, "ge", ">="), (annotated_types.Gt, "gt", ">"), (annotated_types.Le, "le", "<="),
           (annotated_types.Lt, "lt", "<"))


class UnknownKeyError(ValueError):
    """``spotrun spec --explain`` was given a key the spec does not have; the message names the nearest one."""


@dataclass(frozen=True)
class KeyDoc:
    """One leaf key of the spec. ``key`` is dotted (``train.lr``); an entry of a list of sections is
    ``faults[].site``. ``default`` is JSON text (``required`` when there is none); ``applies`` is a key of
    :data:`APPLIES_TO`, or None when the model does not say (a bug the unit tests catch)."""

    key: str
    value_type: str
    default: str
    unit: str
    description: str
    applies: str | None
    section: type[BaseModel]


def keys() -> list[KeyDoc]:
    """Every leaf key of :class:`JobSpec`, in declaration order."""
    return list(_walk(JobSpec, ""))


def _walk(model: type[BaseModel], prefix: str) -> Iterator[KeyDoc]:
    """A section's own keys first, then its sub-sections', so that each section's keys are listed together."""
    section_applies = _extra(model.model_config.get("json_schema_extra")).get("applies")
    subs = {name: _section_of(f.annotation) for name, f in model.model_fields.items()}
    for name, field in model.model_fields.items():
        if subs[name][0] is not None:
            continue
        extra = _extra(field.json_schema_extra)
        yield KeyDoc(key=prefix + name, value_type=_type_of(field), default=_default_of(field),
                     unit=extra.get("unit") or _unit_from_name(name), description=field.description or "",
                     applies=extra.get("applies", section_applies), section=model)
    for name, (sub, many) in subs.items():
        if sub is not None:
            yield from _walk(sub, f"{prefix}{name}{'[].' if many else '.'}")


def _extra(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _section_of(ann: Any) -> tuple[type[BaseModel] | None, bool]:
    """The sub-model a field holds (itself, optional, or a tuple of them), and whether it is a list of them."""
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return ann, False
    args = [a for a in get_args(ann) if a is not type(None) and a is not Ellipsis]
    if len(args) == 1 and isinstance(args[0], type) and issubclass(args[0], BaseModel):
        return args[0], get_origin(ann) is tuple
    return None, False


def _type_name(ann: Any) -> str:
    origin, args = get_origin(ann), get_args(ann)
    if origin is Literal:
        return " | ".join(str(a) for a in args)
    if origin in (Union, types.UnionType):
        return " | ".join("null" if a is type(None) else _type_name(a) for a in args)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"list of ({_type_name(args[0])})"
        return f"[{', '.join(_type_name(a) for a in args)}]"
    if origin is dict:
        return "mapping"
    return getattr(ann, "__name__", str(ann))


def _type_of(field: FieldInfo) -> str:
    """The annotation in YAML words, with its numeric bounds (``float, >= 0, < 1``)."""
    bounds = [f"{sign} {getattr(m, attr)}" for m in field.metadata for cls, attr, sign in _BOUNDS if isinstance(m, cls)]
    return ", ".join([_type_name(field.annotation), *bounds])


def _default_of(field: FieldInfo) -> str:
    if field.default is PydanticUndefined:
        return "required"
    return json.dumps(to_jsonable_python(field.default))


def _unit_from_name(name: str) -> str:
    if name.endswith("_s"):
        return "seconds"
    if name == "updates" or name.endswith("_updates"):
        return "updates"
    if name.endswith("_prob"):
        return "probability"
    return ""


def nearest(word: str, valid: Sequence[str]) -> str | None:
    """The valid spelling closest to ``word``, or None when none is close (what unknown-key errors suggest)."""
    near = difflib.get_close_matches(word, list(valid), n=1)
    return near[0] if near else None


def explain(key: str) -> KeyDoc:
    """The entry of one dotted key (``faults.site`` and ``faults[0].site`` both name ``faults[].site``).

    Raises :class:`UnknownKeyError` naming the keys of a section, or the nearest valid key."""
    docs = {_plain(d.key): d for d in keys()}
    wanted = _plain(key.strip())
    if wanted in docs:
        return docs[wanted]
    inside = [d.key for k, d in docs.items() if k.startswith(wanted + ".")]
    if inside:
        raise UnknownKeyError(f"{key!r} is a section, not a key; its keys: {', '.join(inside)}")
    near = nearest(wanted, list(docs)) or _nearest_leaf(wanted, list(docs))
    hint = f"did you mean {docs[near].key!r}?" if near else "no key is close to it"
    raise UnknownKeyError(f"the spec has no key {key!r}; {hint} (`spotrun spec --defaults` shows every key)")


def _plain(key: str) -> str:
    return re.sub(r"\[\d*\]", "", key)


def _nearest_leaf(wanted: str, valid: list[str]) -> str | None:
    """A key whose last part is close to ``wanted``'s (``lr`` -> ``train.lr``), for a key given without its section."""
    leaf = nearest(wanted.rsplit(".", 1)[-1], [k.rsplit(".", 1)[-1] for k in valid])
    return next((k for k in valid if k.rsplit(".", 1)[-1] == leaf), None) if leaf else None


def explain_text(doc: KeyDoc) -> str:
    """``spotrun spec --explain``'s answer: one key in a few lines."""
    return "\n".join([
        doc.key,
        f"  type        {doc.value_type}",
        f"  default     {doc.default}",
        f"  unit        {doc.unit or '-'}",
        f"  applies to  {APPLIES_TO.get(doc.applies or '', '?')}",
        f"  {doc.description}",
    ]) + "\n"


def defaults_yaml() -> str:
    """The default spec as YAML: every key at its default (a valid spec as it stands)."""
    return yaml.safe_dump(JobSpec().model_dump(mode="json"), sort_keys=False, width=100)


def recipe_keys_set(spec: JobSpec) -> list[str]:
    """The built-in-recipe-only keys a spec with ``job.entrypoint`` sets to something else than their default:
    none of them reaches a user's job (unless its entrypoint reads ``ctx.spec`` itself)."""
    if spec.job is None:
        return []
    default = JobSpec()
    return [d.key for d in keys() if d.applies == "recipe" and _value(spec, d.key) != _value(default, d.key)]


def _value(spec: BaseModel, key: str) -> Any:
    node: Any = spec
    for part in key.split("."):
        node = getattr(node, part)
    return node


def markdown() -> str:
    """``docs/SPEC.md``: every key, section by section."""
    lines = ["# The job spec", "",
             "Generated by `spotrun spec --markdown` (`make docs`) from the spec's own models: do not edit. "
             "`spotrun spec --explain KEY` prints one entry; `spotrun spec --defaults` prints the default spec "
             "as YAML. Unknown keys are refused, naming the nearest valid one; any key can be set with "
             "`--set dotted.key=value`.", "",
             "**Applies to** says who reads a key:", ""]
    lines += [f"- `{name}`: {what}" for name, what in APPLIES_TO.items()]
    lines += ["", "A recipe-only key set to something else than its default on a spec with `job.entrypoint` "
                  "draws a warning: spotrun does not pass it to your job (your entrypoint sees it only if it "
                  "reads `ctx.spec`); set the equivalent in your job instead."]
    section: type[BaseModel] | None = None
    for d in keys():
        if d.section is not section:
            section = d.section
            lines += ["", f"## {_section_title(d.key)}", "", _doc_of(section), "",
                      "| key | type | default | unit | applies to | description |", "|---|---|---|---|---|---|"]
        default = d.default if d.default == "required" else f"`{d.default}`"
        cells = [f"`{d.key}`", d.value_type, default, d.unit, d.applies or "?", d.description]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def _section_title(key: str) -> str:
    return "Top level" if "." not in key else f"`{key.rsplit('.', 1)[0]}`"


def _doc_of(model: type[BaseModel]) -> str:
    return " ".join((model.__doc__ or "").replace("``", "`").split())
