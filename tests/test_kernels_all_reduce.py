"""One-shot and two-shot all-reduce data paths under the Triton interpreter.

2, 4 and 8 ranks are simulated in one process (autosymm.workspace.symm.simulated_workspaces). Everything
the kernels must not touch is poisoned: the all-reduce regions are NaN-filled (a read of an
element nobody staged shows up as NaN) and ``x`` sits inside a larger sentinel-filled tensor (a
write past the tail shows up there).
"""

import pytest
import torch

from autosymm.geometry import segment_vecs
from autosymm.kernels.all_reduce import _one_shot_all_reduce, _two_shot_all_reduce
from autosymm.geometry import ALL_REDUCE_EPOCH_SLOT, DOUBLE_BUFFER_REGION

from _all_reduce_sim import (poisoned_workspaces, arrivals, assert_close_to_sum, epoch, error_counts, half_bytes, half_view, pads, preset,
                             random_inputs, requires_interpreter, snapshot_workspace, tiny_poll_limit)

pytestmark = requires_interpreter

REGION_BYTES = 1 << 16
HALF_BYTES = 1 << 15  # each half of the double-buffer region
SENTINEL = 12345.0

# (world_size, dtype, numel, block, programs, warps): every world size meets every dtype, every
# size meets both kernels, and grids range from one program to more programs than chunks.
CASES = [
    (2, torch.bfloat16, 1, 128, 1, 4),
    (2, torch.float16, 7, 256, 2, 2),
    (2, torch.float32, 4099, 1024, 3, 8),
    (4, torch.bfloat16, 4099, 256, 5, 4),
    (4, torch.float16, 1000, 128, 3, 1),
    (4, torch.float32, 7, 128, 2, 4),
    (8, torch.bfloat16, 1000, 256, 2, 8),
    (8, torch.float16, 4099, 1024, 1, 4),
    (8, torch.float32, 1, 128, 3, 4),
]


def _poisoned_workspaces(world_size):
    return poisoned_workspaces(world_size, REGION_BYTES, HALF_BYTES)


def _x_in_sentinel(values):
    """``values`` copied into the front of a larger sentinel-filled tensor; returns (x, backing)."""
    backing = torch.full((values.numel() + 64,), SENTINEL, dtype=values.dtype)
    x = backing[:values.numel()]
    x.copy_(values)
    return x, backing


def _check(results, inputs, dtype):
    for result in results:
        assert_close_to_sum(result, inputs, dtype)
        assert torch.equal(result, results[0]), "ranks must get bit-identical sums"


def _double_offset(ws):
    """Offset of the double-buffer region from the all-reduce region (what the launcher passes)."""
    return ws.regions[DOUBLE_BUFFER_REGION].offset - ws.regions["all_reduce"].offset


def _run_one_shot(wss, xs, numel, offset, block, programs, warps, zero_copy, double_buffer=False):
    for rank, ws in enumerate(wss):
        if double_buffer:
            offset = _double_offset(ws)
        _one_shot_all_reduce[(programs,)](xs[rank], ws.region_ptrs("all_reduce"), ws.signal_ptrs("all_reduce"),
                                          numel, offset, ws.double_buffer_half_bytes, RANK=rank, WORLD_SIZE=len(wss),
                                          BLOCK=block, ZERO_COPY=zero_copy, ALIGNED=offset % 16 == 0,
                                          DOUBLE_BUFFER=double_buffer, num_warps=warps)


def _check_staged_bounds(wss, xs, backings, expected_pads, numel, offset):
    """Nothing written past x or past its stage in the region, and the signal pads as expected."""
    for ws, backing, want in zip(wss, backings, expected_pads):
        assert (backing[numel:] == SENTINEL).all(), "wrote past the end of x"
        assert torch.equal(pads(ws.buffer), want)
        stage_end = ws.regions["all_reduce"].offset + offset + numel * xs[0].element_size()
        assert (ws.buffer[stage_end:stage_end + 64] == 0xFF).all(), "wrote past the end of the stage"


