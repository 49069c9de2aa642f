"""The signal-pad barrier (autosymm.kernels.barrier) under the Triton interpreter.

Ranks run one after another, so waits are satisfied by pre-set signals (tests/_all_reduce_sim);
the bounded-wait tests leave them unset and shrink the poll limit.
"""

import pytest
import torch
import triton
import triton.language as tl

from autosymm.kernels.barrier import _barrier_kernel, barrier
from autosymm.geometry import SIGNAL_BYTES
from autosymm.workspace.symm import simulated_workspaces

from _all_reduce_sim import error_counts, pads, preset, requires_interpreter, snapshot_workspace, tiny_poll_limit

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


# -- bounded waits ------------------------------------------------------------------------------

@pytest.fixture
def tiny_polls(monkeypatch):
    tiny_poll_limit(monkeypatch, 3)


def test_a_wait_with_no_signal_gives_up_and_records_one_error(tiny_polls):
    wss = simulated_workspaces(2, all_reduce_bytes=256, moe_bytes=256)
    _barrier_kernel[(1,)](wss[0].signal_ptrs("host"), RANK=0, WORLD_SIZE=2)  # rank 1 never runs
    assert error_counts(wss[0]) == {"all_reduce": 0, "moe": 0, "moe_end": 0, "host": 1}
    assert wss[0].barrier_errors() == 1
    assert int(pads(wss[0].buffer, "host").count_nonzero()) == 0, "the empty slot is left alone (no decrement)"
    want = torch.zeros_like(pads(wss[1].buffer, "host"))
    want[0, 0] = 1  # the signal to the peer was still sent
    assert torch.equal(pads(wss[1].buffer, "host"), want)
    assert wss[1].barrier_errors() == 0


def test_only_the_missing_peer_counts(tiny_polls):
    world_size, n_programs = 4, 3
    wss = simulated_workspaces(world_size, all_reduce_bytes=256, moe_bytes=256)
    pads(wss[0].buffer)[:n_programs, 1:3] = 1  # peers 1 and 2 signalled, peer 3 never does
    _run(wss[0], n_programs, 1)
    assert error_counts(wss[0])["all_reduce"] == n_programs  # one wait per program gave up
    assert int(pads(wss[0].buffer).count_nonzero()) == 0  # the signals that came were consumed


def test_signalled_barriers_record_no_error(tiny_polls):
    wss = simulated_workspaces(3, all_reduce_bytes=256, moe_bytes=256)
    expected = preset([ws.buffer for ws in wss], 2, 2)
    for ws in wss:
        _run(ws, 2, 2)
    for ws, want in zip(wss, expected):
        assert torch.equal(pads(ws.buffer), want)
        assert ws.barrier_errors() == 0


def test_after_a_timeout_waits_fail_fast(monkeypatch):
    import time

    wss = simulated_workspaces(2, all_reduce_bytes=256, moe_bytes=256)
    ptrs = wss[0].signal_ptrs("host")
    tiny_poll_limit(monkeypatch, 3)
    _barrier_kernel[(1,)](ptrs, RANK=0, WORLD_SIZE=2)
    tiny_poll_limit(monkeypatch, 5000)  # ~2 s of interpreted polls, were they made
    start = time.perf_counter()
    for _ in range(3):
        _barrier_kernel[(1,)](ptrs, RANK=0, WORLD_SIZE=2)
    assert time.perf_counter() - start < 1.0, "a channel that timed out must not spin again"
    assert wss[0].barrier_errors() == 4
    # A signal that is there is still consumed (the hot path never looks at the error slot).
    pads(wss[0].buffer, "host")[0, 1] = 1
    _barrier_kernel[(1,)](ptrs, RANK=0, WORLD_SIZE=2)
    assert wss[0].barrier_errors() == 4 and int(pads(wss[0].buffer, "host")[0, 1]) == 0
    wss[0].reset_signals()
    assert wss[0].barrier_errors() == 0 and int(wss[0].buffer[:SIGNAL_BYTES].count_nonzero()) == 0
