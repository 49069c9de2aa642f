"""The Lamport one-shot all-reduce for small tensors (Triton, device side only).

No barrier: the data carries its own arrival mark. Every rank stores its x (its *wire* form, the
sign bit flipped, so the sentinel "not arrived" is the word 0) into its slot of buffer ``k % 3``
of every peer's receive buffers (the workspace's Lamport region, autosymm.geometry); each rank
spins with volatile loads on its own buffer until its chunk is there, sums in fp32 in the peer
order 0..W-1 and rounds once (the other one-shots' bits), and re-arms call k - 1's buffer.
Invariants: every rank runs the same sequence of Lamport calls since the last reset; three buffers
because a peer may run one call ahead, never two; the rotation index k % 3 lives on the device
(header word 0). Waits are bounded as autosymm.kernels.barrier's: after a timeout every result
since the last clean ``Workspace.barrier_errors()`` is suspect, and ``Workspace.reset_signals()``
must run on every rank before the next collective kernel.

Design notes: docs/KERNELS.md#kernels-lamport-all-reduce
"""

import triton
import triton.language as tl

from . import barrier as _barrier
from .all_reduce import _chunks, _whole_vectors

#: The header's words (int32 indices) and its size (bytes): autosymm.geometry.LAMPORT_HEADER_BYTES.
_INDEX_WORD: tl.constexpr = tl.constexpr(0)
_ARRIVAL_WORD: tl.constexpr = tl.constexpr(1)
_COUNT_WORD: tl.constexpr = tl.constexpr(2)
_HEADER_BYTES: tl.constexpr = tl.constexpr(256)


@triton.jit
def _buffer_ptr(region_ptrs, receiver, buffer, slot, slot_bytes, WORLD_SIZE: tl.constexpr, WIRE: tl.constexpr):
    """Slot ``slot`` of receive buffer ``buffer`` (0..2) in ``receiver``'s Lamport region."""
    offset = _HEADER_BYTES + (buffer.to(tl.int64) * (WORLD_SIZE - 1) + slot) * slot_bytes
    # the region is 256-byte aligned and slot_bytes a multiple of 256: 16-byte vectors
    return tl.multiple_of((tl.load(region_ptrs + receiver) + offset).to(tl.pointer_type(WIRE)), 16)


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
def _push(x_ptr, region_ptrs, buffer, slot_bytes, offs, end, RANK: tl.constexpr, WORLD_SIZE: tl.constexpr,
          MASKED: tl.constexpr):
    """Store x[offs] (wire form) into this rank's slot of ``buffer`` of every peer."""
    WIRE: tl.constexpr = tl.uint16 if x_ptr.dtype.element_ty.primitive_bitwidth == 16 else tl.uint32
    if MASKED:
        wire = _to_wire(tl.load(x_ptr + offs, mask=offs < end), WIRE)
    else:
        wire = _to_wire(tl.load(x_ptr + offs), WIRE)
    for step in tl.static_range(1, WORLD_SIZE):
        peer = (RANK + step) % WORLD_SIZE  # staggered: every rank writes to a different peer first
        dst = _buffer_ptr(region_ptrs, peer, buffer, WORLD_SIZE - step - 1, slot_bytes, WORLD_SIZE, WIRE) + offs
        if MASKED:
            tl.store(dst, wire, mask=offs < end)
        else:
            tl.store(dst, wire)


@triton.jit
def _rearm(region_ptrs, buffer, slot_bytes, count, pid, n_programs, RANK: tl.constexpr, WORLD_SIZE: tl.constexpr,
           BLOCK: tl.constexpr, WIRE: tl.constexpr):
    """Store the sentinel over the first ``count`` elements of every slot of our ``buffer``,
    rounded up to whole 16-byte vectors (past ``count`` a slot holds the sentinel already)."""
    VEC: tl.constexpr = 128 // WIRE.primitive_bitwidth
    count = (count + VEC - 1) // VEC * VEC
    lane = tl.arange(0, BLOCK)
    zeros = tl.zeros((BLOCK,), WIRE)
    for chunk in range(pid, tl.cdiv(count, BLOCK), n_programs):
        offs = chunk * BLOCK + lane
        for slot in tl.static_range(WORLD_SIZE - 1):
            dst = _buffer_ptr(region_ptrs, RANK, buffer, slot, slot_bytes, WORLD_SIZE, WIRE) + offs
            if (chunk + 1) * BLOCK <= count:
                tl.store(dst, zeros)
            else:
                tl.store(dst, zeros, mask=offs < count)


@triton.jit
def _await(src, offs, end, errors, MASKED: tl.constexpr):
    """The wire words at ``src + offs`` once none is the sentinel, or after MAX_POLLS polls that
    found one (then counted in ``errors``; masked lanes never wait)."""
    if MASKED:
        wire = tl.load(src + offs, mask=offs < end, other=1, volatile=True)
    else:
        wire = tl.load(src + offs, volatile=True)
    missing = tl.sum((wire == 0).to(tl.int32), axis=0)
    if missing > 0:  # slow path only
        # a channel that already timed out is stale until the host resets it: fail fast
        failed = tl.atomic_add(errors, 0, sem="relaxed", scope="gpu")
        polls = tl.where(failed == 0, 0, _barrier.MAX_POLLS)
        while (missing > 0) & (polls < _barrier.MAX_POLLS):
            if MASKED:
                wire = tl.load(src + offs, mask=offs < end, other=1, volatile=True)
            else:
                wire = tl.load(src + offs, volatile=True)
            missing = tl.sum((wire == 0).to(tl.int32), axis=0)
            polls += 1
        if missing > 0:
            tl.atomic_add(errors, 1, sem="relaxed", scope="gpu")
    return wire


