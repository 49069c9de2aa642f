"""Backend ``noop``: a call with nothing to exchange (the dispatcher's rules: an empty tensor, no
rows, or a one-rank group where the op's spec says a rank alone already holds the result). It runs
no collective; its launcher is the op's own, named by its spec's ``local`` entry
(autosymm.spec.OpSpec): the identity for an all-reduce, one copy for a reduce-scatter or an
all-gather (the shard is the whole tensor), the fused op's epilogue on ``x`` itself
(autosymm.epilogue.local_launcher)."""

from __future__ import annotations

from typing import Optional

import torch

from ..entries import load
from ..epilogue import DEFAULT, NATIVE_CHAIN, SINGLE_ROUNDING
from ..problem import Problem
from .base import Backend, Capabilities, Needs, RunContext


class Local(Backend):
    """Serves every call the dispatcher finds nothing to exchange for; never a tuned candidate."""

    name = "noop"
    batch_invariant = True  # a rank alone computes the op's formula on its own data
    needs = Needs(dtypes=None)

    def why_not(self, problem: Problem, caps: Capabilities, mode: str = "eager") -> Optional[str]:
        record = problem.record
        if not record.local:
            return f"{problem.op} always exchanges"
        alone = problem.world_size == 1 and (record.one_rank_reason(False) or record.one_rank_reason(True))
        if not record.empty_reason(problem) and not alone:
            return "the call exchanges data (noop serves only calls with nothing to exchange)"
        return None

    def formula(self, problem: Problem) -> str:
        """The op's, except the fused op's default epilogue: the native chain, as the NCCL
        fallback computes it (autosymm.epilogue.local_launcher)."""
        fused_default = problem.record.formula == SINGLE_ROUNDING and (problem.epilogue or DEFAULT) == DEFAULT
        return NATIVE_CHAIN if fused_default else problem.record.formula

    def prepare(self, problem: Problem, config: None, ctx: RunContext):
        return load(problem.record.local)(problem)


def identity(problem: Problem):
    """An all-reduce over one rank, or of an empty tensor: the tensor itself."""
    return _identity


def _identity(x: torch.Tensor, *args) -> torch.Tensor:
    return x


def copy_shard(problem: Problem):
    """A reduce-scatter or all-gather with nothing to exchange: ``output`` takes ``input`` (one
    copy; none where they are one tensor)."""
    return _copy_shard


def _copy_shard(output: torch.Tensor, input: torch.Tensor, counts=None) -> torch.Tensor:
    if output.numel() and output.data_ptr() != input.data_ptr():
        output.view(-1).copy_(input.reshape(-1))
    return output


noop = Local()
BACKENDS = (noop,)
