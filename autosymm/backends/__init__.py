"""Backend registry: every way autosymm knows to run an op, by name.

Modules are imported on first use so that a missing optional piece (e.g. torch without
symmetric-memory ops) only disables its own backends.
"""

from __future__ import annotations

import importlib
from typing import Optional

from .base import Backend, BackendError, Capabilities, RunContext

# name -> (module, attribute)
_REGISTRY: dict[str, tuple[str, str]] = {
    "nccl": ("autosymm.backends.nccl_all_reduce", "nccl"),
    "torch_one_shot": ("autosymm.backends.torch_symm", "torch_one_shot"),
    "torch_two_shot": ("autosymm.backends.torch_symm", "torch_two_shot"),
    "triton_one_shot": ("autosymm.backends.triton_all_reduce", "triton_one_shot"),
    "triton_one_shot_push": ("autosymm.backends.triton_all_reduce", "triton_one_shot_push"),
    "triton_two_shot": ("autosymm.backends.triton_all_reduce", "triton_two_shot"),
    "triton_multimem": ("autosymm.backends.triton_all_reduce", "triton_multimem"),
    "triton_moe": ("autosymm.backends.triton_moe", "TRITON_MOE"),
    "nccl_all_to_all": ("autosymm.backends.nccl_all_to_all", "NCCL_ALL_TO_ALL"),
}

#: The backend that can always serve an op (the fallback of the dispatcher).
FALLBACK = {"all_reduce": "nccl", "dp_to_ep": "nccl_all_to_all", "ep_to_dp": "nccl_all_to_all"}

_LOADED: dict[str, Backend] = {}


def backend_names() -> list[str]:
    return list(_REGISTRY)


def get_backend(name: str) -> Backend:
    """The backend called ``name``; KeyError naming the known ones otherwise."""
    backend = _LOADED.get(name)
    if backend is None:
        if name not in _REGISTRY:
            raise KeyError(f"unknown backend {name!r}; known: {', '.join(_REGISTRY)}")
        module, attr = _REGISTRY[name]
        backend = getattr(importlib.import_module(module), attr)
        _LOADED[name] = backend
    return backend


def backends_for(op: str, names: Optional[list[str]] = None) -> dict[str, Backend]:
    """All registered backends serving ``op`` (optionally only those in ``names``)."""
    out = {}
    for name in names or _REGISTRY:
        backend = get_backend(name)
        if op in backend.ops:
            out[name] = backend
    return out


__all__ = ["Backend", "BackendError", "Capabilities", "RunContext", "FALLBACK", "backend_names",
           "backends_for", "get_backend"]
