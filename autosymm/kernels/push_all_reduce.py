"""The push one-shot all-reduce (Triton, device side only).

Every rank *stores* its x into its own slot of every peer's stage (posted NVLink writes, no
read round trip), signals, and each rank sums x and its stage's slots from local memory. No
copy-in (x is never read by a peer), one barrier per chunk, software-pipelined so a chunk's
reduce overlaps the next chunk's writes, plus an end barrier (none when DOUBLE_BUFFER). Per
rank: N out over NVLink to each of the W-1 peers (stage: W-1 slots of N), N read twice and
written once locally. Layout, chunking, the double-buffer epoch and the fp32 fixed-order sum
are those of autosymm.kernels.all_reduce (docs/KERNELS.md#kernels-all-reduce).
"""

import triton
import triton.language as tl

from .all_reduce import _chunks, _epoch_stage, _stage_ptr, _whole_vectors
from .barrier import barrier, publish, signal_peers, wait_peers


@triton.jit
def _slot_ptr(region_ptrs, receiver, sender, stage_offset, slot_bytes, ALIGNED: tl.constexpr,
              WORLD_SIZE: tl.constexpr, ELEM: tl.constexpr):
    """Pointer to the slot of ``receiver``'s stage that ``sender`` pushes into: slot
    ``(sender - receiver - 1) mod WORLD_SIZE`` (0..WORLD_SIZE-2), ``slot_bytes`` apart."""
    slot = (sender - receiver - 1 + WORLD_SIZE) % WORLD_SIZE
    return _stage_ptr(region_ptrs, receiver, stage_offset + slot * slot_bytes, ALIGNED, ELEM)


@triton.jit
def _push_chunk(x_ptr, region_ptrs, stage_offset, slot_bytes, offs, end, RANK: tl.constexpr,
                WORLD_SIZE: tl.constexpr, ALIGNED: tl.constexpr, MASKED: tl.constexpr):
    """Store x[offs] into this rank's slot of every peer's stage (posted NVLink writes)."""
    ELEM: tl.constexpr = x_ptr.dtype.element_ty
    if MASKED:
        val = tl.load(x_ptr + offs, mask=offs < end)
    else:
        val = tl.load(x_ptr + offs)
    for step in tl.static_range(1, WORLD_SIZE):
        peer = (RANK + step) % WORLD_SIZE  # staggered: every rank writes to a different peer first
        dst = _slot_ptr(region_ptrs, peer, RANK, stage_offset, slot_bytes, ALIGNED, WORLD_SIZE, ELEM) + offs
        if MASKED:
            tl.store(dst, val, mask=offs < end)
        else:
            tl.store(dst, val)


@triton.jit
def _reduce_pushed_chunk(x_ptr, region_ptrs, stage_offset, slot_bytes, offs, end, RANK: tl.constexpr,
                         WORLD_SIZE: tl.constexpr, ALIGNED: tl.constexpr, MASKED: tl.constexpr):
    """x[offs] = fp32 sum over ranks 0..WORLD_SIZE-1 (fixed order) of x (own) and the peers'
    pushed copies in this rank's stage (local memory only)."""
    ELEM: tl.constexpr = x_ptr.dtype.element_ty
    acc = tl.zeros(offs.shape, tl.float32)
    for peer in tl.static_range(WORLD_SIZE):
        if peer == RANK:
            src = x_ptr + offs
        else:
            src = _slot_ptr(region_ptrs, RANK, peer, stage_offset, slot_bytes, ALIGNED, WORLD_SIZE, ELEM) + offs
        # .cg: the slots are written by peers during this kernel, never serve them from L1.
        if MASKED:
            val = tl.load(src, mask=offs < end, other=0.0, cache_modifier=".cg")
        else:
            val = tl.load(src, cache_modifier=".cg")
        acc += val.to(tl.float32)
    if MASKED:
        tl.store(x_ptr + offs, acc.to(ELEM), mask=offs < end)
    else:
        tl.store(x_ptr + offs, acc.to(ELEM))


