"""The Lamport one-shot all-reduce for small tensors (Triton, device side only).

No barrier: the data carries its own arrival mark. Every rank stores its x (its *wire* form, the
sign bit flipped, so the sentinel "not arrived" is the word 0) into its slot of buffer ``k % 3``
of every peer's receive buffers (the workspace's Lamport region); each rank polls its own buffer
with volatile loads until the whole chunk is there, sums in fp32 in the peer order 0..W-1, rounds
once (the other one-shots' bits) and re-arms (zeroes) what it read at once. Invariants: every rank
runs the same sequence of Lamport calls since the last reset; a peer runs at most one call ahead;
the rotation index k % 3 lives on the device (header word 0), advanced by the grid's last program
once all have read it (autosymm.kernels.barrier's ``count_in`` / ``publish``). Waits are bounded as
the barrier's (then ``Workspace.reset_signals()`` on every rank). The fused all-reduce + RMSNorm's
Lamport variant shares the region, rotation and helpers: Lamport calls of both ops are one sequence.

Design notes: docs/KERNELS.md#kernels-lamport-all-reduce
"""

import triton
import triton.language as tl

from . import barrier as _barrier
from .all_reduce import _chunks, _whole_vectors
from .barrier import count_in, publish

#: The header's words (int32 indices) and its size (bytes): autosymm.geometry.LAMPORT_HEADER_BYTES.
#: Word 2 (the previous call's element count) is no longer used: every call re-arms what it read.
_INDEX_WORD: tl.constexpr = tl.constexpr(0)
_ARRIVAL_WORD: tl.constexpr = tl.constexpr(1)
_HEADER_BYTES: tl.constexpr = tl.constexpr(256)


@triton.jit
def lamport_offset(buffer, slot_bytes, WORLD_SIZE: tl.constexpr):
    """Byte offset, in a Lamport region, of receive buffer ``buffer`` (0..2): its WORLD_SIZE - 1
    slots follow, ``slot_bytes`` apart, sender s in slot ``(s - receiver - 1) mod WORLD_SIZE``:
    the push one-shot's stage layout (autosymm.kernels.push_all_reduce._slot_ptr) at this offset."""
    return _HEADER_BYTES + buffer.to(tl.int64) * (WORLD_SIZE - 1) * slot_bytes


@triton.jit
def _slot(region_ptrs, receiver, sender, offset, slot_bytes, WORLD_SIZE: tl.constexpr, WIRE: tl.constexpr):
    """Sender ``sender``'s slot in ``receiver``'s buffer at ``offset``, as WIRE words."""
    slot = (sender - receiver - 1 + WORLD_SIZE) % WORLD_SIZE
    # the region is 256-byte aligned and slot_bytes a multiple of 256: 16-byte vectors
    return tl.multiple_of((tl.load(region_ptrs + receiver) + offset + slot * slot_bytes).to(tl.pointer_type(WIRE)), 16)


@triton.jit
def _to_wire(val, WIRE: tl.constexpr):
    """Wire form of ``val``: its bits with the sign flipped, -0.0 sent as +0.0 (never the sentinel 0)."""
    sign: tl.constexpr = 1 << (WIRE.primitive_bitwidth - 1)
    bits = val.to(WIRE, bitcast=True)
    return tl.where(bits == sign, sign, bits ^ sign).to(WIRE)


@triton.jit
def _from_wire(wire, ELEM: tl.constexpr):
    sign: tl.constexpr = 1 << (wire.dtype.primitive_bitwidth - 1)
    return (wire ^ sign).to(wire.dtype).to(ELEM, bitcast=True)


@triton.jit
def push_wire(val, region_ptrs, offset, slot_bytes, offs, mask, RANK: tl.constexpr, WORLD_SIZE: tl.constexpr,
              MASKED: tl.constexpr):
    """Store ``val`` (this rank's elements at ``offs``, any shape) in wire form into this rank's slot
    of the buffer at ``offset`` of every peer (posted writes; the data is its own flag)."""
    WIRE: tl.constexpr = tl.uint16 if val.dtype.primitive_bitwidth == 16 else tl.uint32  # val's bits
    wire = _to_wire(val, WIRE)
    for step in tl.static_range(1, WORLD_SIZE):
        peer = (RANK + step) % WORLD_SIZE  # staggered: every rank writes to a different peer first
        dst = _slot(region_ptrs, peer, RANK, offset, slot_bytes, WORLD_SIZE, WIRE) + offs
        if MASKED:
            tl.store(dst, wire, mask=mask)
        else:
            tl.store(dst, wire)


