"""The architecture as the folders draw it: every import points down a fixed order of layers.

Read from the source (no import is executed): each module's imports, at the top or inside a function,
absolute or relative, resolved to spotrun's own modules. A module may import its own folder and the
folders below it in LAYERS; ``trainer/`` never imports ``orchestrator/``; no two modules import each
other, directly or through others.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Bottom first: a folder imports only itself and the folders before it.
LAYERS = (
    "trainer",  # the package root: __version__
    "trainer.storage", "trainer.job", "trainer.runtime", "trainer.data", "trainer.metrics", "trainer.state",
    "trainer.observe", "trainer.bundle", "trainer.run",
    "orchestrator", "orchestrator.policy", "orchestrator.ledger", "orchestrator.notices", "orchestrator.publish",
    "orchestrator.workers", "orchestrator.control", "orchestrator.verify", "orchestrator.dashboard",
    "orchestrator.cli",
)
MAX_LINES = 520  # a module past this holds more than one concept: split it
# being split (each entry leaves with the change that splits it)
OVERSIZE: set[str] = set()


def _modules() -> dict[str, Path]:
    mods = {}
    for top in ("trainer", "orchestrator"):
        for path in (ROOT / top).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            mods[name] = path
    return mods


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The spotrun modules ``name`` imports, without the ``spotrun.`` prefix."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.startswith("spotrun."):
                target = node.module.removeprefix("spotrun.")
            else:
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in MODULES else target)
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix("spotrun.") for a in node.names if a.name.startswith("spotrun.")}
    return {m for m in found if m in MODULES}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def layer_of(module: str) -> str:
    """The deepest entry of LAYERS that ``module`` lies in."""
    return max((lay for lay in LAYERS if module == lay or module.startswith(lay + ".")), key=len)


def upward(graph: dict[str, set[str]]) -> list[str]:
    """Every import that points to a later layer than its own."""
    order = {lay: i for i, lay in enumerate(LAYERS)}
    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                  if order[layer_of(b)] > order[layer_of(a)])


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_every_folder_is_a_layer():
    packages = {m for m, p in MODULES.items() if p.name == "__init__.py" and m.count(".") <= 1}
    assert sorted(packages - set(LAYERS)) == [], "folders with no place in LAYERS"


def test_imports_point_down_the_layers():
    assert upward(GRAPH) == []


def test_no_module_imports_itself_through_others():
    assert cycles(GRAPH) == []


def test_trainer_never_imports_orchestrator():
    assert [f"{a} -> {b}" for a, bs in GRAPH.items() for b in bs
            if a.startswith("trainer") and b.startswith("orchestrator")] == []


def test_the_checks_catch_what_they_forbid():
    """An upward import and a circle, planted in a copy of the graph, are both found."""
    planted = {k: set(v) for k, v in GRAPH.items()}
    planted["trainer.storage.base"].add("trainer.run.rank")
    planted["orchestrator.policy.recovery"].add("orchestrator.control.supervisor")
    assert upward(planted) == ["orchestrator.policy.recovery -> orchestrator.control.supervisor",
                               "trainer.storage.base -> trainer.run.rank"]
    assert any("trainer.storage.base" in c for c in cycles(planted))


def test_no_module_outgrows_one_concept():
    long = {str(p.relative_to(ROOT)): n for p in MODULES.values() if (n := p.read_text().count("\n")) > MAX_LINES}
    assert set(long) - OVERSIZE == set(), "split these by concept"
    assert OVERSIZE - set(long) == set(), "split already: take them off OVERSIZE"
