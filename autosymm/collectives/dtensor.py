"""``redistribute``: a DTensor's redistribution on a 1-D mesh through autosymm's reduce-scatter
and all-gather where it maps (autosymm.collectives.reduce_scatter / all_gather), torch's own
``redistribute`` otherwise."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from ..runtime.group import state_of
from .all_gather import all_gather_into_tensor, all_gatherv
from .reduce_scatter import reduce_scatter_tensor, reduce_scatterv


def redistribute(x, placements):
    """``x.redistribute(placements=placements)`` for a DTensor on a 1-D mesh, through autosymm
    where it maps: ``Partial('sum')`` -> ``Shard(0)`` by a reduce-scatter, ``Shard(0)`` ->
    ``Replicate()`` by an all-gather (uneven shards too: torch's chunking, by per-rank sizes);
    anything else (other meshes or placements) by torch's own ``redistribute``. On a 1-D mesh the
    ranks first agree on the placements (once per placements and shape; AgreementError on every
    rank where they differ). A new DTensor; ``x`` keeps its placements and data."""
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
