"""Backend registry: every way autosymm knows to run an op, by name. Which backends serve an op,
which one always serves it and in which order untuned calls try them, is the op's spec's
(autosymm.spec.OpSpec: ``backends``, ``fallback``, ``fallback_order``); this registry is read off
the registered specs, plus ``noop`` (autosymm.backends.local), which serves every op's calls with
nothing to exchange.

A backend is named by an entry (autosymm.entries) and its module imported on first use, so a
missing optional piece (e.g. torch without symmetric-memory ops) only disables its own backends,
and modules low in the layer order may name backends without importing them.
"""

from __future__ import annotations

import functools

from ..entries import load
from ..spec import NOOP, STACK_BACKENDS, registered
from .base import Backend, BackendError, Capabilities, Needs, RunContext

_LOCAL = "autosymm.backends.local:noop"
_LOADED: dict[str, Backend] = {}  # entry -> its backend
#: The backends that are a serving stack's own path (autosymm.backends.stack), by the stack's name.
STACK_PATHS = tuple(STACK_BACKENDS)


def _entries() -> dict[str, str]:
    """name -> entry of every backend: each registered op's, in registry order, then ``noop``."""
    return _entries_of(registered())


@functools.lru_cache(maxsize=8)
def _entries_of(specs: tuple) -> dict[str, str]:
    return {**{name: entry for record in specs for name, entry in record.backends.items()}, NOOP: _LOCAL}


def backend_names() -> list[str]:
    """Every backend's name (the registered ops' backends in registry order, then ``noop``)."""
    return list(_entries())


def get_backend(name: str) -> Backend:
    """The backend called ``name``; KeyError naming the known ones otherwise."""
    entry = _entries().get(name)
    if entry is None:
        raise KeyError(f"unknown backend {name!r}; known: {', '.join(_entries())}")
    backend = _LOADED.get(entry)
    if backend is None:
        backend = _LOADED[entry] = load(entry)
    return backend


__all__ = ["STACK_PATHS", "Backend", "BackendError", "Capabilities", "Needs", "RunContext", "backend_names",
           "get_backend"]
