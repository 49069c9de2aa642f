"""The all-gather's tuning side: random shards, the reference NCCL's all-gather of them,
compared bit for bit (a copy); both Triton algorithms' stages in the all-reduce region. Sizes
that do not split evenly are tuned with near-even per-rank counts, as the reduce-scatter's."""

from __future__ import annotations

import torch

from ...spec import ALL_GATHER as RECORD
from ...problem import Problem
from .reduce_scatter import ShardedTuning, full_tensor_stage_bytes
from ...backends.nccl_rs_ag import all_gather_launcher
from ...collectives.all_gather import all_gather_into_tensor, all_gatherv


class AllGatherTuning(ShardedTuning):
    exact = True  # pure copies: compared bit for bit
    full_input = False

    def public_functions(self):
        return all_gather_into_tensor, all_gatherv

    def build_reference(self, data) -> None:
        data.expected = torch.empty_like(data.val_output)
        all_gather_launcher(data.group)(data.expected, data.val_input, data.counts)

    def workspace_bytes(self, problem: Problem) -> tuple[int, int]:
        return full_tensor_stage_bytes(problem), 0


ALL_GATHER = AllGatherTuning(RECORD)
