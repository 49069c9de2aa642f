"""Backends ``nccl_reduce_scatter`` and ``nccl_all_gather``: torch.distributed's collectives on the
group (the always-available fallbacks and the tuner's baselines of ``reduce_scatter`` and
``all_gather``).

A launcher is ``launcher(output, input, counts=None) -> output``, as the Triton ones
(autosymm.backends.triton_rs_ag): the full tensor (the reduce-scatter's input, the all-gather's
output) is cut into world_size segments in rank order, equal ones, or ``counts[r]`` elements for
rank r (the same list on every rank). Equal segments take ``reduce_scatter_tensor`` /
``all_gather_into_tensor`` (``reduce_scatter_single`` / ``all_gather_single`` where torch has
them: 2.13 deprecates the old names); per-rank counts take ``dist.reduce_scatter`` over the
input's segments, and an all-gather of the shards padded to the largest (one
``all_gather_into_tensor``, on every backend: gloo's list all-gather refuses uneven shards)
followed by one copy per shard.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ..problem import Problem
from ..spec.all_reduce import UNREDUCIBLE, needs_ordering
from .base import Backend, BackendError, Needs, RunContext


def pick_collective(*names: str):
    """The first of torch.distributed's functions ``names`` this torch has."""
    return next(getattr(dist, name) for name in names if hasattr(dist, name))


def checked_counts(op: str, counts: Optional[Sequence[int]], total: int, world_size: int) -> Optional[list[int]]:
    """``counts`` as ints (None for equal segments): BackendError unless world_size of them, >= 0,
    summing to the full tensor's ``total`` elements."""
    if counts is None:
        if total % world_size:
            raise BackendError(f"{op}: a full tensor of {total} elements does not split into {world_size} equal "
                               "shards; pass per-rank counts")
        return None
    counts = [int(c) for c in counts]
    if len(counts) != world_size or min(counts) < 0 or sum(counts) != total:
        raise BackendError(f"{op}: per-rank counts {counts} must be {world_size} non-negative counts summing to "
                           f"the full tensor's {total} elements")
    return counts


class NcclReduceScatter(Backend):
    """Segment ``rank`` of the reduction over the group: serves every reduce-scatter, no config."""

    name = "nccl_reduce_scatter"
    needs = Needs(dtypes=None, reduce_ops=None)

    def invariant_for(self, problem: Problem) -> bool:
        """Exact reductions (max, min, bitwise, integer sums) are; floating-point sums are not."""
        return not needs_ordering(problem.reduce_op, problem.torch_dtype)

    def prepare(self, problem: Problem, config: None, ctx: RunContext):
        return reduce_scatter_launcher(ctx.group, getattr(dist.ReduceOp, problem.reduce_op.upper()))


def reduce_scatter_launcher(group, reduce_op):
    """``launcher(output, input, counts=None) -> output`` reducing with ``reduce_op`` on ``group``."""
    single = pick_collective("reduce_scatter_single", "reduce_scatter_tensor")
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)

    def launcher(output: torch.Tensor, input: torch.Tensor, counts: Optional[Sequence[int]] = None) -> torch.Tensor:
        counts = checked_counts("reduce_scatter", counts, input.numel(), world_size)
        if counts is None:
            single(output.view(-1), input.reshape(-1), op=reduce_op, group=group)
        else:
            if output.numel() != counts[rank]:
                raise BackendError(f"reduce_scatter: output {tuple(output.shape)} must hold rank {rank}'s "
                                   f"{counts[rank]} elements")
            dist.reduce_scatter(output.view(-1), list(input.reshape(-1).split(counts)), op=reduce_op, group=group)
        return output

    return launcher


class NcclAllGather(Backend):
    """Every rank's input in rank order: serves every all-gather of any dtype, no config (the
    dtypes torch's NCCL and gloo refuse, fp8 and fp4, move as their bytes)."""

    name = "nccl_all_gather"
    batch_invariant = True  # rows are copied, never summed
    needs = Needs(dtypes=None)

    def prepare(self, problem: Problem, config: None, ctx: RunContext):
        launcher = all_gather_launcher(ctx.group)
        return as_bytes(launcher) if problem.torch_dtype in UNREDUCIBLE else launcher


def as_bytes(launcher):
    """``launcher(output, input, counts=None)`` on byte views of contiguous tensors of any dtype."""
    def launch(output: torch.Tensor, input: torch.Tensor, counts=None) -> torch.Tensor:
        size = output.element_size()
        launcher(output.view(-1).view(torch.uint8), input.reshape(-1).view(torch.uint8),
                 None if counts is None else [c * size for c in counts])
        return output

    return launch


def all_gather_launcher(group):
    """``launcher(output, input, counts=None) -> output`` gathering on ``group``."""
    single = pick_collective("all_gather_single", "all_gather_into_tensor")
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)

    def launcher(output: torch.Tensor, input: torch.Tensor, counts: Optional[Sequence[int]] = None) -> torch.Tensor:
        counts = checked_counts("all_gather", counts, output.numel(), world_size)
        flat = output.view(-1)
        if counts is None:
            single(flat, input.reshape(-1), group=group)
            return output
        if input.numel() != counts[rank]:
            raise BackendError(f"all_gather: input {tuple(input.shape)} must be rank {rank}'s {counts[rank]} elements")
        widest = max(counts)
        own, padded = input.new_zeros(widest), input.new_empty(widest * world_size)
        own[:counts[rank]].copy_(input.reshape(-1))
        single(padded, own, group=group)
        for shard, part in zip(padded.view(world_size, widest), flat.split(counts)):
            part.copy_(shard[:part.numel()])
        return output

    return launcher


nccl_reduce_scatter = NcclReduceScatter()
nccl_all_gather = NcclAllGather()
BACKENDS = (nccl_reduce_scatter, nccl_all_gather)
