"""The all-reduce's tuning side: small multiples of 1/4 as the validation input, so every partial
sum of <= 8 ranks is exact in bf16/fp16/fp32 and the reference (NCCL's all_reduce of the same
input) does not depend on the summation order; the push one-shot's stage in the all-reduce
region; `bench` over sizes, with torch's symmetric pool."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...spec import ALL_REDUCE as RECORD
from ...problem import Problem
from .base import TuningOp
from ...collectives.all_reduce import all_reduce


class AllReduceTuning(TuningOp):
    def allocate(self, data, gen: torch.Generator) -> None:
        p, dev = data.problem, data.device
        data.val_input = torch.randint(-8, 9, (p.numel,), generator=gen, device=dev, dtype=torch.int8
                                       ).to(data.dtype).mul_(0.25)
        data.timing = [torch.empty(p.numel, dtype=data.dtype, device=dev) for _ in range(data.n_inputs)]

    def build_reference(self, data) -> None:
        data.expected = data.val_input.clone()
        dist.all_reduce(data.expected, group=data.group)

    def validation_args(self, data) -> tuple:
        return (data.val_input.clone(), *data.extra)  # all-reduce is in place

    def public_call(self, data):
        return all_reduce  # all_reduce(x) -> x

    def workspace_bytes(self, problem: Problem) -> tuple[int, int]:
        # this backend imports the Triton kernels: only a tune's sizing needs it
        from ...backends import triton_all_reduce

        # the largest stage of any Triton all-reduce algorithm (the push one-shot's slot per peer)
        return triton_all_reduce.largest_stage_bytes(problem.nbytes, problem.world_size), 0


ALL_REDUCE = AllReduceTuning(RECORD)
