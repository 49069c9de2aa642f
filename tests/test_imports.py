"""Deferred imports: an import inside a function says why it cannot sit at the module's top (an
optional dependency, a module ``import autosymm`` must not load, an entry point loaded by name),
and ``import autosymm`` loads none of the modules those reasons keep out. A cycle is no reason:
tests/test_layers.py finds every cycle, function-level imports counted."""

from __future__ import annotations

import ast
import io
import json
import os
import subprocess
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "autosymm"

#: Modules ``import autosymm`` must not add to what ``import torch`` has loaded, each with its
#: submodules: the kernels and Triton (a CPU process serves from NCCL), the tuning side, the CLI, the
#: stacks' adapters, optional dependencies, torch's heavy corners. The Triton backends
#: (autosymm.backends.triton_*) load by name at a group's first use, so ``import autosymm`` has none.
NOT_LOADED = ("triton", "autosymm.kernels", "autosymm.tuning", "autosymm.bench", "autosymm.cli",
              "autosymm.integrations", "vllm", "sglang", "flashinfer", "optuna", "matplotlib", "rich",
              "torch._inductor", "torch.distributed.tensor", "torch.distributed._symmetric_memory")
TRITON_BACKENDS = "autosymm.backends.triton"

_PRAGMAS = ("noqa", "type:", "pragma", "pylint", "fmt:")


def _reasons(source: str) -> dict[int, str]:
    """line -> its comment's text (pragmas such as ``noqa`` alone are no reason)."""
    comments = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            text = token.string.lstrip("#").strip()
            if text and not text.startswith(_PRAGMAS):
                comments[token.start[0]] = text
    return comments


def function_level_imports(source: str) -> list[ast.stmt]:
    """Every import statement inside a function (methods and nested functions included)."""
    found = {}
    for function in ast.walk(ast.parse(source)):
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(function):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    found[node.lineno] = node
    return [found[line] for line in sorted(found)]


def unexplained(source: str) -> list[int]:
    """Lines of the function-level imports in ``source`` with no comment on their line or the line
    just above."""
    reasons = _reasons(source)
    return [node.lineno for node in function_level_imports(source)
            if node.lineno not in reasons and node.lineno - 1 not in reasons]


def test_every_function_level_import_says_why_it_is_deferred():
    offenders = [f"{path.relative_to(ROOT)}:{line}" for path in sorted(PACKAGE.rglob("*.py"))
                 for line in unexplained(path.read_text())]
    assert not offenders, f"move these imports to the module's top, or say why they must wait: {offenders}"


def test_the_check_sees_a_bare_deferred_import_and_accepts_a_reason():
    bare = "def f():\n    import triton\n"
    assert unexplained(bare) == [2]
    assert unexplained("def f():\n    import triton  # noqa: F401\n") == [2]  # a pragma is no reason
    assert unexplained("def f():\n    import triton  # optional\n") == []
    assert unexplained("class C:\n    def f(self):\n        # optional\n        from x import y\n") == []
    assert unexplained("import os\n\n\ndef f():\n    return os\n") == []  # module level: nothing to say


def _loaded_by_import_autosymm() -> list[str]:
    """The modules a fresh interpreter loads for ``import autosymm`` beyond ``import torch``'s."""
    code = ("import json, sys; import torch, torch.distributed; before = set(sys.modules); import autosymm; "
            "print(json.dumps(sorted(set(sys.modules) - before)))")
    env = {k: v for k, v in os.environ.items() if k != "AUTOSYMM_AUTOTUNE"}  # the warm-up tuner loads tuning
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300, check=True).stdout
    return json.loads(out.splitlines()[-1])


def test_import_autosymm_loads_no_kernel_tuning_side_integration_or_optional_dependency():
    loaded = _loaded_by_import_autosymm()
    assert "autosymm.api" in loaded  # the subprocess imported this checkout's package
    wrong = [m for m in loaded if m.startswith(TRITON_BACKENDS)
             or any(m == p or m.startswith(p + ".") for p in NOT_LOADED)]
    assert not wrong, f"import autosymm loads {wrong}"
