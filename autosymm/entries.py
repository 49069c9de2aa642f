"""Entry lists: the one way autosymm loads a registry's members late. A member is named by an
entry ``'package.module:attribute'`` and resolved on first use (:func:`load`), so a module low
in the layer order (ARCHITECTURE.md) can name one above it without importing it: an op's spec
naming its door, backends, tuning module and bench (autosymm.spec.OpSpec), and the Triton
families' algorithm tables a config is checked against (autosymm.configs ``FAMILY``). A member whose module fails to import disables only
itself."""

from __future__ import annotations

import importlib
from typing import Any


def load(entry: str) -> Any:
    """The attribute an entry ``'module:attribute'`` names (its module imported on first use);
    ValueError naming an entry without the colon."""
    module, sep, attribute = entry.partition(":")
    if not sep or not module or not attribute:
        raise ValueError(f"entry {entry!r} is not 'package.module:attribute'")
    return getattr(importlib.import_module(module), attribute)
