"""autosymm's collectives as torch custom ops, ``torch.ops.autosymm.*``: graph nodes for torch.compile.

    autosymm::all_reduce_(Tensor(a!) tensor, str op, str group_name) -> ()
    autosymm::all_reduce(Tensor tensor, str op, str group_name) -> Tensor
    autosymm::dp_to_ep(Tensor src, Tensor[] assignment, SymInt[] n_expts_per_shard, Tensor expt_indx,
                       Tensor gate_indx, str group_name) -> Tensor
    autosymm::ep_to_dp(Tensor src, Tensor[] assignment, SymInt[] n_expts_per_shard, Tensor expt_indx,
                       Tensor topk_indx, str group_name) -> Tensor

``op`` is a reduce op's name ("sum", "avg", "max", "min", "product", "band", "bor", "bxor");
``group_name`` the name torch.distributed resolves a group by (``group.group_name``; see
:func:`autosymm.dist_compat.group_name`), as torch's ``symm_mem`` and functional collectives take
it. ``assignment`` is an ExptAssignment's tensors ``[expt_bitmask, expt_boolmask, expt_map,
expt_owner]`` and ``n_expts_per_shard`` its list: the op rebuilds the dataclass from them (no
device work, no host sync), so a compiled graph passes only tensors and ints.

Each op's implementation is the eager runtime path of autosymm.api: the cached prepared call of
(op, dtype, size, contiguity, mode), where the mode is read when the op runs, so a call inside a
CUDA graph capture (inductor's ``mode="reduce-overhead"`` included) takes the graph-mode rows, and
the dispatcher decides once per key, not per call. ``autosymm.all_reduce`` and the conversions
call these ops only while torch.compile traces (or for a tensor subclass); eager calls of plain
tensors go straight to the runtime, without the op dispatcher's overhead.

Aliasing. ``all_reduce_`` mutates its input (torch.compile functionalizes it through
``auto_functionalize`` and inductor re-inplaces it). ``all_reduce`` returns a new tensor: a
contiguous copy of the input reduced in place. The MoE conversions are *functional*: they return
a tensor the caller owns, a copy of the workspace rows the peers wrote. Their eager form returns
those rows as a workspace view valid until the next call of the same op, an alias a compiled
graph cannot see (it may reorder, fuse or keep two results alive at once). An ``out=`` variant
would not save the copy, since the rows must land in symmetric memory that peers write, and
``out`` is a plain tensor; it would only save an allocation, which the caching allocator (and a
CUDA graph's private pool) makes nearly free, at the price of a mutating op. So: clone out.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import api
from .dist_compat import resolve_group
from .routing import ExptAssignment

__all__ = ["all_reduce_", "all_reduce", "dp_to_ep", "ep_to_dp", "assignment_from"]


@torch.library.custom_op("autosymm::all_reduce_", mutates_args=("tensor",))
def all_reduce_(tensor: Tensor, op: str, group_name: str) -> None:
    """Reduce ``tensor`` in place over the group named ``group_name`` (autosymm.all_reduce)."""
    api._all_reduce_direct(tensor, op, resolve_group(group_name))


@all_reduce_.register_fake
def _all_reduce__fake(tensor: Tensor, op: str, group_name: str) -> None:
    return None


@torch.library.custom_op("autosymm::all_reduce", mutates_args=())
def all_reduce(tensor: Tensor, op: str, group_name: str) -> Tensor:
    """A new contiguous tensor: ``tensor`` reduced over the group named ``group_name``."""
    out = tensor.clone(memory_format=torch.contiguous_format)
    api._all_reduce_direct(out, op, resolve_group(group_name))
    return out


@all_reduce.register_fake
def _all_reduce_fake(tensor: Tensor, op: str, group_name: str) -> Tensor:
    return torch.empty_like(tensor, memory_format=torch.contiguous_format)


def assignment_from(assignment: list[Tensor], n_expts_per_shard: list[int]) -> ExptAssignment:
    """The ExptAssignment the MoE ops' arguments describe (the inverse of api._assignment_args)."""
    if len(assignment) != 4:
        raise ValueError(f"autosymm MoE ops: assignment must be [expt_bitmask, expt_boolmask, expt_map, "
                         f"expt_owner], got {len(assignment)} tensors")
    bitmask, boolmask, expt_map, owner = assignment
    return ExptAssignment(bitmask, boolmask, expt_map, [int(n) for n in n_expts_per_shard], owner)


@torch.library.custom_op("autosymm::dp_to_ep", mutates_args=())
def dp_to_ep(src: Tensor, assignment: list[Tensor], n_expts_per_shard: list[int], expt_indx: Tensor,
             gate_indx: Tensor, group_name: str) -> Tensor:
    """autosymm.convert_dp_to_ep, returning [n_tokens_global * k, d_model] rows the caller owns."""
    rows = api._moe_call("dp_to_ep", src, assignment_from(assignment, n_expts_per_shard), expt_indx, gate_indx,
                         resolve_group(group_name))
    return rows.clone(memory_format=torch.contiguous_format)


@dp_to_ep.register_fake
def _dp_to_ep_fake(src, assignment, n_expts_per_shard, expt_indx, gate_indx, group_name):
    return src.new_empty((expt_indx.shape[0] * expt_indx.shape[1], src.shape[1]))


@torch.library.custom_op("autosymm::ep_to_dp", mutates_args=())
def ep_to_dp(src: Tensor, assignment: list[Tensor], n_expts_per_shard: list[int], expt_indx: Tensor,
             topk_indx: Tensor, group_name: str) -> Tensor:
    """autosymm.convert_ep_to_dp, returning [n_tokens_local * k, d_model] rows the caller owns."""
    rows = api._moe_call("ep_to_dp", src, assignment_from(assignment, n_expts_per_shard), expt_indx, topk_indx,
                         resolve_group(group_name))
    return rows.clone(memory_format=torch.contiguous_format)


@ep_to_dp.register_fake
def _ep_to_dp_fake(src, assignment, n_expts_per_shard, expt_indx, topk_indx, group_name):
    world_size = assignment[2].shape[0]  # expt_map [n_expt_shard, n_expts_tot]: one shard per rank
    return src.new_empty((expt_indx.shape[0] * expt_indx.shape[1] // world_size, src.shape[1]))
