"""What the tuner needs of an op beyond its spec (autosymm.spec.OpSpec): the inputs of a tuning
problem, this rank's reference output, how a launcher is called for validation and timing, and
the workspace the sweep needs (:class:`TuningOp`). autosymm.tuning.reference.ProblemData holds
the tensors and delegates here; one module per op, registered in autosymm.tuning.ops."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ...spec import OpSpec
from ...problem import Problem

SEED = 1234


def quarters(shape: tuple, gen: torch.Generator, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Random multiples of 1/4 in [-2, 2]: sums of a few of them are exact in every float dtype."""
    return torch.randint(-8, 9, shape, generator=gen, device=device, dtype=torch.int8).to(dtype).mul_(0.25)


class TuningOp:
    """The tuning side of one op (``record``: its autosymm.spec.OpSpec); ``exact``: its
    validation compares bits (copies)."""

    exact = False

    def __init__(self, record: OpSpec) -> None:
        self.record = record
        self.name = record.name

    def allocate(self, data, gen: torch.Generator) -> None:
        """Set ``data``'s validation input, timing inputs and extra arguments (local: no collective)."""
        raise NotImplementedError(self.name)

    def build_reference(self, data) -> None:
        """Set ``data.expected`` (and ``data.mask``) for this rank (collectives on ``data.group``)."""
        raise NotImplementedError(self.name)

    def validation_args(self, data) -> tuple:
        return (data.val_input, *data.extra)

    def result(self, data, out: Any, args: tuple) -> Any:
        """What is checked of a launcher's return value ``out`` for ``args``."""
        return out

    def timing_args(self, data) -> list[tuple]:
        return [(t, *data.extra) for t in data.timing]

    def callable(self, data, launcher: Any) -> Any:
        """What validation and timing call with their positional arguments: ``launcher`` itself,
        or an op's adapter of it (the fused op's epilogues pass ``scale`` by keyword)."""
        return launcher

    def public_call(self, data) -> Optional[Callable]:
        """What a user calls for this op: its public function (through the dispatcher), taking
        the launcher's positional arguments (:meth:`validation_args`, :meth:`timing_args`) and
        returning what the launcher returns; None where the op has none (`autosymm bench
        --regret` captures it as a user's CUDA graph would)."""
        return None

    def workspace_bytes(self, problem: Problem) -> tuple[int, int]:
        """(all-reduce, MoE) region bytes ``problem`` needs (0: none of that region)."""
        raise NotImplementedError(self.name)

    def __repr__(self) -> str:
        return f"TuningOp({self.name})"
