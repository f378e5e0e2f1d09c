"""Imports go one way: files -> loaders -> engine -> API -> apps.

Every `mlxspec` module belongs to one layer; it may import from its own unit or from a lower
layer, never from a higher one, and never from a sibling unit of the same layer; and no modules
import each other in a circle, inside a unit either. Function-level and TYPE_CHECKING imports
count too: hiding an edge inside a function or behind a flag does not remove it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "mlxspec"

# unit (first component under mlxspec/, or a module name) -> layer
LAYERS = {
    "errors": 0, "logger": 0, "device": 0, "validate": 1, "blas": 4, "cache": 2, "hub": 2,
    "gguf": 3, "cpu_gemm": 3, "cpu_jit": 3, "cpu_ops": 3, "tokenizer": 4, "kernels": 5,
    "targets": 6, "drafters": 7, "engine": 8, "api": 9,
    "corpus": 3, "prompts": 10, "args": 10, "evaluate": 11, "inspect": 11, "bench": 12,
    "train": 12, "server": 12, "distributed": 12, "cli": 13, "__init__": 14, "__main__": 14,
}


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _modules(pkg: Path = PKG):
    for f in sorted(pkg.rglob("*.py")):
        rel = f.relative_to(pkg.parent).with_suffix("")
        yield ".".join(rel.parts), f


def _imports(module: str, path: Path, root: Path = PKG.parent):
    is_pkg = path.name == "__init__.py"
    pkg = module.split(".") if is_pkg else module.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("mlxspec"):
                    yield a.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if name != "mlxspec" and not name.startswith("mlxspec."):
                continue
            for a in node.names:  # `from mlxspec.pkg import mod` imports the module mlxspec.pkg.mod
                sub = root.joinpath(*f"{name}.{a.name}".split("."))
                is_module = sub.with_suffix(".py").exists() or (sub / "__init__.py").exists()
                yield (f"{name}.{a.name}" if is_module else name), node.lineno


def test_every_unit_has_a_layer():
    missing = sorted({_unit(m) for m, _ in _modules()} - set(LAYERS))
    assert not missing, f"give these units a layer in LAYERS: {missing}"


def test_imports_go_one_way():
    bad = []
    for module, path in _modules():
        me = _unit(module)
        for target, line in _imports(module, path):
            other = _unit(target)
            if other == me or other not in LAYERS:
                continue
            if LAYERS[other] >= LAYERS[me]:
                bad.append(f"{path.relative_to(PKG.parent)}:{line} {me} (layer {LAYERS[me]}) imports "
                           f"{target} (layer {LAYERS[other]})")
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def import_graph(root: Path = PKG.parent) -> dict[str, set[str]]:
    """module -> the mlxspec modules it imports (a package by its own name, not `pkg.__init__`;
    function-level and TYPE_CHECKING imports included), over every module under root/mlxspec."""
    def name(m: str) -> str:
        return m.removesuffix(".__init__")

    graph: dict[str, set[str]] = {}
    for module, path in _modules(root / "mlxspec"):
        graph.setdefault(name(module), set()).update(name(t) for t, _ in _imports(module, path, root))
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Import cycles of a module graph, each as [m1, m2, ..., m1]: at least one through every
    set of modules that can only be read together (a depth-first search's back edges)."""
    seen, stack, cycles = set(), [], []

    def visit(m):
        if m in stack:
            cycles.append(stack[stack.index(m):] + [m])
            return
        if m in seen:
            return
        seen.add(m)
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if n in graph and n != m:
                visit(n)
        stack.pop()

    for m in sorted(graph):
        visit(m)
    return cycles


def test_no_import_cycles():
    """No two modules can only be read together, inside a package (server/jobs.py <-> state.py
    was one, through a TYPE_CHECKING import) or across packages."""
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_cycle_check_finds_a_planted_cycle(tmp_path):
    """The check itself: inside one package, a circle through an import in a function body and
    one through a TYPE_CHECKING import are both found; without those edges the package is clean."""
    pkg = tmp_path / "mlxspec" / "shop"
    pkg.mkdir(parents=True)
    (tmp_path / "mlxspec" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "state.py").write_text("from mlxspec.shop import jobs\n")
    (pkg / "jobs.py").write_text("from typing import TYPE_CHECKING\nfrom mlxspec.shop.clock import now\n"
                                 "if TYPE_CHECKING:\n    from mlxspec.shop.state import Server\n")
    (pkg / "clock.py").write_text("def now():\n    from .state import Server\n    return Server\n")
    cycles = find_cycles(import_graph(tmp_path))
    assert ["mlxspec.shop.clock", "mlxspec.shop.state", "mlxspec.shop.jobs", "mlxspec.shop.clock"] in cycles  # in a function
    assert ["mlxspec.shop.state", "mlxspec.shop.jobs", "mlxspec.shop.state"] in cycles  # behind TYPE_CHECKING
    (pkg / "clock.py").write_text("def now():\n    return 0\n")
    (pkg / "jobs.py").write_text("from mlxspec.shop.clock import now\n")
    assert find_cycles(import_graph(tmp_path)) == []
    assert find_cycles({"a": {"b"}, "b": {"a"}, "c": {"c"}}) == [["a", "b", "a"]]  # (a module importing itself is no cycle)
