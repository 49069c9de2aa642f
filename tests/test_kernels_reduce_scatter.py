"""The reduce-scatter kernel under the Triton interpreter, ranks simulated in one process.

Results are compared bit for bit with an independent reference (fp32 sum in rank order,
rounded once) and with the Triton all-reduce. The all-reduce regions are poisoned (a read of
anything nobody staged is NaN), outputs sit in front of sentinel bytes (a write past the end
shows) and the signal pads must end balanced.
"""

import pytest
import torch

from autosymm.backends.rs_ag_layout import push_slot_units, segments
from autosymm.geometry import segment_vecs
from autosymm.kernels.all_reduce import _one_shot_all_reduce, _two_shot_all_reduce

from _all_reduce_sim import error_counts, pads, preset, requires_interpreter, tiny_poll_limit
from _rs_ag_sim import (SENTINEL_BYTE, all_gather, check_pads, random_values, reduce_scatter, reference_sum,
                        stage_bytes_view, vec_of, workspaces)

pytestmark = requires_interpreter

# (world_size, dtype, per-rank counts, block, programs, warps): every world size meets every
# dtype; equal segments that are whole vectors, ragged ones, one element, and per-rank counts
# (reduce_scatterv) with an empty segment; grids from one program to more than the chunks.
CASES = [
    (2, torch.bfloat16, [1, 1], 128, 1, 4),
    (2, torch.float32, [1037, 1037], 256, 3, 2),
    (3, torch.float16, [333, 333, 333], 128, 2, 4),
    (3, torch.bfloat16, [64, 0, 517], 128, 4, 4),
    (4, torch.float32, [8, 8, 8, 8], 128, 2, 4),
    (4, torch.bfloat16, [300, 301, 1, 77], 256, 2, 8),
    (8, torch.float16, [129] * 8, 128, 3, 4),
    (8, torch.float32, [5, 0, 17, 1, 64, 3, 0, 40], 128, 1, 1),
]


def _ids(cases):
    return [f"ws{c[0]}-{str(c[1])[6:]}-{'x'.join(map(str, sorted(set(c[2]))))}-b{c[3]}p{c[4]}" for c in cases]


def _reference(ins, counts, dtype):
    total = reference_sum(ins, dtype)
    starts = segments(counts, 1, padded=False).starts
    return [total[starts[r]:starts[r + 1]] for r in range(len(counts))]


def _launch(block, programs, warps):
    return dict(block=block, programs=programs, warps=warps)


@pytest.mark.parametrize("world_size, dtype, counts, block, programs, warps", CASES, ids=_ids(CASES))
def test_reduce_scatter_staged(world_size, dtype, counts, block, programs, warps):
    wss = workspaces(world_size)
    ins = [random_values(sum(counts), dtype, seed=rank) for rank in range(world_size)]
    outs, tails, expected = reduce_scatter(wss, ins, counts, _launch(block, programs, warps),
                                           even=len(set(counts)) == 1)
    for out, tail, want in zip(outs, tails, _reference(ins, counts, dtype)):
        assert torch.equal(out.view(torch.uint8), want.view(torch.uint8)), "bit-exact fixed-order fp32 sum"
        assert (tail == SENTINEL_BYTE).all(), "wrote past the end of the output"
    check_pads(wss, expected)
    layout = segments(counts, vec_of(dtype), padded=True)
    elem = ins[0].element_size()
    for rank, (ws, x) in enumerate(zip(wss, ins)):
        for s, (start, count) in enumerate(zip(layout.starts, layout.counts)):
            staged = stage_bytes_view(ws, rank, 512 + layout.stage_starts[s] * elem, count * elem)
            # the copy-in wrote it (s >= rank), or it was pre-staged with the same bytes (s < rank)
            assert torch.equal(staged, x[start:start + count].view(torch.uint8))
        end = 512 + (layout.stage_starts[-1] + layout.counts[-1]) * elem
        assert (stage_bytes_view(ws, rank, end, 64) == 0xFF).all(), "wrote past the end of the stage"


