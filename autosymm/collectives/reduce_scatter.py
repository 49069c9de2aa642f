"""``autosymm.reduce_scatter_tensor`` / ``reduce_scatterv``: a tensor summed over the group, each
rank keeping its dim-0 shard (drop-ins for torch.distributed's, and vLLM's per-rank-size form),
their checks and the custom op ``torch.ops.autosymm.reduce_scatter_tensor`` (functional, with
autograd: the gradient of a reduce-scatter is the all-gather of the gradients,
torch.distributed.nn.functional's formula). Also what the all-gather's door shares: the shard
checks (:func:`shard_counts`, :func:`checked_sizes`) and :class:`ShardedDoor`. Its spec:
autosymm.spec.reduce_scatter.

Shards are along dim 0 in rank order. Where no tuned row serves, NCCL does
(``dist.reduce_scatter_tensor``; per-rank sizes: ``dist.reduce_scatter`` over the segments).
Call key: ``call_key(REDUCE_SCATTER, dtype, input shape, input device, capturing, (output shape,
reduce op name, sizes or None))``; the call's arguments ``(output, input, op, sizes)``.
"""

from __future__ import annotations

import math
import operator
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ..dist_compat import Work, group_name, reduce_op_name, resolve_group
from ..problem import Problem, any_dtype_name
from ..runtime.entry import CustomOp, Door, prepare_call, refuse_call
from ..runtime.group import STATES, check_tensor, check_traced, dense_error, state_of, stream_capturing
from ..spec import KEY_EXTRA, REDUCE_SCATTER, call_key
from ..spec.all_reduce import check_reducible

_SUM = dist.ReduceOp.SUM
_Tensor = torch.Tensor
_dynamo_compiling = torch.compiler.is_dynamo_compiling


def shard_counts(door: Door, full: Tensor, shard: Tensor, sizes: Optional[Sequence[int]], rank: int,
                 world_size: int) -> Optional[tuple[int, ...]]:
    """Per-rank element counts of ``full`` (the reduce-scatter's input, the all-gather's output)
    cut into dim-0 shards (None: equal ones), this rank's being ``shard``; ValueError naming the
    shapes unless they fit: ``full`` holds world_size times ``shard``'s elements (the tensor
    forms, torch.distributed's rule), or ``sizes[r]`` rows of ``shard``'s row shape each."""
    what = f"autosymm.{door.name}"
    if full.dtype != shard.dtype:
        raise ValueError(f"{what}: the full tensor is {full.dtype}, the shard {shard.dtype}: input and output "
                         "must share one dtype")
    if sizes is None:
        if full.numel() != world_size * shard.numel():
            raise ValueError(f"{what}: the full tensor {tuple(full.shape)} must hold world_size={world_size} times "
                             f"the {shard.numel()} elements of the shard {tuple(shard.shape)}")
        return None
    sizes = checked_sizes(sizes, door.name)
    if len(sizes) != world_size or min(sizes) < 0:
        raise ValueError(f"{what}: sizes {list(sizes)} must be {world_size} non-negative dim-0 sizes, one per rank")
    if full.dim() < 1 or shard.dim() < 1 or full.shape[1:] != shard.shape[1:]:
        raise ValueError(f"{what}: the full tensor {tuple(full.shape)} and the shard {tuple(shard.shape)} must "
                         "have one row shape (all dims but the first)")
    if full.shape[0] != sum(sizes) or shard.shape[0] != sizes[rank]:
        raise ValueError(f"{what}: sizes {list(sizes)} need a full tensor of {sum(sizes)} rows and a shard of "
                         f"{sizes[rank]} rows on rank {rank}, got {tuple(full.shape)} and {tuple(shard.shape)}")
    row = math.prod(shard.shape[1:])
    return tuple(s * row for s in sizes)


