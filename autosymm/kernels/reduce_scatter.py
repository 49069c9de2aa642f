"""Reduce-scatter (sum) over the symmetric workspace, pull and push (Triton, device side only).

Every rank holds a contiguous input of ``total`` elements (bf16, fp16 or fp32) cut into
WORLD_SIZE *segments* (equal, or a table: reduce_scatterv, :func:`_segment`). Rank r's output is
the sum over ranks of segment r, accumulated in fp32 in the fixed peer order 0..WORLD_SIZE-1 from
0.0 and rounded once: the bits the Triton all-reduce gives each element. Invariants: the
all-reduce's work split, per segment (program ``b`` owns chunks ``b, b+G, ...`` of every segment,
on every rank, in every phase), and its end barrier, so the next kernel may overwrite any stage;
the rank is a run-time argument (one compiled kernel serves every rank).
``_reduce_scatter_push`` stores into the peers' stages instead of loading from them.

Design notes: docs/KERNELS.md#kernels-reduce-scatter
"""

import triton
import triton.language as tl

from .all_reduce import _stage_ptr
from .barrier import barrier


@triton.jit
def _segment(bounds_ptr, seg, stage_seg, s, EVEN: tl.constexpr, WORLD_SIZE: tl.constexpr):
    """(start in the user tensor, count, start in the stage) of segment ``s``, in units
    (elements; bytes for autosymm.kernels.all_gather).

    EVEN: ``s * seg``, ``seg``, ``s * stage_seg``. Else the int32 table ``bounds_ptr``
    [2 * WORLD_SIZE + 1]: ``starts[0..WORLD_SIZE]`` (the last one is the total), then
    ``stage_starts[0..WORLD_SIZE-1]``; the same table on every rank."""
    if EVEN:
        start = s * seg
        count = seg
        stage_start = s * stage_seg
    else:
        start = tl.load(bounds_ptr + s)
        count = tl.load(bounds_ptr + s + 1) - start
        stage_start = tl.load(bounds_ptr + WORLD_SIZE + 1 + s)
    return start, count, stage_start


@triton.jit
def _at(ptr, offset, ALIGNED: tl.constexpr):
    """``ptr + offset``, declared 16-byte aligned when the host guarantees it (ALIGNED). The
    hint must sit on the pointer: an offset's divisibility does not reach the address."""
    ptr = ptr + offset
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def chunk_bounds(count, VEC: tl.constexpr):
    """(whole, tail lanes) of a segment of ``count`` elements: ``whole`` = count rounded down to
    VEC (16 bytes' worth; the rounding tells the compiler it is a multiple, so masks against it
    keep 128-bit accesses) and the VEC lanes from ``whole``, of which those < count are the tail."""
    whole = count // VEC * VEC
    return whole, whole + tl.arange(0, VEC)


@triton.jit
def copy_chunk(dst, src, offs, end, MASKED: tl.constexpr):
    """dst[offs] = src[offs] (only where offs < end when MASKED). .cg: a peer's data, produced
    during this kernel, is never served from L1."""
    if MASKED:
        mask = offs < end
        tl.store(dst + offs, tl.load(src + offs, mask=mask, cache_modifier=".cg"), mask=mask)
    else:
        tl.store(dst + offs, tl.load(src + offs, cache_modifier=".cg"))


@triton.jit
def copy_segment(dst, src, count, pid, n_programs, BLOCK: tl.constexpr, VEC: tl.constexpr):
    """dst[0:count] = src[0:count] over this program's chunks (see the module docstring)."""
    whole, tail = chunk_bounds(count, VEC)
    n_full = whole // BLOCK  # chunks of whole vectors only (compared by index: no int32 overflow)
    lane = tl.arange(0, BLOCK)
    for chunk in range(pid, tl.cdiv(count, BLOCK), n_programs):
        offs = chunk * BLOCK + lane
        if chunk < n_full:
            copy_chunk(dst, src, offs, count, False)
        else:  # the segment's last chunk: whole vectors, then the ragged tail
            copy_chunk(dst, src, offs, whole, True)
            copy_chunk(dst, src, tail, count, True)


