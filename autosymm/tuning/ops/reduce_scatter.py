"""The reduce-scatter's tuning side: small multiples of 1/4 as the validation input, so every
partial sum of <= 8 ranks is exact and the reference (NCCL's reduce-scatter of the same input)
does not depend on the summation order; the stages of both Triton algorithms in the all-reduce
region. A size whose elements do not split into world_size equal shards is tuned with near-even
per-rank counts (the first ranks one element more), for every backend alike."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ...spec import REDUCE_SCATTER as RECORD
from ...problem import Problem
from .base import TuningOp, quarters
from ...backends.nccl_rs_ag import reduce_scatter_launcher
from ...backends.rs_ag_layout import stage_bytes
from ...collectives.reduce_scatter import reduce_scatter_tensor, reduce_scatterv


def tuning_counts(numel: int, world_size: int) -> Optional[list[int]]:
    """None when ``numel`` splits evenly, else the near-even per-rank counts."""
    if numel % world_size == 0:
        return None
    base, extra = divmod(numel, world_size)
    return [base + (r < extra) for r in range(world_size)]


def full_tensor_stage_bytes(problem: Problem) -> int:
    """All-reduce region bytes the largest Triton stage of either op takes for ``problem`` (every
    segment staged; a per-rank split: up to 16 bytes more per rank)."""
    return stage_bytes(False, problem.nbytes, problem.world_size) + 16 * problem.world_size


class ShardedTuning(TuningOp):
    """What the reduce-scatter and the all-gather share: a launcher takes ``(output, input,
    counts)``; ``data.outputs`` holds the timing outputs."""

    #: True: the full tensor is the input (reduce-scatter); False: the output (all-gather)
    full_input = True

    def allocate(self, data, gen: torch.Generator) -> None:
        p, dev, dtype = data.problem, data.device, data.dtype
        data.counts = tuning_counts(p.numel, p.world_size)
        shard = data.counts[data.rank] if data.counts else p.numel // p.world_size
        n_in, n_out = (p.numel, shard) if self.full_input else (shard, p.numel)
        data.val_input = quarters((n_in,), gen, dev, dtype)
        data.val_output = torch.empty(n_out, dtype=dtype, device=dev)
        data.timing = [torch.empty(n_in, dtype=dtype, device=dev) for _ in range(data.n_inputs)]
        data.outputs = [torch.empty(n_out, dtype=dtype, device=dev) for _ in range(data.n_inputs)]

    def validation_args(self, data) -> tuple:
        return (data.val_output.fill_(float("nan")) if data.dtype.is_floating_point else data.val_output,
                data.val_input, data.counts)

    def timing_args(self, data) -> list[tuple]:
        return [(out, inp, data.counts) for out, inp in zip(data.outputs, data.timing)]

    def public_call(self, data):
        """The op's public pair: the even form (``counts`` None; a drop-in for torch's, it returns
        None), else its per-rank-sizes form; either way the output, as a launcher returns it."""
        even, per_rank = self.public_functions()

        def call(output, input, counts=None):
            if counts is None:
                even(output, input)
                return output
            return per_rank(output, input, counts)

        return call

    def public_functions(self):
        """(the public function of equal shards, the one of per-rank sizes)."""
        raise NotImplementedError(self.name)


class ReduceScatterTuning(ShardedTuning):
    def public_functions(self):
        return reduce_scatter_tensor, reduce_scatterv

    def build_reference(self, data) -> None:
        data.expected = torch.empty_like(data.val_output)
        reduce_scatter_launcher(data.group, dist.ReduceOp.SUM)(data.expected, data.val_input, data.counts)

    def workspace_bytes(self, problem: Problem) -> tuple[int, int]:
        return full_tensor_stage_bytes(problem), 0


REDUCE_SCATTER = ReduceScatterTuning(RECORD)
