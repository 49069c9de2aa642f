"""Push one-shot all-reduce data path under the Triton interpreter.

Ranks run one after another, so a rank's reduce would find its stage empty of the pushes of
ranks that have not run yet. Each rank therefore runs against *snapshots* of its peers
(tests/_all_reduce_sim.snapshot_workspace): its own stage is pre-filled with what the peers
would push (the slot layout of :func:`slot_of`), and its own pushes land in the peers' copies,
where the test checks them against the same layout. Regions are NaN-poisoned (an unwritten slot
or element reads as NaN) and x sits in a sentinel-filled tensor (a write past its end shows).
"""

import pytest
import torch

from autosymm.kernels.push_all_reduce import _push_one_shot_all_reduce
from autosymm.geometry import ALL_REDUCE_EPOCH_SLOT, DOUBLE_BUFFER_REGION, push_slot_bytes

from test_kernels_all_reduce import CASES as PULL_CASES
from _all_reduce_sim import (poisoned_workspaces, arrivals, assert_close_to_sum, epoch, error_counts, pads, random_inputs,
                             requires_interpreter, snapshot_workspace, tiny_poll_limit)

pytestmark = requires_interpreter

REGION_BYTES = 1 << 16
HALF_BYTES = 1 << 16
SENTINEL = 12345.0
STAGE_OFFSET = 512  # single buffer: where the slots start in the all-reduce region (bytes)

# (world_size, dtype, numel, block, programs, warps): the pull kernels' cases (every world size
# meets every dtype, partial tails, single elements, more programs than chunks: programs with
# nothing to push still pass the end barrier), plus one program over many chunks (the
# pipeline's steady state) and an odd world size.
CASES = PULL_CASES + [(2, torch.float16, 4099, 256, 1, 2), (3, torch.bfloat16, 1000, 128, 2, 4)]


def slot_of(receiver: int, sender: int, world_size: int) -> int:
    """Which slot of ``receiver``'s stage ``sender`` pushes into (the kernel's layout)."""
    return (sender - receiver - 1) % world_size


def _poisoned(world_size):
    return poisoned_workspaces(world_size, REGION_BYTES, HALF_BYTES)


def _slot_view(ws, region: str, base: int, slot: int, numel: int, dtype, rank=None):
    slot_bytes = push_slot_bytes(numel * torch.tensor([], dtype=dtype).element_size())
    return ws.peer_view(ws.rank if rank is None else rank, region, (numel,), dtype, base + slot * slot_bytes)


def _x_in_sentinel(values):
    backing = torch.full((values.numel() + 64,), SENTINEL, dtype=values.dtype)
    backing[:values.numel()] = values
    return backing[:values.numel()], backing


