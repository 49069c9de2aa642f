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


def _spin_asm(pack: int, bits: int) -> str:
    """PTX of :func:`_spin` over ``pack`` words of ``bits`` bits: operands $0.. the words out, then
    (``pack`` each) the first poll's words (as u32), their addresses, the error count read at the
    start, the poll limit, the error slot's address. Block-scoped (registers and labels), so a
    kernel may hold many instances."""
    outs = [f"${i}" for i in range(pack)]
    firsts = [f"${pack + i}" for i in range(pack)]
    addrs = [f"${2 * pack + i}" for i in range(pack)]
    failed, limit, errors = f"${3 * pack}", f"${4 * pack}", f"${5 * pack}"
    missing = [f"setp.eq.u32 %lw_m, {outs[0]}, 0;"] + [f"setp.eq.or.u32 %lw_m, {o}, 0, %lw_m;" for o in outs[1:]]
    reloads = []
    for out, addr in zip(outs, addrs):  # only the words still the sentinel; masked lanes hold 1
        reloads += [f"setp.eq.u32 %lw_q, {out}, 0;", f"@%lw_q ld.volatile.global.u{bits} {out}, [{addr}];"]
    return "\n".join(
        ["{", ".reg .pred %lw_m, %lw_q;", ".reg .u32 %lw_n;"]
        + [f"mov.u32 {o}, {f};" for o, f in zip(outs, firsts)]
        + missing + ["@!%lw_m bra LW_DONE;",
                     # slow path only: the error count is first used here, so the fast path never waits for it
                     f"setp.ne.u32 %lw_q, {failed}, 0;", f"selp.u32 %lw_n, {limit}, 0, %lw_q;",
                     "LW_POLL:", f"setp.ge.u32 %lw_q, %lw_n, {limit};", "@%lw_q bra LW_DONE;"]
        + reloads + ["add.u32 %lw_n, %lw_n, 1;"] + missing + ["@%lw_m bra LW_POLL;", "LW_DONE:"]
        # a give-up (words still missing): counted by this thread
        + [f"@%lw_m red.global.gpu.relaxed.add.u32 [{errors}], 1;", "}"])


_SPIN_16_1: tl.constexpr = tl.constexpr(_spin_asm(1, 16))
_SPIN_16_2: tl.constexpr = tl.constexpr(_spin_asm(2, 16))
_SPIN_16_4: tl.constexpr = tl.constexpr(_spin_asm(4, 16))
_SPIN_16_8: tl.constexpr = tl.constexpr(_spin_asm(8, 16))
_SPIN_32_1: tl.constexpr = tl.constexpr(_spin_asm(1, 32))
_SPIN_32_2: tl.constexpr = tl.constexpr(_spin_asm(2, 32))
_SPIN_32_4: tl.constexpr = tl.constexpr(_spin_asm(4, 32))