@triton.jit
def _poll_sum(own, region_ptrs, offset, slot_bytes, offs, mask, RANK: tl.constexpr, WORLD_SIZE: tl.constexpr,
              MASKED: tl.constexpr):
    """(fp32 sum over ranks 0..W-1 in order of ``own`` and the peers' wire words at ``offs`` of this
    rank's buffer, how many of those words are still the sentinel): one volatile load per peer,
    all in flight together (never served from L1)."""
    WIRE: tl.constexpr = tl.uint16 if own.dtype.primitive_bitwidth == 16 else tl.uint32  # own's bits
    acc = tl.zeros(offs.shape, tl.float32)
    missing = tl.zeros(offs.shape, tl.int32)
    for peer in tl.static_range(WORLD_SIZE):
        if peer == RANK:
            acc += own.to(tl.float32)
        else:
            src = _slot(region_ptrs, RANK, peer, offset, slot_bytes, WORLD_SIZE, WIRE) + offs
            if MASKED:
                wire = tl.load(src, mask=mask, other=1, volatile=True)  # masked lanes never wait
            else:
                wire = tl.load(src, volatile=True)
            missing += (wire == 0).to(tl.int32)
            acc += _from_wire(wire, own.dtype).to(tl.float32)
    return acc, tl.sum(missing, axis=None)  # over every axis (a 1-D chunk or a row tile)


@triton.jit
def lamport_sum(own, region_ptrs, signal_ptrs, offset, slot_bytes, offs, mask, RANK: tl.constexpr,
                WORLD_SIZE: tl.constexpr, MASKED: tl.constexpr):
    """fp32 sum over ranks 0..W-1 (fixed order) of ``own`` (this rank's elements at ``offs``) and
    the peers' pushes of the same elements into this rank's buffer at ``offset``, once every one
    has arrived (or after MAX_POLLS polls that found one missing: then counted in this rank's error
    slot ``signal_ptrs[WORLD_SIZE]``, the missing words add -0.0, i.e. nothing); then re-arms
    those words (stores the sentinel over what it read)."""
    WIRE: tl.constexpr = tl.uint16 if own.dtype.primitive_bitwidth == 16 else tl.uint32  # own's bits
    acc, missing = _poll_sum(own, region_ptrs, offset, slot_bytes, offs, mask, RANK, WORLD_SIZE, MASKED)
    if missing > 0:  # slow path only: a peer's chunk is not all there yet; poll every peer again
        errors = tl.load(signal_ptrs + WORLD_SIZE).to(tl.pointer_type(tl.int32))
        # a channel that already timed out is stale until the host resets it: fail fast
        failed = tl.load(errors, cache_modifier=".cv")  # a hint: fetched again, not served from L1
        polls = tl.where(failed == 0, 0, _barrier.MAX_POLLS)
        while (missing > 0) & (polls < _barrier.MAX_POLLS):
            acc, missing = _poll_sum(own, region_ptrs, offset, slot_bytes, offs, mask, RANK, WORLD_SIZE, MASKED)
            polls += 1
        if missing > 0:
            tl.atomic_add(errors, 1, sem="relaxed", scope="gpu")
    # Re-arm at once. Who writes these words next: a peer's call k + 3 (the rotation), which it
    # starts only after its call k + 2 saw this rank's call k + 2 pushes, made after this kernel
    # (and these stores) completed; a peer one call ahead writes buffer k + 1, never this one.
    zeros = tl.zeros(offs.shape, WIRE)
    for peer in tl.static_range(WORLD_SIZE):
        if peer != RANK:
            dst = _slot(region_ptrs, RANK, peer, offset, slot_bytes, WORLD_SIZE, WIRE) + offs
            if MASKED:
                tl.store(dst, zeros, mask=mask)
            else:
                tl.store(dst, zeros)
    return acc


@triton.jit
def lamport_buffer(header_ptr):
    """This call's receive buffer, the rotation index k % 3 (header word 0; every program reads it
    before it counts in: see :func:`lamport_rotate`)."""
    return tl.load(header_ptr + _INDEX_WORD)


@triton.jit
def lamport_count_in(header_ptr, pid, n_programs):
    """Count this program in once it has read the rotation index (autosymm.kernels.barrier.count_in)."""
    count_in(header_ptr + _ARRIVAL_WORD, pid, n_programs)