@triton.jit
def _sum_chunk(out_ptr, region_ptrs, stage_offset, at, offs, end, rank, WORLD_SIZE: tl.constexpr,
               ALIGNED: tl.constexpr, ELEM: tl.constexpr, MASKED: tl.constexpr, SLOTS: tl.constexpr):
    """out[offs] = fp32 sum over p = 0..WORLD_SIZE-1 (fixed order, from 0.0), rounded once, of
    element ``offs`` of: rank p's stage at element ``at`` (pull), or slot p of this rank's own
    stage, ``at`` elements apart (SLOTS: the push). The same loads for every p, this rank
    included (no branch on the run-time rank), so all of them can be in flight at once."""
    mask = offs < end
    acc = tl.zeros(offs.shape, tl.float32)
    for p in tl.static_range(WORLD_SIZE):
        if SLOTS:
            src = _at(_stage_ptr(region_ptrs, rank, stage_offset, ALIGNED, ELEM), p * at, ALIGNED) + offs
        else:
            src = _at(_stage_ptr(region_ptrs, p, stage_offset, ALIGNED, ELEM), at, ALIGNED) + offs
        # .cg: written by peers during this kernel, never serve it from L1
        if MASKED:
            val = tl.load(src, mask=mask, other=0.0, cache_modifier=".cg")
        else:
            val = tl.load(src, cache_modifier=".cg")
        acc += val.to(tl.float32)
    if MASKED:
        tl.store(out_ptr + offs, acc.to(ELEM), mask=mask)
    else:
        tl.store(out_ptr + offs, acc.to(ELEM))


@triton.jit
def _sum_segment(out_ptr, region_ptrs, stage_offset, at, count, rank, pid, n_programs, WORLD_SIZE: tl.constexpr,
                 BLOCK: tl.constexpr, VEC: tl.constexpr, ALIGNED: tl.constexpr, ELEM: tl.constexpr,
                 SLOTS: tl.constexpr):
    """out[0:count] by :func:`_sum_chunk`, chunk c by program c mod n_programs: whole chunks
    unmasked, the last one as its whole 16-byte vectors, then its ragged tail."""
    whole, tail = chunk_bounds(count, VEC)
    n_full = whole // BLOCK
    lane = tl.arange(0, BLOCK)
    for chunk in range(pid, tl.cdiv(count, BLOCK), n_programs):
        offs = chunk * BLOCK + lane
        if chunk < n_full:
            _sum_chunk(out_ptr, region_ptrs, stage_offset, at, offs, count, rank, WORLD_SIZE, ALIGNED, ELEM, False,
                       SLOTS)
        else:
            _sum_chunk(out_ptr, region_ptrs, stage_offset, at, offs, whole, rank, WORLD_SIZE, ALIGNED, ELEM, True,
                       SLOTS)
            _sum_chunk(out_ptr, region_ptrs, stage_offset, at, tail, count, rank, WORLD_SIZE, ALIGNED, ELEM, True,
                       SLOTS)


