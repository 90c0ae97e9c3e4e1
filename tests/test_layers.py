"""The package's imports point one way (docs/architecture.md): contracts → pieces → engines →
workflows → launchers → recipes, with no import cycle anywhere.

Every ``import``/``from … import`` of an ``arealite`` module counts, wherever it stands (module
level, inside a function, under ``TYPE_CHECKING``): a lazy import is still a dependency."""

import ast
import os

import pytest

from conftest import REPO_ROOT

PACKAGE = os.path.join(REPO_ROOT, "arealite")

# Layer of each top-level part of the package (a module may import its own layer or lower ones).
LAYERS = {
    "api": 0,  # contracts: configs, dataclasses, abstract engines/workflows, the weight-update protocol
    "utils": 1, "algorithms": 1, "dataset": 1, "reward": 1, "rollout": 1, "sandbox": 1,  # pieces
    "engine": 2,  # trainer engine, HTTP client, our server, weight sync, vLLM extension
    "workflow": 3, "agent": 3,  # rollouts of one data row
    "launcher": 4, "evaluate": 4, "report": 4,  # processes, the training loops, the weight-update coordinator
}
NAMES = {0: "contracts", 1: "pieces", 2: "engines", 3: "workflows", 4: "launchers"}


def _modules() -> dict[str, str]:
    """``arealite.x.y`` → file path, for every .py file of the package."""
    found = {}
    for root, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(root, f), REPO_ROOT)[:-3].replace(os.sep, ".")
                found[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(root, f)
    return found


def _imports(path: str, module: str, known: set[str]) -> set[str]:
    """The arealite modules imported by the file (``from a import b`` counts ``a.b`` when that is
    a module, else ``a``); relative imports are resolved against ``module``."""
    tree = ast.parse(open(path).read(), path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:  # arealite.a.b.Class → arealite.a.b
                name = name.rpartition(".")[0]
            if name.startswith("arealite") and name != module:
                out.add(name)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(p, m, set(mods)) for m, p in mods.items()}


def _layer(module: str) -> int | None:
    part = module.split(".")[1] if "." in module else None
    return LAYERS.get(part)


def test_every_module_has_a_layer():
    assert sorted(m for m in _graph() if m != "arealite" and _layer(m) is None) == []


def test_imports_never_point_to_a_higher_layer():
    bad = [f"{m} ({NAMES[_layer(m)]}) imports {d} ({NAMES[_layer(d)]})"
           for m, deps in sorted(_graph().items()) if m != "arealite"
           for d in sorted(deps) if d != "arealite" and _layer(d) > _layer(m)]
    assert bad == []


def test_no_import_cycle():
    graph = _graph()
    state, stack, cycles = {}, [], []

    def visit(m):  # depth-first search; a grey node met again closes a cycle
        state[m] = "grey"
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == "grey":
                cycles.append(" → ".join(stack[stack.index(d):] + [d]))
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = "black"

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert cycles == []


def test_the_checker_sees_a_lazy_upward_import(tmp_path):
    """The parser counts imports inside functions and relative ones (so the checks can fail)."""
    f = tmp_path / "mod.py"
    f.write_text("def f():\n    from ..engine import fsdp\n    import arealite.launcher.local\n")
    known = {"arealite.engine", "arealite.engine.fsdp", "arealite.launcher.local", "arealite.api.mod"}
    assert _imports(str(f), "arealite.api.mod", known) == {"arealite.engine.fsdp", "arealite.launcher.local"}


@pytest.mark.parametrize("recipe", sorted(f for f in os.listdir(os.path.join(REPO_ROOT, "recipes")) if f.endswith(".py")))
def test_recipes_import_only_the_package(recipe):
    """No recipe edits sys.path or imports another recipe: a new user's file needs neither."""
    src = open(os.path.join(REPO_ROOT, "recipes", recipe)).read()
    assert "sys.path" not in src
    others = {f[:-3] for f in os.listdir(os.path.join(REPO_ROOT, "recipes")) if f.endswith(".py")}
    tree = ast.parse(src)
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | \
        {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert imported & others == set()


def test_no_module_over_600_lines():
    long = {m: n for m, p in _modules().items() if (n := sum(1 for _ in open(p))) > 600}
    assert long == {}
