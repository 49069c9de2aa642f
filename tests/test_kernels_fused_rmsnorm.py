"""Fused all-reduce + residual add + RMSNorm data paths under the Triton interpreter.

Ranks are simulated one after another (tests/_all_reduce_sim): the pull one-shot finds its
peers' stages pre-filled (their copy-in writes the same values again) and their signals
pre-set; the push one-shot runs against snapshots of its peers with its own stage pre-filled
with what they would push; the two-shot runs each phase on every rank in turn. Regions are
NaN-poisoned, x and residual sit in sentinel-filled tensors, and every rank must end with a
bit-identical residual and output within one ulp of the float64 reference.
"""

import pytest
import torch

from autosymm.backends.triton_fused import split_scratch
from autosymm.geometry import DOUBLE_BUFFER_REGION, align
from autosymm.kernels.fused_rmsnorm import _one_shot_all_reduce_rmsnorm, _two_shot_all_reduce_rmsnorm

from _all_reduce_sim import pads, poisoned_workspaces, preset, requires_interpreter, snapshot_workspace
from _fused_ref import check, reference, ulps_off

pytestmark = requires_interpreter

REGION_BYTES = 1 << 17
HALF_BYTES = 1 << 16
STAGE = 768  # bytes into the all-reduce region
SENTINEL = 4321.0
EPS = 1e-6

# (world_size, dtype, n_rows, hidden, block, rows_per_program, programs, warps): odd token counts,
# hidden sizes below BLOCK (masked columns) and equal to it, more programs than row groups,
# groups cut by the end of the rows.
CASES = [
    (2, torch.bfloat16, 3, 4104, 8192, 2, 2, 4),
    (2, torch.float16, 1, 72, 128, 1, 1, 4),
    (3, torch.float32, 7, 40, 64, 2, 2, 2),
    (4, torch.bfloat16, 5, 256, 256, 4, 3, 4),
    (8, torch.bfloat16, 9, 136, 256, 1, 4, 2),
]


def _inputs(world_size, n_rows, hidden, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(n_rows, hidden, generator=gen).to(dtype) for _ in range(world_size)]
    residual = torch.randn(n_rows, hidden, generator=gen).to(dtype)
    weight = (1 + 0.5 * torch.randn(hidden, generator=gen)).to(dtype)
    return xs, residual, weight


def _in_sentinel(values):
    backing = torch.full((values.numel() + 64,), SENTINEL, dtype=values.dtype)
    backing[:values.numel()] = values.reshape(-1)
    return backing[:values.numel()].view(values.shape), backing


def _outputs(xs, residual):
    """Per rank: (x, x backing, residual copy, residual backing, out)."""
    out = []
    for x in xs:
        xv, xb = _in_sentinel(x)
        rv, rb = _in_sentinel(residual)
        out.append((xv, xb, rv, rb, torch.full_like(x, float("nan"))))
    return out


def _check_all(runs, xs, residual, weight):
    for xv, xb, rv, rb, out in runs:
        check(rv, out, xs, residual, weight, EPS)
        assert torch.equal(rv, runs[0][2]) and torch.equal(out, runs[0][4]), "ranks must end bit-identical"
        assert (xb[xv.numel():] == SENTINEL).all() and (rb[rv.numel():] == SENTINEL).all(), "wrote past the end"
    for (xv, *_), x in zip(runs, xs):
        assert torch.equal(xv, x), "x is left unchanged"




def _launch_one_shot(ws, run, weight, n_rows, hidden, case, *, push, double, offset, slot_bytes, split=1):
    world_size, _, _, _, block, rows, programs, warps = case
    xv, _, rv, _, out = run
    _one_shot_all_reduce_rmsnorm[(programs,)](xv, rv, weight, out, out, out, ws.region_ptrs("all_reduce"),
                                              ws.signal_ptrs("all_reduce"), *split_scratch(ws), split_scratch(ws)[0], n_rows, EPS, offset,
                                              slot_bytes, HALF_BYTES, RANK=ws.rank, WORLD_SIZE=world_size,
                                              HIDDEN=hidden, BLOCK=block, ROWS=rows, SPLIT=split, PUSH=push,
                                              DOUBLE_BUFFER=double, num_warps=warps)


def _double_offset(ws):
    return ws.regions[DOUBLE_BUFFER_REGION].offset - ws.regions["all_reduce"].offset


def _run_pull(case, xs, residual, weight, double):
    """The pull one-shot on every simulated rank; returns (workspaces, runs, expected pads)."""
    world_size, dtype, n_rows, hidden = case[:4]
    wss = poisoned_workspaces(world_size, REGION_BYTES, HALF_BYTES)
    for ws, x in zip(wss, xs):  # peers' copy-in, ahead of their turn
        base = _double_offset(ws) if double else STAGE
        ws.buffer[ws.regions["all_reduce"].offset + base:][:x.numel() * x.element_size()].view(dtype).copy_(
            x.reshape(-1))
    expected_pads = preset([ws.buffer for ws in wss], case[6], 1 if double else 2)
    runs = _outputs(xs, residual)
    for ws, run in zip(wss, runs):
        _launch_one_shot(ws, run, weight, n_rows, hidden, case, push=False, double=double,
                         offset=_double_offset(ws) if double else STAGE, slot_bytes=0)
    _check_all(runs, xs, residual, weight)
    return wss, runs, expected_pads


