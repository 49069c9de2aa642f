"""The workspace layout of autosymm.workspace.symm: signal pointers, error slots, barrier health and reset."""

import pytest
import torch

from autosymm.geometry import (ERROR_SLOTS_OFFSET, FUSED_COUNTS_OFFSET, FUSED_PARTIALS_OFFSET, FUSED_SPLIT_MAX,
                               FUSED_SPLIT_MAX_ROWS, MAX_WORLD_SIZE, N_SIGNAL_CHANNELS, SIGNAL_BYTES, SIGNAL_CHANNEL,
                               SIGNAL_SLOTS_PER_RANK, align, moe_buffer)
from autosymm.geometry import DEFAULT_ALL_REDUCE_BYTES, DEFAULT_MOE_BYTES, LAMPORT_REGION
from autosymm.settings import MAX_WORKSPACE_BYTES, default_region_bytes
from autosymm.workspace.symm import Workspace, simulated_workspaces

from _all_reduce_sim import requires_interpreter


def _error_slots(ws) -> torch.Tensor:
    return ws.buffer[ERROR_SLOTS_OFFSET:ERROR_SLOTS_OFFSET + 4 * N_SIGNAL_CHANNELS].view(torch.int32)


def test_error_slots_follow_the_channels_inside_the_signal_region():
    assert ERROR_SLOTS_OFFSET == N_SIGNAL_CHANNELS * SIGNAL_SLOTS_PER_RANK * 4
    # then the split-row fused kernels' counters and partial sums (autosymm.geometry)
    assert ERROR_SLOTS_OFFSET + 4 * N_SIGNAL_CHANNELS <= FUSED_COUNTS_OFFSET and FUSED_COUNTS_OFFSET % 16 == 0
    assert FUSED_PARTIALS_OFFSET == FUSED_COUNTS_OFFSET + 4 * FUSED_SPLIT_MAX_ROWS
    assert SIGNAL_BYTES == FUSED_PARTIALS_OFFSET + 4 * FUSED_SPLIT_MAX_ROWS * FUSED_SPLIT_MAX
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


def test_reset_signals_zeroes_this_ranks_signal_region_and_lamport_buffers_only():
    ws, peer = simulated_workspaces(2, all_reduce_bytes=1024, moe_bytes=1024)
    for w in (ws, peer):
        w.buffer.fill_(7)
    ws.reset_signals()
    assert int(ws.buffer[:SIGNAL_BYTES].count_nonzero()) == 0 and ws.barrier_errors() == 0
    lamport = ws.regions[LAMPORT_REGION]
    assert int(ws.buffer[lamport.offset:lamport.offset + lamport.nbytes].count_nonzero()) == 0, "re-armed"
    assert bool((ws.buffer[SIGNAL_BYTES:lamport.offset] == 7).all()), "data regions are left alone"
    assert bool((ws.buffer[lamport.offset + lamport.nbytes:] == 7).all())
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

# -- the MoE region moved to a larger allocation (autosymm.runtime.moe_room's growth) ---------------------

def test_move_region_readdresses_the_region_and_keeps_everything_made_before():
    wss = simulated_workspaces(2, all_reduce_bytes=1024, moe_bytes=1024)
    ws = wss[0]
    kept = ws.empty((16,), torch.float32)
    kept.fill_(3)
    old_view = ws.local_view("moe", (4,), torch.float32)
    old_view.fill_(5)
    new = [torch.zeros(5000, dtype=torch.uint8) for _ in wss]
    for w in wss:
        w.move_region("moe", new)
    assert ws.capacity("moe") == 5000 // 256 * 256 and ws.capacity("all_reduce") == 1024
    assert ws.region_ptrs("moe").tolist() == [b.data_ptr() for b in new]
    for op in ("dp_to_ep", "ep_to_dp"):  # both buffers' address tables made at the move, not inside a capture
        offset = moe_buffer(op, ws.capacity("moe"), 2)[0]
        assert ("at", new[0].data_ptr() + offset) in ws._ptr_cache
    assert ws.peer_view(1, "moe", (2,), torch.float32).data_ptr() == new[1].data_ptr()
    assert ws.offset_in_region(ws.local_view("moe", (8,), torch.float32, 256), "moe") == 256
    assert ws.offset_in_region(old_view, "moe") is None
    assert bool((old_view == 5).all()) and bool((kept == 3).all()) and ws.offset_in_region(kept) == 0
    with pytest.raises(ValueError, match="1 buffers for world size 2"):
        ws.move_region("moe", new[:1])


@requires_interpreter
def test_a_moe_conversion_prepared_after_the_move_writes_the_new_region():
    from autosymm.backends.base import RunContext
    from autosymm.backends.triton_moe import TRITON_MOE, buffer_bytes
    from autosymm.configs import MoEConfig
    from autosymm.problem import MoEShape, Problem
    from autosymm.routing import make_expt_assignment, make_expt_dict_random, random_expt_indx, route
    from _moe_ref import reference_dp_to_ep

    from _moe_sim import check_and_clear, presatisfy

    world_size, n_tokens_local, shape = 2, 24, MoEShape(40, 6, 3)
    problem = Problem.moe("dp_to_ep", shape, n_tokens_local, "fp32", world_size)
    wss = simulated_workspaces(world_size, moe_bytes=1024)
    assert buffer_bytes(problem) > moe_buffer("dp_to_ep", 1024, world_size)[1]
    new = [torch.zeros(4 * buffer_bytes(problem), dtype=torch.uint8) for _ in wss]
    for ws in wss:
        ws.move_region("moe", new)
    assignment = make_expt_assignment(world_size, 6, make_expt_dict_random(world_size, 6, seed=2))
    expt_indx = random_expt_indx(world_size * n_tokens_local, 6, 3, seed=3, drop_fraction=0.1)
    gate, _ = route(expt_indx)
    srcs = [torch.randn(n_tokens_local, 40) for _ in wss]
    launchers = [TRITON_MOE.prepare(problem, MoEConfig(64, 1, rows_per_program=4), RunContext(workspace=ws))
                 for ws in wss]
    presatisfy(wss, "dp_to_ep")
    outs = [launch(src, assignment, expt_indx, gate) for launch, src in zip(launchers, srcs)]
    check_and_clear(wss, "dp_to_ep")
    want = reference_dp_to_ep(srcs, assignment, expt_indx, gate, out=[o.clone() for o in outs])
    for rank, (ws, out) in enumerate(zip(wss, outs)):
        assert ws.offset_in_region(out, "moe") == moe_buffer("dp_to_ep", ws.capacity("moe"), world_size)[0]
        assert out.data_ptr() >= new[rank].data_ptr()
        assert torch.equal(out, want[rank])
