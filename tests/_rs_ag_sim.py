"""Run the reduce-scatter and all-gather kernels on ranks simulated one after another
(interpreter), with the helpers of _all_reduce_sim (pre-set signals, poisoned regions).

Ranks run in turn, so a rank reads its peers' stages before the peers have run: each helper
pre-stages, for every rank, exactly what that rank's own launch will write there (a later run
writes the same bytes again), and leaves everything else poisoned (0xFF: NaN in every float
dtype, and a wrong value in every integer one). Whatever a kernel reads that nobody wrote shows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from autosymm.backends.rs_ag_layout import Segments, push_slot_units, segments
from autosymm.kernels.all_gather import _all_gather_pull, _all_gather_push
from autosymm.kernels.reduce_scatter import _reduce_scatter, _reduce_scatter_push

from _all_reduce_sim import pads, poisoned_workspaces, preset

REGION = "all_reduce"
SENTINEL_BYTE = 0x5A


def vec_of(dtype: torch.dtype) -> int:
    """Elements of ``dtype`` in 16 bytes."""
    return 16 // torch.empty((), dtype=dtype).element_size()


def random_values(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=gen).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -(1 << 30)), min(info.max, 1 << 30), (numel,), generator=gen, dtype=torch.int64).to(dtype)


def in_sentinel(numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, backing): ``x`` of ``numel`` elements at the front of a larger sentinel-filled buffer,
    so a write past its end shows in ``backing``."""
    elem = torch.empty((), dtype=dtype).element_size()
    backing = torch.full(((numel + 64) * elem,), SENTINEL_BYTE, dtype=torch.uint8)
    return backing[:numel * elem].view(dtype), backing[numel * elem:]


def bounds_tensor(layout: Segments) -> torch.Tensor:
    return torch.tensor(layout.table(), dtype=torch.int32)


def workspaces(world_size: int, region_bytes: int = 1 << 16):
    return poisoned_workspaces(world_size, region_bytes, 1 << 12)


def stage_bytes_view(ws, rank: int, offset: int, nbytes: int) -> torch.Tensor:
    """Bytes [offset, offset + nbytes) of rank ``rank``'s all-reduce region."""
    start = ws.regions[REGION].offset + offset
    return ws.peer_buffers[rank][start:start + nbytes]


def _launch_all(kernel, wss, outs, ins, layout: Segments, stage_offset: int, launch: dict, stride: int,
                **constexprs) -> None:
    """Launch ``kernel`` on every rank in turn (block, programs, warps in ``launch``; ``stride``:
    the stage stride, or the push reduce-scatter's slot)."""
    table = bounds_tensor(layout)
    for rank, ws in enumerate(wss):
        kernel[(launch["programs"],)](outs[rank], ins[rank], ws.region_ptrs(REGION), ws.signal_ptrs(REGION), table,
                                      rank, layout.seg, stride, stage_offset, WORLD_SIZE=len(wss),
                                      BLOCK=launch["block"], EVEN=layout.even, num_warps=launch["warps"],
                                      **constexprs)


def prestage_reduce_scatter(wss, ins, layout: Segments, stage_offset: int) -> None:
    """Rank q's stage gets the segments s < q of its input (those ranks read them before q runs)."""
    elem = ins[0].element_size()
    for rank, (ws, x) in enumerate(zip(wss, ins)):
        raw = x.view(torch.uint8)
        for s, (start, count) in enumerate(zip(layout.starts, layout.counts)):
            if s < rank:  # the others are the copy-in's to write
                at = stage_offset + layout.stage_starts[s] * elem
                stage_bytes_view(ws, rank, at, count * elem).copy_(raw[start * elem:(start + count) * elem])


def prestage_all_gather(wss, raw_shards, layout: Segments, stage_offset: int, push: bool) -> None:
    """Pull: every rank's stage but rank 0's gets its own shard (uint8). Push: rank r's stage
    gets the shards of the ranks q > r (at their padded starts), which push after r ran."""
    for rank, ws in enumerate(wss):
        if not push and rank > 0:
            stage_bytes_view(ws, rank, stage_offset, layout.counts[rank]).copy_(raw_shards[rank])
        for q in range(rank + 1, len(wss)) if push else ():
            start = stage_offset + layout.stage_starts[q]
            stage_bytes_view(ws, rank, start, layout.counts[q]).copy_(raw_shards[q])


def prestage_push_slots(wss, ins, layout: Segments, slot: int, stage_offset: int) -> None:
    """Slot p of rank r's stage gets segment r of rank p's input for the ranks p > r, which push
    it after r ran (the slots of p <= r must come from real pushes)."""
    elem = ins[0].element_size()
    for rank, ws in enumerate(wss):
        start, count = layout.starts[rank], layout.counts[rank]
        for p in range(rank + 1, len(wss)):
            raw = ins[p].view(torch.uint8)[start * elem:(start + count) * elem]
            stage_bytes_view(ws, rank, stage_offset + p * slot * elem, count * elem).copy_(raw)


