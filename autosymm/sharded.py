"""The sharded collectives: ``reduce_scatter_tensor`` and ``all_gather_into_tensor`` (drop-ins for
torch.distributed's), their per-rank-size forms ``reduce_scatterv`` / ``all_gatherv`` (vLLM's),
and the DTensor redistributions they serve (:func:`redistribute`). Their records (problem,
checks, custom ops and autograd) are autosymm.collectives.reduce_scatter / all_gather.

Calls are decided and prepared through the group state of autosymm.runtime.group (the same databases,
rank agreement, workspace and cache of prepared calls as ``all_reduce``): a repeated call is a
dict lookup and the launcher. Shards are along dim 0 in rank order. Where no tuned row serves
(as until a node has tuned these ops), NCCL does (``dist.reduce_scatter_tensor`` /
``all_gather_into_tensor``; per-rank sizes: ``dist.reduce_scatter`` over the segments, and an
all-gather of the shards padded to the largest).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.distributed as dist

from .collectives import ALL_GATHER, REDUCE_SCATTER, prepare_call, refuse_call
from .collectives.reduce_scatter import checked_sizes
from .dist_compat import Work, group_name, reduce_op_name
from .runtime.group import STATES, check_traced, dense_error, state_of, stream_capturing

_SUM = dist.ReduceOp.SUM
_Tensor = torch.Tensor
_dynamo_compiling = torch.compiler.is_dynamo_compiling


def _traced(what: str, *tensors: torch.Tensor) -> bool:
    """torch.compile, or a tensor subclass (FakeTensor, FunctionalTensor): the op path (a fake or
    meta tensor outside tracing: a ValueError, autosymm.runtime.group.check_traced). Anything that is
    not a tensor takes the keyed path, whose checks name it."""
    if _dynamo_compiling():
        return True
    if any(type(t) is not _Tensor and type(t) is not torch.nn.Parameter and isinstance(t, _Tensor) for t in tensors):
        for t in tensors:
            check_traced(t, what)
        return True
    return False


def _reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: str, sizes, group):
    state = STATES.get(group) or state_of(group)
    try:
        key = (REDUCE_SCATTER, input.dtype, input.shape, output.shape, op,
               None if sizes is None else checked_sizes(sizes, "reduce_scatterv"), input.device, stream_capturing())
    except (AttributeError, TypeError):  # not a tensor, or sizes not ints: the checks name which, on every rank
        return refuse_call(state, REDUCE_SCATTER, (output, input, op, sizes))
    entry = state.cache.get(key)
    if entry is None:
        entry = prepare_call(state, REDUCE_SCATTER, key, (output, input, op, key[5]))
    entry.calls += 1
    row = math.prod(output.shape[1:])
    try:
        return entry.launcher(output, input, None if key[5] is None else [s * row for s in key[5]])
    except (NotImplementedError, RuntimeError):
        _refuse_layout(REDUCE_SCATTER, output, input)
        raise


def _all_gather(output: torch.Tensor, input: torch.Tensor, sizes, group):
    state = STATES.get(group) or state_of(group)
    try:
        key = (ALL_GATHER, input.dtype, input.shape, output.shape,
               None if sizes is None else checked_sizes(sizes, "all_gatherv"), input.device, stream_capturing())
    except (AttributeError, TypeError):  # not a tensor, or sizes not ints: the checks name which, on every rank
        return refuse_call(state, ALL_GATHER, (output, input, sizes))
    entry = state.cache.get(key)
    if entry is None:
        entry = prepare_call(state, ALL_GATHER, key, (output, input, key[4]))
    entry.calls += 1
    row = math.prod(input.shape[1:])
    try:
        return entry.launcher(output, input, None if key[4] is None else [s * row for s in key[4]])
    except (NotImplementedError, RuntimeError):
        _refuse_layout(ALL_GATHER, output, input)
        raise


def _refuse_layout(record, output, input) -> None:
    """The error naming a sparse ``output`` or ``input`` of a call whose key was prepared for
    dense tensors (its key holds no layout): the launcher failed at its first touch of it, before
    anything ran (torch's collectives refuse sparse tensors, the kernels need a data pointer)."""
    error = dense_error(output, record.name, "output") or dense_error(input, record.name, "input")
    if error is not None:
        raise error from None


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op=_SUM, group=None, async_op: bool = False):
    """``dist.reduce_scatter_tensor``: ``output`` = this rank's dim-0 shard of ``input`` reduced over
    ``group`` (``input`` holds world_size shards of ``output``'s elements, in rank order).

    ``op``: a ``dist.ReduceOp`` or its lower-case name; only sums of bf16/fp16/fp32 have tuned
    kernels (the fp32 sum in rank order 0..W-1, rounded once: the all-reduce's bits), NCCL serves
    the rest. ``async_op=True`` returns a handle (``wait()``) of the work queued on the current
    stream. Both tensors contiguous, on the group's device, one dtype. Under torch.compile the call
    is ``torch.ops.autosymm.reduce_scatter_tensor`` (functional; copied into ``output``).
    """
    name = reduce_op_name(op)
    if _traced("reduce_scatter_tensor", output, input):
        if async_op:
            raise RuntimeError("autosymm.reduce_scatter_tensor: async_op=True cannot be traced; drop async_op")
        world_size = dist.get_world_size(group)
        output.copy_(torch.ops.autosymm.reduce_scatter_tensor(input, name, world_size, group_name(group))
                     .view(output.shape))
        return None
    _reduce_scatter(output, input, name, None, group)
    return Work(output) if async_op else None  # the work is queued on the current stream


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """``dist.all_gather_into_tensor``: ``output`` = every rank's ``input`` in rank order along dim 0
    (``output`` holds world_size times ``input``'s elements). Any dtype (bytes are copied); both
    tensors contiguous, on the group's device. ``async_op`` as :func:`reduce_scatter_tensor`.
    Under torch.compile the call is ``torch.ops.autosymm.all_gather_into_tensor``.
    """
    if _traced("all_gather_into_tensor", output, input):
        if async_op:
            raise RuntimeError("autosymm.all_gather_into_tensor: async_op=True cannot be traced; drop async_op")
        world_size = dist.get_world_size(group)
        output.copy_(torch.ops.autosymm.all_gather_into_tensor(input, world_size, group_name(group))
                     .view(output.shape))
        return None
    _all_gather(output, input, None, group)
    return Work(output) if async_op else None


