"""The push one-shot launcher (backend ``triton_one_shot_push``): where it stages, its limits,
and calls end to end under the interpreter."""

import pytest
import torch

from autosymm.backends.base import BackendError, RunContext
from autosymm.backends.triton_all_reduce import triton_one_shot_push
from autosymm.backends.triton_all_reduce import ALGORITHMS, all_reduce_space
from autosymm.geometry import DOUBLE_BUFFER_REGION, push_slot_bytes
from autosymm.configs import AllReduceConfig
from autosymm.problem import Problem
from autosymm.workspace.symm import simulated_workspaces

from _all_reduce_sim import assert_close_to_sum, epoch, pads, random_inputs, requires_interpreter, snapshot_workspace


@pytest.fixture
def recorded_launches(monkeypatch):
    """Launches recorded instead of run: (constexprs, args) per call."""
    import autosymm.backends.triton_all_reduce as tar

    calls = []

    class FakeLean:
        def __init__(self, fn, grid, constexprs, **options):
            self.fn, self.constexprs, self.direct = fn, constexprs, None

        def __call__(self, *args):
            calls.append((self.constexprs, args))

    monkeypatch.setattr(tar, "LeanLauncher", FakeLean)
    return calls


def _launcher(world_size=3, region=1 << 16, half=4096, double_buffer=True, rank=0):
    wss = simulated_workspaces(world_size, all_reduce_bytes=region, moe_bytes=256, double_buffer_bytes=half)
    cfg = AllReduceConfig("one_shot_push", 256, 2, 4, double_buffer=double_buffer)
    problem = Problem.all_reduce(4096, "bf16", world_size)
    return wss, triton_one_shot_push.prepare(problem, cfg, RunContext(workspace=wss[rank]))


def test_stage_bytes_counts_one_slot_per_peer():
    assert push_slot_bytes(1) == 256 and push_slot_bytes(256) == 256 and push_slot_bytes(257) == 512
    stage = {name: a.stage_bytes(1000, 4) for name, a in ALGORITHMS.items()}
    assert stage == {"one_shot_push": 3 * 1024, "one_shot": 1000, "two_shot": 1000, "multimem": 1000, "lamport": 0}


def test_slots_go_to_a_half_when_they_fit_else_to_the_top_of_the_region(recorded_launches):
    wss, launcher = _launcher(world_size=3, half=4096)
    ws = wss[0]
    capacity = ws.capacity("all_reduce")
    double_offset = ws.regions[DOUBLE_BUFFER_REGION].offset - ws.regions["all_reduce"].offset
    launcher(torch.zeros(1024, dtype=torch.bfloat16))  # 2 slots of 2048 bytes: fill a 4096-byte half
    launcher(torch.zeros(1025, dtype=torch.bfloat16))  # 2 slots of 2304 bytes: single buffer
    ws.empty((64,), torch.bfloat16)
    zero_copy = ws.empty((100,), torch.bfloat16)
    launcher(zero_copy)  # a tensor in the region is just another input: x is only read locally
    (fits, args_fits), (big, args_big), (inside, args_inside) = recorded_launches
    assert fits["DOUBLE_BUFFER"] and "ZERO_COPY" not in fits
    assert args_fits[3:] == (1024, double_offset, 2048, 4096)
    assert not big["DOUBLE_BUFFER"] and args_big[3:] == (1025, capacity - 2 * 2304, 2304, 4096)
    assert inside["DOUBLE_BUFFER"] and args_inside[0] is zero_copy and args_inside[3:] == (100, double_offset, 256, 4096)


def test_single_buffer_config_never_takes_the_halves(recorded_launches):
    wss, launcher = _launcher(double_buffer=False)
    launcher(torch.zeros(16, dtype=torch.bfloat16))
    constexprs, args = recorded_launches[0]
    assert not constexprs["DOUBLE_BUFFER"] and args[3:] == (16, wss[0].capacity("all_reduce") - 2 * 256, 256, 0)


