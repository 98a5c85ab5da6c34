"""The identity of a job's code: its entrypoint module and every module of the user's own that it
imports, file by file (driver and ranks alike compute it, from the same files).

A bundle restores only into the code that wrote it, because other code may not take the same next
updates: a constant edited in a helper module changes the trajectory as surely as one in the
entrypoint. The *user's own* modules are found statically: the entrypoint's source is parsed and
every module it imports (at the top or inside a function, absolute or relative) is looked up
without being imported; those that lie outside the installed libraries (the standard library,
site-packages, spotrun itself) are parsed in turn. Installed libraries are not fingerprinted: the
manifest records the versions of Python, torch, torchdata, NumPy and spotrun (a ``strict`` restore
compares the kernels' ones), not of every package; a library of the user's own in an editable install
lives in the user's folders and is followed.

What the static walk cannot see: a module imported by a computed name (``importlib.import_module(
name)``), and files that are not Python modules (a YAML the job reads). Record those yourself: the
job's data has a ``version=``, and a config that shapes training belongs in the spec's ``job.config``.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import site
import sys
import sysconfig
from collections.abc import Iterator
from functools import cache
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from spotrun.trainer.job.contract import entrypoint_of
from spotrun.trainer.job.spec import JobSpec


class CodeInfo(BaseModel):
    """The job's code: a bundle restores only into the code that wrote it
    (:func:`code_identity`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    entrypoint: str
    fingerprint: str  # sha256 (16 hex) of the entrypoint module's source
    # every user module the entrypoint imports (itself included), by module name: sha256 (16 hex) of
    # its source. Empty for the built-in recipe, and in manifests written before schema 6.
    files: dict[str, str] = {}


def code_identity(spec: JobSpec) -> CodeInfo:
    """The code identity of ``spec``'s job: the entrypoint's module must be imported already (the
    fingerprint is its source); ``files`` maps every user module it reaches to its source's digest."""
    ref = entrypoint_of(spec)
    name = ref.partition(":")[0]
    module = sys.modules[name]
    file = getattr(module, "__file__", None)
    source = Path(file).read_bytes() if file else b""
    return CodeInfo(entrypoint=ref, fingerprint=_digest(source), files=user_modules(name))


def user_modules(entry: str) -> dict[str, str]:
    """``{module name: digest of its source}`` for ``entry`` and each user module it reaches by
    import statements, recursively; empty when ``entry`` is not a user module (the built-in recipe)."""
    out: dict[str, str] = {}
    todo = [entry]
    while todo:
        name = todo.pop()
        if name in out:
            continue
        path = _user_file(name)
        if path is None:
            continue
        source = path.read_bytes()
        out[name] = _digest(source)
        todo += _parents(name)  # importing pkg.mod runs pkg/__init__.py
        todo += _imports(name, path, source)
    return dict(sorted(out.items()))


def code_problem(bundle: CodeInfo, ours: CodeInfo) -> str | None:
    """What differs between the code that wrote a bundle and this job's, naming each changed file
    (None: the same). A manifest written before files were recorded compares the entrypoint alone."""
    if bundle.entrypoint != ours.entrypoint:
        return f"the entrypoint is {ours.entrypoint}, the bundle was written by {bundle.entrypoint}"
    if bundle.fingerprint == ours.fingerprint and (not bundle.files or bundle.files == ours.files):
        return None
    entry = bundle.entrypoint.partition(":")[0]
    if not bundle.files:
        return f"module {entry} changed (fingerprint {bundle.fingerprint}, now {ours.fingerprint})"
    changed = sorted(m for m in bundle.files.keys() & ours.files.keys() if bundle.files[m] != ours.files[m])
    gone = sorted(bundle.files.keys() - ours.files.keys())
    new = sorted(ours.files.keys() - bundle.files.keys())
    parts = [f"changed: {', '.join(_where(m) for m in changed)}" if changed else "",
             f"no longer imported: {', '.join(gone)}" if gone else "",
             f"newly imported: {', '.join(_where(m) for m in new)}" if new else ""]
    if not any(parts):  # the entrypoint's own fingerprint alone (a manifest's files without it)
        parts = [f"changed: {_where(entry)}"]
    return "; ".join(p for p in parts if p)


def _where(module: str) -> str:
    path = _user_file(module)
    return f"{module} ({path})" if path is not None else module


def _digest(source: bytes) -> str:
    return hashlib.sha256(source).hexdigest()[:16]


def _parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _imports(name: str, path: Path, source: bytes) -> Iterator[str]:
    """The absolute names of the modules ``name``'s source imports (for ``from a import b``: ``a``,
    and ``a.b`` in case ``b`` is a submodule)."""
    try:
        tree = ast.parse(source, filename=str(path))
    except SyntaxError:
        return  # the import itself would have failed; the digest still records the file
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: max(0, len(package.split(".")) - node.level + 1)]
                base = ".".join([*up, base] if base else up)
            if base:
                yield base
                yield from (f"{base}.{a.name}" for a in node.names if a.name != "*")


def _user_file(name: str) -> Path | None:
    """The source file of module ``name`` when it is the user's own (outside the installed libraries
    and spotrun), found without importing it where its top-level package is not the user's."""
    top = name.partition(".")[0]
    if top in sys.builtin_module_names or top == "spotrun" or (top != name and _user_file(top) is None):
        return None
    module = sys.modules.get(name)
    origin = getattr(module, "__file__", None) if module is not None else None
    if origin is None:
        try:
            spec = importlib.util.find_spec(name)  # imports parents only: they are the user's own here
        except (ImportError, ValueError):
            return None
        origin = spec.origin if spec is not None else None
    if not origin or not origin.endswith(".py"):
        return None
    path = Path(origin).resolve()
    return None if any(path.is_relative_to(root) for root in _library_roots()) else path


@cache
def _library_roots() -> tuple[Path, ...]:
    """Where installed code lives: the standard library, every site-packages, spotrun's own tree."""
    paths = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    paths |= set(site.getsitepackages()) | {site.getusersitepackages()}
    spotrun_root = Path(__file__).resolve().parents[2]  # trainer/ and orchestrator/ sit here (links)
    return tuple({Path(p).resolve() for p in paths} | {spotrun_root / "trainer", spotrun_root / "orchestrator",
                                                        spotrun_root / "spotrun"})
