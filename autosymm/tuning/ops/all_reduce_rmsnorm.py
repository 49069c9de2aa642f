"""The fused all-reduce + RMSNorm's tuning side: small multiples of 1/4 for x and the (replicated)
residual and weight, so the updated residual is exact; the expected result is that residual
stacked on its RMSNorm * weight computed in fp32 (a launcher's result is stacked the same way,
:meth:`FusedTuning.result`); the fused backends' stages in the all-reduce region."""

from __future__ import annotations

from typing import Any

import torch

from ...collectives import ALL_REDUCE_RMSNORM as RECORD
from ...problem import Problem
from .base import SEED, TuningOp, quarters

EPS = 1e-6


class FusedTuning(TuningOp):
    def allocate(self, data, gen: torch.Generator) -> None:
        p, dev = data.problem, data.device
        shape = (p.n_tokens_local, p.hidden)
        data.val_input = quarters(shape, gen, dev, data.dtype)
        same = torch.Generator(device=dev).manual_seed(SEED)  # residual and weight: replicated
        data.residual, data.weight = quarters(shape, same, dev, data.dtype), quarters((p.hidden,), same, dev, data.dtype)
        data.timing = [torch.empty(shape, dtype=data.dtype, device=dev) for _ in range(data.n_inputs)]
        data.timing_residuals = [torch.empty_like(t) for t in data.timing]

    def build_reference(self, data) -> None:
        import torch.distributed as dist

        total = data.val_input.clone()
        dist.all_reduce(total, group=data.group)  # exact: small multiples of 1/4
        new = data.residual.float() + total.float()
        out = new * torch.rsqrt(new.pow(2).mean(-1, keepdim=True) + EPS) * data.weight.float()
        data.expected = torch.stack((new.to(data.dtype), out.to(data.dtype)))

    def validation_args(self, data) -> tuple:
        # residual updated in place; x may be (NCCL)
        return (data.val_input.clone(), data.residual.clone(), data.weight, EPS)

    def result(self, data, out: Any, args: tuple) -> Any:
        """The updated residual stacked on the output (the expected value's layout)."""
        return torch.stack((args[1], out)) if isinstance(out, torch.Tensor) else out

    def timing_args(self, data) -> list[tuple]:
        return [(t, r, data.weight, EPS) for t, r in zip(data.timing, data.timing_residuals)]

    def workspace_bytes(self, problem: Problem) -> tuple[int, int]:
        from ...backends import triton_fused

        # the largest stage of any fused algorithm (the two-shot's x and out rows)
        return triton_fused.largest_stage_bytes(problem.nbytes, problem.world_size), 0


ALL_REDUCE_RMSNORM = FusedTuning(RECORD)