def reduce_scatter(wss, ins, counts, launch: dict, *, stage_offset: int = 512, zero_copy: bool = False,
                   even: bool = True, push: bool = False):
    """Run the reduce-scatter on every rank; returns (outputs, their sentinel tails, expected pads).

    Staged: rank q's stage is pre-staged with the segments of the ranks that run before it
    (s < q), which read them before q's copy-in; q's copy-in must write the others (s >= q).
    ZERO_COPY: ``ins`` are the stages (at ``stage_offset`` of every region). ``push``: the push
    kernel, slots pre-staged by :func:`prestage_push_slots`."""
    dtype = ins[0].dtype
    layout = segments(counts, vec_of(dtype), padded=not zero_copy)
    if not even:  # the table path, even if the counts happen to be equal
        layout = Segments(layout.starts, layout.stage_starts, False, 0, 0, layout.seg_aligned)
    stride = layout.stage_seg
    if push:
        stride = push_slot_units(counts, vec_of(dtype))
        prestage_push_slots(wss, ins, layout, stride, stage_offset)
    elif not zero_copy:
        prestage_reduce_scatter(wss, ins, layout, stage_offset)
    aligned = stage_offset % 16 == 0 and (not zero_copy or layout.seg_aligned)
    expected = preset([ws.buffer for ws in wss], launch["programs"], 2)
    outs, tails = zip(*(in_sentinel(layout.counts[r], dtype) for r in range(len(wss))))
    flags = dict(ALIGNED=aligned, SEG_ALIGNED=layout.seg_aligned)
    if push:
        _launch_all(_reduce_scatter_push, wss, outs, ins, layout, stage_offset, launch, stride, **flags)
    else:
        _launch_all(_reduce_scatter, wss, outs, ins, layout, stage_offset, launch, stride, ZERO_COPY=zero_copy,
                    **flags)
    return list(outs), list(tails), expected


def all_gather(wss, shards, counts, launch: dict, *, push: bool, stage_offset: int = 512, zero_copy: bool = False,
               even: bool = True, outs=None):
    """Run the all-gather (uint8 views) on every rank; returns (outputs, sentinel tails, expected pads).

    ``counts`` in elements of the shards' dtype. Staged pull: every rank's stage but rank 0's
    (rank 0 runs first, its copy-in must write it) is pre-staged with its own shard. Staged push: rank r's stage is pre-staged with the shards of ranks
    > r only (earlier ranks really push theirs before r runs). ZERO_COPY: ``shards`` (pull) or
    ``outs`` (push, given) are the stages, at ``stage_offset``."""
    elem = shards[0].element_size()
    dtype = shards[0].dtype
    layout = segments([c * elem for c in counts], 16, padded=push and not zero_copy)
    if not even:
        layout = Segments(layout.starts, layout.stage_starts, False, 0, 0, layout.seg_aligned)
    raw = [s.view(torch.uint8) for s in shards]
    if not zero_copy:
        prestage_all_gather(wss, raw, layout, stage_offset, push)
    tails = []
    if outs is None:
        outs, tails = map(list, zip(*(in_sentinel(layout.total // elem, dtype) for _ in wss)))
    aligned = stage_offset % 16 == 0 and (not zero_copy or not push or layout.seg_aligned)
    expected = preset([ws.buffer for ws in wss], launch["programs"], 2)
    kernel = _all_gather_push if push else _all_gather_pull
    _launch_all(kernel, wss, [o.view(torch.uint8) for o in outs], raw, layout, stage_offset, launch, layout.stage_seg,
                ZERO_COPY=zero_copy, ALIGNED=aligned, SEG_ALIGNED=layout.seg_aligned)
    return outs, tails, expected


def check_pads(wss, expected) -> None:
    """Every pre-set signal consumed exactly once, every sent one landed."""
    for ws, want in zip(wss, expected):
        assert torch.equal(pads(ws.buffer), want), "signal pads out of balance"
        assert ws.barrier_errors() == 0


@triton.jit
def _round_kernel(src, dst, numel, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + offs, tl.load(src + offs, mask=offs < numel).to(dst.dtype.element_ty), mask=offs < numel)


def reference_sum(inputs, dtype: torch.dtype) -> torch.Tensor:
    """The kernels' sum, computed independently: fp32, ranks 0..W-1 in order from 0.0 (torch's
    fp32 additions are the IEEE ones the kernels do), rounded once by triton's own fp32 -> dtype
    conversion (on GPUs round-to-nearest-even; the interpreter's bf16 conversion truncates, and
    the kernels under test run through that same conversion)."""
    acc = torch.zeros(inputs[0].numel(), dtype=torch.float32)
    for x in inputs:
        acc += x.float()
    out = torch.empty(acc.numel(), dtype=dtype)
    if acc.numel():
        _round_kernel[(triton.cdiv(acc.numel(), 1024),)](acc, out, acc.numel(), BLOCK=1024)
    return out