@pytest.mark.parametrize("world_size, dtype, counts, block, programs, warps",
                         [CASES[1], CASES[3], CASES[4], CASES[7]], ids=_ids([CASES[1], CASES[3], CASES[4], CASES[7]]))
def test_reduce_scatter_zero_copy(world_size, dtype, counts, block, programs, warps):
    """The inputs are the stages (Workspace.empty), at the same offset on every rank."""
    wss = workspaces(world_size)
    offset = 768
    ins = [ws.local_view("all_reduce", (sum(counts),), dtype, offset) for ws in wss]
    for rank, x in enumerate(ins):
        x.copy_(random_values(sum(counts), dtype, seed=rank + 10))
    before = [x.clone() for x in ins]
    outs, tails, expected = reduce_scatter(wss, ins, counts, _launch(block, programs, warps), stage_offset=offset,
                                           zero_copy=True, even=len(set(counts)) == 1)
    for out, tail, want in zip(outs, tails, _reference(before, counts, dtype)):
        assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))
        assert (tail == SENTINEL_BYTE).all()
    assert all(torch.equal(x, b) for x, b in zip(ins, before)), "the inputs are read, never written"
    check_pads(wss, expected)


@pytest.mark.parametrize("world_size, dtype, counts, block, programs, warps", CASES, ids=_ids(CASES))
def test_reduce_scatter_push(world_size, dtype, counts, block, programs, warps):
    """Posted writes into every peer's slots, then a local sum: the pull's bits. Slot p of each
    rank's stage holds rank p's copy (the slots of the ranks that ran first are real pushes)."""
    wss = workspaces(world_size)
    ins = [random_values(sum(counts), dtype, seed=rank + 30) for rank in range(world_size)]
    outs, tails, expected = reduce_scatter(wss, ins, counts, _launch(block, programs, warps),
                                           even=len(set(counts)) == 1, push=True)
    for out, tail, want in zip(outs, tails, _reference(ins, counts, dtype)):
        assert torch.equal(out.view(torch.uint8), want.view(torch.uint8)), "bit-exact fixed-order fp32 sum"
        assert (tail == SENTINEL_BYTE).all(), "wrote past the end of the output"
    check_pads(wss, expected)
    elem, slot = ins[0].element_size(), push_slot_units(counts, vec_of(dtype))
    starts = segments(counts, 1, padded=False).starts
    for rank, ws in enumerate(wss):
        for p, x in enumerate(ins):
            pushed = stage_bytes_view(ws, rank, 512 + p * slot * elem, counts[rank] * elem)
            assert torch.equal(pushed, x[starts[rank]:starts[rank + 1]].view(torch.uint8))
        end = 512 + ((world_size - 1) * slot + counts[rank]) * elem
        assert (stage_bytes_view(ws, rank, end, 64) == 0xFF).all(), "wrote past the last slot"


def test_equal_counts_through_the_table_match_the_even_path():
    """reduce_scatterv with equal counts (the table) gives the bits of the equal-segment path."""
    world_size, dtype, counts = 3, torch.bfloat16, [201, 201, 201]
    ins = [random_values(sum(counts), dtype, seed=rank + 3) for rank in range(world_size)]
    even, _, _ = reduce_scatter(workspaces(world_size), ins, counts, _launch(128, 2, 4), even=True)
    table, _, _ = reduce_scatter(workspaces(world_size), ins, counts, _launch(128, 2, 4), even=False)
    pushed, _, _ = reduce_scatter(workspaces(world_size), ins, counts, _launch(128, 2, 4), even=False, push=True)
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(even, table, pushed))


@pytest.mark.parametrize("push", [False, True], ids=["pull", "push"])
def test_world_size_one_copies_through(push):
    (ws,) = workspaces(1)
    x = random_values(1001, torch.float16, seed=1)
    (out,), (tail,), _ = reduce_scatter([ws], [x], [1001], _launch(256, 2, 4), push=push)
    assert torch.equal(out, x) and (tail == SENTINEL_BYTE).all()