def test_limits_name_the_stage(recorded_launches):
    wss, launcher = _launcher(world_size=3, region=1 << 16)
    with pytest.raises(BackendError, match="at most 32768 fit"):  # 2 slots must fit 64 KiB
        launcher(torch.zeros(16385, dtype=torch.bfloat16))
    launcher(torch.zeros(16384, dtype=torch.bfloat16))  # exactly two slots: the whole region
    wss[0].empty((1000,), torch.bfloat16)
    with pytest.raises(BackendError, match="push stage of 65536 bytes would overwrite the 2048 bytes"):
        launcher(torch.zeros(16384, dtype=torch.bfloat16))
    inside = wss[0].local_view("all_reduce", (4096,), torch.bfloat16, 52 * 1024)  # stage: the top 16 KiB
    with pytest.raises(BackendError, match="overlaps the push stage"):
        launcher(inside)  # a tensor where peers write their slots
    in_half = wss[0].local_view(DOUBLE_BUFFER_REGION, (16,), torch.bfloat16, 0)
    with pytest.raises(BackendError, match="overlaps the push stage"):
        launcher(in_half)


def test_space_offers_double_buffer_where_the_slots_fit_a_half():
    def has_double(nbytes, world_size):
        space = all_reduce_space("one_shot_push", nbytes // 2, world_size, 2)
        return any(c.double_buffer for c in space)

    assert has_double(4 << 20, 2) and not has_double(8 << 20, 2)  # 1 slot vs the 4 MiB half
    assert has_double(1 << 20, 4) and not has_double(2 << 20, 4)  # 3 slots
    assert not any(c.double_buffer for c in all_reduce_space("one_shot", (2 << 20) // 2, 2, 2))  # pull: <= 1 MiB


@requires_interpreter
def test_launchers_alternate_halves_and_fall_back_across_calls():
    """Consecutive calls through two double-buffered configs with a single-buffer fallback in
    between: right sums, the epoch counts the double-buffered calls only."""
    world_size, dtype = 3, torch.float16
    wss = simulated_workspaces(world_size, all_reduce_bytes=1 << 15, moe_bytes=256, double_buffer_bytes=4096)
    problem = Problem.all_reduce(4096, "fp16", world_size)
    configs = [AllReduceConfig("one_shot_push", 256, 3, 4, True), AllReduceConfig("one_shot_push", 512, 1, 4, True)]
    # (config, numel, double-buffered?): two slots of 1025 fp16 elements exceed a 4096-byte half
    calls = [(configs[0], 1000, True), (configs[1], 1025, False), (configs[1], 1024, True), (configs[0], 7, True)]
    n_double = 0
    for k, (config, numel, double) in enumerate(calls):
        inputs = random_inputs(world_size, numel, dtype, seed=k)
        slot = push_slot_bytes(numel * 2)
        for ws in wss:  # ranks run in turn: pre-fill each stage with what its peers push
            region, base = (DOUBLE_BUFFER_REGION, (n_double % 2) * 4096) if double else \
                ("all_reduce", ws.capacity("all_reduce") - 2 * slot)
            for q in range(world_size):
                if q != ws.rank:
                    s = (q - ws.rank - 1) % world_size
                    ws.local_view(region, (numel,), dtype, base + s * slot).copy_(inputs[q])
            chunks = -(-numel // config.block_size)
            view = pads(ws.buffer)
            peers = [q for q in range(world_size) if q != ws.rank]
            for program in range(config.num_blocks):
                view[program, peers] = len(range(program, chunks, config.num_blocks)) + (0 if double else 1)
        snapshots = [snapshot_workspace(wss, r) for r in range(world_size)]
        xs = [v.clone() for v in inputs]
        for ws, x in zip(snapshots, xs):
            assert triton_one_shot_push.prepare(problem, config, RunContext(workspace=ws))(x) is x
        n_double += double
        for ws, x in zip(wss, xs):
            assert_close_to_sum(x, inputs, dtype)
            assert epoch(ws) == n_double