@triton.jit
def _reduce(x_ptr, region_ptrs, errors, buffer, slot_bytes, offs, end, RANK: tl.constexpr,
            WORLD_SIZE: tl.constexpr, MASKED: tl.constexpr):
    """x[offs] = fp32 sum over ranks 0..WORLD_SIZE-1 (fixed order): our x, the peers' arrivals."""
    ELEM: tl.constexpr = x_ptr.dtype.element_ty
    WIRE: tl.constexpr = tl.uint16 if ELEM.primitive_bitwidth == 16 else tl.uint32  # ELEM's bits
    acc = tl.zeros(offs.shape, tl.float32)
    for peer in tl.static_range(WORLD_SIZE):
        if peer == RANK:
            if MASKED:
                val = tl.load(x_ptr + offs, mask=offs < end, other=0.0)
            else:
                val = tl.load(x_ptr + offs)
        else:
            slot = (peer - RANK - 1 + WORLD_SIZE) % WORLD_SIZE
            src = _buffer_ptr(region_ptrs, RANK, buffer, slot, slot_bytes, WORLD_SIZE, WIRE)
            val = _from_wire(_await(src, offs, end, errors, MASKED), ELEM)
        acc += val.to(tl.float32)
    if MASKED:
        tl.store(x_ptr + offs, acc.to(ELEM), mask=offs < end)
    else:
        tl.store(x_ptr + offs, acc.to(ELEM))


@triton.jit
def _advance(header, buffer, numel):
    """Count this program's arrival; the grid's last program resets the count and stores the
    next rotation index (mod 3) and this call's element count (every program read the old ones
    first: its loads precede its acq_rel arrival, which the last program's arrival acquires)."""
    tl.debug_barrier()  # every thread of this program is past its header loads
    arrived = tl.atomic_add(header + _ARRIVAL_WORD, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) - 1:
        tl.atomic_xchg(header + _ARRIVAL_WORD, 0, sem="relaxed", scope="gpu")
        tl.store(header + _COUNT_WORD, numel)
        tl.store(header + _INDEX_WORD, (buffer + 1) % 3)


@triton.jit(do_not_specialize=["numel", "slot_bytes"])
def _lamport_all_reduce(x_ptr, region_ptrs, signal_ptrs, numel: tl.int32, slot_bytes: tl.int64,
                        RANK: tl.constexpr, WORLD_SIZE: tl.constexpr, BLOCK: tl.constexpr,
                        TAIL: tl.constexpr = 1, PHASE: tl.constexpr = 0):
    """x = sum over ranks of x, in place, without a barrier (see the module docstring).

    ``region_ptrs[r]``: rank r's Lamport region; ``signal_ptrs[WORLD_SIZE]``: this rank's error
    slot of the 'all_reduce' channel (the only entry used). ``slot_bytes``: the region's slot
    stride (autosymm.geometry.LAMPORT_SLOT_BYTES, a multiple of 256, at least the bytes of x), the
    same in every call: the re-arm finds the previous call's data with it. PHASE 0 runs
    everything; 1 only the pushes, 2 the re-arm, the reads and the rotation (tests run phase 1 on every simulated rank, then phase 2).
    """
    ELEM: tl.constexpr = x_ptr.dtype.element_ty
    WIRE: tl.constexpr = tl.uint16 if ELEM.primitive_bitwidth == 16 else tl.uint32  # ELEM's bits
    numel = _whole_vectors(numel, TAIL)
    pid, n_programs, n_chunks, n_full, lane = _chunks(numel, BLOCK)
    header = tl.load(region_ptrs + RANK).to(tl.pointer_type(tl.int32))
    buffer = tl.load(header + _INDEX_WORD)  # the rotation index k % 3: this call's receive buffer
    if PHASE != 2:
        for chunk in range(pid, n_chunks, n_programs):
            offs = chunk * BLOCK + lane
            if chunk < n_full:
                _push(x_ptr, region_ptrs, buffer, slot_bytes, offs, numel, RANK, WORLD_SIZE, False)
            else:
                _push(x_ptr, region_ptrs, buffer, slot_bytes, offs, numel, RANK, WORLD_SIZE, True)
    if PHASE != 1:
        previous = tl.load(header + _COUNT_WORD)
        _rearm(region_ptrs, (buffer + 2) % 3, slot_bytes, previous, pid, n_programs, RANK, WORLD_SIZE, BLOCK, WIRE)
        errors = tl.load(signal_ptrs + WORLD_SIZE).to(tl.pointer_type(tl.int32))
        for chunk in range(pid, n_chunks, n_programs):
            offs = chunk * BLOCK + lane
            if chunk < n_full:
                _reduce(x_ptr, region_ptrs, errors, buffer, slot_bytes, offs, numel, RANK, WORLD_SIZE, False)
            else:
                _reduce(x_ptr, region_ptrs, errors, buffer, slot_bytes, offs, numel, RANK, WORLD_SIZE, True)
        _advance(header, buffer, numel)
