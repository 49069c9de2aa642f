"""Backends ``nccl_ordered`` (all_reduce) and ``nccl_ordered_fused`` (all_reduce_rmsnorm): the
batch-invariant fallbacks of the ``deterministic`` setting (autosymm.settings).

An NCCL all-gather moves every rank's tensor unchanged (no arithmetic), then each rank sums the
W copies locally in fp32 in the order 0..W-1, starting from +0.0, and rounds once: the formula of
the Triton all-reduce kernels (autosymm.kernels.all_reduce), element by element, so a row's bits
depend on that row's inputs alone, at any size, world size and mode, and equal those of
``triton_one_shot``, ``triton_one_shot_push`` and ``triton_two_shot``. NCCL's own all-reduce
cannot promise that (its ring reduces each chunk in an order that follows the chunk's position,
with a rounding per step, and picks its algorithm by size).

The fused fallback sums the same way, adds the residual in fp32 and rounds once (the Triton
fused kernels' residual, bit for bit), then takes the RMSNorm of the unrounded sum with a fixed
reduction tree: the squares of a row, padded with zeros to a power of two, summed pairwise by
column index (column 2i + column 2i+1, level after level). Every step is an elementwise add of
two given values, so the tree follows the hidden size alone, never the batch, the device's
reduction kernels or their launch shapes.

Cost: each rank receives (W - 1) copies of the tensor (NCCL's all-reduce: about 2 (W - 1) / W)
and holds W copies plus an fp32 accumulator.
"""

from __future__ import annotations

import torch

from ..problem import Problem
from .base import Backend, Needs, RunContext


def ordered_sum(gathered: torch.Tensor) -> torch.Tensor:
    """fp32 sum over dim 0 of ``gathered`` [W, ...] in the order 0..W-1, from +0.0 (unrounded)."""
    acc = torch.zeros(gathered.shape[1:], dtype=torch.float32, device=gathered.device)
    for copy in gathered:
        acc.add_(copy)  # fp32 result: the copy is widened exactly, one rounding per add
    return acc


def pairwise_row_sum(values: torch.Tensor) -> torch.Tensor:
    """[rows] fp32: each row of ``values`` [rows, n] summed by the fixed pairwise tree over its
    columns (zero-padded to a power of two)."""
    width = 1 << max(0, values.shape[1] - 1).bit_length()
    level = torch.nn.functional.pad(values, (0, width - values.shape[1]))
    while level.shape[1] > 1:
        level = level[:, 0::2] + level[:, 1::2]
    return level[:, 0]


def ordered_rmsnorm(s: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 ``s * rsqrt(mean(s^2) + eps) * weight`` of rows ``s`` [rows, hidden] (unrounded), the
    mean by :func:`pairwise_row_sum`."""
    inv_rms = torch.rsqrt(pairwise_row_sum(s * s) / s.shape[1] + eps)
    return s * inv_rms[:, None] * weight.float()


def _gather(x: torch.Tensor, world_size: int, group) -> torch.Tensor:
    """[world_size, *x.shape]: every rank's ``x`` (contiguous), by rank."""
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gathered = torch.empty(world_size * x.numel(), dtype=x.dtype, device=x.device)
    gather(gathered, x.reshape(-1), group=group)
    return gathered.view(world_size, *x.shape)


class NcclOrderedAllReduce(Backend):
    """All-gather + fp32 in-order sum: serves every bf16/fp16/fp32 sum, no config."""

    name = "nccl_ordered"
    needs = Needs(ops=("all_reduce",))
    batch_invariant = True

    def prepare(self, problem: Problem, config: None, ctx: RunContext):
        group, world_size = ctx.group, problem.world_size

        def launcher(x: torch.Tensor) -> torch.Tensor:
            return x.copy_(ordered_sum(_gather(x, world_size, group)))

        return launcher


class NcclOrderedFused(Backend):
    """All-gather + fp32 in-order sum + residual, RMSNorm by the fixed tree: serves every call."""

    name = "nccl_ordered_fused"
    needs = Needs(ops=("all_reduce_rmsnorm",))
    batch_invariant = True

    def prepare(self, problem: Problem, config: None, ctx: RunContext):
        group, world_size = ctx.group, problem.world_size

        def launcher(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
            s = ordered_sum(_gather(x, world_size, group)).add_(residual)
            residual.copy_(s)
            return ordered_rmsnorm(s, weight, float(eps)).to(x.dtype)

        return launcher


nccl_ordered = NcclOrderedAllReduce()
nccl_ordered_fused = NcclOrderedFused()
BACKENDS = (nccl_ordered, nccl_ordered_fused)
