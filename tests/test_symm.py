"""The workspace layout of autosymm.symm: signal pointers, error slots, barrier health and reset."""

import pytest
import torch

from autosymm.geometry import (ERROR_SLOTS_OFFSET, MAX_WORLD_SIZE, N_SIGNAL_CHANNELS, SIGNAL_BYTES, SIGNAL_CHANNEL,
                               SIGNAL_SLOTS_PER_RANK, align)
from autosymm.geometry import DEFAULT_ALL_REDUCE_BYTES, DEFAULT_MOE_BYTES
from autosymm.symm import MAX_WORKSPACE_BYTES, Workspace, default_region_bytes, simulated_workspaces

from _all_reduce_sim import requires_interpreter


def _error_slots(ws) -> torch.Tensor:
    return ws.buffer[ERROR_SLOTS_OFFSET:ERROR_SLOTS_OFFSET + 4 * N_SIGNAL_CHANNELS].view(torch.int32)


def test_error_slots_follow_the_channels_inside_the_signal_region():
    assert ERROR_SLOTS_OFFSET == N_SIGNAL_CHANNELS * SIGNAL_SLOTS_PER_RANK * 4
    assert SIGNAL_BYTES == ERROR_SLOTS_OFFSET + 4 * N_SIGNAL_CHANNELS
    (ws,) = simulated_workspaces(1, all_reduce_bytes=256, moe_bytes=256)
    assert ws.regions["signal"].nbytes == align(SIGNAL_BYTES)
    assert ws.regions["all_reduce"].offset >= SIGNAL_BYTES


@pytest.mark.parametrize("world_size", [1, 2, 5])
def test_signal_ptrs_end_with_this_ranks_error_slot(world_size):
    wss = simulated_workspaces(world_size, all_reduce_bytes=256, moe_bytes=256)
    for ws in wss:
        for family, channel in SIGNAL_CHANNEL.items():
            ptrs = ws.signal_ptrs(family).tolist()
            assert len(ptrs) == world_size + 1
            assert ptrs[:world_size] == [b.data_ptr() + channel * SIGNAL_SLOTS_PER_RANK * 4 for b in ws.peer_buffers]
            assert ptrs[world_size] == ws.buffer.data_ptr() + ERROR_SLOTS_OFFSET + 4 * channel
            shifted = ws.signal_ptrs(family, 1).tolist()  # one program further, same error slot
            assert shifted == [p + MAX_WORLD_SIZE * 4 for p in ptrs[:world_size]] + [ptrs[world_size]]
            assert ws.signal_ptrs(family) is ws.signal_ptrs(family)  # made once: no host copy per call
    with pytest.raises(ValueError, match="program"):
        wss[0].signal_ptrs("moe_end", 256)


def test_barrier_errors_read_the_error_slots():
    ws, peer = simulated_workspaces(2, all_reduce_bytes=256, moe_bytes=256)
    assert ws.barrier_errors() == 0
    _error_slots(ws)[SIGNAL_CHANNEL["moe_end"]] = 2
    _error_slots(ws)[SIGNAL_CHANNEL["all_reduce"]] = 1
    assert ws.barrier_error_counts() == {"all_reduce": 1, "moe": 0, "moe_end": 2, "host": 0}
    assert ws.barrier_errors() == 3
    assert peer.barrier_errors() == 0  # each rank has its own


def test_reset_signals_zeroes_this_ranks_signal_region_only():
    ws, peer = simulated_workspaces(2, all_reduce_bytes=1024, moe_bytes=1024)
    for w in (ws, peer):
        w.buffer.fill_(7)
    ws.reset_signals()
    assert int(ws.buffer[:SIGNAL_BYTES].count_nonzero()) == 0 and ws.barrier_errors() == 0
    assert bool((ws.buffer[SIGNAL_BYTES:] == 7).all()), "data regions are left alone"
    assert bool((peer.buffer == 7).all()), "a peer's pads are its own to reset"


