"""Backend registry: every way autosymm knows to run an op, by name. Which backend always serves
an op, and in which order untuned calls try them, is the op's spec's (autosymm.spec.OpSpec:
``fallback``, ``fallback_order``).

The registry is an entry list (autosymm.entries): a backend's module is imported on first use,
so a missing optional piece (e.g. torch without symmetric-memory ops) only disables its own
backends, and modules low in the layer order may name backends without importing them.
"""

from __future__ import annotations

from ..entries import load
from .base import Backend, BackendError, Capabilities, Needs, RunContext

# name -> its entry 'module:attribute' (autosymm.entries)
_REGISTRY: dict[str, str] = {
    "nccl": "autosymm.backends.nccl_all_reduce:nccl",
    "nccl_symm": "autosymm.backends.nccl_symm:nccl_symm",
    "torch_one_shot": "autosymm.backends.torch_symm:torch_one_shot",
    "torch_two_shot": "autosymm.backends.torch_symm:torch_two_shot",
    "triton_one_shot": "autosymm.backends.triton_all_reduce:triton_one_shot",
    "triton_one_shot_push": "autosymm.backends.triton_all_reduce:triton_one_shot_push",
    "triton_two_shot": "autosymm.backends.triton_all_reduce:triton_two_shot",
    "triton_multimem": "autosymm.backends.triton_all_reduce:triton_multimem",
    "triton_lamport": "autosymm.backends.triton_lamport:triton_lamport",
    "triton_moe": "autosymm.backends.triton_moe:TRITON_MOE",
    "nccl_all_to_all": "autosymm.backends.nccl_all_to_all:NCCL_ALL_TO_ALL",
    "nccl_fused": "autosymm.backends.nccl_fused:nccl_fused",
    "nccl_ordered": "autosymm.backends.nccl_ordered:nccl_ordered",
    "nccl_ordered_fused": "autosymm.backends.nccl_ordered:nccl_ordered_fused",
    "nccl_ordered_reduce_scatter": "autosymm.backends.nccl_ordered:nccl_ordered_reduce_scatter",
    "triton_fused_one_shot": "autosymm.backends.triton_fused:triton_fused_one_shot",
    "triton_fused_one_shot_push": "autosymm.backends.triton_fused:triton_fused_one_shot_push",
    "triton_fused_two_shot": "autosymm.backends.triton_fused:triton_fused_two_shot",
    "triton_fused_lamport": "autosymm.backends.triton_fused:triton_fused_lamport",
    "flashinfer_fused": "autosymm.backends.flashinfer_fused:flashinfer_fused",
    "nccl_reduce_scatter": "autosymm.backends.nccl_rs_ag:nccl_reduce_scatter",
    "nccl_all_gather": "autosymm.backends.nccl_rs_ag:nccl_all_gather",
    "triton_reduce_scatter_pull": "autosymm.backends.triton_rs_ag:triton_reduce_scatter_pull",
    "triton_reduce_scatter_push": "autosymm.backends.triton_rs_ag:triton_reduce_scatter_push",
    "triton_all_gather_push": "autosymm.backends.triton_rs_ag:triton_all_gather_push",
    "triton_all_gather_pull": "autosymm.backends.triton_rs_ag:triton_all_gather_pull",
    "noop": "autosymm.backends.local:noop",
    "vllm": "autosymm.backends.stack:vllm",
    "sglang": "autosymm.backends.stack:sglang",
}
#: The backends that are a serving stack's own path (autosymm.backends.stack), by the stack's name.
STACK_PATHS = ("vllm", "sglang")

_LOADED: dict[str, Backend] = {}


def backend_names() -> list[str]:
    return list(_REGISTRY)


def get_backend(name: str) -> Backend:
    """The backend called ``name``; KeyError naming the known ones otherwise."""
    backend = _LOADED.get(name)
    if backend is None:
        if name not in _REGISTRY:
            raise KeyError(f"unknown backend {name!r}; known: {', '.join(_REGISTRY)}")
        backend = load(_REGISTRY[name])
        _LOADED[name] = backend
    return backend


__all__ = ["STACK_PATHS", "Backend", "BackendError", "Capabilities", "Needs", "RunContext", "backend_names",
           "get_backend"]