@pytest.mark.parametrize("world_size, dtype, numel, block, programs, warps", CASES)
def test_one_shot(world_size, dtype, numel, block, programs, warps):
    wss = _poisoned_workspaces(world_size)
    inputs = random_inputs(world_size, numel, dtype, seed=numel)
    offset = 768
    # Ranks run one after another: pre-stage every rank's input (the copy-in writes the same
    # values again) and pre-set the signals of both barriers.
    for ws, values in zip(wss, inputs):
        ws.local_view("all_reduce", (numel,), dtype, offset).copy_(values)
    expected_pads = preset([ws.buffer for ws in wss], programs, 2)
    xs, backings = zip(*(_x_in_sentinel(v) for v in inputs))
    _run_one_shot(wss, xs, numel, offset, block, programs, warps, zero_copy=False)
    _check(xs, inputs, dtype)
    _check_staged_bounds(wss, xs, backings, expected_pads, numel, offset)


@pytest.mark.parametrize("world_size, dtype, numel, block, programs, warps, aligned",
                         [(*CASES[2], True), (*CASES[3], False), (*CASES[5], True), (*CASES[7], True),
                          (2, torch.bfloat16, 1000, 128, 3, 4, False)])
def test_one_shot_zero_copy(world_size, dtype, numel, block, programs, warps, aligned):
    """x is the stage; each sum is stored only after its round's barrier (peers are snapshots)."""
    wss = _poisoned_workspaces(world_size)
    inputs = random_inputs(world_size, numel, dtype, seed=7)
    skip = 0 if aligned else 1  # unaligned: x starts one element into its 256-byte slot
    xs = [ws.local_view("all_reduce", (numel + 1,), dtype, 256)[skip:skip + numel] for ws in wss]
    offset = 256 + skip * xs[0].element_size()
    for x, values in zip(xs, inputs):
        x.copy_(values)
    n_chunks = -(-numel // block)
    for ws in wss:  # program p passes 1 + (its chunks) barriers; every peer's signals pre-set
        view = pads(ws.buffer)
        for program in range(programs):
            view[program, :world_size] = 1 + len(range(program, n_chunks, programs))
            view[program, ws.rank] = 0
    snapshots = [snapshot_workspace(wss, r) for r in range(world_size)]  # inputs, before anyone runs
    _run_one_shot(snapshots, xs, numel, offset, block, programs, warps, zero_copy=True)
    _check(xs, inputs, dtype)
    for ws in wss:
        assert int(pads(ws.buffer).count_nonzero()) == 0, "every pre-set signal consumed exactly once"


# -- double-buffered one-shot: consecutive calls alternate halves, no end barrier ------------------

# (numel, block, programs, warps) of consecutive calls: the grid and the size change every call.
DOUBLE_CALLS = [(1000, 256, 3, 4), (4099, 1024, 1, 8), (7, 128, 2, 4), (3001, 256, 5, 2)]


def _double_buffered_calls(world_size, dtype, calls, seed=0):
    """Run ``calls`` in turn on simulated ranks; check every call (see the test's docstring)."""
    wss = _poisoned_workspaces(world_size)
    for k, (numel, block, programs, warps) in enumerate(calls):
        parity = k % 2
        inputs = random_inputs(world_size, numel, dtype, seed=seed + k)
        for ws in wss:  # both halves poisoned: a read of the wrong half, or of an unstaged element, is NaN
            ws.buffer[ws.regions[DOUBLE_BUFFER_REGION].offset:][:2 * HALF_BYTES] = 0xFF
        # Ranks run in turn: rank r reads the half of peers that have not run yet, so pre-stage
        # theirs (their copy-in writes the same values again); rank 0's half must be its own copy-in.
        for ws, values in zip(wss[1:], inputs[1:]):
            half_view(ws, parity, numel, dtype).copy_(values)
        expected_pads = preset([ws.buffer for ws in wss], programs, 1)  # one barrier per program
        xs, backings = zip(*(_x_in_sentinel(v) for v in inputs))
        _run_one_shot(wss, xs, numel, None, block, programs, warps, zero_copy=False, double_buffer=True)
        _check(xs, inputs, dtype)
        for ws, values, backing, want in zip(wss, inputs, backings, expected_pads):
            assert (backing[numel:] == SENTINEL).all(), "wrote past the end of x"
            assert epoch(ws) == k + 1, "the epoch advances by exactly one per call, whatever the grid"
            assert arrivals(ws) == 0, "the last program resets the arrival counter"
            want[ALL_REDUCE_EPOCH_SLOT, ws.rank] = k + 1
            assert torch.equal(pads(ws.buffer), want), "one barrier's signals, each consumed once"
            assert torch.equal(half_view(ws, parity, numel, dtype), values), f"call {k} stages in half {parity}"
            tail = half_bytes(ws, parity)[numel * values.element_size():]
            assert (tail == 0xFF).all(), "wrote past the end of the stage"
            assert (half_bytes(ws, 1 - parity) == 0xFF).all(), "the other half is left alone"
        assert error_counts(wss[0])["all_reduce"] == 0
    return wss


@pytest.mark.parametrize("world_size, dtype", [(2, torch.bfloat16), (3, torch.float32), (4, torch.float16)])
def test_one_shot_double_buffer_alternates_halves(world_size, dtype):
    """Two, three, four consecutive calls with different grids and sizes: call k stages in half
    k % 2 (the other half stays poisoned, so reading it would give NaN), the sums are right,
    the epoch counts the calls, the arrival counter is back to 0 and the pads are balanced."""
    import autosymm.kernels.all_reduce as kernels
    from autosymm.geometry import ALL_REDUCE_ARRIVAL_SLOT

    assert (kernels._ARRIVAL_SLOT.value, kernels._EPOCH_SLOT.value) == (ALL_REDUCE_ARRIVAL_SLOT, ALL_REDUCE_EPOCH_SLOT)
    calls = DOUBLE_CALLS[:world_size]  # 2 ranks: two calls, 3 ranks: three, 4 ranks: four
    _double_buffered_calls(world_size, dtype, calls, seed=world_size)


def test_one_shot_double_buffer_after_single_buffer_calls():
    """Single-buffer calls (staged or zero-copy) in between do not move the epoch, and do not
    touch the double-buffer halves."""
    world_size, dtype, numel, block, programs, warps = 2, torch.float32, 1000, 256, 2, 4
    wss = _double_buffered_calls(world_size, dtype, DOUBLE_CALLS[:1])
    inputs = random_inputs(world_size, numel, dtype, seed=99)
    offset = 768
    for ws, values in zip(wss, inputs):
        ws.local_view("all_reduce", (numel,), dtype, offset).copy_(values)
    halves = [ws.buffer[ws.regions[DOUBLE_BUFFER_REGION].offset:].clone() for ws in wss]
    expected_pads = preset([ws.buffer for ws in wss], programs, 2)
    xs = [v.clone() for v in inputs]
    _run_one_shot(wss, xs, numel, offset, block, programs, warps, zero_copy=False)
    _check(xs, inputs, dtype)
    for ws, want, before in zip(wss, expected_pads, halves):
        assert epoch(ws) == 1 and torch.equal(pads(ws.buffer), want)
        assert torch.equal(ws.buffer[ws.regions[DOUBLE_BUFFER_REGION].offset:], before)


def _run_two_shot(wss, xs, numel, offset, block, programs, warps, zero_copy):
    world_size = len(wss)
    seg = segment_vecs(numel, world_size, xs[0].element_size())
    for phase in (1, 2, 3):  # each phase on every rank before the next phase starts anywhere
        for rank, ws in enumerate(wss):
            _two_shot_all_reduce[(programs,)](xs[rank], ws.region_ptrs("all_reduce"), ws.signal_ptrs("all_reduce"),
                                              numel, offset, seg, 0, RANK=rank, WORLD_SIZE=world_size, BLOCK=block,
                                              ZERO_COPY=zero_copy, ALIGNED=offset % 16 == 0, MULTIMEM=False,
                                              PHASE=phase, num_warps=warps)


@pytest.mark.parametrize("world_size, dtype, numel, block, programs, warps", CASES)
def test_two_shot(world_size, dtype, numel, block, programs, warps):
    wss = _poisoned_workspaces(world_size)
    inputs = random_inputs(world_size, numel, dtype, seed=numel + 1)
    expected_pads = preset([ws.buffer for ws in wss], programs, 3)  # start, all-gather, end (copy-out)
    xs, backings = zip(*(_x_in_sentinel(v) for v in inputs))
    offset = 1024
    _run_two_shot(wss, xs, numel, offset, block, programs, warps, zero_copy=False)
    _check(xs, inputs, dtype)
    _check_staged_bounds(wss, xs, backings, expected_pads, numel, offset)


@pytest.mark.parametrize("world_size, dtype, numel, block, programs, warps", [CASES[1], CASES[3], CASES[6]])
def test_two_shot_zero_copy_in_place(world_size, dtype, numel, block, programs, warps):
    wss = _poisoned_workspaces(world_size)
    inputs = random_inputs(world_size, numel, dtype, seed=3)
    offset = 512
    xs = [ws.local_view("all_reduce", (numel,), dtype, offset) for ws in wss]
    for x, values in zip(xs, inputs):
        x.copy_(values)
    expected_pads = preset([ws.buffer for ws in wss], programs, 2)
    _run_two_shot(wss, xs, numel, offset, block, programs, warps, zero_copy=True)
    _check(xs, inputs, dtype)
    for ws, want in zip(wss, expected_pads):
        assert torch.equal(pads(ws.buffer), want)


@pytest.mark.parametrize("kernel", ["one_shot", "one_shot_double_buffer", "two_shot"])
def test_world_size_one_copies_through(kernel):
    (ws,) = _poisoned_workspaces(1)
    values = random_inputs(1, 1000, torch.bfloat16)[0]
    x, backing = _x_in_sentinel(values)
    if kernel.startswith("one_shot"):
        _run_one_shot([ws], [x], 1000, 0, 256, 2, 4, zero_copy=False, double_buffer=kernel != "one_shot")
        assert epoch(ws) == (kernel != "one_shot") and arrivals(ws) == 0
    else:
        _run_two_shot([ws], [x], 1000, 0, 256, 2, 4, zero_copy=False)
    assert torch.equal(x, values)
    assert (backing[1000:] == SENTINEL).all()


# -- a missing peer: bounded waits --------------------------------------------------------------

@pytest.mark.parametrize("kernel, zero_copy", [("one_shot", False), ("one_shot", True), ("one_shot_double_buffer", False),
                                               ("two_shot", False), ("two_shot", True)])
def test_a_missing_peer_flags_the_error_and_the_kernel_completes(monkeypatch, kernel, zero_copy):
    """Only rank 0 runs (rank 1 never launches) and no signal is pre-set: every wait gives up
    after the poll limit, counts itself in rank 0's error slot and the kernel returns."""
    tiny_poll_limit(monkeypatch, 3)
    world_size, dtype, numel, block, programs = 2, torch.float32, 1000, 256, 2
    wss = _poisoned_workspaces(world_size)
    ws = wss[0]
    if zero_copy:
        x = ws.local_view("all_reduce", (numel,), dtype, 0)
        x.copy_(torch.ones(numel))
    else:
        x = torch.ones(numel, dtype=dtype)
    if kernel.startswith("one_shot"):
        double = kernel == "one_shot_double_buffer"
        offset = _double_offset(ws) if double else 0
        _one_shot_all_reduce[(programs,)](x, ws.region_ptrs("all_reduce"), ws.signal_ptrs("all_reduce"), numel,
                                          offset, ws.double_buffer_half_bytes, RANK=0, WORLD_SIZE=world_size,
                                          BLOCK=block, ZERO_COPY=zero_copy, ALIGNED=True, DOUBLE_BUFFER=double,
                                          num_warps=4)
    else:
        seg = segment_vecs(numel, world_size, 4)
        _two_shot_all_reduce[(programs,)](x, ws.region_ptrs("all_reduce"), ws.signal_ptrs("all_reduce"), numel, 0,
                                          seg, 0, RANK=0, WORLD_SIZE=world_size, BLOCK=block, ZERO_COPY=zero_copy,
                                          ALIGNED=True, MULTIMEM=False, PHASE=0, num_warps=4)
    chunks_per_program = -(-numel // block) // programs
    barriers = {("one_shot", True): 1 + chunks_per_program, ("one_shot_double_buffer", False): 1,
                ("two_shot", False): 3}.get((kernel, zero_copy), 2)
    # every barrier of every program gave up once (the first by spinning, the others fail fast)
    assert error_counts(ws) == {"all_reduce": barriers * programs, "moe": 0, "moe_end": 0, "host": 0}
    if kernel == "one_shot_double_buffer":  # the kernel still ran to its end: the epoch moved on
        assert epoch(ws) == 1 and arrivals(ws) == 0
        pads(ws.buffer)[ALL_REDUCE_EPOCH_SLOT, 0] = 0
    assert int(pads(ws.buffer).count_nonzero()) == 0, "no signal came, none was consumed"
    assert int(pads(wss[1].buffer).sum()) > 0  # rank 0 still signalled its peer
    assert wss[1].barrier_errors() == 0
