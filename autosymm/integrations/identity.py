"""The identity of autosymm's code that a stack keys its compile caches by (a pass's ``uuid()``).

A stack hashes what autosymm hands it: vLLM puts a pass's ``uuid()`` into the JSON hash of its
compilation config (``config/utils.py:311-312``: ``normalize_value`` returns it as it is, then
``hash_factors`` runs ``json.dumps``, ``:397-399``) and into its pass manager's
``InductorPass.hash_dict`` (``compilation/passes/pass_manager.py:236-247``); inductor into its FX
graph cache key. So the identity is a ``str`` (JSON takes nothing else), the same in every process
and after a restart (no path, id or time in it), and it changes when the code that shapes the
rewritten graph changes: the named modules' source and autosymm's version.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
from pathlib import Path

from autosymm.version import __version__


@functools.cache
def code_identity(*modules: str) -> str:
    """SHA-256 hex digest of autosymm's version and, for each module named (``'autosymm.x.y'``),
    its name and its source file's bytes."""
    digest = hashlib.sha256(f"autosymm {__version__}".encode())
    for name in modules:
        source = importlib.import_module(name).__file__
        digest.update(f"\0{name}\0".encode())
        digest.update(Path(source).read_bytes())
    return digest.hexdigest()