@pytest.mark.parametrize("push", [False, True], ids=["pull", "push"])
def test_a_missing_peer_flags_the_error_and_the_kernel_completes(monkeypatch, push):
    """Only rank 0 runs and no signal is pre-set: both barriers of every program give up."""
    from autosymm.kernels.reduce_scatter import _reduce_scatter, _reduce_scatter_push

    tiny_poll_limit(monkeypatch, 3)
    wss = workspaces(2)
    ws, programs = wss[0], 2
    x, out = torch.ones(600), torch.zeros(300)
    args = (out, x, ws.region_ptrs("all_reduce"), ws.signal_ptrs("all_reduce"), torch.zeros(1, dtype=torch.int32), 0,
            300, 304, 0)
    flags = dict(WORLD_SIZE=2, BLOCK=128, ALIGNED=True, SEG_ALIGNED=False, EVEN=True, num_warps=4)
    if push:
        _reduce_scatter_push[(programs,)](*args, **flags)
    else:
        _reduce_scatter[(programs,)](*args, ZERO_COPY=False, **flags)
    assert error_counts(ws) == {"all_reduce": 2 * programs, "moe": 0, "moe_end": 0, "host": 0}
    assert int(pads(ws.buffer).count_nonzero()) == 0, "no signal came, none was consumed"
    assert int(pads(wss[1].buffer).sum()) == 2 * programs  # rank 0 still signalled its peer


# -- reduce-scatter + all-gather = all-reduce -------------------------------------------------

def _all_reduce(world_size, ins, kernel, launch):
    """The Triton all-reduce of ``ins`` on simulated ranks, staged at offset 1024 (one-shot:
    every stage pre-staged; two-shot: each phase on every rank before the next, as
    test_kernels_all_reduce runs it)."""
    wss = workspaces(world_size)
    xs = [x.clone() for x in ins]
    numel = xs[0].numel()
    grid, block, warps = (launch["programs"],), launch["block"], launch["warps"]
    if kernel == "one_shot":
        for ws, x in zip(wss, xs):
            ws.local_view("all_reduce", (numel,), x.dtype, 1024).copy_(x)
    preset([ws.buffer for ws in wss], launch["programs"], 2 if kernel == "one_shot" else 3)
    seg = segment_vecs(numel, world_size, xs[0].element_size())
    for phase in (0,) if kernel == "one_shot" else (1, 2, 3):
        for rank, (ws, x) in enumerate(zip(wss, xs)):
            common = (x, ws.region_ptrs("all_reduce"), ws.signal_ptrs("all_reduce"), numel, 1024)
            if kernel == "one_shot":
                _one_shot_all_reduce[grid](*common, 0, RANK=rank, WORLD_SIZE=world_size, BLOCK=block, ZERO_COPY=False,
                                           ALIGNED=True, DOUBLE_BUFFER=False, num_warps=warps)
            else:
                _two_shot_all_reduce[grid](*common, seg, 0, RANK=rank, WORLD_SIZE=world_size, BLOCK=block,
                                           ZERO_COPY=False, ALIGNED=True, MULTIMEM=False, PHASE=phase, num_warps=warps)
    return xs


@pytest.mark.parametrize("world_size, dtype, shard, kernel, push", [
    (2, torch.bfloat16, 517, "one_shot", False),
    (3, torch.float16, 64, "two_shot", True),
    (4, torch.bfloat16, 129, "two_shot", False),
    (8, torch.float32, 33, "one_shot", True),
])
def test_reduce_scatter_then_all_gather_is_the_all_reduce_bit_for_bit(world_size, dtype, shard, kernel, push):
    """``push``: both the push reduce-scatter and the push all-gather, else both pulls."""
    launch = _launch(128, 2, 4)
    ins = [random_values(world_size * shard, dtype, seed=rank + 20) for rank in range(world_size)]
    reduced = _all_reduce(world_size, ins, kernel, launch)
    counts = [shard] * world_size
    scattered, _, _ = reduce_scatter(workspaces(world_size), ins, counts, launch, push=push)
    gathered, _, _ = all_gather(workspaces(world_size), scattered, counts, launch, push=push)
    for x, y in zip(reduced, gathered):
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))
