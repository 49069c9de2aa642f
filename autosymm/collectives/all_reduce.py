"""``all_reduce``: a tensor reduced in place over the group (``autosymm.all_reduce``, whose hot path
lives in autosymm.api), and its custom ops ``torch.ops.autosymm.all_reduce_`` / ``all_reduce`` (the
functional one differentiable: autosymm.collectives.autograd).

Problem: ``nbytes`` of the whole tensor; bucket: those bytes (at least 1); no shape. Cache key
(built by the hot path itself): ``(dtype, numel, contiguous, reduce op name, device, capturing)``.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from ..configs import AllReduceConfig
from . import autograd
from ..dist_compat import REDUCE_OP_NAMES
from ..problem import DTYPE_NAMES, Problem, octave_points
from .base import Collective, CustomOp, Lookups, PointRequest, TuningPoints

log = logging.getLogger("autosymm")

#: Reduce op name -> the dist.ReduceOp attribute NCCL runs it with (every op but a bf16/fp16/fp32 sum).
NCCL_OPS = {name: name.upper() for name in REDUCE_OP_NAMES}

#: dtypes no backend reduces (torch.distributed's NCCL and gloo refuse them: "Invalid scalar type").
UNREDUCIBLE = frozenset(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                                           "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2")
                        if hasattr(torch, name))

#: `autosymm tune --sizes` by default: 4 KiB..256 MiB, two points per octave (2^k, 1.5 * 2^k).
SIZES_SPEC = "4KiB:256MiB:2"
SIZES = tuple(octave_points(4 << 10, 256 << 20, 2))


def check_reducible(dtype: torch.dtype, what: str) -> None:
    """ValueError for a dtype no backend reduces (:data:`UNREDUCIBLE`: fp8, fp4), naming it."""
    if dtype in UNREDUCIBLE:
        raise ValueError(f"autosymm.{what}: dtype {dtype} cannot be reduced: tuned kernels serve "
                         f"{', '.join(map(str, DTYPE_NAMES))} sums, NCCL the other real, integer, bool and "
                         f"complex dtypes (cast an fp8 tensor up, e.g. to torch.bfloat16, and back)")


class BytesKeyed(Collective):
    """A collective keyed by the bytes of its full tensor (all-reduce, reduce-scatter, all-gather)."""

    def check_problem(self, problem: Problem) -> None:
        if problem.nbytes < 0:
            raise ValueError(f"nbytes={problem.nbytes} must be >= 0")

    def problems(self, request: PointRequest) -> list[Problem]:
        sizes = self.points.sizes if request.sizes is None else request.sizes
        return [Problem(self.name, d, request.world_size, nbytes=n) for d in request.dtypes for n in sizes]


class AllReduce(BytesKeyed):

    def one_rank_reason(self, deterministic: bool) -> str:
        return "world size 1: nothing to exchange"  # any reduction over one rank is the identity

    def call_text(self, key: tuple, args: tuple, mode: str) -> str:
        x, op = args
        return f"all_reduce of {x.dtype} x {x.numel()} op={op} in {mode} mode"

    def check_call(self, state, key: tuple, args: tuple, mode: str):
        from ..runtime.dispatch import Decision
        from ..runtime.group import Entry, check_tensor, identity

        x, op = args
        check_tensor(x, state, self.name)
        if op not in NCCL_OPS:
            raise ValueError(f"autosymm.all_reduce: op={op!r} is not one of {sorted(NCCL_OPS)}")
        check_reducible(x.dtype, self.name)
        if state.world_size == 1:
            return Entry(Decision("noop", None, self.one_rank_reason(state.deterministic), mode=mode), identity)
        dtype = DTYPE_NAMES.get(x.dtype)
        if op == "sum" and dtype is not None:
            return Problem.all_reduce(x.numel() * x.element_size(), dtype, state.world_size)
        return _nccl_entry(state, x, op, mode)

    def custom_ops(self) -> tuple[CustomOp, ...]:
        return (CustomOp("all_reduce_", _all_reduce_, _all_reduce__fake, mutates_args=("tensor",)),
                CustomOp("all_reduce", _all_reduce, _all_reduce_fake, backward=autograd.all_reduce_backward,
                         setup_context=autograd.all_reduce_setup))


def _nccl_entry(state, x: Tensor, op: str, mode: str):
    """Only sums of bf16/fp16/fp32 have tuned kernels; NCCL serves the rest on every rank alike.
    Under the deterministic setting a floating-point sum, mean or product takes the ordered
    fallback's formula (autosymm.backends.nccl_ordered): NCCL's could round differently with
    the call's size."""
    import torch.distributed as dist

    from ..backends.nccl_ordered import needs_ordering, ordered_all_reduce_launcher
    from ..runtime.dispatch import Decision
    from ..runtime.group import Entry

    reason = f"op {op}" if op != "sum" else f"dtype {x.dtype}"
    if state.deterministic and needs_ordering(op, x.dtype):
        decision = Decision(ALL_REDUCE.invariant_fallback, None, f"{reason} has no tuned kernel; deterministic: "
                            f"NCCL all-gather + in-order {op}", mode=mode)
        log.info("autosymm: all_reduce %s %s -> %s", x.dtype, op, decision.describe())
        return Entry(decision, ordered_all_reduce_launcher(state.group, state.world_size, op))
    decision = Decision("nccl", None, f"{reason} has no tuned kernel: NCCL", mode=mode)
    reduce_op = getattr(dist.ReduceOp, NCCL_OPS[op])
    group = state.group

    def launcher(t):
        dist.all_reduce(t, op=reduce_op, group=group)
        return t

    log.info("autosymm: all_reduce %s %s -> %s", x.dtype, op, decision.describe())
    return Entry(decision, launcher)


def _all_reduce_(tensor: Tensor, op: str, group_name: str) -> None:
    """Reduce ``tensor`` in place over the group named ``group_name`` (autosymm.all_reduce)."""
    from .. import api
    from ..dist_compat import resolve_group

    api._all_reduce_direct(tensor, op, resolve_group(group_name))


def _all_reduce__fake(tensor: Tensor, op: str, group_name: str) -> None:
    return None


def _all_reduce(tensor: Tensor, op: str, group_name: str) -> Tensor:
    """A new contiguous tensor: ``tensor`` reduced over the group named ``group_name``."""
    from .. import api
    from ..dist_compat import resolve_group

    out = tensor.clone(memory_format=torch.contiguous_format)
    api._all_reduce_direct(out, op, resolve_group(group_name))
    return out


def _all_reduce_fake(tensor: Tensor, op: str, group_name: str) -> Tensor:
    return torch.empty_like(tensor, memory_format=torch.contiguous_format)


ALL_REDUCE = AllReduce("all_reduce", "bytes", fallback="nccl", fallback_order=("nccl",),
                       points=TuningPoints(sizes=SIZES), config_type=AllReduceConfig, lookups=Lookups(bf16_same_bytes=True),
                       invariant_fallback="nccl_ordered",
                       arg_names=("tensor", "reduce_op"))
