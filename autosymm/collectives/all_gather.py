"""``all_gather``: every rank's tensor concatenated along dim 0 in rank order
(``autosymm.all_gather_into_tensor`` / ``all_gatherv``, autosymm.sharded), and its custom op
``torch.ops.autosymm.all_gather_into_tensor`` (functional, with autograd: the gradient of an
all-gather is the reduce-scatter (sum) of the gradients, torch.distributed.nn.functional's formula).

Problem: ``nbytes`` of the full (gathered) output; bucket: those bytes; no shape. An all-gather
copies bytes: a dtype without rows of its own (integers, bool, fp8) is keyed as bf16 (the rows
of the same byte size), and fp16 / fp32 calls fall back to the bf16 rows too; where NCCL serves
fp8 or fp4 (which torch's NCCL and gloo refuse), it moves their bytes. Cache key:
``(record, dtype, input shape, output shape, sizes or None, input device, capturing)``; the call's arguments
``(output, input, sizes)``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..backends.rs_ag_layout import AllGatherConfig
from ..problem import DTYPE_NAMES, Problem
from .all_reduce import SIZES, UNREDUCIBLE
from .base import CustomOp, Lookups, TuningPoints
from .reduce_scatter import Sharded, checked_tensors, shard_counts, shards_text


class AllGather(Sharded):
    def call_text(self, key: tuple, args: tuple, mode: str) -> str:
        output, input, sizes = args
        return f"{self.name} of {input.dtype} {shards_text(input, sizes)} -> {tuple(output.shape)} in {mode} mode"

    def check_call(self, state, key: tuple, args: tuple, mode: str):
        output, input, sizes = args
        checked_tensors(self, state, output, input)
        shard_counts(self, output, input, sizes, state.rank, state.world_size)
        if state.world_size == 1:
            return self.single_rank_entry(mode)
        dtype = DTYPE_NAMES.get(input.dtype, "bf16")  # bytes are bytes: see the module docstring
        problem = Problem(self.name, dtype, state.world_size, nbytes=output.numel() * output.element_size())
        if input.dtype not in UNREDUCIBLE:
            return problem
        entry = self.prepare(state, problem, mode)
        if entry.decision.backend == self.fallback:  # torch's collectives refuse fp8: they move its bytes
            entry.launcher = _as_bytes(entry.launcher)
        return entry

    def bytes_per_call(self, args: tuple) -> int:
        return args[0].numel() * args[0].element_size()

    def custom_ops(self) -> tuple[CustomOp, ...]:
        return (CustomOp("all_gather_into_tensor", _all_gather_into_tensor, _all_gather_into_tensor_fake,
                         setup_context=_setup, backward=_backward),)


def _as_bytes(launcher):
    """``launcher(output, input, counts=None)`` on byte views of contiguous tensors of any dtype."""
    def launch(output: Tensor, input: Tensor, counts=None) -> Tensor:
        size = output.element_size()
        launcher(output.view(-1).view(torch.uint8), input.reshape(-1).view(torch.uint8),
                 None if counts is None else [c * size for c in counts])
        return output

    return launch


def _all_gather_into_tensor(input: Tensor, group_size: int, group_name: str) -> Tensor:
    """A new tensor: every rank's ``input`` of the group ``group_name`` (of ``group_size`` ranks)
    in rank order along dim 0, [group_size * input.shape[0], *input.shape[1:]] (a 0-d input
    gathers into [group_size])."""
    from ..dist_compat import resolve_group
    from ..sharded import all_gather_into_tensor

    out = _all_gather_into_tensor_fake(input, group_size, group_name)
    all_gather_into_tensor(out, input.contiguous(), resolve_group(group_name))
    return out


def _all_gather_into_tensor_fake(input: Tensor, group_size: int, group_name: str) -> Tensor:
    if input.dim() == 0:
        return input.new_empty((group_size,))
    return input.new_empty((group_size * input.shape[0], *input.shape[1:]))


def _setup(ctx, inputs, output) -> None:
    input, ctx.group_size, ctx.group_name = inputs
    ctx.shape = input.shape


def _backward(ctx, grad: Tensor):
    """d(output)/d(input_q) is the identity into segment q of every rank's output: the input's
    gradient is the reduce-scatter (sum) of the outputs' gradients."""
    shard = torch.ops.autosymm.reduce_scatter_tensor(grad.contiguous(), "sum", ctx.group_size, ctx.group_name)
    return shard.reshape(ctx.shape), None, None


ALL_GATHER = AllGather("all_gather", "bytes", fallback="nccl_all_gather", fallback_order=("nccl_all_gather",),
                       points=TuningPoints(sizes=SIZES), config_type=AllGatherConfig,
                       lookups=Lookups(bf16_same_bytes=True), tuned_by_default=False,
                       arg_names=("output", "input", "sizes"))
