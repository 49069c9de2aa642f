"""``all_reduce``'s spec: a tensor reduced in place over the group. Problem: ``nbytes`` of the
whole tensor; bucket: those bytes (at least 1); no shape. Also the reduce ops and dtypes every
reducing op shares (reduce-scatter too). Its front door: autosymm.collectives.all_reduce."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..configs import AllReduceConfig
from ..dist_compat import REDUCE_OP_NAMES
from ..problem import DTYPE_NAMES
from .base import STACK_BACKENDS, BytesKeyed, Domain, Lookups, TuningPoints
from .kinds import SIZES

#: Reduce op name -> the dist.ReduceOp attribute NCCL runs it with (every op but a bf16/fp16/fp32 sum).
NCCL_OPS = {name: name.upper() for name in REDUCE_OP_NAMES}

#: dtypes no backend reduces (torch.distributed's NCCL and gloo refuse them: "Invalid scalar type").
UNREDUCIBLE = frozenset(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                                           "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2")
                        if hasattr(torch, name))

#: The reductions whose result can depend on the order of the ranks' values (floating point).
ORDERED_OPS = ("sum", "avg", "product")


def needs_ordering(op: str, dtype: torch.dtype) -> bool:
    """Whether NCCL's ``op`` over ``dtype`` can round differently with the call's size or algorithm
    (floating-point sums, means and products); max, min, bitwise and integer ops are exact."""
    return op in ORDERED_OPS and (dtype.is_floating_point or dtype.is_complex)


def check_reducible(dtype: torch.dtype, what: str) -> None:
    """ValueError for a dtype no backend reduces (:data:`UNREDUCIBLE`: fp8, fp4), naming it."""
    if dtype in UNREDUCIBLE:
        raise ValueError(f"autosymm.{what}: dtype {dtype} cannot be reduced: tuned kernels serve "
                         f"{', '.join(map(str, DTYPE_NAMES))} sums, NCCL the other real, integer, bool and "
                         f"complex dtypes (cast an fp8 tensor up, e.g. to torch.bfloat16, and back)")


@dataclass(frozen=True, eq=False)
class AllReduceSpec(BytesKeyed):
    def one_rank_reason(self, deterministic: bool) -> str:
        return "world size 1: nothing to exchange"  # any reduction over one rank is the identity


#: The all-reduce's and reduce-scatter's tuned domain: sums of the kernels' dtypes.
SUMS = Domain(reduce_ops=("sum",))

_BACKENDS = "autosymm.backends."
ALL_REDUCE = AllReduceSpec(
    "all_reduce", fallback="nccl", fallback_order=("nccl",), points=TuningPoints(sizes=SIZES),
    config_type=AllReduceConfig, door="autosymm.collectives.all_reduce:DOOR",
    backends={"nccl": _BACKENDS + "nccl_all_reduce:nccl", "nccl_symm": _BACKENDS + "nccl_symm:nccl_symm",
              "torch_one_shot": _BACKENDS + "torch_symm:torch_one_shot",
              "torch_two_shot": _BACKENDS + "torch_symm:torch_two_shot",
              "triton_one_shot": _BACKENDS + "triton_all_reduce:triton_one_shot",
              "triton_one_shot_push": _BACKENDS + "triton_all_reduce:triton_one_shot_push",
              "triton_two_shot": _BACKENDS + "triton_all_reduce:triton_two_shot",
              "triton_multimem": _BACKENDS + "triton_all_reduce:triton_multimem",
              "triton_lamport": _BACKENDS + "triton_lamport:triton_lamport",
              "nccl_ordered": _BACKENDS + "nccl_ordered:nccl_ordered", **STACK_BACKENDS},
    tuning="autosymm.tuning.ops.all_reduce:ALL_REDUCE", bench="autosymm.bench.run:ALL_REDUCE_BENCH",
    lookups=Lookups(bf16_same_bytes=True), invariant_fallback="nccl_ordered", domain=SUMS,
    local="autosymm.backends.local:identity")