def spin_pack(elems_per_thread: int, elem_bytes: int) -> int:
    """The SPIN constexpr of a Lamport kernel (host side): words a thread waits on together, at
    most 16 bytes of them, a divisor of the thread's elements (``elems_per_thread``: the tile's
    elements / (32 * warps), at least 1)."""
    pack = 1
    while pack * 2 <= min(16 // elem_bytes, max(1, elems_per_thread)) and elems_per_thread % (pack * 2) == 0:
        pack *= 2
    return pack


@triton.jit
def lamport_bases(region_ptrs, WORLD_SIZE: tl.constexpr):
    """Every rank's Lamport region address (a tuple in rank order): W loads in flight together,
    issued before the header's load, so no push or poll waits for an address of its own."""
    bases = ()
    for r in tl.static_range(WORLD_SIZE):
        bases = bases + (tl.load(region_ptrs + r),)
    return bases


@triton.jit
def lamport_error_slot(signal_ptrs, WORLD_SIZE: tl.constexpr):
    """(this rank's error slot of the 'all_reduce' channel, the count it holds), read at the start,
    in flight with the header's load: only a slow path uses the count, so no poll waits for it.
    A count already non-zero (a wait timed out since the host's last reset: the channel is stale)
    makes every wait give up at once (fail fast)."""
    errors = tl.load(signal_ptrs + WORLD_SIZE).to(tl.pointer_type(tl.int32))
    failed = tl.load(errors, cache_modifier=".cv")  # a hint: fetched again, not served from L1
    return errors, failed


@triton.jit
def _slot(bases, receiver: tl.constexpr, sender: tl.constexpr, offset, slot_bytes, WORLD_SIZE: tl.constexpr,
          WIRE: tl.constexpr):
    """Sender ``sender``'s slot in ``receiver``'s buffer at ``offset``, as WIRE words (``bases``:
    :func:`lamport_bases`; ``receiver`` and ``sender`` compile-time ranks)."""
    slot = (sender - receiver - 1 + WORLD_SIZE) % WORLD_SIZE
    # the region is 256-byte aligned and slot_bytes a multiple of 256: 16-byte vectors
    return tl.multiple_of((bases[receiver] + offset + slot * slot_bytes).to(tl.pointer_type(WIRE)), 16)


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
def push_wire(val, bases, offset, slot_bytes, offs, mask, RANK: tl.constexpr, WORLD_SIZE: tl.constexpr,
              MASKED: tl.constexpr):
    """Store ``val`` (this rank's elements at ``offs``, any shape) in wire form into this rank's slot
    of the buffer at ``offset`` of every peer (posted writes; the data is its own flag)."""
    WIRE: tl.constexpr = tl.uint16 if val.dtype.primitive_bitwidth == 16 else tl.uint32  # val's bits
    wire = _to_wire(val, WIRE)
    for step in tl.static_range(1, WORLD_SIZE):
        # staggered: every rank writes to a different peer first (a compile-time rank: not assigned,
        # which would make it a tensor)
        dst = _slot(bases, (RANK + step) % WORLD_SIZE, RANK, offset, slot_bytes, WORLD_SIZE, WIRE) + offs
        if MASKED:
            tl.store(dst, wire, mask=mask)
        else:
            tl.store(dst, wire)


@triton.jit
def _spin(wire, src, errors, failed, SPIN: tl.constexpr):
    """``wire`` (a first poll of the words at ``src``) once none is the sentinel: each thread polls
    again (volatile) only its own words still missing, SPIN of them in flight together, up to
    MAX_POLLS times (none when ``failed`` != 0), and a thread that gives up adds 1 to ``errors``
    (relaxed, gpu scope); no CTA barrier or reduction anywhere, and the first check is the fast
    path's only cost. Inline PTX (GPUs only: under the interpreter SPIN is 0 and
    :func:`lamport_sum` waits with a CTA-uniform loop of the same bounds). The asm has side
    effects (not pure), so the compiler keeps the re-arm stores after it; same-address order in
    a thread keeps them after its loads."""
    tl.static_assert((SPIN == 1 or SPIN == 2 or SPIN == 4 or SPIN == 8) and SPIN * wire.dtype.primitive_bitwidth <= 128,
                     "SPIN: a power of two, at most 16 bytes of words (spin_pack)")
    if wire.dtype.primitive_bitwidth == 16:
        if SPIN == 8:
            asm: tl.constexpr = _SPIN_16_8
        elif SPIN == 4:
            asm: tl.constexpr = _SPIN_16_4
        elif SPIN == 2:
            asm: tl.constexpr = _SPIN_16_2
        else:
            asm: tl.constexpr = _SPIN_16_1
    else:
        if SPIN == 4:
            asm: tl.constexpr = _SPIN_32_4
        elif SPIN == 2:
            asm: tl.constexpr = _SPIN_32_2
        else:
            asm: tl.constexpr = _SPIN_32_1
    failed_all = failed + tl.zeros(wire.shape, tl.int32)
    limit = tl.full(wire.shape, _barrier.MAX_POLLS, tl.int32)
    errors_all = errors.to(tl.int64, bitcast=True) + tl.zeros(wire.shape, tl.int64)
    got = tl.inline_asm_elementwise(asm, "=r," * SPIN + "r," * SPIN + "l," * SPIN + "r," * SPIN + "r," * SPIN + "l"
                                    + ",l" * (SPIN - 1),
                                    [wire.to(tl.uint32), src.to(tl.int64, bitcast=True), failed_all, limit, errors_all],
                                    dtype=tl.uint32, is_pure=False, pack=SPIN)
    return got.to(wire.dtype)


@triton.jit
def _poll(own_bases, offset, slot_bytes, offs, mask, RANK: tl.constexpr, WORLD_SIZE: tl.constexpr,
          WIRE: tl.constexpr, MASKED: tl.constexpr):
    """Every peer's wire words at ``offs`` of this rank's buffer (a tuple in peer order, this rank's
    entry 0): one volatile load per peer, all in flight together (never served from L1)."""
    wires = ()
    for peer in tl.static_range(WORLD_SIZE):
        if peer == RANK:
            wires = wires + (0,)
        else:
            src = _slot(own_bases, RANK, peer, offset, slot_bytes, WORLD_SIZE, WIRE) + offs
            if MASKED:
                wires = wires + (tl.load(src, mask=mask, other=1, volatile=True),)  # masked lanes never wait
            else:
                wires = wires + (tl.load(src, volatile=True),)
    return wires


@triton.jit
def _missing(wires, offs, RANK: tl.constexpr, WORLD_SIZE: tl.constexpr):
    """Per element of ``offs``, how many peers' words are still the sentinel (a tensor of zeros at
    world size 1: no peer)."""
    missing = tl.zeros(offs.shape, tl.int32)
    for peer in tl.static_range(WORLD_SIZE):
        if peer != RANK:
            missing += (wires[peer] == 0).to(tl.int32)
    return missing


@triton.jit
def lamport_sum(own, bases, errors, failed, offset, slot_bytes, offs, mask, RANK: tl.constexpr,
                WORLD_SIZE: tl.constexpr, MASKED: tl.constexpr, SPIN: tl.constexpr = 0):
    """fp32 sum over ranks 0..W-1 (fixed order) of ``own`` (this rank's elements at ``offs``) and
    the peers' pushes of the same elements into this rank's buffer at ``offset``, once every one
    has arrived (or after MAX_POLLS polls that found one missing: then the give-up is counted in
    this rank's error slot ``errors``, and the missing words add -0.0, i.e. nothing); then re-arms
    those words (stores the sentinel over what it read). ``bases``: :func:`lamport_bases`;
    ``errors``, ``failed``: :func:`lamport_error_slot`.

    The wait: a first poll of every peer (in flight together); then, SPIN > 0 with one peer
    (world size 2, GPUs), each thread polls its own missing words alone and counts its own
    give-up (:func:`_spin`); else every peer's words again, in a loop whose condition is a
    CTA-wide count (a CTA reduction an iteration), and one give-up count per CTA. Both give up
    after MAX_POLLS polls of the same words."""
    WIRE: tl.constexpr = tl.uint16 if own.dtype.primitive_bitwidth == 16 else tl.uint32  # own's bits
    wires = _poll(bases, offset, slot_bytes, offs, mask, RANK, WORLD_SIZE, WIRE, MASKED)
    if SPIN > 0 and WORLD_SIZE == 2:
        peer: tl.constexpr = 1 - RANK
        src = _slot(bases, RANK, peer, offset, slot_bytes, WORLD_SIZE, WIRE) + offs
        wires = (_spin(wires[0], src, errors, failed, SPIN), wires[1]) if peer == 0 else \
            (wires[0], _spin(wires[1], src, errors, failed, SPIN))
    else:
        missing = tl.sum(_missing(wires, offs, RANK, WORLD_SIZE), axis=None)  # over every axis (a chunk or a row tile)
        if missing > 0:  # slow path only: a peer's chunk is not all there yet; poll every peer again
            # a channel that already timed out is stale until the host resets it: fail fast
            polls = tl.where(failed == 0, 0, _barrier.MAX_POLLS)
            while (missing > 0) & (polls < _barrier.MAX_POLLS):
                wires = _poll(bases, offset, slot_bytes, offs, mask, RANK, WORLD_SIZE, WIRE, MASKED)
                missing = tl.sum(_missing(wires, offs, RANK, WORLD_SIZE), axis=None)
                polls += 1
            if missing > 0:
                tl.atomic_add(errors, 1, sem="relaxed", scope="gpu")
    acc = tl.zeros(offs.shape, tl.float32)
    for peer in tl.static_range(WORLD_SIZE):
        if peer == RANK:
            acc += own.to(tl.float32)
        else:
            acc += _from_wire(wires[peer], own.dtype).to(tl.float32)
    # Re-arm at once. Who writes these words next: a peer's call k + 3 (the rotation), which it
    # starts only after its call k + 2 saw this rank's call k + 2 pushes, made after this kernel
    # (and these stores) completed; a peer one call ahead writes buffer k + 1, never this one.
    zeros = tl.zeros(offs.shape, WIRE)
    for peer in tl.static_range(WORLD_SIZE):
        if peer != RANK:
            dst = _slot(bases, RANK, peer, offset, slot_bytes, WORLD_SIZE, WIRE) + offs
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
def _reduce_chunk(x_ptr, bases, errors, failed, offset, slot_bytes, offs, end, RANK: tl.constexpr,
                  WORLD_SIZE: tl.constexpr, MASKED: tl.constexpr, SPIN: tl.constexpr):
    """x[offs] = the Lamport sum of this chunk, rounded once."""
    mask = offs < end
    if MASKED:
        own = tl.load(x_ptr + offs, mask=mask, other=0.0)
    else:
        own = tl.load(x_ptr + offs)
    acc = lamport_sum(own, bases, errors, failed, offset, slot_bytes, offs, mask, RANK, WORLD_SIZE, MASKED, SPIN)
    if MASKED:
        tl.store(x_ptr + offs, acc.to(x_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(x_ptr + offs, acc.to(x_ptr.dtype.element_ty))


@triton.jit
def _push_chunk(x_ptr, bases, offset, slot_bytes, offs, end, RANK: tl.constexpr, WORLD_SIZE: tl.constexpr,
                MASKED: tl.constexpr):
    mask = offs < end
    if MASKED:
        val = tl.load(x_ptr + offs, mask=mask)
    else:
        val = tl.load(x_ptr + offs)
    push_wire(val, bases, offset, slot_bytes, offs, mask, RANK, WORLD_SIZE, MASKED)


@triton.jit(do_not_specialize=["numel", "slot_bytes"])
def _lamport_all_reduce(x_ptr, region_ptrs, signal_ptrs, header_ptr, numel: tl.int32, slot_bytes: tl.int64,
                        RANK: tl.constexpr, WORLD_SIZE: tl.constexpr, BLOCK: tl.constexpr,
                        TAIL: tl.constexpr = 1, PHASE: tl.constexpr = 0, SPIN: tl.constexpr = 0):
    """x = sum over ranks of x, in place, without a barrier (see the module docstring).

    ``region_ptrs[r]``: rank r's Lamport region; ``header_ptr``: this rank's (its header, passed as
    an argument so the rotation index is one load away); ``signal_ptrs[WORLD_SIZE]``: this rank's
    error slot of the 'all_reduce' channel (its count read at the start, used on slow paths only).
    ``slot_bytes``: the region's slot stride (autosymm.geometry.LAMPORT_SLOT_BYTES, a multiple of
    256, at least the bytes of x). PHASE 0 runs everything; 1 only the pushes, 2 the rotation and
    the reads (tests run phase 1 on every simulated rank, then phase 2). SPIN: the words a thread
    waits on together (:func:`spin_pack`) in the per-thread spin of :func:`lamport_sum`, 0 for the
    CTA-uniform wait (the host passes 0 under the interpreter and at world sizes other than 2).

    Order: the W region bases and the error count (loads in flight together), read the index,
    count in (release: after that read), push every chunk, the last program publishes the next
    index (its wait for the others' count overlaps the pushes' flight), then poll, sum, store and
    re-arm each chunk. Nothing follows the last store.
    """
    numel = _whole_vectors(numel, TAIL)
    pid, n_programs, n_chunks, n_full, lane = _chunks(numel, BLOCK)
    bases = lamport_bases(region_ptrs, WORLD_SIZE)
    errors, failed = lamport_error_slot(signal_ptrs, WORLD_SIZE)
    buffer = lamport_buffer(header_ptr)
    offset = lamport_offset(buffer, slot_bytes, WORLD_SIZE)
    if PHASE != 1:
        lamport_count_in(header_ptr, pid, n_programs)
    if PHASE != 2:
        for chunk in range(pid, n_chunks, n_programs):
            offs = chunk * BLOCK + lane
            if chunk < n_full:
                _push_chunk(x_ptr, bases, offset, slot_bytes, offs, numel, RANK, WORLD_SIZE, False)
            else:
                _push_chunk(x_ptr, bases, offset, slot_bytes, offs, numel, RANK, WORLD_SIZE, True)
    if PHASE != 1:
        lamport_rotate(header_ptr, signal_ptrs, buffer, pid, n_programs, WORLD_SIZE)
        for chunk in range(pid, n_chunks, n_programs):
            offs = chunk * BLOCK + lane
            if chunk < n_full:
                _reduce_chunk(x_ptr, bases, errors, failed, offset, slot_bytes, offs, numel, RANK, WORLD_SIZE,
                              False, SPIN)
            else:
                _reduce_chunk(x_ptr, bases, errors, failed, offset, slot_bytes, offs, numel, RANK, WORLD_SIZE,
                              True, SPIN)
