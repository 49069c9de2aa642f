"""``autosymm.all_gather_into_tensor`` / ``all_gatherv``: every rank's tensor concatenated along
dim 0 in rank order (drop-ins for torch.distributed's, and vLLM's per-rank-size form), their
checks and the custom op ``torch.ops.autosymm.all_gather_into_tensor`` (functional, with
autograd: the gradient of an all-gather is the reduce-scatter (sum) of the gradients). Its spec:
autosymm.spec.reduce_scatter.ALL_GATHER.

An all-gather copies bytes: a dtype without rows of its own (integers, bool, fp8) is keyed as
bf16 (its spec's domain), and where NCCL serves fp8 or fp4 (which torch's NCCL and gloo refuse),
it moves their bytes (autosymm.backends.nccl_rs_ag). Call key: ``call_key(ALL_GATHER, dtype, input shape, input device, capturing, (output
shape, sizes or None))``; the call's arguments ``(output, input, sizes)``.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ..dist_compat import Work, group_name, resolve_group
from ..problem import Problem, any_dtype_name
from ..runtime.entry import CustomOp, refuse_call
from ..runtime.group import STATES, state_of, stream_capturing
from ..spec import ALL_GATHER, KEY_EXTRA, call_key
from .reduce_scatter import ShardedDoor, checked_sizes, checked_tensors, run_sharded, shard_counts, shards_text, traced


class AllGatherDoor(ShardedDoor):
    def call_text(self, key: tuple, args: tuple, mode: str) -> str:
        output, input, sizes = args
        return f"{self.name} of {input.dtype} {shards_text(input, sizes)} -> {tuple(output.shape)} in {mode} mode"

    def check_tensors(self, state, args: tuple, mode: str) -> None:
        output, input, sizes = args
        checked_tensors(self, state, output, input)
        shard_counts(self, output, input, sizes, state.rank, state.world_size)

    def problem(self, state, key, args: tuple, mode: str) -> Problem:
        output = args[0]
        return Problem(self.name, any_dtype_name(output.dtype), state.world_size,
                       nbytes=output.numel() * output.element_size())

    def bytes_per_call(self, args: tuple) -> int:
        return args[0].numel() * args[0].element_size()

    def custom_ops(self) -> tuple[CustomOp, ...]:
        return (CustomOp("all_gather_into_tensor", _all_gather_into_tensor, _all_gather_into_tensor_fake,
                         setup_context=_setup, backward=_backward),)


DOOR = AllGatherDoor(ALL_GATHER, arg_names=("output", "input", "sizes"))


def _all_gather(output: torch.Tensor, input: torch.Tensor, sizes, group):
    state = STATES.get(group) or state_of(group)
    try:
        key = call_key(ALL_GATHER, input.dtype, input.shape, input.device, stream_capturing(),
                       (output.shape, None if sizes is None else checked_sizes(sizes, "all_gatherv")))
    except (AttributeError, TypeError):  # not a tensor, or sizes not ints: the checks name which, on every rank
        return refuse_call(state, DOOR, (output, input, sizes))
    sizes = key[KEY_EXTRA][1]
    return run_sharded(state, DOOR, key, (output, input, sizes), sizes, math.prod(input.shape[1:]))


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """``dist.all_gather_into_tensor``: ``output`` = every rank's ``input`` in rank order along dim 0
    (``output`` holds world_size times ``input``'s elements). Any dtype (bytes are copied); both
    tensors contiguous, on the group's device. ``async_op`` as :func:`reduce_scatter_tensor`.
    Under torch.compile the call is ``torch.ops.autosymm.all_gather_into_tensor``.
    """
    if traced("all_gather_into_tensor", output, input):
        if async_op:
            raise RuntimeError("autosymm.all_gather_into_tensor: async_op=True cannot be traced; drop async_op")
        world_size = dist.get_world_size(group)
        output.copy_(torch.ops.autosymm.all_gather_into_tensor(input, world_size, group_name(group))
                     .view(output.shape))
        return None
    _all_gather(output, input, None, group)
    return Work(output) if async_op else None


def all_gatherv(output: torch.Tensor, input: torch.Tensor, sizes: Sequence[int], group=None) -> torch.Tensor:
    """All-gather with per-rank dim-0 ``sizes`` (host ints, the same on every rank, as vLLM's
    ``all_gatherv``): ``output`` [sum(sizes), ...] = every rank's ``input`` [sizes[r], ...] in rank
    order. Returns ``output``. Eager only, as :func:`reduce_scatterv`."""
    return _all_gather(output, input, sizes, group)


def _all_gather_into_tensor(input: Tensor, group_size: int, group_name: str) -> Tensor:
    """A new tensor: every rank's ``input`` of the group ``group_name`` (of ``group_size`` ranks)
    in rank order along dim 0, [group_size * input.shape[0], *input.shape[1:]] (a 0-d input
    gathers into [group_size])."""
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
