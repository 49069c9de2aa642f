"""Run a Triton all-reduce or fused launcher on every simulated rank (interpreter) through the
backend's own ``prepare``, whatever its algorithm: the batch-invariance tests call the same
config on calls of different sizes and compare the bits.

Ranks run one after another (tests/_all_reduce_sim): each rank's stage is pre-filled with what
its copy-in (pull) or its peers' pushes (push) put there, the signals later ranks (or, against
snapshots, all peers) would send are pre-set, and the two-shots run phase by phase.
"""

from __future__ import annotations

import torch

from autosymm.backends.base import RunContext
from autosymm.backends.triton_all_reduce import triton_one_shot, triton_one_shot_push, triton_two_shot
from autosymm.backends.triton_fused import ALGORITHMS as FUSED_ALGORITHMS
from autosymm.backends.triton_fused import triton_fused_one_shot, triton_fused_one_shot_push, triton_fused_two_shot
from autosymm.geometry import ALL_REDUCE_REGION, DOUBLE_BUFFER_REGION, align, stage_offset
from autosymm.problem import Problem, dtype_name
from autosymm.workspace.symm import simulated_workspaces

from _all_reduce_sim import pads, snapshot_workspace

ALL_REDUCE_BACKENDS = {"one_shot": triton_one_shot, "one_shot_push": triton_one_shot_push,
                       "two_shot": triton_two_shot}
FUSED_BACKENDS = {"one_shot": triton_fused_one_shot, "one_shot_push": triton_fused_one_shot_push,
                  "two_shot": triton_fused_two_shot}


def workspaces(world_size: int, region_bytes: int, half_bytes: int):
    return simulated_workspaces(world_size, all_reduce_bytes=region_bytes, moe_bytes=256,
                                double_buffer_bytes=half_bytes)


def _region_view(ws, offset: int, values: torch.Tensor) -> None:
    """``values`` (flattened) written at ``offset`` bytes from ``ws``'s all-reduce region (the
    double buffer lies beyond it, at the offset the launchers pass)."""
    start = ws.regions[ALL_REDUCE_REGION].offset + offset
    ws.buffer[start:start + values.numel() * values.element_size()].view(values.dtype).copy_(values.reshape(-1))


def _double_offset(ws) -> int:
    return ws.regions[DOUBLE_BUFFER_REGION].offset - ws.regions[ALL_REDUCE_REGION].offset


def _preset_per_program(wss, counts: list[int], *, all_peers: bool) -> None:
    """Signals program p of every peer (``all_peers``) or of every later rank sends: ``counts[p]``."""
    world_size = len(wss)
    for rank, ws in enumerate(wss):
        view = pads(ws.buffer)
        senders = [q for q in range(world_size) if q != rank] if all_peers else list(range(rank + 1, world_size))
        for program, count in enumerate(counts):
            view[program, senders] += count


def _chunks_of(program: int, n_chunks: int, n_programs: int) -> int:
    return len(range(program, n_chunks, n_programs))


