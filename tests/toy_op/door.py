"""The toy op's front door: ``toy_sum(x, group=None)`` sums a [rows, width] tensor over the group
in place, checked, decided and prepared on its first call like every autosymm call
(autosymm.runtime.entry.prepare_call), then one cache lookup per call."""

from __future__ import annotations

import torch

from autosymm.problem import any_dtype_name
from autosymm.runtime.entry import Door, prepare_call
from autosymm.runtime.group import STATES, check_tensor, state_of, stream_capturing
from autosymm.spec import call_key

from .spec import TOY, Width


class ToyDoor(Door):
    def call_text(self, key, args: tuple, mode: str) -> str:
        x, = args
        return f"toy of {x.dtype} {tuple(x.shape)} in {mode} mode"

    def check_tensors(self, state, args: tuple, mode: str) -> None:
        x, = args
        check_tensor(x, state, self.name, "x")
        if x.dim() != 2 or x.shape[1] < 1:
            raise ValueError(f"autosymm.toy: x must be [rows, width >= 1], got shape {tuple(x.shape)}")

    def problem(self, state, key, args: tuple, mode: str):
        x, = args
        return TOY.problem_at(any_dtype_name(x.dtype), state.world_size, x.shape[0], Width(x.shape[1]))

    def custom_ops(self) -> tuple:
        return ()


DOOR = ToyDoor(TOY, arg_names=("x",))


def toy_sum(x: torch.Tensor, group=None) -> torch.Tensor:
    """``x`` [rows, width] summed over ``group`` in place; returns ``x``."""
    state = STATES.get(group) or state_of(group)
    key = call_key(TOY, x.dtype, tuple(x.shape), x.device, stream_capturing())
    entry = state.cache.get(key)
    if entry is None:
        entry = prepare_call(state, DOOR, key, (x,))
    entry.calls += 1
    return entry.launcher(x)
