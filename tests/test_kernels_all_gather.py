"""The all-gather kernels (push and pull) under the Triton interpreter, ranks simulated in one
process: every output must equal the concatenated shards byte for byte, whatever the dtype
(integers included), the shard sizes (ragged, per-rank, empty) and the grid; regions poisoned,
outputs in front of sentinel bytes, signal pads balanced.
"""

import pytest
import torch

from autosymm.backends.rs_ag_layout import segments

from _all_reduce_sim import error_counts, pads, requires_interpreter, tiny_poll_limit
from _rs_ag_sim import (SENTINEL_BYTE, all_gather, check_pads, random_values, stage_bytes_view, workspaces)

pytestmark = requires_interpreter

# (world_size, dtype, per-rank counts in elements, block in bytes, programs, warps)
CASES = [
    (2, torch.bfloat16, [1, 1], 128, 1, 4),
    (2, torch.int8, [1037, 1037], 256, 3, 2),
    (3, torch.float32, [333, 333, 333], 512, 2, 4),
    (3, torch.int16, [64, 0, 517], 128, 4, 4),
    (4, torch.int64, [8, 8, 8, 8], 128, 2, 4),
    (4, torch.float16, [300, 301, 1, 77], 256, 2, 8),
    (8, torch.int32, [129] * 8, 256, 3, 4),
    (8, torch.uint8, [5, 0, 17, 1, 64, 3, 0, 40], 128, 1, 1),
]


def _ids(cases):
    return [f"ws{c[0]}-{str(c[1])[6:]}-{'x'.join(map(str, sorted(set(c[2]))))}-b{c[3]}p{c[4]}" for c in cases]


def _launch(block, programs, warps):
    return dict(block=block, programs=programs, warps=warps)


def _shards(dtype, counts, seed=0):
    return [random_values(count, dtype, seed=seed + rank) for rank, count in enumerate(counts)]


def _check(outs, tails, shards):
    """Every output is the shards' concatenation; ``tails`` (None: outputs in the region, checked
    by the caller) are the sentinel bytes after each output."""
    want = torch.cat(shards)
    for out in outs:
        assert torch.equal(out.view(torch.uint8), want.view(torch.uint8)), "every rank gets every shard, in rank order"
    for tail in tails or ():
        assert (tail == SENTINEL_BYTE).all(), "wrote past the end of the output"


@pytest.mark.parametrize("push", [False, True], ids=["pull", "push"])
@pytest.mark.parametrize("world_size, dtype, counts, block, programs, warps", CASES, ids=_ids(CASES))
def test_all_gather_staged(world_size, dtype, counts, block, programs, warps, push):
    wss = workspaces(world_size)
    shards = _shards(dtype, counts)
    outs, tails, expected = all_gather(wss, shards, counts, _launch(block, programs, warps), push=push,
                                       even=len(set(counts)) == 1)
    _check(outs, tails, shards)
    check_pads(wss, expected)
    elem = shards[0].element_size()
    layout = segments([c * elem for c in counts], 16, padded=push)
    for rank, ws in enumerate(wss):
        if push:  # shard q at its padded start of every peer's stage; a rank's own is never staged
            for q, count in enumerate(layout.counts):
                staged = stage_bytes_view(ws, rank, 512 + layout.stage_starts[q], count)
                assert torch.equal(staged, shards[q].view(torch.uint8)) if q != rank else (staged == 0xFF).all()
            end = 512 + layout.stage_starts[-1] + layout.counts[-1]
        else:  # a rank stages its own shard only
            assert torch.equal(stage_bytes_view(ws, rank, 512, layout.counts[rank]), shards[rank].view(torch.uint8))
            end = 512 + layout.counts[rank]
        assert (stage_bytes_view(ws, rank, end, 64) == 0xFF).all(), "wrote past the end of the stage"


def _region_tensors(wss, numel, dtype, offset):
    return [ws.local_view("all_reduce", (numel,), dtype, offset) for ws in wss]


@pytest.mark.parametrize("world_size, dtype, counts, block, programs, warps",
                         [CASES[1], CASES[3], CASES[4], CASES[7]], ids=_ids([CASES[1], CASES[3], CASES[4], CASES[7]]))