@triton.jit(do_not_specialize=["rank", "seg", "stage_seg", "stage_offset"])
def _reduce_scatter(out_ptr, in_ptr, region_ptrs, signal_ptrs, bounds_ptr, rank, seg: tl.int32, stage_seg: tl.int32,
                    stage_offset: tl.int64, WORLD_SIZE: tl.constexpr, BLOCK: tl.constexpr, ZERO_COPY: tl.constexpr,
                    ALIGNED: tl.constexpr, SEG_ALIGNED: tl.constexpr, EVEN: tl.constexpr):
    """out = segment ``rank`` of the sum over ranks of ``in`` (see the module docstring).

    ``out_ptr``: this rank's ``count_rank`` elements (not inside any stage; it may be segment
    ``rank`` of a staged input); ``in_ptr``: the input (ZERO_COPY: this rank's stage,
    ``stage_offset`` bytes into its region, read through ``region_ptrs``).
    ``seg``/``stage_seg``: equal segments' length and stage stride (EVEN), else ignored for
    ``bounds_ptr``. ALIGNED: the stage and every ``stage_start`` are 16-byte aligned.
    SEG_ALIGNED: ``in_ptr`` is 16-byte aligned and every ``start`` a multiple of 16 bytes.
    """
    ELEM: tl.constexpr = in_ptr.dtype.element_ty
    VEC: tl.constexpr = 16 // (ELEM.primitive_bitwidth // 8)
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    if not ZERO_COPY:
        stage = _stage_ptr(region_ptrs, rank, stage_offset, ALIGNED, ELEM)
        for s in tl.static_range(WORLD_SIZE):
            start, count, stage_start = _segment(bounds_ptr, seg, stage_seg, s, EVEN, WORLD_SIZE)
            copy_segment(_at(stage, stage_start, ALIGNED), _at(in_ptr, start, SEG_ALIGNED), count, pid, n_programs,
                         BLOCK, VEC)
    barrier(signal_ptrs, pid, rank, WORLD_SIZE)  # every stage holds its rank's segments
    start, count, stage_start = _segment(bounds_ptr, seg, stage_seg, rank, EVEN, WORLD_SIZE)
    _sum_segment(out_ptr, region_ptrs, stage_offset, stage_start, count, rank, pid, n_programs, WORLD_SIZE, BLOCK,
                 VEC, ALIGNED, ELEM, False)
    barrier(signal_ptrs, pid, rank, WORLD_SIZE)  # no peer still reads our stage (ZERO_COPY: our input)


@triton.jit(do_not_specialize=["rank", "seg", "slot", "stage_offset"])
def _reduce_scatter_push(out_ptr, in_ptr, region_ptrs, signal_ptrs, bounds_ptr, rank, seg: tl.int32, slot: tl.int32,
                         stage_offset: tl.int64, WORLD_SIZE: tl.constexpr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr,
                         SEG_ALIGNED: tl.constexpr, EVEN: tl.constexpr):
    """out = segment ``rank`` of the sum over ranks of ``in``, by posted writes: every rank
    *stores* its segment s into slot ``rank`` of rank s's stage (this rank's own segment into
    its own stage, the same code), barrier, then sums its stage's WORLD_SIZE slots in slot
    order 0..WORLD_SIZE-1 from local memory (the pull's bits), end barrier (a peer's next
    pushes land in our slots at once, not before our reads).

    Slot p of a stage starts ``p * slot`` elements in (``slot``: the largest segment rounded up
    to 16 bytes, the same on every rank; ALIGNED: the stage is 16-byte aligned). Segments as in
    :func:`_segment` (the table's stage starts are unused). The input is only read locally, so
    any tensor is served with no copy-in and there is no zero-copy variant. Per rank (N = bytes
    of the input): N (W-1)/W out over NVLink (posted, no read round trip), N read locally twice.
    Chunk c of segment s is pushed by program b and, after the barrier, summed by rank s's
    program b (the module docstring's work split), so the per-program barrier orders them.
    """
    ELEM: tl.constexpr = in_ptr.dtype.element_ty
    VEC: tl.constexpr = 16 // (ELEM.primitive_bitwidth // 8)
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    for step in tl.static_range(WORLD_SIZE):
        dest = (rank + step) % WORLD_SIZE  # staggered: every rank writes to a different peer first
        start, count, _ = _segment(bounds_ptr, seg, slot, dest, EVEN, WORLD_SIZE)
        slot_ptr = _at(_stage_ptr(region_ptrs, dest, stage_offset, ALIGNED, ELEM), rank * slot, ALIGNED)
        copy_segment(slot_ptr, _at(in_ptr, start, SEG_ALIGNED), count, pid, n_programs, BLOCK, VEC)
    barrier(signal_ptrs, pid, rank, WORLD_SIZE)  # every slot of every stage holds its sender's segment
    start, count, _ = _segment(bounds_ptr, seg, slot, rank, EVEN, WORLD_SIZE)
    _sum_segment(out_ptr, region_ptrs, stage_offset, slot, count, rank, pid, n_programs, WORLD_SIZE, BLOCK,
                 VEC, ALIGNED, ELEM, True)
    barrier(signal_ptrs, pid, rank, WORLD_SIZE)  # no peer pushes into our slots before we read them
