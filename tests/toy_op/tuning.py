"""The toy op's tuning side: multiples of 1/4 (exact sums), the reference a plain all_reduce of
the same input, no symmetric workspace."""

from __future__ import annotations

import torch
import torch.distributed as dist

from autosymm.tuning.ops.base import TuningOp, quarters

from .spec import TOY as RECORD


class ToyTuning(TuningOp):
    def allocate(self, data, gen: torch.Generator) -> None:
        shape = (data.problem.n_tokens_local, data.problem.shape.elements)
        data.val_input = quarters(shape, gen, data.device, data.dtype)
        data.timing = [torch.empty(shape, dtype=data.dtype, device=data.device) for _ in range(data.n_inputs)]

    def build_reference(self, data) -> None:
        data.expected = data.val_input.clone()
        dist.all_reduce(data.expected, group=data.group)

    def validation_args(self, data) -> tuple:
        return (data.val_input.clone(),)  # summed in place

    def workspace_bytes(self, problem) -> tuple[int, int]:
        return 0, 0


TOY = ToyTuning(RECORD)
