"""``autosymm.all_reduce``: a tensor reduced in place over the group, its hot path, its checks
and its custom ops ``torch.ops.autosymm.all_reduce_`` / ``all_reduce`` (the functional one
differentiable: autosymm.collectives.autograd). Its spec: autosymm.spec.all_reduce.

Call key: ``call_key(ALL_REDUCE, dtype, numel, device, capturing, reduce op name)`` (a contiguous
tensor is served flat: its shape beyond numel fixes nothing).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..dist_compat import Work, group_name, is_dtensor, reduce_dtensor, reduce_op_name, resolve_group
from ..problem import Problem, any_dtype_name
from ..runtime.entry import CustomOp, Door, prepare_call, refuse_call
from ..runtime.group import STATES, check_tensor, check_traced, current_raw_stream, dense_error, state_of, \
    stream_capturing
from ..runtime.replay import HOT, EagerReplay, HotCall
from ..spec import ALL_REDUCE, KEY_CAPTURING, KEY_SHAPE, call_key
from ..spec.all_reduce import NCCL_OPS, check_reducible
from . import autograd

_SUM = dist.ReduceOp.SUM
_Tensor = torch.Tensor
# Bound once: one global lookup and call (~60 ns; torch.compiler.is_compiling costs ~4x more).
# Dynamo folds it to True while tracing; other tracers (export, make_fx, AOT) hand us tensor
# subclasses (FakeTensor, FunctionalTensor), which take the op path by their type.
_dynamo_compiling = torch.compiler.is_dynamo_compiling


class AllReduceDoor(Door):
    def call_text(self, key, args: tuple, mode: str) -> str:
        x, op = args
        return f"all_reduce of {x.dtype} x {x.numel()} op={reduce_op_name(op)} in {mode} mode"

    def check_options(self, state, args: tuple) -> None:
        reduce_op_name(args[1])  # names what is accepted

    def check_tensors(self, state, args: tuple, mode: str) -> None:
        x = args[0]
        check_tensor(x, state, self.name)
        check_reducible(x.dtype, self.name)

    def problem(self, state, key, args: tuple, mode: str) -> Problem:
        x, op = args
        return Problem(self.name, any_dtype_name(x.dtype), state.world_size, nbytes=x.numel() * x.element_size(),
                       reduce_op=reduce_op_name(op))

    def custom_ops(self) -> tuple[CustomOp, ...]:
        return (CustomOp("all_reduce_", _all_reduce_, _all_reduce__fake, mutates_args=("tensor",)),
                CustomOp("all_reduce", _all_reduce, _all_reduce_fake, backward=autograd.all_reduce_backward,
                         setup_context=autograd.all_reduce_setup))


DOOR = AllReduceDoor(ALL_REDUCE, arg_names=("tensor", "reduce_op"))


def all_reduce(tensor: torch.Tensor, op=_SUM, group=None, async_op: bool = False):
    """Reduce ``tensor`` over ``group`` in place and return it; a drop-in for ``dist.all_reduce``.

    ``op``: a ``dist.ReduceOp`` (SUM, AVG, MAX, MIN, PRODUCT, BAND, BOR, BXOR) or its lower-case
    name; only sums of bf16/fp16/fp32 have tuned kernels, NCCL serves the rest. ``async_op=True``
    returns a work handle (``wait()``, ``is_completed()``): torch's own where NCCL serves, else
    an autosymm ``Work`` for kernels already queued on the current stream. A DTensor with
    ``Partial`` placements is reduced over those mesh dimensions into a new ``Replicate``
    DTensor (the input keeps its placements and data, as with ``redistribute``). A tensor that
    requires grad (grad mode on) takes the differentiable ``torch.ops.autosymm.all_reduce`` and
    the result is copied back (the gradient of torch.distributed.nn.functional.all_reduce); a
    non-contiguous tensor is copied in and out. Under torch.compile the call is
    ``torch.ops.autosymm.all_reduce_`` (no graph break); in eager it skips the op dispatcher.
    """
    # The hot path: an eager SUM of a plain tensor at an address that has a plan (replay.HOT).
    # The address fixes the device (unified addressing); dtype, numel and contiguity fix the
    # prepared call (its key below) with the group; on torch's default stream nothing captures.
    try:  # free unless raised (Python >= 3.11)
        if (op is _SUM and not async_op and type(tensor) is _Tensor and not tensor.requires_grad
                and not _dynamo_compiling()):
            hot = HOT.get(tensor.data_ptr())
            if (hot is not None and hot.group is group and hot.dtype is tensor.dtype and hot.numel == tensor.numel()
                    and tensor.is_contiguous()
                    and (current_raw_stream(hot.device_index) == 0 or not stream_capturing())):
                hot.entry.calls += 1
                hot.plan()
                return tensor
            return _all_reduce_sum(tensor, group)
        return _all_reduce_general(tensor, op, group, async_op)
    except (AttributeError, RuntimeError, TypeError, ValueError) as error:
        # a list or a sparse tensor fails at its first use as a dense tensor, an unknown op at its
        # name, before anything runs: refused on every rank of a first call
        if dense_error(tensor, "all_reduce") is None and _op_error(op) is None:
            raise
        if _dynamo_compiling() or (isinstance(tensor, _Tensor) and type(tensor) is not _Tensor
                                   and type(tensor) is not torch.nn.Parameter):
            raise error  # a tracer's tensor: nothing runs, no rank waits
    refuse_call(STATES.get(group) or state_of(group), DOOR, (tensor, op))


def _op_error(op):
    """The error :func:`reduce_op_name` raises for ``op``, or None."""
    try:
        reduce_op_name(op)
    except (TypeError, ValueError) as error:
        return error
    return None


def _all_reduce_sum(tensor: torch.Tensor, group) -> torch.Tensor:
    """An eager or captured SUM of a plain tensor without a hot plan: one key, one dict lookup,
    one counter; an eager call whose launcher then has a plan for the address makes it hot."""
    if not tensor.is_contiguous():
        return _all_reduce_direct(tensor, "sum", group)
    state = STATES.get(group) or state_of(group)
    key = call_key(ALL_REDUCE, tensor.dtype, tensor.numel(), tensor.device, stream_capturing(), "sum")
    entry = state.cache.get(key)
    if entry is None:
        entry = prepare_call(state, DOOR, key, (tensor, "sum"))
    entry.calls += 1
    launcher = entry.launcher
    launcher(tensor)
    if not key[KEY_CAPTURING] and type(launcher) is EagerReplay and not state.check_calls:  # checked: never hot
        addr = tensor.data_ptr()
        plan = launcher.plan_for(addr)
        if plan is not None:
            HOT[addr] = HotCall(group, tensor.dtype, key[KEY_SHAPE], launcher.device_index, entry, plan)
    return tensor


def _all_reduce_general(tensor, op, group, async_op: bool):
    """Every all_reduce but an eager SUM of a plain tensor: other ops, async, DTensor, tracing."""
    name = reduce_op_name(op)
    if is_dtensor(tensor):
        if async_op:
            raise ValueError("autosymm.all_reduce: async_op=True is not supported for a DTensor "
                             f"(placements {tuple(tensor.placements)}): the result is a new DTensor")
        return reduce_dtensor(tensor, name, op is not _SUM, all_reduce)
    if async_op:
        if _dynamo_compiling():
            raise RuntimeError("autosymm.all_reduce: async_op=True cannot be traced by torch.compile; the "
                               "traced op is already ordered on the stream: drop async_op")
        return _all_reduce_async(tensor, name, group)
    if tensor.requires_grad and torch.is_grad_enabled():
        # as torch.distributed.nn.functional.all_reduce, copied back: autograd records the copy
        # (a leaf that requires grad raises torch's in-place error)
        return tensor.copy_(torch.ops.autosymm.all_reduce(tensor, name, group_name(group)))
    if (type(tensor) is _Tensor or type(tensor) is torch.nn.Parameter) and not _dynamo_compiling():
        return _all_reduce_direct(tensor, name, group)
    # torch.compile, or a tensor subclass (FakeTensor, FunctionalTensor under export or make_fx):
    # the op dispatcher routes it (fake impl, functionalization, or the real impl)
    check_traced(tensor, "all_reduce")
    torch.ops.autosymm.all_reduce_(tensor, name, group_name(group))
    return tensor


def _all_reduce_entry(tensor: torch.Tensor, op: str, group) -> tuple:
    """(group state, prepared call) of a contiguous ``tensor`` (op by name) on ``group`` in the
    current mode, counted."""
    state = STATES.get(group) or state_of(group)
    key = call_key(ALL_REDUCE, tensor.dtype, tensor.numel(), tensor.device, stream_capturing(), op)
    entry = state.cache.get(key)
    if entry is None:
        entry = prepare_call(state, DOOR, key, (tensor, op))
    entry.calls += 1
    return state, entry


def _all_reduce_direct(tensor: torch.Tensor, op: str, group) -> torch.Tensor:
    """The eager path for any op name (``all_reduce``'s hot path, generalised; the custom ops'
    impls). A non-contiguous tensor is copied in and out, as ``dist.all_reduce`` does."""
    if not tensor.is_contiguous():
        return tensor.copy_(_all_reduce_direct(tensor.contiguous(), op, group))
    return _all_reduce_entry(tensor, op, group)[1].launcher(tensor)


def _all_reduce_async(tensor: torch.Tensor, op: str, group):
    if not tensor.is_contiguous():  # copied in and out: done when this returns
        return Work(_all_reduce_direct(tensor, op, group))
    state, entry = _all_reduce_entry(tensor, op, group)
    if entry.decision.backend == ALL_REDUCE.fallback:  # torch's own handle where NCCL serves
        return dist.all_reduce(tensor, op=getattr(dist.ReduceOp, NCCL_OPS[op]), group=state.group, async_op=True)
    entry.launcher(tensor)
    return Work(tensor)


def _all_reduce_(tensor: Tensor, op: str, group_name: str) -> None:
    """Reduce ``tensor`` in place over the group named ``group_name`` (autosymm.all_reduce)."""
    _all_reduce_direct(tensor, op, resolve_group(group_name))


def _all_reduce__fake(tensor: Tensor, op: str, group_name: str) -> None:
    return None


def _all_reduce(tensor: Tensor, op: str, group_name: str) -> Tensor:
    """A new contiguous tensor: ``tensor`` reduced over the group named ``group_name``."""
    out = tensor.clone(memory_format=torch.contiguous_format)
    _all_reduce_direct(out, op, resolve_group(group_name))
    return out


def _all_reduce_fake(tensor: Tensor, op: str, group_name: str) -> Tensor:
    return torch.empty_like(tensor, memory_format=torch.contiguous_format)
