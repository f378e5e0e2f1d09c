"""Imports go one way: files -> loaders -> engine -> API -> apps.

Every `mlxspec` module belongs to one layer; it may import from its own unit or from a lower
layer, never from a higher one, and never from a sibling unit of the same layer. Function-level
imports count too: hiding an edge inside a function does not remove it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "mlxspec"

# unit (first component under mlxspec/, or a module name) -> layer
LAYERS = {
    "errors": 0, "logger": 0, "device": 0, "validate": 1, "blas": 1, "cache": 2, "hub": 2,
    "gguf": 3, "tokenizer": 4, "kernels": 5,
    "targets": 6, "drafters": 7, "engine": 8, "api": 9,
    "corpus": 3, "prompts": 10, "args": 10, "evaluate": 11, "inspect": 11, "bench": 12,
    "train": 12, "server": 12, "distributed": 12, "cli": 13, "__init__": 14, "__main__": 14,
}


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _modules():
    for f in sorted(PKG.rglob("*.py")):
        rel = f.relative_to(PKG.parent).with_suffix("")
        yield ".".join(rel.parts), f


def _imports(module: str, path: Path):
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
                sub = PKG.parent.joinpath(*f"{name}.{a.name}".split("."))
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


@pytest.mark.parametrize("unit", ["drafters", "targets", "engine", "gguf"])
def test_no_cycles_inside_a_package(unit):
    """Inside one package, module imports form no cycle (a cycle is two modules that can only
    be read together)."""
    graph: dict[str, set[str]] = {}
    for module, path in _modules():
        if _unit(module) != unit:
            continue
        graph.setdefault(module, set())
        for target, _ in _imports(module, path):
            if _unit(target) == unit and target != module:
                graph[module].add(target)
    seen, stack, cycles = set(), [], []

    def visit(m):
        if m in stack:
            cycles.append(stack[stack.index(m):] + [m])
            return
        if m in seen:
            return
        seen.add(m)
        stack.append(m)
        for n in graph.get(m, ()):
            if n in graph:
                visit(n)
        stack.pop()

    for m in graph:
        visit(m)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)
