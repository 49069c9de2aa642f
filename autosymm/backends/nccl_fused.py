"""Backend ``nccl_fused``: NCCL all-reduce, torch add, torch ``rms_norm`` (the fallback and the
baseline of ``all_reduce_rmsnorm``); for the other epilogues, NCCL's sum of x in fp32 (a copy:
x is left as it is) then the reference epilogue's torch ops (autosymm.epilogue.reference:
+ residual and the norm in fp32, then the quant), so every epilogue has a fallback whose
quantized output is the stated formula's but where NCCL's summation order rounds the fp32 sum's
last bit otherwise (16-bit x: twice the bytes of an all-reduce in x's dtype, whose rounded sum
would put a quantized value many e4m3 steps off where the ranks' values cancel)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..problem import Problem
from .base import Backend, Needs, RunContext
from ..epilogue import DEFAULT, NATIVE_CHAIN, SINGLE_ROUNDING, epilogue_launcher


class NcclFused(Backend):
    """``dist.all_reduce(x)``, ``residual += x``, ``rms_norm(residual, weight, eps)``: serves every
    call, no config. x ends holding the sum (the Triton backends leave it unchanged)."""

    name = "nccl_fused"
    needs = Needs()

    def formula(self, problem: Problem) -> str:
        """The default epilogue: the native chain (two roundings); the others: the reference
        formula from NCCL's fp32 sum."""
        return NATIVE_CHAIN if problem.epilogue == DEFAULT else SINGLE_ROUNDING

    def prepare(self, problem: Problem, config: None, ctx: RunContext):
        group, all_reduce, rms_norm = ctx.group, dist.all_reduce, torch.nn.functional.rms_norm
        hidden = (problem.hidden,)
        if problem.epilogue != DEFAULT:  # launcher(x, residual, weight, eps, scale)
            def total(x: torch.Tensor) -> torch.Tensor:
                s = x.to(torch.float32, copy=True)
                all_reduce(s, group=group)
                return s

            return epilogue_launcher(problem.epilogue, total)

        def launcher(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
            all_reduce(x, group=group)
            residual.add_(x)
            return rms_norm(residual, hidden, weight, eps)

        return launcher


nccl_fused = NcclFused()
BACKENDS = (nccl_fused,)