def reduce_scatterv(output: torch.Tensor, input: torch.Tensor, sizes: Sequence[int], group=None) -> torch.Tensor:
    """Reduce-scatter with per-rank dim-0 ``sizes`` (host ints, the same list on every rank, as
    vLLM's ``reduce_scatterv``): ``input`` [sum(sizes), ...] summed over ``group``; this rank's
    ``output`` [sizes[rank], ...] gets rows sizes[:rank].sum() onward. Returns ``output``. Eager
    only (a per-rank split copies its bounds table to the device on its first call: make that
    call before capturing a CUDA graph)."""
    return _reduce_scatter(output, input, "sum", sizes, group)


def all_gatherv(output: torch.Tensor, input: torch.Tensor, sizes: Sequence[int], group=None) -> torch.Tensor:
    """All-gather with per-rank dim-0 ``sizes`` (host ints, the same on every rank, as vLLM's
    ``all_gatherv``): ``output`` [sum(sizes), ...] = every rank's ``input`` [sizes[r], ...] in rank
    order. Returns ``output``. Eager only, as :func:`reduce_scatterv`."""
    return _all_gather(output, input, sizes, group)


def redistribute(x, placements):
    """``x.redistribute(placements=placements)`` for a DTensor on a 1-D mesh, through autosymm
    where it maps: ``Partial('sum')`` -> ``Shard(0)`` by a reduce-scatter, ``Shard(0)`` ->
    ``Replicate()`` by an all-gather (uneven shards too: torch's chunking, by per-rank sizes);
    anything else (other meshes or placements) by torch's own ``redistribute``. On a 1-D mesh the
    ranks first agree on the placements (once per placements and shape; AgreementError on every
    rank where they differ). A new DTensor; ``x`` keeps its placements and data."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    placements = tuple(placements)
    mesh = x.device_mesh
    if mesh.ndim != 1:
        return x.redistribute(mesh, placements)
    group, world_size = mesh.get_group(0), mesh.size(0)
    # which path serves (ours, torch's) follows the placements: the ranks agree on them first
    state_of(group).agree_once(f"redistribute of {x.dtype} {tuple(x.shape)} from {x.placements} to {placements}")
    if len(placements) != 1:
        return x.redistribute(mesh, placements)
    source, target = x.placements[0], placements[0]
    local = x.to_local().contiguous()
    sizes = [len(chunk) for chunk in torch.arange(x.shape[0]).chunk(world_size)] if x.dim() else []
    sizes += [0] * (world_size - len(sizes))
    if type(source) is Partial and source.reduce_op == "sum" and target == Shard(0) and x.dim() > 0:
        out = local.new_empty((sizes[mesh.get_local_rank()], *x.shape[1:]))
        if len(set(sizes)) == 1:
            reduce_scatter_tensor(out, local, group=group)
        else:
            reduce_scatterv(out, local, sizes, group=group)
    elif source == Shard(0) and target == Replicate() and x.dim() > 0:
        out = local.new_empty(tuple(x.shape))
        if len(set(sizes)) == 1:
            all_gather_into_tensor(out, local, group=group)
        else:
            all_gatherv(out, local, sizes, group=group)
    else:
        return x.redistribute(mesh, placements)
    return DTensor.from_local(out, mesh, placements, run_check=False, shape=x.shape, stride=x.stride())