@triton.jit
def lamport_rotate(header_ptr, signal_ptrs, buffer, pid, n_programs, WORLD_SIZE: tl.constexpr):
    """The grid's last program stores the next rotation index once every program counted in
    (autosymm.kernels.barrier.publish): the next Lamport call on this rank (stream order) uses the
    next buffer, any grid advances it by exactly one, and a CUDA graph replays unchanged."""
    publish(header_ptr + _ARRIVAL_WORD, header_ptr + _INDEX_WORD, (buffer + 1) % 3, pid, n_programs, signal_ptrs,
            WORLD_SIZE)


@triton.jit
def _reduce_chunk(x_ptr, region_ptrs, signal_ptrs, offset, slot_bytes, offs, end, RANK: tl.constexpr,
                  WORLD_SIZE: tl.constexpr, MASKED: tl.constexpr):
    """x[offs] = the Lamport sum of this chunk, rounded once."""
    mask = offs < end
    if MASKED:
        own = tl.load(x_ptr + offs, mask=mask, other=0.0)
    else:
        own = tl.load(x_ptr + offs)
    acc = lamport_sum(own, region_ptrs, signal_ptrs, offset, slot_bytes, offs, mask, RANK, WORLD_SIZE, MASKED)
    if MASKED:
        tl.store(x_ptr + offs, acc.to(x_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(x_ptr + offs, acc.to(x_ptr.dtype.element_ty))


@triton.jit
def _push_chunk(x_ptr, region_ptrs, offset, slot_bytes, offs, end, RANK: tl.constexpr, WORLD_SIZE: tl.constexpr,
                MASKED: tl.constexpr):
    mask = offs < end
    if MASKED:
        val = tl.load(x_ptr + offs, mask=mask)
    else:
        val = tl.load(x_ptr + offs)
    push_wire(val, region_ptrs, offset, slot_bytes, offs, mask, RANK, WORLD_SIZE, MASKED)


@triton.jit(do_not_specialize=["numel", "slot_bytes"])
def _lamport_all_reduce(x_ptr, region_ptrs, signal_ptrs, header_ptr, numel: tl.int32, slot_bytes: tl.int64,
                        RANK: tl.constexpr, WORLD_SIZE: tl.constexpr, BLOCK: tl.constexpr,
                        TAIL: tl.constexpr = 1, PHASE: tl.constexpr = 0):
    """x = sum over ranks of x, in place, without a barrier (see the module docstring).

    ``region_ptrs[r]``: rank r's Lamport region; ``header_ptr``: this rank's (its header, passed as
    an argument so the rotation index is one load away); ``signal_ptrs[WORLD_SIZE]``: this rank's
    error slot of the 'all_reduce' channel (the only entry used, on slow paths). ``slot_bytes``:
    the region's slot stride (autosymm.geometry.LAMPORT_SLOT_BYTES, a multiple of 256, at least
    the bytes of x). PHASE 0 runs everything; 1 only the pushes, 2 the rotation and the reads
    (tests run phase 1 on every simulated rank, then phase 2).

    Order: read the index, count in (release: after that read), push every chunk, the last program
    publishes the next index (its wait for the others' count overlaps the pushes' flight), then
    poll, sum, store and re-arm each chunk. Nothing follows the last store.
    """
    numel = _whole_vectors(numel, TAIL)
    pid, n_programs, n_chunks, n_full, lane = _chunks(numel, BLOCK)
    buffer = lamport_buffer(header_ptr)
    offset = lamport_offset(buffer, slot_bytes, WORLD_SIZE)
    if PHASE != 1:
        lamport_count_in(header_ptr, pid, n_programs)
    if PHASE != 2:
        for chunk in range(pid, n_chunks, n_programs):
            offs = chunk * BLOCK + lane
            if chunk < n_full:
                _push_chunk(x_ptr, region_ptrs, offset, slot_bytes, offs, numel, RANK, WORLD_SIZE, False)
            else:
                _push_chunk(x_ptr, region_ptrs, offset, slot_bytes, offs, numel, RANK, WORLD_SIZE, True)
    if PHASE != 1:
        lamport_rotate(header_ptr, signal_ptrs, buffer, pid, n_programs, WORLD_SIZE)
        for chunk in range(pid, n_chunks, n_programs):
            offs = chunk * BLOCK + lane
            if chunk < n_full:
                _reduce_chunk(x_ptr, region_ptrs, signal_ptrs, offset, slot_bytes, offs, numel, RANK, WORLD_SIZE,
                              False)
            else:
                _reduce_chunk(x_ptr, region_ptrs, signal_ptrs, offset, slot_bytes, offs, numel, RANK, WORLD_SIZE,
                              True)
