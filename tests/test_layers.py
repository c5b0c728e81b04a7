"""The package's import graph has no cycles, counting imports inside functions too: each
layer (core, reference engine, training, SGLang plugin, kernels) depends only downward. The CPU
platform, the reference engine and the test-only package stand apart from the layers beside them."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"jetflow_sglang": ROOT / "jetflow_sglang", "jetflow_kernels": ROOT / "kernels"}


def module_name(path: Path) -> str:
    for package, folder in PACKAGES.items():
        if folder in path.parents:
            parts = path.relative_to(folder).with_suffix("").parts
            return ".".join((package, *parts)).removesuffix(".__init__")
    raise ValueError(path)


def imports(path: Path, modules: set[str]) -> set[str]:
    """The package modules a file imports anywhere in it (relative imports resolved)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    files = [p for folder in PACKAGES.values() for p in folder.rglob("*.py") if "heads" not in p.parts]
    modules = {module_name(p) for p in files}
    graph = {module_name(p): imports(p, modules) for p in files}
    for module in graph:  # importing a.b runs a's __init__, which is no dependency of a.b's own
        graph[module] = {m for m in graph[module] if not module.startswith(m + ".")}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_planted_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_the_package_has_no_import_cycles():
    graph = import_graph()
    assert "jetflow_sglang.training.train" in graph and graph["jetflow_sglang.training.train"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_cpu_platform_reference_engine_and_test_parts_stand_apart():
    """The CPU platform imports nothing of JETFLOW; the reference engine nothing of SGLang, training
    or the test parts; the test parts are imported by the worker alone (where a JETFLOW_TEST_*
    hook asks for them), never by the rest of the package."""
    graph = import_graph()
    cpu, reference, testing = "jetflow_sglang.sglang_plugin.cpu", "jetflow_sglang.reference", "jetflow_sglang.testing"
    assert any(_under(m, cpu) for m in graph) and any(_under(m, reference) for m in graph)
    for module, deps in graph.items():
        if _under(module, cpu):
            assert all(_under(d, cpu) for d in deps), (module, deps)
        if _under(module, reference):
            apart = ("jetflow_sglang.sglang_plugin", "jetflow_sglang.training", testing)
            assert not [d for d in deps if any(_under(d, p) for p in apart)], (module, deps)
        if not _under(module, testing) and module != "jetflow_sglang.sglang_plugin.worker":
            assert not [d for d in deps if _under(d, testing)], (module, deps)