@pytest.mark.parametrize("double", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_one_shot_pull(case, double):
    world_size, dtype, n_rows, hidden = case[:4]
    xs, residual, weight = _inputs(world_size, n_rows, hidden, dtype, seed=n_rows * hidden)
    wss, runs, expected_pads = _run_pull(case, xs, residual, weight, double)
    for ws, want in zip(wss, expected_pads):
        got = pads(ws.buffer).clone()
        if double:
            got[1, ws.rank] = 0  # the epoch advanced by one
            assert int(pads(ws.buffer)[1, ws.rank]) == 1
        assert torch.equal(got, want)


def test_the_check_follows_the_fp32_sum_where_it_is_not_the_exact_one():
    """x0 + x1 in fp32 drops the low bits of a tiny x1; the residual's cancellation then leaves
    that loss 3 ulp wide. The kernel's sum is the documented fp32 one, which the check expects
    (against a float64 reference this correct kernel fails)."""
    case = (2, torch.bfloat16, 1, 256, 256, 1, 1, 4)
    xs, residual, weight = _inputs(2, 1, 256, torch.bfloat16, seed=7)
    xs[0][0, 5], xs[1][0, 5], residual[0, 5] = 1.8984375, -1.981854439e-06, -1.8984375
    _, runs, _ = _run_pull(case, xs, residual, weight, False)
    assert ulps_off(runs[0][2], reference(xs, residual, weight, EPS)[0]) == 3.0


def _slot_of(receiver, sender, world_size):
    return (sender - receiver - 1) % world_size


@pytest.mark.parametrize("double", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_one_shot_push(case, double):
    _push_case(case, double)


def _push_case(case, double, split=1):
    """The push one-shot on every rank against snapshots of its peers; checks results and slots."""
    world_size, dtype, n_rows, hidden = case[:4]
    wss = poisoned_workspaces(world_size, REGION_BYTES, HALF_BYTES)
    xs, residual, weight = _inputs(world_size, n_rows, hidden, dtype, seed=3 + n_rows)
    slot_bytes = align(xs[0].numel() * xs[0].element_size())
    for ws in wss:  # what the peers would push into this rank's stage; every peer's signals pre-set
        base = _double_offset(ws) if double else STAGE
        for q in range(world_size):
            if q != ws.rank:
                start = ws.regions["all_reduce"].offset + base + _slot_of(ws.rank, q, world_size) * slot_bytes
                ws.buffer[start:start + slot_bytes][:xs[q].numel() * xs[q].element_size()].view(dtype).copy_(
                    xs[q].reshape(-1))
    preset([ws.buffer for ws in wss], case[6], 1 if double else 2, all_peers=True)
    snapshots = [snapshot_workspace(wss, r) for r in range(world_size)]
    runs = _outputs(xs, residual)
    for ws, run in zip(snapshots, runs):
        _launch_one_shot(ws, run, weight, n_rows, hidden, case, push=True, double=double,
                         offset=_double_offset(ws) if double else STAGE, slot_bytes=slot_bytes, split=split)
        assert int(split_scratch(ws)[0].count_nonzero()) == 0, "every row's arrival counter is 0 again"
    _check_all(runs, xs, residual, weight)
    for rank, snap in enumerate(snapshots):  # this rank's pushes, in its peers' copies
        base = _double_offset(snap) if double else STAGE
        for q in range(world_size):
            if q != rank:
                start = snap.regions["all_reduce"].offset + base + _slot_of(q, rank, world_size) * slot_bytes
                pushed = snap.peer_buffers[q][start:start + xs[rank].numel() * xs[rank].element_size()]
                assert torch.equal(pushed.view(dtype), xs[rank].reshape(-1)), f"rank {rank} -> {q}: wrong slot"
        view = pads(snap.buffer).clone()
        view[1, rank] = 0  # the epoch
        assert int(view.count_nonzero()) == 0, "every pre-set signal consumed exactly once"


@pytest.mark.parametrize("case", CASES + [(2, torch.bfloat16, 1, 136, 256, 1, 2, 2)])  # one row: an empty segment
def test_two_shot(case):
    world_size, dtype, n_rows, hidden, block, rows, programs, warps = case
    wss = poisoned_workspaces(world_size, REGION_BYTES, HALF_BYTES)
    xs, residual, weight = _inputs(world_size, n_rows, hidden, dtype, seed=11 + hidden)
    out_offset = STAGE + align(xs[0].numel() * xs[0].element_size())
    expected_pads = preset([ws.buffer for ws in wss], programs, 3)
    runs = _outputs(xs, residual)
    for phase in (1, 2, 3):
        for ws, (xv, _, rv, _, out) in zip(wss, runs):
            _two_shot_all_reduce_rmsnorm[(programs,)](xv, rv, weight, out, out, out, ws.region_ptrs("all_reduce"),
                                                      ws.signal_ptrs("all_reduce"), n_rows, EPS, STAGE, out_offset,
                                                      RANK=ws.rank, WORLD_SIZE=world_size, HIDDEN=hidden,
                                                      BLOCK=block, ROWS=rows, PHASE=phase, num_warps=warps)
    _check_all(runs, xs, residual, weight)
    stage_end = wss[0].regions["all_reduce"].offset + out_offset + xs[0].numel() * xs[0].element_size()
    for ws, want in zip(wss, expected_pads):
        assert torch.equal(pads(ws.buffer), want)
        assert (ws.buffer[stage_end:stage_end + 64] == 0xFF).all(), "wrote past the end of the stage"


# Split rows: (world_size, dtype, n_rows, hidden, block, 1, programs, warps) and the split. Parts
# partly and wholly past HIDDEN (4104 of 8192 in 2; 136 of 256 in 8: 5 parts), fewer and more
# programs than (row, part) items, one row of 8192 in 8 parts (the case split rows are for).
SPLIT_CASES = [
    ((2, torch.bfloat16, 3, 4104, 8192, 1, 4, 4), 2),
    ((2, torch.float16, 5, 256, 256, 1, 32, 1), 4),
    ((4, torch.bfloat16, 2, 136, 256, 1, 3, 1), 8),
    ((2, torch.bfloat16, 1, 8192, 8192, 1, 8, 4), 8),
    ((3, torch.float16, 4, 200, 256, 1, 5, 1), 2),
]
SPLIT_IDS = [f"ws{c[0]}-{str(c[1])[6:]}-rows{c[2]}-h{c[3]}-split{split}" for c, split in SPLIT_CASES]


@pytest.mark.parametrize("case, split", SPLIT_CASES, ids=SPLIT_IDS)
def test_split_rows_pull_replayed(case, split):
    """The pull one-shot with SPLIT, called twice on every rank (a replay: the second call finds
    its arrival counters at 0 again and adds to the residual the first left)."""
    world_size, dtype, n_rows, hidden = case[:4]
    wss = poisoned_workspaces(world_size, REGION_BYTES, HALF_BYTES)
    xs, residual, weight = _inputs(world_size, n_rows, hidden, dtype, seed=5 + split)
    for ws, x in zip(wss, xs):  # peers' copy-in (the same both calls), ahead of their turn
        ws.buffer[ws.regions["all_reduce"].offset + STAGE:][:x.numel() * x.element_size()].view(dtype).copy_(
            x.reshape(-1))
    expected_pads = preset([ws.buffer for ws in wss], case[6], 4)
    runs = _outputs(xs, residual)
    residual_in = residual
    for call in range(2):
        for ws, run in zip(wss, runs):
            run[4].fill_(float("nan"))
            _launch_one_shot(ws, run, weight, n_rows, hidden, case, push=False, double=False, offset=STAGE,
                             slot_bytes=0, split=split)
            assert int(split_scratch(ws)[0].count_nonzero()) == 0, f"call {call}: arrival counters are 0 again"
        _check_all(runs, xs, residual_in, weight)
        residual_in = runs[0][2].clone()
    for ws, want in zip(wss, expected_pads):
        assert torch.equal(pads(ws.buffer), want)


@pytest.mark.parametrize("double", [False, True])
@pytest.mark.parametrize("case, split", SPLIT_CASES[:3], ids=SPLIT_IDS[:3])
def test_split_rows_push(case, split, double):
    _push_case(case, double, split)


def test_split_rows_are_normalised_from_the_unrounded_sum():
    """Sums far from bf16-representable: out follows the fp32 sum to one ulp (the stash holds the
    unrounded sums; normalising the rounded residual is up to 2 ulp off), as with whole rows, and
    the residual equals whole rows'."""
    case = (2, torch.bfloat16, 2, 256, 256, 1, 4, 1)
    xs, residual, weight = _inputs(2, 2, 256, torch.bfloat16, seed=9)
    xs[0] = xs[0] * 1000 + 0.3
    results = []
    for split in (1, 4):
        wss = poisoned_workspaces(2, REGION_BYTES, HALF_BYTES)
        for ws, x in zip(wss, xs):
            ws.buffer[ws.regions["all_reduce"].offset + STAGE:][:x.numel() * 2].view(torch.bfloat16).copy_(
                x.reshape(-1))
        preset([ws.buffer for ws in wss], case[6], 2)
        runs = _outputs(xs, residual)
        for ws, run in zip(wss, runs):
            _launch_one_shot(ws, run, weight, 2, 256, case, push=False, double=False, offset=STAGE, slot_bytes=0,
                             split=split)
        _check_all(runs, xs, residual, weight)
        results.append(runs[0])
    assert torch.equal(results[0][2], results[1][2]), "the same residual"
