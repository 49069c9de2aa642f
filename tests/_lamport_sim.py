"""Run the Lamport one-shot all-reduce (backend ``triton_lamport``) on ranks simulated one after
another (interpreter), through its launcher.

A rank's reads would wait for pushes of ranks that have not run yet, so every call runs phase 1
(the pushes) on every rank first, then phase 2 (re-arm, reads, rotation) on each.
"""

from __future__ import annotations

import torch

from autosymm.backends import get_backend
from autosymm.backends.base import RunContext
from autosymm.configs import AllReduceConfig
from autosymm.problem import Problem, dtype_name
from autosymm.workspace.symm import simulated_workspaces

#: The value around each x: a write past its end shows.
SENTINEL = 12345.0


def workspaces(world_size: int):
    return simulated_workspaces(world_size, all_reduce_bytes=1 << 12, moe_bytes=1 << 12, double_buffer_bytes=0)


def launchers(wss, dtype: torch.dtype, numel: int, block: int = 256, programs: int = 2, warps: int = 2):
    """Every rank's launcher of one Lamport config for calls of ``numel`` elements."""
    problem = Problem.all_reduce(numel * torch.tensor([], dtype=dtype).element_size(), dtype_name(dtype), len(wss))
    config = AllReduceConfig("lamport", block, programs, warps)
    return [get_backend("triton_lamport").prepare(problem, config, RunContext(workspace=ws)) for ws in wss]


def run_call(launch_of, inputs, *, dead=()):
    """One call on every simulated rank (pushes first, then each reader); ranks in ``dead`` never
    launch. Returns each rank's x, inside a sentinel-filled backing (a write past its end shows)."""
    xs, backings = [], []
    for t in inputs:
        backing = torch.full((t.numel() + 64,), SENTINEL, dtype=t.dtype)
        backing[:t.numel()] = t
        xs.append(backing[:t.numel()])
        backings.append(backing)
    live = [r for r in range(len(inputs)) if r not in dead]
    for r in live:
        launch_of[r](xs[r], phase=1)
    for r in live:
        launch_of[r](xs[r], phase=2)
    for backing, t in zip(backings, inputs):
        assert bool((backing[t.numel():] == SENTINEL).all()), "a write past the end of x"
    return xs
