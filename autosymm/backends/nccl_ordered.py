"""Backends ``nccl_ordered`` (all_reduce), ``nccl_ordered_fused`` (all_reduce_rmsnorm) and
``nccl_ordered_reduce_scatter`` (reduce_scatter): the batch-invariant fallbacks of the
``deterministic`` setting (autosymm.settings).

NCCL only moves data (an all-gather; an all-to-all for the reduce-scatter), then each rank sums
the W copies locally in fp32 in the order 0..W-1, starting from +0.0, and rounds once: the Triton
kernels' formula, so a row's bits depend on that row's inputs alone and equal those of
``triton_one_shot``, ``triton_one_shot_push`` and ``triton_two_shot``. The fused fallback takes
the RMSNorm with a fixed pairwise reduction tree that follows the hidden size alone. Other
floating-point reductions use the same scheme (:func:`ordered_reduce`). Cost: the all-reduce
receives (W - 1) copies of the tensor and holds W copies plus an accumulator.

Design notes: docs/BACKENDS.md#backends-nccl-ordered
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..problem import Problem
from ..spec.all_reduce import ORDERED_OPS, needs_ordering
from .base import Backend, BackendError, Needs, RunContext
from .nccl_rs_ag import checked_counts
from ..epilogue import DEFAULT, epilogue_launcher



def ordered_sum(gathered: torch.Tensor) -> torch.Tensor:
    """fp32 sum over dim 0 of ``gathered`` [W, ...] in the order 0..W-1, from +0.0 (unrounded)."""
    return ordered_reduce(gathered, "sum")


def ordered_reduce(gathered: torch.Tensor, op: str) -> torch.Tensor:
    """``op`` (one of :data:`ORDERED_OPS`) over dim 0 of ``gathered`` [W, ...], unrounded: an
    accumulator of at least fp32 (fp64 and complex keep their own precision) from +0.0 (product:
    1.0), the copies applied in the order 0..W-1; ``avg`` divides the sum by W once at the end."""
    acc_dtype = torch.promote_types(gathered.dtype, torch.float32)
    start = 1.0 if op == "product" else 0.0
    acc = torch.full(gathered.shape[1:], start, dtype=acc_dtype, device=gathered.device)
    combine = acc.mul_ if op == "product" else acc.add_
    for copy in gathered:
        combine(copy)  # the copy is widened exactly, one rounding per step
    return acc.div_(gathered.shape[0]) if op == "avg" else acc


def pairwise_row_sum(values: torch.Tensor) -> torch.Tensor:
    """[rows] fp32: each row of ``values`` [rows, n] summed by the fixed pairwise tree over its
    columns (zero-padded to a power of two)."""
    width = 1 << max(0, values.shape[1] - 1).bit_length()
    level = torch.nn.functional.pad(values, (0, width - values.shape[1]))
    while level.shape[1] > 1:
        level = level[:, 0::2] + level[:, 1::2]
    return level[:, 0]


def ordered_inv_rms(s: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 [rows, 1]: ``rsqrt(mean(s^2) + eps)`` of rows ``s`` [rows, hidden], the mean by
    :func:`pairwise_row_sum` (the epilogues' inverse RMS under the ``deterministic`` setting)."""
    return torch.rsqrt(pairwise_row_sum(s * s) / s.shape[1] + eps)[:, None]


