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
        if rel.parts[0] in ("tuning", "bench", "cli") or rel.name == "__main__.py":
            continue  # the tuning side itself, the bench over it, and the CLI over both halves
        if rel == Path("__init__.py") or rel.parts[0] == "integrations":
            assert _loads_tuning_only_when_asked(path.read_text()), f"{rel} imports the tuning side at its top"
            continue  # the doors (the package's autotune, the stacks' warm-up) load it when called
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom):
                names = [("." * node.level) + (node.module or "")] + [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            if any("tuning" in n.split(".") for n in names):
                offenders.append(f"{rel}:{node.lineno}")
    assert not offenders, offenders


def _loads_tuning_only_when_asked(source: str) -> bool:
    """No module-level unconditional import of the tuning side in ``source``: inside a function,
    or under an ``if`` (a setting asking for it)."""
    tree = ast.parse(source)
    return not any(isinstance(node, ast.ImportFrom) and "tuning" in (node.module or "").split(".")
                   for node in tree.body)


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


#: Comparisons on op names allowed outside the op records (autosymm/collectives/) and the tuning
#: side's per-op modules (autosymm/tuning/ops/): everything else asks the registry.
MAX_OP_NAME_COMPARISONS = 3
MAX_BACKEND_NAME_COMPARISONS = 11


def _names_op(node, op_names) -> bool:
    """Whether ``node`` is a string literal naming a registered op, or a literal tuple/list/set
    holding one."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value in op_names
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_op(e, op_names) for e in node.elts)
    return False


def _op_name_comparisons(source: str, op_names) -> list[tuple[int, str]]:
    """(line, text) of each comparison in ``source`` with an op-name literal, or with a name bound
    to one in that source (``OP = "all_reduce"``, ``MOE_OPS = ("dp_to_ep", "ep_to_dp")``)."""
    tree = ast.parse(source)
    constants = {target.id for node in ast.walk(tree) if isinstance(node, ast.Assign) and _names_op(node.value, op_names)
                 for target in node.targets if isinstance(target, ast.Name)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(
                _names_op(side, op_names) or (isinstance(side, ast.Name) and side.id in constants)
                for side in (node.left, *node.comparators)):
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_the_op_name_check_finds_literals_tuples_and_their_constants():
    ops = {"all_reduce", "dp_to_ep"}
    source = ('MOE = ("dp_to_ep", "x")\nif op == "all_reduce": pass\nif op in MOE: pass\n'
              'if op in ("dp_to_ep",): pass\nif op == "sum" or op is record: pass\n')
    assert [line for line, _ in _op_name_comparisons(source, ops)] == [2, 3, 4]


def _comparisons_outside_the_specs(words) -> list[str]:
    found = []
    for path in _modules():
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] == "spec" or rel.parts[:2] == ("tuning", "ops"):
            continue  # the specs and the tuning side's per-op modules name their own op
        found += [f"{rel}:{line}: {text}" for line, text in _op_name_comparisons(path.read_text(), words)]
    return found


def test_few_comparisons_on_op_names_outside_the_op_specs():
    from autosymm import spec

    found = _comparisons_outside_the_specs(set(spec.names()))
    assert len(found) <= MAX_OP_NAME_COMPARISONS, found


def test_no_comparison_on_bucket_units_or_shape_kinds():
    """The CLI, plans, bench and database ask an op's spec (its ``unit`` and ``shape`` records);
    none compares their names."""
    from autosymm import spec

    words = {unit.name for unit in (spec.BYTES, spec.TOKENS)} | {s.shape.name for s in spec.ALL if s.shape}
    assert words == {"bytes", "tokens", "moe_shape", "hidden"}
    assert _comparisons_outside_the_specs(words) == []


def test_few_comparisons_on_backend_names():
    """Backends answer for themselves (``why_not``, their ``needs``); the few comparisons left are
    the bench's own implementations (NCCL and torch's ops it times beside autosymm), the 'noop'
    decision and torch's 'nccl' process-group backend."""
    from autosymm.backends import backend_names

    found = _comparisons_outside_the_specs(set(backend_names()) | {"noop"})
    assert len(found) <= MAX_BACKEND_NAME_COMPARISONS, found