def checked_sizes(sizes, what: str) -> tuple[int, ...]:
    """Per-rank dim-0 ``sizes`` (a list or tuple of host ints, numpy's too) as a tuple of ints;
    TypeError naming ``sizes`` for anything else: a float, string or bool would be cut or read
    as a row count, a tensor would be read from the device on every call."""
    if isinstance(sizes, (list, tuple)):
        found = tuple(sizes)
        if all(type(s) is int for s in found):
            return found
        try:
            if not any(isinstance(s, bool) for s in found):
                return tuple(operator.index(s) for s in found)
        except TypeError:
            pass
        kinds = sorted({type(s).__name__ for s in found if type(s) is not int})
        raise TypeError(f"autosymm.{what}: sizes={list(found)!r} must be ints, one per rank (got {', '.join(kinds)})")
    kind = "a tensor: pass host ints (sizes.tolist())" if isinstance(sizes, torch.Tensor) else type(sizes).__name__
    raise TypeError(f"autosymm.{what}: sizes must be a list of ints, one per rank, not {kind}")


def shards_text(shard: Tensor, sizes: Optional[Sequence[int]]) -> str:
    """A call's shards as every rank states them alike (its own shard's rows differ with sizes)."""
    if sizes is None:
        return str(tuple(shard.shape))
    return f"rows {list(sizes)} of {tuple(shard.shape[1:])}"


class ShardedDoor(Door):
    """The reduce-scatter's and the all-gather's entry: a full tensor and its dim-0 shards."""

    def check_options(self, state, args: tuple) -> None:
        sizes = args[-1]
        if sizes is not None:
            checked_sizes(sizes, self.name)


def checked_tensors(door: Door, state, output: Tensor, input: Tensor) -> None:
    check_tensor(output, state, door.name, "output")
    check_tensor(input, state, door.name, "input")


class ReduceScatterDoor(ShardedDoor):
    def call_text(self, key: tuple, args: tuple, mode: str) -> str:
        output, input, op, sizes = args
        return f"{self.name} of {input.dtype} {tuple(input.shape)} -> {shards_text(output, sizes)} op={op} in {mode} mode"

    def check_options(self, state, args: tuple) -> None:
        reduce_op_name(args[2])
        super().check_options(state, args)

    def check_tensors(self, state, args: tuple, mode: str) -> None:
        output, input, op, sizes = args
        checked_tensors(self, state, output, input)
        check_reducible(input.dtype, self.name)
        shard_counts(self, input, output, sizes, state.rank, state.world_size)

    def problem(self, state, key, args: tuple, mode: str) -> Problem:
        output, input, op, sizes = args
        return Problem(self.name, any_dtype_name(input.dtype), state.world_size,
                       nbytes=input.numel() * input.element_size(), reduce_op=reduce_op_name(op))

    def bytes_per_call(self, args: tuple) -> int:
        return args[1].numel() * args[1].element_size()

    def custom_ops(self) -> tuple[CustomOp, ...]:
        return (CustomOp("reduce_scatter_tensor", _reduce_scatter_tensor, _reduce_scatter_tensor_fake,
                         setup_context=_setup, backward=_backward),)


DOOR = ReduceScatterDoor(REDUCE_SCATTER, arg_names=("output", "input", "reduce_op", "sizes"))


def traced(what: str, *tensors: torch.Tensor) -> bool:
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


def _reduce_scatter(output: torch.Tensor, input: torch.Tensor, op, sizes, group):
    state = STATES.get(group) or state_of(group)
    try:
        key = call_key(REDUCE_SCATTER, input.dtype, input.shape, input.device, stream_capturing(),
                       (output.shape, reduce_op_name(op),
                        None if sizes is None else checked_sizes(sizes, "reduce_scatterv")))
    except (AttributeError, TypeError, ValueError):
        # not a tensor, an unknown op, sizes not ints: the checks name which, on every rank
        return refuse_call(state, DOOR, (output, input, op, sizes))
    op = key[KEY_EXTRA][1]
    sizes = key[KEY_EXTRA][2]
    return run_sharded(state, DOOR, key, (output, input, op, sizes), sizes, math.prod(output.shape[1:]))


