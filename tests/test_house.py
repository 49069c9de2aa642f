"""The layout rules of the package: the runtime never imports the tuning side; only
autosymm.settings reads the environment; functions and modules stay small (Triton kernels aside:
a @triton.jit signature is the kernel's launch ABI)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "autosymm"
MAX_PARAMS, MAX_BODY_LINES, MAX_MODULE_LINES = 8, 80, 450


def _modules():
    return sorted(PACKAGE.rglob("*.py"))


def _is_triton_jit(node) -> bool:
    return any("triton.jit" in ast.unparse(d) for d in node.decorator_list)


def test_runtime_modules_import_nothing_from_the_tuning_side():
    offenders = []
    for path in _modules():
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] == "tuning" or rel.name.startswith("cli") or rel.name == "__main__.py":
            continue  # the tuning side itself, and the CLI over both halves
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom):
                names = [("." * node.level) + (node.module or "")] + [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            if any("tuning" in n.split(".") for n in names):
                offenders.append(f"{rel}:{node.lineno}")
    assert not offenders, offenders


def test_functions_and_modules_stay_small():
    too_big = []
    for path in _modules():
        source = path.read_text()
        if source.count("\n") > MAX_MODULE_LINES:
            too_big.append(f"{path.name}: {source.count(chr(10))} lines")
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or _is_triton_jit(node):
                continue
            a = node.args
            params = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)
            body = node.body[1:] if ast.get_docstring(node) and len(node.body) > 1 else node.body
            lines = node.end_lineno - body[0].lineno + 1
            if params > MAX_PARAMS or lines > MAX_BODY_LINES:
                too_big.append(f"{path.name}:{node.lineno} {node.name}: {params} parameters, {lines} body lines")
    assert not too_big, too_big


def _environment_reads(tree) -> list[int]:
    """Lines that touch ``os.environ`` or call ``os.getenv`` (also as ``from os import environ``)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb", "putenv") \
                and isinstance(node.value, ast.Name) and node.value.id == "os":
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os" \
                and any(a.name in ("environ", "getenv", "environb", "putenv") for a in node.names):
            lines.append(node.lineno)
    return lines


def test_only_the_settings_module_touches_the_environment():
    offenders = [f"{path.relative_to(PACKAGE)}:{line}" for path in _modules() if path.name != "settings.py"
                 or path.parent != PACKAGE for line in _environment_reads(ast.parse(path.read_text()))]
    assert not offenders, f"read the environment through autosymm.settings: {offenders}"
    assert _environment_reads(ast.parse((PACKAGE / "settings.py").read_text()))  # the check sees real reads