def run_all_reduce(algorithm: str, config, inputs: list[torch.Tensor], *, zero_copy: bool = False,
                   region_bytes: int = 1 << 20, half_bytes: int = 1 << 15) -> list[torch.Tensor]:
    """Every rank's result of ``launcher(x)`` for ``inputs`` (one 1-D tensor per rank) with the
    ``algorithm``'s backend and ``config``; ``zero_copy``: x allocated with ``Workspace.empty``."""
    world_size, numel, dtype = len(inputs), inputs[0].numel(), inputs[0].dtype
    nbytes = numel * inputs[0].element_size()
    wss = workspaces(world_size, region_bytes, half_bytes)
    problem = Problem.all_reduce(nbytes, dtype_name(dtype), world_size)
    xs = [ws.empty((numel,), dtype).copy_(v) if zero_copy else v.clone() for ws, v in zip(wss, inputs)]
    n_chunks = -(-numel // config.block_size)
    counts = [_chunks_of(p, n_chunks, config.num_blocks) for p in range(config.num_blocks)]
    double = config.double_buffer and not zero_copy
    if algorithm == "two_shot":
        _preset_per_program(wss, [2 if zero_copy else 3] * config.num_blocks, all_peers=False)
        launchers = [triton_two_shot.prepare(problem, config, RunContext(workspace=ws)) for ws in wss]
        for phase in (1, 2, 3):
            for launcher, x in zip(launchers, xs):
                launcher.run(x, phase=phase)
        return xs
    if algorithm == "one_shot_push":
        slot = align(nbytes)
        double = double and (world_size - 1) * slot <= half_bytes
        base = _double_offset(wss[0]) if double else wss[0].capacity(ALL_REDUCE_REGION) - (world_size - 1) * slot
        for ws in wss:  # what every peer pushes into this rank's slots
            for q in range(world_size):
                if q != ws.rank:
                    _region_view(ws, base + (q - ws.rank - 1) % world_size * slot, inputs[q])
        _preset_per_program(wss, [c + (0 if double else 1) for c in counts], all_peers=True)
    elif zero_copy:  # one barrier, then one per chunk before its sum is stored
        _preset_per_program(wss, [1 + c for c in counts], all_peers=True)
    else:
        double = double and nbytes <= half_bytes
        base = _double_offset(wss[0]) if double else stage_offset(wss[0].capacity(ALL_REDUCE_REGION), nbytes)
        for ws, values in zip(wss, inputs):  # the copy-in of every rank, ahead of its turn
            _region_view(ws, base, values)
        _preset_per_program(wss, [1 if double else 2] * config.num_blocks, all_peers=False)
    ranks = [snapshot_workspace(wss, r) for r in range(world_size)] if (zero_copy or algorithm != "one_shot") else wss
    for ws, x in zip(ranks, xs):
        ALL_REDUCE_BACKENDS[algorithm].prepare(problem, config, RunContext(workspace=ws))(x)
    return xs


def run_fused(config, xs: list[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
              region_bytes: int = 1 << 21, half_bytes: int = 1 << 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every rank's (residual, out) of the fused launcher of ``config`` for ``xs`` ([tokens, hidden]
    per rank) and a replicated ``residual`` and ``weight``."""
    world_size, (n_rows, hidden), dtype = len(xs), xs[0].shape, xs[0].dtype
    nbytes = xs[0].numel() * xs[0].element_size()
    wss = workspaces(world_size, region_bytes, half_bytes)
    problem = Problem.all_reduce_rmsnorm(n_rows, hidden, dtype_name(dtype), world_size)
    backend = FUSED_BACKENDS[config.algorithm]
    need = FUSED_ALGORITHMS[config.algorithm].stage_bytes(nbytes, world_size)
    double = config.double_buffer and need <= half_bytes
    base = _double_offset(wss[0]) if double else wss[0].capacity(ALL_REDUCE_REGION) - need
    residuals = [residual.clone() for _ in range(world_size)]
    if config.algorithm == "two_shot":
        _preset_per_program(wss, [3] * config.num_blocks, all_peers=False)
        launchers = [backend.prepare(problem, config, RunContext(workspace=ws)) for ws in wss]
        outs = [torch.empty_like(x) for x in xs]
        for phase in (1, 2, 3):
            for launcher, x, res, out in zip(launchers, xs, residuals, outs):
                launcher(x, res, weight, eps, phase=phase, out=out)
        return list(zip(residuals, outs))
    push = config.algorithm == "one_shot_push"
    for ws in wss:
        if push:  # what every peer pushes into this rank's slots
            for q in range(world_size):
                if q != ws.rank:
                    _region_view(ws, base + (q - ws.rank - 1) % world_size * align(nbytes), xs[q])
        else:  # every rank's copy-in, ahead of its turn
            _region_view(ws, base, xs[ws.rank])
    _preset_per_program(wss, [1 if double else 2] * config.num_blocks, all_peers=push)
    ranks = [snapshot_workspace(wss, r) for r in range(world_size)] if push else wss
    outs = [backend.prepare(problem, config, RunContext(workspace=ws))(x, res, weight, eps)
            for ws, x, res in zip(ranks, xs, residuals)]
    return list(zip(residuals, outs))