def run_sharded(state, door: Door, key, args: tuple, sizes, row: int):
    """A sharded op's keyed call: its entry (prepared on a miss), counted, launched on ``args[0]``
    (output) and ``args[1]`` (input) with the per-rank ``sizes`` in rows of ``row`` elements."""
    entry = state.cache.get(key)
    if entry is None:
        entry = prepare_call(state, door, key, args)
    entry.calls += 1
    output, input = args[0], args[1]
    try:
        return entry.launcher(output, input, None if sizes is None else [s * row for s in sizes])
    except (NotImplementedError, RuntimeError):
        refuse_layout(door, output, input)
        raise


def refuse_layout(door, output, input) -> None:
    """The error naming a sparse ``output`` or ``input`` of a call whose key was prepared for
    dense tensors (its key holds no layout): the launcher failed at its first touch of it, before
    anything ran (torch's collectives refuse sparse tensors, the kernels need a data pointer)."""
    error = dense_error(output, door.name, "output") or dense_error(input, door.name, "input")
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
    if traced("reduce_scatter_tensor", output, input):
        if async_op:
            raise RuntimeError("autosymm.reduce_scatter_tensor: async_op=True cannot be traced; drop async_op")
        world_size = dist.get_world_size(group)
        output.copy_(torch.ops.autosymm.reduce_scatter_tensor(input, reduce_op_name(op), world_size,
                                                              group_name(group)).view(output.shape))
        return None
    _reduce_scatter(output, input, op, None, group)
    return Work(output) if async_op else None  # the work is queued on the current stream


def reduce_scatterv(output: torch.Tensor, input: torch.Tensor, sizes: Sequence[int], group=None) -> torch.Tensor:
    """Reduce-scatter with per-rank dim-0 ``sizes`` (host ints, the same list on every rank, as
    vLLM's ``reduce_scatterv``): ``input`` [sum(sizes), ...] summed over ``group``; this rank's
    ``output`` [sizes[rank], ...] gets rows sizes[:rank].sum() onward. Returns ``output``. Eager
    only (a per-rank split copies its bounds table to the device on its first call: make that
    call before capturing a CUDA graph)."""
    return _reduce_scatter(output, input, "sum", sizes, group)


def _reduce_scatter_tensor(input: Tensor, op: str, group_size: int, group_name: str) -> Tensor:
    """A new tensor: this rank's dim-0 shard of ``input`` reduced over the group ``group_name``
    (of ``group_size`` ranks), [input.shape[0] // group_size, *input.shape[1:]]."""
    out = input.new_empty((input.shape[0] // group_size, *input.shape[1:]))
    reduce_scatter_tensor(out, input.contiguous(), op, resolve_group(group_name))
    return out


def _reduce_scatter_tensor_fake(input: Tensor, op: str, group_size: int, group_name: str) -> Tensor:
    return input.new_empty((input.shape[0] // group_size, *input.shape[1:]))


def _setup(ctx, inputs, output) -> None:
    _, ctx.op, ctx.group_size, ctx.group_name = inputs


def _backward(ctx, grad: Tensor):
    """d(shard_p)/d(input_q) is the identity on segment p: the input's gradient on every rank is
    the all-gather of the shards' gradients (``avg``: divided by the group size)."""
    if ctx.op not in ("sum", "avg"):
        raise RuntimeError(f"autosymm.reduce_scatter_tensor: no gradient for op={ctx.op!r} (only sum and avg are "
                           "linear in their inputs)")
    gathered = torch.ops.autosymm.all_gather_into_tensor(grad.contiguous(), ctx.group_size, ctx.group_name)
    return (gathered / ctx.group_size if ctx.op == "avg" else gathered), None, None, None