def test_all_gather_pull_zero_copy(world_size, dtype, counts, block, programs, warps):
    """Each input is the stage (Workspace.empty, the same offset on every rank; rank r's
    shard of count_r elements at its front)."""
    wss = workspaces(world_size)
    offset = 768
    inputs = _region_tensors(wss, max(counts), dtype, offset)
    shards = [x[:count] for x, count in zip(inputs, counts)]
    for shard, values in zip(shards, _shards(dtype, counts, seed=5)):
        shard.copy_(values)
    before = [s.clone() for s in shards]
    outs, tails, expected = all_gather(wss, shards, counts, _launch(block, programs, warps), push=False,
                                       stage_offset=offset, zero_copy=True, even=len(set(counts)) == 1)
    _check(outs, tails, before)
    assert all(torch.equal(s, b) for s, b in zip(shards, before)), "the inputs are read, never written"
    check_pads(wss, expected)


@pytest.mark.parametrize("world_size, dtype, counts, block, programs, warps",
                         [CASES[0], CASES[3], CASES[5], CASES[6]], ids=_ids([CASES[0], CASES[3], CASES[5], CASES[6]]))
def test_all_gather_push_zero_copy(world_size, dtype, counts, block, programs, warps):
    """The outputs are the stages: every rank stores its shard straight into every peer's output."""
    wss = workspaces(world_size)
    offset = 1024
    total = sum(counts)
    region_outs = _region_tensors(wss, total + 16, dtype, offset)  # 16 more: the bytes after must stay 0xFF
    outs = [o[:total] for o in region_outs]
    shards = _shards(dtype, counts, seed=9)
    outs, _, expected = all_gather(wss, shards, counts, _launch(block, programs, warps), push=True,
                                   stage_offset=offset, zero_copy=True, even=len(set(counts)) == 1, outs=outs)
    elem = shards[0].element_size()
    _check(outs, None, shards)
    for rank, ws in enumerate(wss):
        assert (stage_bytes_view(ws, rank, offset + total * elem, 16 * elem) == 0xFF).all(), "wrote past the output"
    check_pads(wss, expected)


@pytest.mark.parametrize("push", [False, True], ids=["pull", "push"])
def test_equal_counts_through_the_table_match_the_even_path(push):
    counts = [75, 75, 75]
    shards = _shards(torch.float16, counts, seed=2)
    even, _, _ = all_gather(workspaces(3), shards, counts, _launch(128, 2, 4), push=push, even=True)
    table, _, _ = all_gather(workspaces(3), shards, counts, _launch(128, 2, 4), push=push, even=False)
    assert all(torch.equal(a, b) for a, b in zip(even, table))


@pytest.mark.parametrize("push", [False, True], ids=["pull", "push"])
def test_world_size_one_copies_through(push):
    shard = random_values(1001, torch.int32, seed=4)
    (out,), (tail,), _ = all_gather(workspaces(1), [shard], [1001], _launch(256, 2, 4), push=push)
    assert torch.equal(out, shard) and (tail == SENTINEL_BYTE).all()


@pytest.mark.parametrize("push, zero_copy", [(False, False), (True, False), (True, True)])
def test_a_missing_peer_flags_the_error_and_the_kernel_completes(monkeypatch, push, zero_copy):
    """Only rank 0 runs and no signal is pre-set: both barriers of every program give up."""
    from autosymm.kernels.all_gather import _all_gather_pull, _all_gather_push

    tiny_poll_limit(monkeypatch, 3)
    wss = workspaces(2)
    ws, programs = wss[0], 2
    shard = torch.ones(300, dtype=torch.uint8)
    out = ws.local_view("all_reduce", (600,), torch.uint8, 0) if zero_copy else torch.zeros(600, dtype=torch.uint8)
    kernel = _all_gather_push if push else _all_gather_pull
    kernel[(programs,)](out, shard, ws.region_ptrs("all_reduce"), ws.signal_ptrs("all_reduce"),
                        torch.zeros(1, dtype=torch.int32), 0, 300, 304, 0 if zero_copy else 1024, WORLD_SIZE=2,
                        BLOCK=128, ZERO_COPY=zero_copy, ALIGNED=True, SEG_ALIGNED=False, EVEN=True, num_warps=4)
    assert error_counts(ws) == {"all_reduce": 2 * programs, "moe": 0, "moe_end": 0, "host": 0}
    assert int(pads(ws.buffer).count_nonzero()) == 0, "no signal came, none was consumed"
    assert int(pads(wss[1].buffer).sum()) == 2 * programs  # rank 0 still signalled its peer
    assert torch.equal(out[:300], shard), "its own shard still lands"
