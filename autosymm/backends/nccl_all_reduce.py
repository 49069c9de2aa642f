"""Backend ``nccl``: ``torch.distributed.all_reduce`` on the group (the always-available fallback)."""

from __future__ import annotations

from typing import Optional

import torch

from ..problem import Problem
from .base import Capabilities, RunContext


class NcclAllReduce:
    """``dist.all_reduce(x, group=ctx.group)``: serves every all-reduce, no config."""

    name = "nccl"
    ops = ("all_reduce",)

    def unsupported_reason(self, problem: Problem, caps: Capabilities) -> Optional[str]:
        return None if problem.op == "all_reduce" else f"op {problem.op}"

    def search_space(self, problem: Problem) -> list[None]:
        return [None]

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
