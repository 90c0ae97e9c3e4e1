"""The package's imports point one way (docs/architecture.md): every package of ``arealite/`` has
a rank and imports only packages of a lower rank, a few named rules hold besides (engines ↛
rollout/algorithms, rollout ↛ algorithms, workflows ↛ engines), and no import cycle exists.

Every ``import``/``from … import`` of an ``arealite`` module counts, wherever it stands (module
level, inside a function, under ``TYPE_CHECKING``): a lazy import is still a dependency."""

import ast
import os

import pytest

from conftest import REPO_ROOT

PACKAGE = os.path.join(REPO_ROOT, "arealite")

# Rank of each package (a top-level part of arealite/): a module imports its own package or packages
# of a lower rank, never one of equal or higher rank (docs/architecture.md lists the same table).
RANKS = {
    "api": 0,  # contracts: configs, dataclasses, the ABCs, the weight-update wire format
    "utils": 1,  # processes, HF loading, recover checkpoints, stats logger, timeline
    "sandbox": 2,  # the code sandbox (model-written programs in a limited process)
    "native": 2,  # C kernels built at first use: decode attention, the bf16 LM head (GEMM, softmax)
    "reward": 3, "algorithms": 3,  # verifiers (the code reward runs programs in the sandbox) and metrics; losses
    "env": 3,  # environments with tools and state (search index, store database, simulated users)
    "dataset": 4,  # rows, loaders (math rows carry answers normalised by arealite.reward)
    "rollout": 5,  # the asyncio executor and the staleness rule
    "train_engine": 6, "inference": 6,  # FSDP2 train engine; the HTTP inference client
    "weights": 7,  # the trainer's weight push (the HTTP client's control calls + the process group)
    "server": 8,  # what runs inside a generation server: ours, and the vLLM worker extension
    "workflow": 9,  # rollouts of one data row (against the InferenceEngine ABC)
    "agent": 10,  # the OpenAI-compatible client and proxy, on top of the workflows
    "launcher": 11,  # processes: local servers, Ray, Slurm
    "evaluate": 12, "report": 12,  # held-out evaluation (launches servers), the run report
    "trainer": 13,  # the training loops, the weight-update coordinator, core sharing
}
ENGINES = {"train_engine", "inference", "weights", "server"}
# Named rules beyond the ranks: (importer packages, imported packages, why).
NEVER = [
    (ENGINES, {"rollout"}, "engines know no rollout executor"),
    (ENGINES, {"algorithms"}, "engines know no algorithm"),
    ({"rollout"}, {"algorithms"}, "the executor knows no algorithm"),
    ({"workflow", "agent"}, ENGINES, "workflows reach models through the InferenceEngine ABC only"),
    ({"api"}, set(RANKS) - {"api"}, "contracts import nothing else of arealite"),
]


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


def _package(module: str) -> str | None:
    return module.split(".")[1] if "." in module else None


def test_every_package_has_a_rank():
    assert sorted({_package(m) for m in _graph() if m != "arealite"} - set(RANKS)) == []


def _violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports of ``graph`` (module → imported modules) that break a rank or a named rule."""
    bad = []
    for m, deps in sorted(graph.items()):
        for d in sorted(deps):
            pm, pd = _package(m), _package(d)
            if m == "arealite" or d == "arealite" or pm == pd:
                continue
            if RANKS[pd] >= RANKS[pm]:
                bad.append(f"{m} (rank {RANKS[pm]}) imports {d} (rank {RANKS[pd]})")
            bad += [f"{m} imports {d}: {why}" for importers, imported, why in NEVER if pm in importers and pd in imported]
    return bad


def test_imports_follow_the_ranks_and_the_named_rules():
    assert _violations(_graph()) == []


def test_the_checker_refuses_same_rank_upward_and_named_imports():
    """Not vacuous: an import between equal ranks, an upward one and each named rule fail."""
    made_up = {"arealite.inference.x": {"arealite.train_engine.y"},  # equal ranks
               "arealite.utils.a": {"arealite.reward.b"},  # upward
               "arealite.rollout.e": {"arealite.algorithms.g"},  # rank allows it, the rule does not
               "arealite.server.s": {"arealite.rollout.e"},
               "arealite.agent.c": {"arealite.inference.x", "arealite.api.ok"}}
    bad = _violations(made_up)
    assert len(bad) == 5, bad
    assert not any("api.ok" in b for b in bad)


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


RECIPES = sorted(os.path.relpath(os.path.join(root, f), os.path.join(REPO_ROOT, "recipes"))
                 for root, _, files in os.walk(os.path.join(REPO_ROOT, "recipes")) for f in files if f.endswith(".py"))


def test_agent_recipes_are_scanned():
    assert any(r.startswith("agents" + os.sep) for r in RECIPES)


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipes_import_only_the_package(recipe):
    """No recipe (recipes/ and recipes/agents/) edits sys.path or imports another recipe: a new
    user's file needs neither."""
    src = open(os.path.join(REPO_ROOT, "recipes", recipe)).read()
    assert "sys.path" not in src
    others = {os.path.basename(f)[:-3] for f in RECIPES}
    tree = ast.parse(src)
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | \
        {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert imported & others == set()


def test_no_module_over_600_lines():
    long = {m: n for m, p in _modules().items() if (n := sum(1 for _ in open(p))) > 600}
    assert long == {}


def test_no_function_over_80_lines():
    """A function a researcher reads in one screen: none in arealite/ is over 80 lines (the RL
    step loop, arealite.trainer.rl_loop.train, is under 50)."""
    long = []
    for m, p in _modules().items():
        for node in ast.walk(ast.parse(open(p).read(), p)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 80:
                long.append(f"{m}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert long == []
    from arealite.trainer.rl_loop import train

    import inspect

    assert len(inspect.getsource(train).splitlines()) <= 50
