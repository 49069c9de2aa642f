"""Backend ``nccl``: ``torch.distributed.all_reduce`` on the group (the always-available fallback)."""

from __future__ import annotations

import torch

from ..problem import Problem
from .base import Backend, Needs, RunContext


class NcclAllReduce(Backend):
    """``dist.all_reduce(x, group=ctx.group)``: serves every all-reduce, no config."""

    name = "nccl"
    needs = Needs(ops=("all_reduce",))

    def prepare(self, problem: Problem, config: None, ctx: RunContext):
        import torch.distributed as dist

        group = ctx.group
        all_reduce = dist.all_reduce

        def launcher(x: torch.Tensor) -> torch.Tensor:
            all_reduce(x, group=group)
            return x

        return launcher


nccl = NcclAllReduce()
BACKENDS = (nccl,)
