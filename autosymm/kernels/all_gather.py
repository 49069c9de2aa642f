"""All-gather over the symmetric workspace, push and pull (Triton, device side only).

Bytes are copied whatever the dtype (the host passes uint8 views): rank s's shard lands at byte
``start_s`` of every rank's output (equal shards, or all_gatherv's table from
autosymm.kernels.reduce_scatter's ``_segment``), as 16-byte vectors with a byte-granular tail.
The work split, the per-program barriers and the end-barrier rule (a kernel returns only after
every peer's same program is past its last access to this rank's stage) are
autosymm.kernels.reduce_scatter's. ``_all_gather_pull``: the shard staged (or the zero-copy
input), barrier, every peer's shard read, end barrier. ``_all_gather_push``: the shard stored into
every peer's stage and our output, barrier, copy-out, end barrier (zero-copy: a start barrier, the
pushes land in the peers' outputs, one barrier). Traffic per rank: the design notes.

Design notes: docs/KERNELS.md#kernels-all-gather
"""

import triton
import triton.language as tl

from .all_reduce import _stage_ptr
from .barrier import barrier
from .reduce_scatter import _at, _segment, chunk_bounds, copy_segment

#: Bytes of one vector: the kernels' unit of alignment.
_VEC: tl.constexpr = tl.constexpr(16)


@triton.jit
def _peer_stage(region_ptrs, peer, stage_offset, ALIGNED: tl.constexpr):
    return _stage_ptr(region_ptrs, peer, stage_offset, ALIGNED, tl.uint8)


@triton.jit(do_not_specialize=["rank", "seg", "stage_seg", "stage_offset"])
def _all_gather_pull(out_ptr, in_ptr, region_ptrs, signal_ptrs, bounds_ptr, rank, seg: tl.int32, stage_seg: tl.int32,
                     stage_offset: tl.int64, WORLD_SIZE: tl.constexpr, BLOCK: tl.constexpr, ZERO_COPY: tl.constexpr,
                     ALIGNED: tl.constexpr, SEG_ALIGNED: tl.constexpr, EVEN: tl.constexpr):
    """out[start_s : start_s + count_s] = rank s's input, for every s (uint8; see the module
    docstring). ``stage_seg`` is unused (a pull stage holds one shard, at its start).
    ALIGNED: the stage is 16-byte aligned; SEG_ALIGNED: ``out_ptr`` is, and every ``start_s``
    is a multiple of 16."""
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    start, count, _ = _segment(bounds_ptr, seg, stage_seg, rank, EVEN, WORLD_SIZE)
    if not ZERO_COPY:
        copy_segment(_peer_stage(region_ptrs, rank, stage_offset, ALIGNED), in_ptr, count, pid, n_programs, BLOCK,
                     _VEC)
    barrier(signal_ptrs, pid, rank, WORLD_SIZE)  # every stage holds its rank's shard
    for step in tl.static_range(WORLD_SIZE):
        peer = (rank + step) % WORLD_SIZE  # staggered: every rank reads a different peer first
        start, count, _ = _segment(bounds_ptr, seg, stage_seg, peer, EVEN, WORLD_SIZE)
        dst = _at(out_ptr, start, SEG_ALIGNED)
        if step == 0:
            copy_segment(dst, in_ptr, count, pid, n_programs, BLOCK, _VEC)
        else:
            copy_segment(dst, _peer_stage(region_ptrs, peer, stage_offset, ALIGNED), count, pid, n_programs, BLOCK,
                         _VEC)
    barrier(signal_ptrs, pid, rank, WORLD_SIZE)  # no peer still reads our stage (ZERO_COPY: our input)


@triton.jit
def _push_chunk(out_shard, in_ptr, region_ptrs, stage_offset, stage_start, offs, end, rank,
                WORLD_SIZE: tl.constexpr, ALIGNED: tl.constexpr, MASKED: tl.constexpr):
    """Store in[offs] into our output's shard and at ``stage_start`` of every peer's stage."""
    mask = offs < end
    if MASKED:
        val = tl.load(in_ptr + offs, mask=mask)
        tl.store(out_shard + offs, val, mask=mask)
    else:
        val = tl.load(in_ptr + offs)
        tl.store(out_shard + offs, val)
    for step in tl.static_range(1, WORLD_SIZE):
        peer = (rank + step) % WORLD_SIZE  # staggered: every rank writes to a different peer first
        dst = _at(_peer_stage(region_ptrs, peer, stage_offset, ALIGNED), stage_start, ALIGNED) + offs
        if MASKED:
            tl.store(dst, val, mask=mask)
        else:
            tl.store(dst, val)


@triton.jit(do_not_specialize=["rank", "seg", "stage_seg", "stage_offset"])
def _all_gather_push(out_ptr, in_ptr, region_ptrs, signal_ptrs, bounds_ptr, rank, seg: tl.int32, stage_seg: tl.int32,
                     stage_offset: tl.int64, WORLD_SIZE: tl.constexpr, BLOCK: tl.constexpr, ZERO_COPY: tl.constexpr,
                     ALIGNED: tl.constexpr, SEG_ALIGNED: tl.constexpr, EVEN: tl.constexpr):
    """out[start_s : start_s + count_s] = rank s's input, for every s (uint8; see the module
    docstring). Staged: shard s sits at ``stage_start_s`` of the stage (16-byte aligned, so
    ALIGNED means the stage base is); ZERO_COPY: the output is the stage, ``stage_start_s =
    start_s`` (ALIGNED then also says every ``start_s`` is a multiple of 16)."""
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    if ZERO_COPY:
        barrier(signal_ptrs, pid, rank, WORLD_SIZE)  # every peer's output is free to be written
    start, count, stage_start = _segment(bounds_ptr, seg, stage_seg, rank, EVEN, WORLD_SIZE)
    out_shard = _at(out_ptr, start, SEG_ALIGNED)
    whole, tail = chunk_bounds(count, _VEC)
    n_full = whole // BLOCK
    lane = tl.arange(0, BLOCK)
    for chunk in range(pid, tl.cdiv(count, BLOCK), n_programs):
        offs = chunk * BLOCK + lane
        if chunk < n_full:
            _push_chunk(out_shard, in_ptr, region_ptrs, stage_offset, stage_start, offs, count, rank, WORLD_SIZE,
                        ALIGNED, False)
        else:  # the last chunk: whole vectors, then the ragged tail
            _push_chunk(out_shard, in_ptr, region_ptrs, stage_offset, stage_start, offs, whole, rank, WORLD_SIZE,
                        ALIGNED, True)
            _push_chunk(out_shard, in_ptr, region_ptrs, stage_offset, stage_start, tail, count, rank, WORLD_SIZE,
                        ALIGNED, True)
    barrier(signal_ptrs, pid, rank, WORLD_SIZE)  # every peer's shard is in our stage
    if not ZERO_COPY:
        stage = _peer_stage(region_ptrs, rank, stage_offset, ALIGNED)
        for step in tl.static_range(1, WORLD_SIZE):
            peer = (rank + step) % WORLD_SIZE
            start, count, stage_start = _segment(bounds_ptr, seg, stage_seg, peer, EVEN, WORLD_SIZE)
            copy_segment(_at(out_ptr, start, SEG_ALIGNED), _at(stage, stage_start, ALIGNED), count, pid, n_programs,
                         BLOCK, _VEC)
        # End barrier: a peer's next push writes our stage at once, not before this copy-out.
        barrier(signal_ptrs, pid, rank, WORLD_SIZE)
