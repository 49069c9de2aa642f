"""Helpers to run the all-reduce kernels on ranks simulated one after another (interpreter).

The Triton interpreter runs one rank's launch to completion before the next starts, so a
barrier wait of rank r would spin forever on a signal that a later rank sends. ``preset``
gives each rank, up front, the signals its *later* peers will send (``n_barriers`` per program
and peer p > r): every wait then finds a signal, and once all ranks ran, each slot again holds
exactly its preset value (every signal sent was consumed once).
"""

from __future__ import annotations

import os

import pytest
import torch

from autosymm.geometry import (ALL_REDUCE_ARRIVAL_SLOT, ALL_REDUCE_EPOCH_SLOT, DOUBLE_BUFFER_REGION, MAX_PROGRAMS,
                               MAX_WORLD_SIZE, SIGNAL_CHANNEL, SIGNAL_SLOTS_PER_RANK)
from autosymm.workspace.symm import Workspace

requires_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
    reason="runs kernels under the Triton interpreter (TRITON_INTERPRET=1; tests/conftest.py sets it unless the session is only tests/gpu)",
)

TOLERANCE = {torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3), torch.float32: (1e-5, 1e-5)}


def pads(buffer: torch.Tensor, channel: str = "all_reduce") -> torch.Tensor:
    """int32 view [MAX_PROGRAMS, MAX_WORLD_SIZE] of a workspace buffer's signal channel."""
    start = SIGNAL_CHANNEL[channel] * SIGNAL_SLOTS_PER_RANK * 4
    raw = buffer[start:start + SIGNAL_SLOTS_PER_RANK * 4]
    return raw.view(torch.int32).view(MAX_PROGRAMS, MAX_WORLD_SIZE)


def preset(buffers, n_programs: int, n_barriers: int, channel: str = "all_reduce", *,
           all_peers: bool = False) -> list[torch.Tensor]:
    """Pre-set the signals later ranks will send; returns each rank's expected final pads.

    ``all_peers``: pre-set every peer's signals (ranks whose peers are snapshots, whose own
    signals land in the copies); the pads then end at zero.
    """
    world_size = len(buffers)
    expected = []
    for rank, buffer in enumerate(buffers):
        view = pads(buffer, channel)
        senders = [p for p in range(world_size) if p != rank] if all_peers else list(range(rank + 1, world_size))
        expected.append(view.clone())
        view[:n_programs, senders] += n_barriers
        if not all_peers:
            expected[-1] = view.clone()
    return expected


def epoch(ws) -> int:
    """Rank ``ws.rank``'s double-buffer epoch (its self slot of the 'all_reduce' channel)."""
    return int(pads(ws.buffer)[ALL_REDUCE_EPOCH_SLOT, ws.rank])


def arrivals(ws) -> int:
    """Rank ``ws.rank``'s double-buffer arrival counter (0 whenever no kernel runs)."""
    return int(pads(ws.buffer)[ALL_REDUCE_ARRIVAL_SLOT, ws.rank])


def half_view(ws, parity: int, numel: int, dtype: torch.dtype, rank=None) -> torch.Tensor:
    """The first ``numel`` elements of half ``parity`` of a rank's double-buffer region (where
    the double-buffered one-shot stages), of ``ws``'s own rank unless ``rank`` is given."""
    return ws.peer_view(ws.rank if rank is None else rank, DOUBLE_BUFFER_REGION, (numel,), dtype,
                        parity * ws.double_buffer_half_bytes)


def half_bytes(ws, parity: int) -> torch.Tensor:
    """The raw bytes of half ``parity`` of ``ws``'s double-buffer region."""
    region = ws.regions[DOUBLE_BUFFER_REGION]
    start = region.offset + parity * ws.double_buffer_half_bytes
    return ws.buffer[start:start + ws.double_buffer_half_bytes]


def tiny_poll_limit(monkeypatch, polls: int = 3) -> None:
    """Make every barrier wait give up after ``polls`` empty polls (the interpreter reads the
    module attribute when a kernel runs; compiled kernels would need a recompile)."""
    import triton.language as tl

    import autosymm.kernels.barrier as barrier_module

    monkeypatch.setattr(barrier_module, "MAX_POLLS", tl.constexpr(polls))


def error_counts(ws) -> dict:
    """{channel: waits that gave up} of a simulated workspace (its error slots)."""
    return ws.barrier_error_counts()


def random_inputs(world_size: int, numel: int, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=gen, dtype=torch.float32).to(dtype) for _ in range(world_size)]


def reference_sum(inputs) -> torch.Tensor:
    return torch.stack([t.double() for t in inputs]).sum(0)


def assert_close_to_sum(result: torch.Tensor, inputs, dtype: torch.dtype) -> None:
    rtol, atol = TOLERANCE[dtype]
    assert not torch.isnan(result).any(), "an element was never written (NaN poison survived)"
    torch.testing.assert_close(result.double(), reference_sum(inputs), rtol=rtol, atol=atol * len(inputs))


def snapshot_workspace(workspaces, rank: int) -> Workspace:
    """Rank ``rank``'s workspace whose peers are *copies* of the peers' buffers taken now.

    For the in-place (zero-copy) one-shot, where rank r overwrites its input after the barrier
    that, on GPUs, only passes once every peer has read it: ranks run one after another here, so
    each rank reads its peers' inputs from the snapshot and signals into the copies.
    """
    ws = workspaces[rank]
    peers = [ws.buffer if p == rank else workspaces[p].buffer.clone() for p in range(ws.world_size)]
    return Workspace(rank, peers, ws.layout)


def poisoned_workspaces(world_size: int, region_bytes: int, half_bytes: int) -> list[Workspace]:
    """Simulated workspaces whose all-reduce region and double buffer are NaN-filled (0xFF bytes
    are NaN in every float dtype): a read of anything nobody wrote shows up as NaN."""
    from autosymm.workspace.symm import simulated_workspaces

    wss = simulated_workspaces(world_size, all_reduce_bytes=region_bytes, moe_bytes=256, double_buffer_bytes=half_bytes)
    for ws in wss:
        for name in ("all_reduce", DOUBLE_BUFFER_REGION):
            region = ws.regions[name]
            ws.buffer[region.offset:region.offset + region.nbytes] = 0xFF
    return wss
