"""The public runtime: ``all_reduce``, the MoE conversions, ``explain``, ``stats``, ``init``.

Per process group a ``GroupState`` (autosymm.runtime.group) holds what the first call found out, agreed
by every rank, and a dict of prepared calls keyed by (op, dtype, size, device, mode). A repeated call is a
dict lookup, one counter increment and the backend's launcher; a repeated eager all-reduce of a
tensor whose address has a plan (autosymm.runtime.replay.HOT) skips even the key: five attribute checks
and the plan. Call ``init(group)`` (or make one eager call) before capturing a CUDA
graph: the first call on a group runs collectives that must not be captured.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .runtime import moe_room
from .collectives import ALL_REDUCE, DP_TO_EP, EP_TO_DP, Collective, prepare_call, refuse_call
from .collectives import get as collective, names as op_names
from .collectives.all_reduce import NCCL_OPS
from .runtime.dispatch import Decision
from .dist_compat import Work, group_name, is_dtensor, reduce_dtensor, reduce_op_name
from .runtime.group import (STATES, Entry, GroupState, check_traced, current_raw_stream, dense_error, state_key,
                            state_of, stream_capturing)
from .logs import configure_from_env
from .problem import MODES, Problem, dtype_name
from .runtime.replay import HOT, EagerReplay, HotCall, forget_all
from .routing import ExptAssignment

configure_from_env()  # AUTOSYMM_LOG; a bad value is warned about, never raised

_SUM = dist.ReduceOp.SUM
_Tensor = torch.Tensor
# Bound once: one global lookup and call (~60 ns; torch.compiler.is_compiling costs ~4x more).
# Dynamo folds it to True while tracing; other tracers (export, make_fx, AOT) hand us tensor
# subclasses (FakeTensor, FunctionalTensor), which take the op path by their type.
_dynamo_compiling = torch.compiler.is_dynamo_compiling


def init(group=None, *, moe: Sequence = (), moe_max_bytes: Optional[int] = None,
         deterministic: Optional[bool] = None) -> None:
    """Set up autosymm on ``group`` now (collective): workspace, databases, rank agreement.

    ``moe``: the MoE conversions to come, a list of ``autosymm.MoEPlan(shape, max_tokens_per_rank,
    dtype)``: the workspace's MoE region is sized for the largest (grown now, collectively, if
    the group is set up already), so those calls run the Triton conversion, CUDA-graph capture
    included. ``moe_max_bytes``: how far eager MoE calls may grow the MoE region (bytes; default
    geometry.DEFAULT_MOE_MAX_BYTES; 0: never grow). ``deterministic``: True restricts this group's
    calls to batch-invariant backends, False lifts it (default: AUTOSYMM_DETERMINISTIC; README,
    "Batch-invariant bits"). Every rank must pass the same values; a bad one on any rank is a
    ValueError on every rank, before anything is set up.
    """
    if not dist.is_initialized():
        raise RuntimeError("autosymm needs torch.distributed initialised (dist.init_process_group)")
    wrong = "" if deterministic is None or isinstance(deterministic, bool) else \
        f"TypeError: deterministic={deterministic!r} ({type(deterministic).__name__}) must be True, False or None"
    region_bytes, max_bytes = moe_room.agree(group if group is not None else dist.group.WORLD, moe, moe_max_bytes,
                                             wrong)
    if region_bytes and state_key(group) not in STATES:
        from .workspace.symm import reserve_moe_bytes

        reserve_moe_bytes(group if group is not None else dist.group.WORLD, region_bytes)
    moe_room.configure(state_of(group), region_bytes, max_bytes)
    if deterministic is not None:
        state_of(group).set_deterministic(deterministic)
        forget_all()  # hot plans were made under the old setting


def _mode() -> str:
    """'graph' while the current stream is capturing a CUDA graph, else 'eager'."""
    return "graph" if stream_capturing() else "eager"


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
    except (AttributeError, RuntimeError):
        # a list or a sparse tensor fails at its first use as a dense tensor, before anything runs
        if dense_error(tensor, "all_reduce") is None:
            raise
    refuse_call(STATES.get(group) or state_of(group), ALL_REDUCE, (tensor, reduce_op_name(op)))


def _all_reduce_sum(tensor: torch.Tensor, group) -> torch.Tensor:
    """An eager or captured SUM of a plain tensor without a hot plan: one key, one dict lookup,
    one counter; an eager call whose launcher then has a plan for the address makes it hot."""
    state = STATES.get(group) or state_of(group)
    key = (tensor.dtype, tensor.numel(), tensor.is_contiguous(), "sum", tensor.device, stream_capturing())
    if not key[2]:
        return _all_reduce_direct(tensor, "sum", group)
    entry = state.cache.get(key)
    if entry is None:
        entry = prepare_call(state, ALL_REDUCE, key, (tensor, "sum"))
    entry.calls += 1
    launcher = entry.launcher
    launcher(tensor)
    if not key[-1] and type(launcher) is EagerReplay and not state.check_calls:  # checked: never hot
        addr = tensor.data_ptr()
        plan = launcher.plan_for(addr)
        if plan is not None:
            HOT[addr] = HotCall(group, tensor.dtype, key[1], launcher.device_index, entry, plan)
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


def _all_reduce_entry(tensor: torch.Tensor, op: str, group) -> tuple[GroupState, Entry]:
    """The prepared call of ``tensor`` (op by name) on ``group`` in the current mode, counted."""
    state = STATES.get(group) or state_of(group)
    key = (tensor.dtype, tensor.numel(), tensor.is_contiguous(), op, tensor.device, stream_capturing())
    entry = state.cache.get(key)
    if entry is None:
        entry = prepare_call(state, ALL_REDUCE, key, (tensor, op))
    entry.calls += 1
    return state, entry


def _all_reduce_direct(tensor: torch.Tensor, op: str, group) -> torch.Tensor:
    """The eager path for any op name (``all_reduce``'s hot path, generalised; ops.py's impls).
    A non-contiguous tensor is copied in and out, as ``dist.all_reduce`` does."""
    if not tensor.is_contiguous():
        return tensor.copy_(_all_reduce_direct(tensor.contiguous(), op, group))
    return _all_reduce_entry(tensor, op, group)[1].launcher(tensor)


def _all_reduce_async(tensor: torch.Tensor, op: str, group):
    if not tensor.is_contiguous():  # copied in and out: done when this returns
        return Work(_all_reduce_direct(tensor, op, group))
    state, entry = _all_reduce_entry(tensor, op, group)
    if entry.decision.backend == "nccl":
        return dist.all_reduce(tensor, op=getattr(dist.ReduceOp, NCCL_OPS[op]), group=state.group, async_op=True)
    entry.launcher(tensor)
    return Work(tensor)


def _moe_call(record: Collective, src, expt_assignment, expt_indx, indx, group):
    """A MoE conversion (``record``: DP_TO_EP or EP_TO_DP) of plain tensors, eager or captured."""
    state = STATES.get(group) or state_of(group)
    key = (record, src.dtype, src.shape, int(expt_assignment.expt_map.shape[1]), expt_indx.shape, src.device,
           stream_capturing())
    entry = state.cache.get(key)
    if entry is None:
        entry = prepare_call(state, record, key, (src, expt_assignment, expt_indx, indx))
    entry.calls += 1
    return entry.launcher(src, expt_assignment, expt_indx, indx)


def convert_dp_to_ep(src: torch.Tensor, expt_assignment, expt_indx: torch.Tensor, gate_indx: torch.Tensor,
                     group=None) -> torch.Tensor:
    """Send each local token's row to the ranks owning its top-k experts (see autosymm.routing).

    ``src`` [n_tokens_local, d_model]; ``expt_indx`` [n_tokens_global, k] global expert ids;
    ``gate_indx`` from ``autosymm.route``. Returns this rank's [n_tokens_global * k, d_model]
    expert-ordered buffer. Eager: a workspace view, valid until the next dp->ep call (no copy).
    Under torch.compile, or for a ``src`` that requires grad: ``torch.ops.autosymm.dp_to_ep``, a
    tensor the caller owns (one copy; differentiable: its backward is ep->dp).
    """
    if type(src) is not _Tensor or src.requires_grad or _dynamo_compiling():
        check_traced(src, "convert_dp_to_ep")
        tensors, per_shard = _assignment_args(expt_assignment)
        return torch.ops.autosymm.dp_to_ep(src, tensors, per_shard, expt_indx, gate_indx, group_name(group))
    return _moe_call(DP_TO_EP, src, expt_assignment, expt_indx, gate_indx, group)


def convert_ep_to_dp(src: torch.Tensor, expt_assignment, expt_indx: torch.Tensor, topk_indx: torch.Tensor,
                     group=None) -> torch.Tensor:
    """Send expert outputs back to their tokens' home ranks (inverse of convert_dp_to_ep).

    ``src`` [n_tokens_global * k, d_model] in expert order; returns this rank's
    [n_tokens_local * k, d_model] rows. Eager: a workspace view, valid until the next ep->dp
    call. Under torch.compile, or for a ``src`` that requires grad: ``torch.ops.autosymm.ep_to_dp``,
    a tensor the caller owns (differentiable: its backward is dp->ep).
    """
    if type(src) is not _Tensor or src.requires_grad or _dynamo_compiling():
        check_traced(src, "convert_ep_to_dp")
        tensors, per_shard = _assignment_args(expt_assignment)
        return torch.ops.autosymm.ep_to_dp(src, tensors, per_shard, expt_indx, topk_indx, group_name(group))
    return _moe_call(EP_TO_DP, src, expt_assignment, expt_indx, topk_indx, group)


def _assignment_args(a) -> tuple[list[torch.Tensor], list[int]]:
    """An ExptAssignment as the MoE ops take it (autosymm.ops.assignment_from rebuilds it)."""
    if not isinstance(a, ExptAssignment):
        raise TypeError(f"autosymm: the expert assignment must be an ExptAssignment, got {type(a).__name__}")
    return [a.expt_bitmask, a.expt_boolmask, a.expt_map, a.expt_owner], list(a.n_expts_per_shard)


def explain(x: Optional[torch.Tensor] = None, *, group=None, op: str = "all_reduce", mode: Optional[str] = None,
            problem: Optional[Problem] = None) -> Decision:
    """The Decision a call would get on ``group`` (backend, config, DB row or fallback reason,
    expected µs), without running it. Give a tensor (all-reduce) or a Problem."""
    if mode is not None and mode not in MODES:
        raise ValueError(f"explain: mode={mode!r} is not one of {MODES}")
    if op not in op_names():
        raise ValueError(f"explain: op={op!r} is not one of {op_names()}")
    asked = collective(op)
    if problem is None:
        if x is None:
            raise ValueError("explain needs a tensor or a Problem")
        if asked is not ALL_REDUCE:
            raise ValueError(f"explain: a tensor describes an all-reduce, not {op}; pass "
                             f"problem={asked.problem_hint()}")
    elif asked is not ALL_REDUCE and problem.op != op:
        raise ValueError(f"explain: op={op!r} but the problem is a {problem.op}")
    state = state_of(group)
    mode = mode or _mode()
    if problem is None:
        problem = Problem.all_reduce(x.numel() * x.element_size(), dtype_name(x.dtype), state.world_size)
    return state.decide(problem, mode)


def stats(group=None) -> dict[str, dict[str, int]]:
    """Calls and bytes per backend since start (all groups, or one group)."""
    out: dict[str, dict[str, int]] = {}
    if group is None:
        states = list(STATES.values())
    else:
        states = [STATES[group]] if group in STATES else []
    for state in {id(state): state for state in states}.values():  # a state may sit under two names
        for entry in state.cache.values():
            agg = out.setdefault(entry.decision.backend, {"calls": 0, "bytes": 0})
            agg["calls"] += entry.calls
            agg["bytes"] += entry.calls * entry.bytes_per_call
    return out


def empty(shape, dtype: torch.dtype = torch.bfloat16, group=None) -> torch.Tensor:
    """A tensor inside the group's workspace: all_reduce of it needs no copy (zero-copy path).

    Every rank must call it in the same order with the same shapes.
    """
    state = state_of(group)
    if state.workspace is None:
        return torch.empty(shape, dtype=dtype, device=state.device)
    return state.workspace.empty(tuple(shape), dtype)


def barrier_errors(group=None) -> int:
    """Barrier waits on this rank that gave up (a peer never arrived) since the last
    ``reset_barriers``; 0 when healthy. Non-zero: results since the last clean check are garbage.
    Synchronizes the device: call it after the fact, not per call."""
    workspace = state_of(group).workspace
    return workspace.barrier_errors() if workspace is not None else 0


def reset_barriers(group=None) -> None:
    """Re-arm the signal pads after barrier errors (collective: every rank of ``group`` calls it)."""
    workspace = state_of(group).workspace
    if workspace is not None:
        workspace.reset_signals()


def reset() -> None:
    """Forget every group's state and prepared calls (tests; after destroy_process_group), and
    free FlashInfer's fused workspaces (autosymm.backends.flashinfer_fused)."""
    from .backends import flashinfer_fused

    forget_all()
    flashinfer_fused.close_all()
    STATES.clear()
