"""A tuning problem's inputs and this rank's reference output (autosymm.tuning.sweep validates every
candidate against it before timing it): :class:`ProblemData` holds the tensors, the op's tuning
module (autosymm.tuning.ops: all-reduce, fused all-reduce + RMSNorm, the MoE conversions) builds
them and its reference; :func:`check_output` compares a candidate's output with it.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..problem import DTYPES, Problem
from . import ops as tuning_ops
from .ops.base import SEED

def check_output(out: Any, expected: torch.Tensor, mask: Optional[torch.Tensor], *, exact: bool) -> None:
    """Raise ValueError unless ``out`` matches ``expected`` (on the rows of ``mask``). NaN never
    passes; ``exact`` for pure copies, else a bf16-level tolerance (atol = rtol = 1e-2)."""
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"launcher returned {type(out).__name__}, not a tensor")
    if tuple(out.shape) != tuple(expected.shape) or out.dtype != expected.dtype:
        raise ValueError(f"output {tuple(out.shape)} {out.dtype} != expected {tuple(expected.shape)} {expected.dtype}")
    got, want = (out[mask], expected[mask]) if mask is not None else (out, expected)
    if got.numel() == 0:
        return
    if exact:
        bad = got.view(torch.int16 if got.element_size() == 2 else torch.int32) != \
            want.view(torch.int16 if want.element_size() == 2 else torch.int32)
        if bool(bad.any()):
            raise ValueError(f"wrong result: {int(bad.any(dim=-1).sum())} of {got.shape[0]} rows differ")
        return
    got32, want32 = got.float(), want.float()
    err = (got32 - want32).abs()
    tol = 1e-2 + 1e-2 * want32.abs()
    bad = ~(err <= tol)  # NaN compares False: never passes
    if bool(bad.any()):
        first = int(torch.nonzero(bad.reshape(-1))[0])
        got_v, want_v = got32.reshape(-1)[first].item(), want32.reshape(-1)[first].item()
        raise ValueError(f"wrong result: {int(bad.sum())} of {bad.numel()} elements off (first at flat index "
                         f"{first}: got {got_v}, expected {want_v})")


class ProblemData:
    """One problem's inputs and this rank's reference, on ``device``. ``allocate`` is local (may
    fail: out of memory); ``build_reference`` runs NCCL collectives on ``group``. The op's tuning
    module (``self.op``) fills ``val_input``, ``timing`` (``timing_residuals``), ``extra`` and
    ``expected`` (``mask``)."""

    def __init__(self, problem: Problem, group, device: torch.device, rank: int, n_inputs: int):
        self.problem, self.group, self.device, self.rank, self.n_inputs = problem, group, device, rank, n_inputs
        self.op = tuning_ops.get(problem.op)
        self.dtype = DTYPES[problem.dtype]
        self.expected: Optional[torch.Tensor] = None
        self.mask: Optional[torch.Tensor] = None
        self.exact = self.op.exact
        self.timing: list[torch.Tensor] = []
        self.timing_residuals: list[torch.Tensor] = []
        self.extra: tuple = ()

    def allocate(self) -> None:
        gen = torch.Generator(device=self.device).manual_seed(SEED * 1009 + self.rank)
        self.op.allocate(self, gen)
        self.refresh()

    def refresh(self) -> None:
        """Fresh random timing inputs (in-place all-reduces grow them call after call)."""
        for t in self.timing + self.timing_residuals:
            t.normal_()

    def build_reference(self) -> None:
        self.op.build_reference(self)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def validation_args(self) -> tuple:
        return self.op.validation_args(self)

    def result(self, out: Any, args: tuple) -> Any:
        """What is checked of a launcher's return value ``out`` for ``args`` (the fused op's
        updated residual stacked on its output; else ``out`` itself)."""
        return self.op.result(self, out, args)

    def timing_args(self) -> list[tuple]:
        return self.op.timing_args(self)