@triton.jit
def _wait_and_reduce(x_ptr, region_ptrs, signal_ptrs, stage_offset, slot_bytes, chunk, numel, n_full, lane, pid,
                     RANK: tl.constexpr, WORLD_SIZE: tl.constexpr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    """Consume every peer's signal for ``chunk`` (acquire), then reduce it from the stage."""
    wait_peers(signal_ptrs, pid, RANK, WORLD_SIZE)
    tl.debug_barrier()  # no thread reads the stage before the acquire above
    offs = chunk * BLOCK + lane
    if chunk < n_full:
        _reduce_pushed_chunk(x_ptr, region_ptrs, stage_offset, slot_bytes, offs, numel, RANK, WORLD_SIZE,
                             ALIGNED, False)
    else:
        _reduce_pushed_chunk(x_ptr, region_ptrs, stage_offset, slot_bytes, offs, numel, RANK, WORLD_SIZE,
                             ALIGNED, True)


@triton.jit(do_not_specialize=["numel", "stage_offset", "slot_bytes", "half_bytes"])
def _push_one_shot_all_reduce(x_ptr, region_ptrs, signal_ptrs, numel: tl.int32, stage_offset: tl.int64,
                              slot_bytes: tl.int64, half_bytes: tl.int64, RANK: tl.constexpr,
                              WORLD_SIZE: tl.constexpr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr,
                              DOUBLE_BUFFER: tl.constexpr, TAIL: tl.constexpr = 1):
    """x = sum over ranks of x; every rank *writes* its x into every peer's stage, then sums
    its own stage locally (see the module docstring).

    The stage of rank q holds WORLD_SIZE - 1 slots of ``slot_bytes`` (>= the bytes of x, a
    multiple of 256), one per sender (:func:`_slot_ptr`); x itself is never read by a peer, so
    any tensor is served without a copy-in.

    Software pipeline, per program: push chunk i (posted writes), wait for every peer's signal
    of chunk i-1 and reduce it from local memory while chunk i's writes drain over NVLink, then
    signal chunk i to every peer (release.sys after a CTA barrier: the pushes are visible to
    whoever acquires it; its fence waits for the writes, by then mostly acknowledged). Signal i
    depends only on wait i-1, which the peer's signal i-1 (sent before its wait i-1) satisfies:
    no cycle. The k-th signal a program consumes from a peer's program is that program's k-th
    (counting slots; every rank runs the same grid and chunk sequence), i.e. the one sent after
    it pushed the same chunk. A peer may run one chunk ahead: its next pushes go to other chunks
    of the slot, never to one we still read.

    Between calls. Single buffer: an end barrier (each program signals after its last read of
    its stage; a peer's kernel returns only after all its programs consumed those signals), so
    the next kernel's pushes, whatever its grid, land after every read. This kernel's own first
    pushes, before any barrier, rely on the same of the kernel before it: every single-buffer
    kernel ends with a barrier after its last read of its stage (autosymm.kernels.all_reduce). DOUBLE_BUFFER (all
    slots fit in ``half_bytes``): the stage alternates between two halves by the device epoch
    shared with the double-buffered pull one-shot (:func:`_epoch_stage`),
    and there is no end barrier: q pushes into rank r's half h in call m only after q's call
    m-1 (other parity) waited for r's signal of call m-1, which r sent after its call m-2
    (the previous one of parity h, whose reads of half h it completed) returned. Every program
    counts in after reading the epoch; the grid's last program stores epoch + 1 after its last
    signal, before its last wait (autosymm.kernels.barrier.publish): nothing at the kernel's end.
    """
    numel = _whole_vectors(numel, TAIL)
    pid, n_programs, n_chunks, n_full, lane = _chunks(numel, BLOCK)
    if DOUBLE_BUFFER:
        arrival_slot, epoch_slot, epoch, stage_offset = _epoch_stage(signal_ptrs, stage_offset, half_bytes, pid,
                                                                     n_programs, RANK)
    prev = -1
    for chunk in range(pid, n_chunks, n_programs):
        offs = chunk * BLOCK + lane
        if chunk < n_full:
            _push_chunk(x_ptr, region_ptrs, stage_offset, slot_bytes, offs, numel, RANK, WORLD_SIZE, ALIGNED, False)
        else:
            _push_chunk(x_ptr, region_ptrs, stage_offset, slot_bytes, offs, numel, RANK, WORLD_SIZE, ALIGNED, True)
        if prev >= 0:  # while this chunk's writes drain over NVLink: the previous chunk's reduce
            _wait_and_reduce(x_ptr, region_ptrs, signal_ptrs, stage_offset, slot_bytes, prev, numel, n_full,
                             lane, pid, RANK, WORLD_SIZE, BLOCK, ALIGNED)
        tl.debug_barrier()  # every thread's pushes of this chunk are issued before the release
        signal_peers(signal_ptrs, pid, RANK, WORLD_SIZE)  # its fence waits for them: little is left
        prev = chunk
    if DOUBLE_BUFFER:  # the last program: while its last signal flies
        publish(arrival_slot, epoch_slot, epoch + 1, pid, n_programs, signal_ptrs, WORLD_SIZE)
    if prev >= 0:
        _wait_and_reduce(x_ptr, region_ptrs, signal_ptrs, stage_offset, slot_bytes, prev, numel, n_full,
                         lane, pid, RANK, WORLD_SIZE, BLOCK, ALIGNED)
    if not DOUBLE_BUFFER:
        barrier(signal_ptrs, pid, RANK, WORLD_SIZE)  # every peer is done reading its stage