def ordered_rmsnorm(s: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 ``s * rsqrt(mean(s^2) + eps) * weight`` of rows ``s`` [rows, hidden] (unrounded), the
    mean by :func:`pairwise_row_sum`."""
    return s * ordered_inv_rms(s, eps) * weight.float()


def _gather(x: torch.Tensor, world_size: int, group) -> torch.Tensor:
    """[world_size, *x.shape]: every rank's ``x`` (contiguous), by rank."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gathered = torch.empty(world_size * x.numel(), dtype=x.dtype, device=x.device)
    gather(gathered, x.reshape(-1), group=group)
    return gathered.view(world_size, *x.shape)


def ordered_all_reduce_launcher(group, world_size: int, op: str = "sum"):
    """``launcher(x) -> x``: ``x`` replaced by :func:`ordered_reduce` of every rank's ``x``."""

    def launcher(x: torch.Tensor) -> torch.Tensor:
        return x.copy_(ordered_reduce(_gather(x, world_size, group), op))

    return launcher


def ordered_reduce_scatter_launcher(group, world_size: int, rank: int, op: str = "sum"):
    """``launcher(output, input, counts=None) -> output`` (autosymm.backends.nccl_rs_ag's form):
    every rank's segment ``rank`` of ``input`` by one all-to-all, then :func:`ordered_reduce`."""
    def launcher(output: torch.Tensor, input: torch.Tensor, counts=None) -> torch.Tensor:
        counts = checked_counts("reduce_scatter", counts, input.numel(), world_size)
        mine = input.numel() // world_size if counts is None else counts[rank]
        if output.numel() != mine:
            raise BackendError(f"reduce_scatter: output {tuple(output.shape)} must hold rank {rank}'s {mine} "
                               "elements")
        received = torch.empty(world_size * mine, dtype=input.dtype, device=input.device)
        dist.all_to_all_single(received, input.reshape(-1), None if counts is None else [mine] * world_size,
                               counts, group=group)
        output.view(-1).copy_(ordered_reduce(received.view(world_size, mine), op))
        return output

    return launcher


class _Ordered(Backend):
    """The ordered scheme serves the reductions whose result NCCL could round otherwise: a
    floating-point sum, mean or product (:func:`needs_ordering`), no config."""

    batch_invariant = True

    def limits(self, problem: Problem, caps) -> Optional[str]:
        if not needs_ordering(problem.reduce_op, problem.torch_dtype):
            return f"op {problem.reduce_op} of {problem.dtype} is exact in any order (NCCL serves it)"
        return None


class NcclOrderedAllReduce(_Ordered):
    """All-gather + in-order reduction (fp32 from +0.0 for a sum, rounded once)."""

    name = "nccl_ordered"
    needs = Needs(dtypes=None, reduce_ops=ORDERED_OPS)

    def prepare(self, problem: Problem, config: None, ctx: RunContext):
        return ordered_all_reduce_launcher(ctx.group, problem.world_size, problem.reduce_op)


class NcclOrderedReduceScatter(_Ordered):
    """All-to-all of the segments + in-order reduction."""

    name = "nccl_ordered_reduce_scatter"
    needs = Needs(dtypes=None, reduce_ops=ORDERED_OPS)

    def prepare(self, problem: Problem, config: None, ctx: RunContext):
        return ordered_reduce_scatter_launcher(ctx.group, problem.world_size, dist.get_rank(ctx.group),
                                               problem.reduce_op)


class NcclOrderedFused(Backend):
    """All-gather + fp32 in-order sum + residual, RMSNorm by the fixed tree: serves every call."""

    name = "nccl_ordered_fused"
    needs = Needs()
    batch_invariant = True

    def prepare(self, problem: Problem, config: None, ctx: RunContext):
        group, world_size = ctx.group, problem.world_size
        if problem.epilogue != DEFAULT:  # the fp32 in-order sum, unrounded, then the reference epilogue
            return epilogue_launcher(problem.epilogue, lambda x: ordered_sum(_gather(x, world_size, group)),
                                     inv_rms=ordered_inv_rms)

        def launcher(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
            s = ordered_sum(_gather(x, world_size, group)).add_(residual)
            residual.copy_(s)
            return ordered_rmsnorm(s, weight, float(eps)).to(x.dtype)

        return launcher


nccl_ordered = NcclOrderedAllReduce()
nccl_ordered_fused = NcclOrderedFused()
nccl_ordered_reduce_scatter = NcclOrderedReduceScatter()
BACKENDS = (nccl_ordered, nccl_ordered_fused, nccl_ordered_reduce_scatter)