def test_reset_signals_lines_the_ranks_up_around_the_zeroing(monkeypatch):
    (ws,) = simulated_workspaces(1, all_reduce_bytes=256, moe_bytes=256)
    ws.buffer[:SIGNAL_BYTES] = 1
    log = []
    monkeypatch.setattr(ws, "_synchronize", lambda: log.append("sync"))
    monkeypatch.setattr(Workspace, "_host_barrier",
                        staticmethod(lambda group: log.append(("barrier", group, int(ws.buffer[:SIGNAL_BYTES].sum())))))
    ws.reset_signals(group="control")
    # sync -> barrier (pads still as the kernels left them) -> zero -> sync -> barrier (zero)
    assert log == ["sync", ("barrier", "control", SIGNAL_BYTES), "sync", ("barrier", "control", 0)]


def test_reset_signals_joins_both_barriers_when_a_local_step_fails(monkeypatch):
    (ws,) = simulated_workspaces(1, all_reduce_bytes=256, moe_bytes=256)
    barriers = []

    def broken_sync():
        raise RuntimeError("device lost")

    monkeypatch.setattr(ws, "_synchronize", broken_sync)
    monkeypatch.setattr(Workspace, "_host_barrier", staticmethod(lambda group: barriers.append(group)))
    with pytest.raises(RuntimeError, match="device lost"):
        ws.reset_signals(group="g")
    assert barriers == ["g", "g"], "a peer must never be left waiting in the barrier"


@requires_interpreter
def test_device_barrier_is_a_no_op_for_one_rank_and_consumes_signals_otherwise():
    (solo,) = simulated_workspaces(1, all_reduce_bytes=256, moe_bytes=256)
    solo.device_barrier()
    assert int(solo.buffer.count_nonzero()) == 0
    ws, peer = simulated_workspaces(2, all_reduce_bytes=256, moe_bytes=256)
    start = SIGNAL_CHANNEL["host"] * SIGNAL_SLOTS_PER_RANK
    ws.buffer[:SIGNAL_BYTES].view(torch.int32)[start + 1] = 1  # the peer's signal, pre-set
    ws.device_barrier()
    assert ws.barrier_errors() == 0 and int(ws.buffer[:SIGNAL_BYTES].count_nonzero()) == 0
    assert int(peer.buffer[:SIGNAL_BYTES].view(torch.int32)[start]) == 1  # our signal reached the peer


# ------------------------------------------------------------------------ AUTOSYMM_WORKSPACE_BYTES


@pytest.mark.parametrize("text, expected", [
    ("2GiB", (1 << 30, 1 << 30)),
    ("512MiB", (256 << 20, 256 << 20)),
    ("1073741824", (512 << 20, 512 << 20)),
    (" 64GiB ", (32 << 30, 32 << 30)),  # MAX_WORKSPACE_BYTES itself
    ("", (DEFAULT_ALL_REDUCE_BYTES, DEFAULT_MOE_BYTES)),
    (None, (DEFAULT_ALL_REDUCE_BYTES, DEFAULT_MOE_BYTES)),
])
def test_workspace_bytes_from_the_environment(monkeypatch, text, expected):
    if text is None:
        monkeypatch.delenv("AUTOSYMM_WORKSPACE_BYTES", raising=False)
    else:
        monkeypatch.setenv("AUTOSYMM_WORKSPACE_BYTES", text)
    assert default_region_bytes() == expected


@pytest.mark.parametrize("text", ["1e20", "65GiB", "-1GiB", "-5", "abc", "2XB", "nan", "inf", "100", "1.2.3"])
def test_bad_workspace_bytes_name_the_variable_and_value(monkeypatch, text):
    monkeypatch.setenv("AUTOSYMM_WORKSPACE_BYTES", text)
    with pytest.raises(ValueError) as info:
        default_region_bytes()
    assert f"AUTOSYMM_WORKSPACE_BYTES={text!r}" in str(info.value) and "64GiB" in str(info.value)
    assert MAX_WORKSPACE_BYTES == 64 << 30
