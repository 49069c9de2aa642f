"""Backend ``nccl``: ``torch.distributed.all_reduce`` on the group (the always-available fallback),
for every dtype and reduction torch.distributed's backend takes."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..problem import Problem
from ..spec.all_reduce import needs_ordering
from .base import Backend, Needs, RunContext


class NcclAllReduce(Backend):
    """``dist.all_reduce(x, op, group=ctx.group)``: serves every all-reduce, no config."""

    name = "nccl"
    needs = Needs(dtypes=None, reduce_ops=None)

    def invariant_for(self, problem: Problem) -> bool:
        """Max, min, bitwise ops and integer sums are exact in any order; floating-point sums,
        means and products round with NCCL's algorithm, which follows the call's size."""
        return not needs_ordering(problem.reduce_op, problem.torch_dtype)

    def prepare(self, problem: Problem, config: None, ctx: RunContext):
        group, all_reduce = ctx.group, dist.all_reduce
        reduce_op = getattr(dist.ReduceOp, problem.reduce_op.upper())

        def launcher(x: torch.Tensor) -> torch.Tensor:
            all_reduce(x, op=reduce_op, group=group)
            return x

        return launcher


nccl = NcclAllReduce()
BACKENDS = (nccl,)