def _run(wss, inputs, block, programs, warps, *, double_buffer=False, parity=0):
    """One push one-shot call on every simulated rank; returns (xs, backings, snapshots)."""
    world_size, numel, dtype = len(wss), inputs[0].numel(), inputs[0].dtype
    region, base = (DOUBLE_BUFFER_REGION, parity * HALF_BYTES) if double_buffer else ("all_reduce", STAGE_OFFSET)
    for ws in wss:  # what the peers would have pushed into this rank's stage
        for q in range(world_size):
            if q != ws.rank:
                _slot_view(ws, region, base, slot_of(ws.rank, q, world_size), numel, dtype).copy_(inputs[q])
    n_chunks = -(-numel // block)
    for ws in wss:  # each program: one signal per chunk, plus the end barrier (single buffer)
        view = pads(ws.buffer)
        peers = [q for q in range(world_size) if q != ws.rank]  # self slots hold the epoch: untouched
        for program in range(programs):
            view[program, peers] = len(range(program, n_chunks, programs)) + (0 if double_buffer else 1)
    snapshots = [snapshot_workspace(wss, r) for r in range(world_size)]
    xs, backings = zip(*(_x_in_sentinel(v) for v in inputs))
    slot_bytes = push_slot_bytes(numel * inputs[0].element_size())
    for rank, ws in enumerate(snapshots):
        offset = ws.regions[DOUBLE_BUFFER_REGION].offset - ws.regions["all_reduce"].offset if double_buffer \
            else STAGE_OFFSET
        _push_one_shot_all_reduce[(programs,)](xs[rank], ws.region_ptrs("all_reduce"), ws.signal_ptrs("all_reduce"),
                                               numel, offset, slot_bytes, HALF_BYTES, RANK=rank, WORLD_SIZE=world_size,
                                               BLOCK=block, ALIGNED=True, DOUBLE_BUFFER=double_buffer,
                                               num_warps=warps)
    return xs, backings, snapshots


def _check_sums_and_pushes(xs, backings, snapshots, inputs, region, base):
    world_size, numel, dtype = len(xs), inputs[0].numel(), inputs[0].dtype
    for rank, (x, backing, snap) in enumerate(zip(xs, backings, snapshots)):
        assert_close_to_sum(x, inputs, dtype)
        assert torch.equal(x, xs[0]), "ranks must get bit-identical sums"
        assert (backing[numel:] == SENTINEL).all(), "wrote past the end of x"
        for q in range(world_size):  # this rank's pushes, in the copies of its peers
            if q != rank:
                pushed = _slot_view(snap, region, base, slot_of(q, rank, world_size), numel, dtype, rank=q)
                assert torch.equal(pushed, inputs[rank]), f"rank {rank} pushed into the wrong slot of rank {q}"
    for snap in snapshots:
        assert int(pads(snap.buffer).count_nonzero()) == 0 or region == DOUBLE_BUFFER_REGION


@pytest.mark.parametrize("world_size, dtype, numel, block, programs, warps", CASES)
def test_push_one_shot(world_size, dtype, numel, block, programs, warps):
    wss = _poisoned(world_size)
    inputs = random_inputs(world_size, numel, dtype, seed=numel + world_size)
    xs, backings, snapshots = _run(wss, inputs, block, programs, warps)
    _check_sums_and_pushes(xs, backings, snapshots, inputs, "all_reduce", STAGE_OFFSET)
    for ws in wss:
        assert int(pads(ws.buffer).count_nonzero()) == 0, "every pre-set signal consumed exactly once"
        slots_end = ws.regions["all_reduce"].offset + STAGE_OFFSET + \
            (world_size - 1) * push_slot_bytes(numel * inputs[0].element_size())
        assert (ws.buffer[slots_end:slots_end + 256] == 0xFF).all(), "nothing written past the last slot"
        assert error_counts(ws)["all_reduce"] == 0


# (numel, block, programs, warps) of consecutive double-buffered calls: grid and size change.
DOUBLE_CALLS = [(1000, 256, 3, 4), (4099, 1024, 1, 8), (7, 128, 2, 4), (3001, 256, 5, 2)]


@pytest.mark.parametrize("world_size, dtype", [(2, torch.bfloat16), (3, torch.float32), (4, torch.float16)])
def test_push_one_shot_double_buffer_alternates_halves(world_size, dtype):
    """Call k pushes into half k % 2 (the other half stays poisoned: reading it would be NaN),
    the epoch counts the calls, the arrival counter returns to 0, and no end barrier runs (the
    pre-set signals are one per chunk only, and all are consumed)."""
    wss = _poisoned(world_size)
    for k, (numel, block, programs, warps) in enumerate(DOUBLE_CALLS[:world_size]):
        parity = k % 2
        for ws in wss:
            ws.buffer[ws.regions[DOUBLE_BUFFER_REGION].offset:][:2 * HALF_BYTES] = 0xFF
        inputs = random_inputs(world_size, numel, dtype, seed=10 * world_size + k)
        xs, backings, snapshots = _run(wss, inputs, block, programs, warps, double_buffer=True, parity=parity)
        _check_sums_and_pushes(xs, backings, snapshots, inputs, DOUBLE_BUFFER_REGION, parity * HALF_BYTES)
        for ws in wss:
            assert epoch(ws) == k + 1, "the epoch advances by exactly one per call, whatever the grid"
            assert arrivals(ws) == 0, "the last program resets the arrival counter"
            view = pads(ws.buffer).clone()
            view[ALL_REDUCE_EPOCH_SLOT, ws.rank] = 0
            assert int(view.count_nonzero()) == 0, "one signal per chunk, each consumed once"
            other = ws.buffer[ws.regions[DOUBLE_BUFFER_REGION].offset + (1 - parity) * HALF_BYTES:][:HALF_BYTES]
            assert (other == 0xFF).all(), "the other half is left alone"


def test_push_one_shot_world_size_one_copies_through():
    (ws,) = _poisoned(1)
    values = random_inputs(1, 1000, torch.bfloat16)[0]
    x, backing = _x_in_sentinel(values)
    _push_one_shot_all_reduce[(2,)](x, ws.region_ptrs("all_reduce"), ws.signal_ptrs("all_reduce"), 1000, 0,
                                    push_slot_bytes(2000), HALF_BYTES, RANK=0, WORLD_SIZE=1, BLOCK=256, ALIGNED=True,
                                    DOUBLE_BUFFER=False, num_warps=4)
    assert torch.equal(x, values) and (backing[1000:] == SENTINEL).all()


@pytest.mark.parametrize("double_buffer", [False, True])
def test_a_missing_peer_flags_the_error_and_the_kernel_completes(monkeypatch, double_buffer):
    """Rank 1 never launches: every wait of rank 0 gives up, counts itself, and the kernel ends."""
    tiny_poll_limit(monkeypatch, 3)
    world_size, numel, block, programs = 2, 1000, 256, 2
    wss = _poisoned(world_size)
    ws = wss[0]
    x = torch.ones(numel, dtype=torch.float32)
    offset = ws.regions[DOUBLE_BUFFER_REGION].offset - ws.regions["all_reduce"].offset if double_buffer else 0
    _push_one_shot_all_reduce[(programs,)](x, ws.region_ptrs("all_reduce"), ws.signal_ptrs("all_reduce"), numel,
                                           offset, push_slot_bytes(4 * numel), HALF_BYTES, RANK=0,
                                           WORLD_SIZE=world_size, BLOCK=block, ALIGNED=True,
                                           DOUBLE_BUFFER=double_buffer, num_warps=4)
    waits = -(-numel // block) + (0 if double_buffer else programs)  # one per chunk (+ end barriers)
    assert error_counts(ws) == {"all_reduce": waits, "moe": 0, "moe_end": 0, "host": 0}
    if double_buffer:
        assert epoch(ws) == 1 and arrivals(ws) == 0
        pads(ws.buffer)[ALL_REDUCE_EPOCH_SLOT, 0] = 0
    assert int(pads(ws.buffer).count_nonzero()) == 0, "no signal came, none was consumed"
    assert int(pads(wss[1].buffer).sum()) > 0  # rank 0 still signalled its peer


@pytest.mark.parametrize("world_size", [2, 3])
def test_concurrent_ranks_double_buffered_calls_advance_the_epoch(world_size):
    """Ranks as concurrent processes (tests/_forked_ranks.py), each running six double-buffered
    calls in a row over 3 programs, push and pull one-shots alternating (they share the epoch and
    the halves): every sum is the fp32 in-order sum's bits, the epoch moved by six (the grid's last
    program advanced it once a call, after every program read it), the arrival counter is 0, and
    every signal sent was consumed."""
    from _forked_ranks import run_forked, shared, shared_workspaces

    from autosymm.backends import get_backend
    from autosymm.backends.base import RunContext
    from autosymm.configs import AllReduceConfig
    from autosymm.problem import Problem

    dtype, numel, calls = torch.float32, 700, 6
    wss = shared_workspaces(world_size, all_reduce_bytes=1 << 14, moe_bytes=1 << 12, double_buffer_bytes=1 << 14)
    gen = torch.Generator().manual_seed(3)
    xs = [[shared(torch.randn(numel, generator=gen)) for _ in range(world_size)] for _ in range(calls)]
    inputs = [[x.clone() for x in per_rank] for per_rank in xs]
    problem = Problem.all_reduce(4 * numel, "fp32", world_size)

    def body(rank: int) -> None:
        ctx = RunContext(workspace=wss[rank])
        launchers = [get_backend(f"triton_{name}").prepare(problem, AllReduceConfig(name, 128, 3, 2, double_buffer=True),
                                                          ctx) for name in ("one_shot_push", "one_shot")]
        for k in range(calls):
            launchers[k % 2](xs[k][rank])

    run_forked(world_size, body)
    for k in range(calls):
        acc = torch.zeros(numel)  # fp32 in order from +0.0, as the kernels add
        for x in inputs[k]:
            acc = acc + x
        for rank in range(world_size):
            assert torch.equal(xs[k][rank], acc), f"call {k} rank {rank}"
    for ws in wss:
        assert (epoch(ws), arrivals(ws)) == (calls, 0)
        assert error_counts(ws)["all_reduce"] == 0
        view = pads(ws.buffer)[:, [p for p in range(world_size) if p != ws.rank]]
        assert int(view.count_nonzero()) == 0, f"rank {ws.rank}: unconsumed signals"
