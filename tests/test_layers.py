"""The layer order of ARCHITECTURE.md, checked from the package's imports (module-level and
function-level alike): no import points up the documented order, and no import cycle exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "autosymm"


def _layers() -> list[tuple[str, list[str]]]:
    """(name, module prefixes) of every layer, top first, as ARCHITECTURE.md's table gives them."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    block = re.search(r"<!-- layers:.*?-->\s*```\n(.*?)```", text, re.S).group(1)
    return [(line.split()[0], line.split()[1:]) for line in block.splitlines() if line.strip()]


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def import_edges() -> dict[str, dict[str, int]]:
    """module -> {imported autosymm module: line}, every import statement anywhere in the module."""
    mods = _modules()
    edges: dict[str, dict[str, int]] = {m: {} for m in mods}
    for mod, path in mods.items():
        package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for target in targets:
                if target in mods and target != mod:
                    edges[mod].setdefault(target, node.lineno)
    return edges


def layer_of(module: str, layers) -> int:
    """Index (0: top) of the layer whose longest prefix names ``module``."""
    best, found = -1, None
    for index, (_, prefixes) in enumerate(layers):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, found = len(prefix), index
    assert found is not None, f"{module} is in no layer of ARCHITECTURE.md"
    return found


def upward_imports() -> list[str]:
    layers = _layers()
    return [f"{mod} ({layers[layer_of(mod, layers)][0]}) -> {target} ({layers[layer_of(target, layers)][0]}) "
            f"line {line}" for mod, targets in sorted(import_edges().items()) for target, line in targets.items()
            if layer_of(target, layers) < layer_of(mod, layers)]


def cycles() -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    edges, index, low, stack, on, found = import_edges(), {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    return found


def test_every_module_sits_in_a_documented_layer():
    layers = _layers()
    assert [name for name, _ in layers][:2] == ["doors", "tuning"] and layers[-1][0] == "data"
    for mod in _modules():
        layer_of(mod, layers)  # asserts


def test_no_import_points_up_the_layer_order():
    assert upward_imports() == []


def test_the_package_has_no_import_cycle():
    assert cycles() == []


def test_the_checks_see_function_level_imports_and_cycles(tmp_path, monkeypatch):
    """The checks find an upward import inside a function, and the cycle it closes."""
    fake = tmp_path / "autosymm"
    (fake / "runtime").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "problem.py").write_text("def f():\n    from .runtime import group\n")
    (fake / "runtime" / "__init__.py").write_text("")
    (fake / "runtime" / "group.py").write_text("from ..problem import f\n")
    (tmp_path / "ARCHITECTURE.md").write_text((ROOT / "ARCHITECTURE.md").read_text())
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    monkeypatch.setattr(__import__(__name__), "PACKAGE", fake)
    assert upward_imports() == ["autosymm.problem (data) -> autosymm.runtime.group (runtime) line 2"]
    assert cycles() == [["autosymm.problem", "autosymm.runtime.group"]]


def test_the_top_level_holds_only_the_modules_everything_uses():
    top = [p.stem for p in PACKAGE.glob("*.py") if p.stem not in ("__init__", "__main__")]
    assert len(top) <= 15, sorted(top)
