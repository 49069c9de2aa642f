"""The signal-pad barrier (autosymm.kernels.barrier) under the Triton interpreter.

Ranks run one after another, so waits are satisfied by pre-set signals (tests/_all_reduce_sim).
"""

import pytest
import torch
import triton
import triton.language as tl

from autosymm.kernels.barrier import _barrier_kernel, barrier
from autosymm.symm import simulated_workspaces

from _all_reduce_sim import pads, preset, requires_interpreter, snapshot_workspace

pytestmark = requires_interpreter


@triton.jit
def _barriers_kernel(signal_ptrs, RANK: tl.constexpr, WORLD_SIZE: tl.constexpr, N_BARRIERS: tl.constexpr):
    for _ in tl.static_range(N_BARRIERS):
        barrier(signal_ptrs, tl.program_id(0), RANK, WORLD_SIZE)


def _run(ws, n_programs, n_barriers, channel="all_reduce"):
    _barriers_kernel[(n_programs,)](ws.signal_ptrs(channel), RANK=ws.rank, WORLD_SIZE=ws.world_size,
                                    N_BARRIERS=n_barriers)


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_signals_land_on_peer_slots_and_waits_consume_one(world_size):
    wss = simulated_workspaces(world_size, all_reduce_bytes=256, moe_bytes=256)
    n_programs, n_barriers = 3, 2
    # Rank 0 alone, with every peer's signals pre-set on its own pads.
    pads(wss[0].buffer)[:n_programs, 1:world_size] = n_barriers
    _run(wss[0], n_programs, n_barriers)
    assert pads(wss[0].buffer).sum() == 0, "each wait consumes exactly one signal per peer"
    for peer in range(1, world_size):
        got = pads(wss[peer].buffer)
        want = torch.zeros_like(got)
        want[:n_programs, 0] = n_barriers  # slot [program][sender=0]
        assert torch.equal(got, want)


@pytest.mark.parametrize("world_size", [2, 3, 8])
def test_every_signal_is_consumed_once_and_replays(world_size):
    wss = simulated_workspaces(world_size, all_reduce_bytes=256, moe_bytes=256)
    n_programs, n_barriers = 4, 3
    expected = preset([ws.buffer for ws in wss], n_programs, n_barriers)
    for _ in range(2):  # a second round needs no new preset: like a CUDA-graph replay
        for ws in wss:
            _run(ws, n_programs, n_barriers)
        for ws, want in zip(wss, expected):
            assert torch.equal(pads(ws.buffer), want)


def test_pads_back_to_zero_and_channels_independent():
    world_size, n_programs, n_barriers = 4, 2, 2
    wss = simulated_workspaces(world_size, all_reduce_bytes=256, moe_bytes=256)
    # Each rank's peers are snapshots: the rank waits for every peer's pre-set signals and its
    # own signals go to the copies, so its pads must end at zero.
    preset([ws.buffer for ws in wss], n_programs, n_barriers, channel="moe", all_peers=True)
    for rank in range(world_size):
        ws = snapshot_workspace(wss, rank)
        _run(ws, n_programs, n_barriers, channel="moe")
    for ws in wss:
        assert int(ws.buffer.count_nonzero()) == 0  # every pad of every channel is zero again


def test_world_size_one_is_a_no_op():
    (ws,) = simulated_workspaces(1, all_reduce_bytes=256, moe_bytes=256)
    _run(ws, 2, 3)
    _barrier_kernel[(1,)](ws.signal_ptrs("host"), RANK=0, WORLD_SIZE=1)
    assert int(ws.buffer.count_nonzero()) == 0


def test_barrier_kernel_of_the_module():
    wss = simulated_workspaces(2, all_reduce_bytes=256, moe_bytes=256)
    expected = preset([ws.buffer for ws in wss], 1, 1, channel="host")
    for ws in wss:
        _barrier_kernel[(1,)](ws.signal_ptrs("host"), RANK=ws.rank, WORLD_SIZE=2)
    for ws, want in zip(wss, expected):
        assert torch.equal(pads(ws.buffer, "host"), want)
