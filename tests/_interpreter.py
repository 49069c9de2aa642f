"""The Triton interpreter without its redundant re-patching of ``triton.language`` per device call.

Under TRITON_INTERPRET=1 a kernel launch (``GridExecutor.__call__``) patches the language
modules its function sees (``tl``, ``tl.core``: their builtins, ``tl.math``, the tensor class)
and restores them when the grid has run. Every call of a ``@triton.jit`` helper inside the
kernel runs the same patching again, a scan of every module member (about 1 ms a call; a third
of the CPU suite's interpreter time goes there), and never restores it: it changes nothing while
the launch's patches hold. Here a helper's call patches only the language modules the launch
has not patched yet, so the patched state, and what every kernel computes, is the same.

``install`` is idempotent and does nothing for a Triton whose interpreter lacks the two names it
wraps. conftest installs it in the pytest processes, ``_gloo`` in the rank processes.
"""

from __future__ import annotations

import inspect
import threading

_launch = threading.local()  # .patched: id()s of the language modules the running launch has patched


def install() -> None:
    from triton.runtime import interpreter

    if getattr(interpreter, "_autosymm_tests_patch_once", False):
        return
    patch_lang, grid_call = getattr(interpreter, "_patch_lang", None), getattr(interpreter.GridExecutor, "__call__", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if patch_lang is None or grid_call is None or scope_type is None:
        return
    import triton.language as tl

    languages = (tl, tl.core)
    seen: dict[tuple[int, int], frozenset[int]] = {}  # (id, size) of function globals -> their languages' id()s

    def languages_of(fn) -> frozenset[int]:
        key = (id(fn.__globals__), len(fn.__globals__))  # the interpreter adds names to a module's globals
        if key not in seen:
            seen[key] = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in languages)
        return seen[key]

    def patch_once(fn):
        patched = getattr(_launch, "patched", None)
        if patched is None:  # outside any launch: as Triton does
            return patch_lang(fn)
        wanted = languages_of(fn)
        if wanted <= patched:  # patched by this launch already, and not restored before it ends
            return scope_type()
        scope = patch_lang(fn)
        patched |= wanted
        return scope

    def launch(self, *args, **kwargs):
        _launch.patched = set()  # its own first patching (of the kernel's languages) is the one it restores
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            _launch.patched = None

    interpreter._patch_lang = patch_once
    interpreter.GridExecutor.__call__ = launch
    interpreter._autosymm_tests_patch_once = True
