"""The house's import graph: no circle anywhere, and built-ins named by their own files only.

A circle makes the import order matter (the MoE backends once imported each other through `auto`);
a module outside a registry's home that imports a built-in is a second place to edit when one is added.
"""

import ast
from pathlib import Path

import grimp
import pytest
from grpo_rollout.engines.base import ENGINES
from grpo_rollout.rewards.base import BUILTINS as REWARDS
from grpo_rollout.tools.registry import BUILTINS as TOOLS
from grpo_trainer.moe.dispatch import BACKENDS

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("grpo_operator", "grpo_trainer", "grpo_rollout", "grpo_wire")
SOURCES = dict(zip(PACKAGES, ("operator", "trainers", "rollout", "wire"), strict=True))


def circles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan, iterative)."""
    modules = sorted(graph.modules)
    edges = {m: sorted(set(graph.find_modules_directly_imported_by(m)) & set(modules)) for m in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in modules:
        if root in index:
            continue
        work = [(root, iter(edges[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(edges[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def test_circles_are_found() -> None:
    graph = grimp.ImportGraph()
    for a, b in (("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a"), ("p.c", "p.d")):
        graph.add_import(importer=a, imported=b)
    assert circles(graph) == [["p.a", "p.b", "p.c"]]


def test_no_module_of_ours_imports_itself_through_others() -> None:
    """Run-time imports, lazy ones inside functions included; type-checking-only imports are not
    executed and do not count."""
    graph = grimp.build_graph(*PACKAGES, exclude_type_checking_imports=True)
    assert circles(graph) == []


def _importers_of(prefix: str, outside: str) -> list[str]:
    """Files outside `outside` (a package folder) that import a module under `prefix`."""
    found = []
    for package, folder in SOURCES.items():
        for path in (ROOT / folder / package).rglob("*.py"):
            if path.is_relative_to(ROOT / outside):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                names = []
                if isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                if any(n == prefix or n.startswith(prefix + ".") for n in names):
                    found.append(str(path.relative_to(ROOT)))
    return found


@pytest.mark.parametrize(
    ("registry", "folder"),
    [
        (BACKENDS, "trainers/grpo_trainer/moe/backends"),
        (REWARDS, "rollout/grpo_rollout/rewards/builtin"),
        (TOOLS, "rollout/grpo_rollout/tools/builtin"),
    ],
    ids=["EP backends", "reward built-ins", "tool built-ins"],
)
def test_a_package_of_built_ins_is_named_by_nothing_outside_it(registry, folder: str) -> None:
    """Adding one is one file there: the registry finds it, nothing else of ours imports it."""
    assert registry.home == folder.split("/", 1)[1].replace("/", ".")
    assert len(registry) >= 1
    assert _importers_of(registry.home, folder) == []


def test_every_engine_module_registers_itself_and_only_the_registry_finds_it() -> None:
    assert ENGINES.home == "grpo_rollout.engines"
    for name, engine in ENGINES.items():
        module = engine.__module__
        assert module.startswith("grpo_rollout.engines."), (name, module)
        assert _importers_of(module, "rollout/grpo_rollout/engines") == [], name
