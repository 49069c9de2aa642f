"""All-reduce (sum) kernels over the symmetric workspace (Triton, device side only).

Every kernel reduces a contiguous tensor ``x`` of ``numel`` elements (bf16, fp16 or fp32) in place
over the group, accumulating in fp32 in a fixed peer order (0..WORLD_SIZE-1), so every rank gets
bit-identical results. ``region_ptrs[r] + stage_offset`` (bytes) is rank r's copy of ``x``, the
*stage* (a fused copy-in, unless ZERO_COPY). Invariants: program ``b`` of a grid of ``G`` owns
chunks ``b, b+G, ...`` in every phase and on every rank, so the per-program signal-pad barriers of
autosymm.kernels.barrier order every cross-rank access; every single-buffer kernel that reads a
stage ends with an *end barrier*, so the next kernel (any grid) may overwrite any stage at once;
the double-buffered one-shot instead alternates between two halves nothing else writes.
Kernels: ``_one_shot_all_reduce``, ``_two_shot_all_reduce`` (MULTIMEM: ``multimem.ld_reduce`` and
``multimem.st``); the push one-shot lives in autosymm.kernels.push_all_reduce.

Design notes: docs/KERNELS.md#kernels-all-reduce
"""

import triton
import triton.language as tl

from .barrier import SLOTS_PER_PROGRAM, barrier, barrier_and_publish, count_in


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------

@triton.jit
def _stage_ptr(region_ptrs, rank, stage_offset, ALIGNED: tl.constexpr, ELEM: tl.constexpr):
    """Pointer to ``rank``'s stage: its all-reduce region plus ``stage_offset`` bytes."""
    ptr = (tl.load(region_ptrs + rank) + stage_offset).to(tl.pointer_type(ELEM))
    if ALIGNED:
        # Regions are 256-byte aligned and the host checked the offset. The hint must sit on the
        # pointer: divisibility does not propagate through int_to_ptr.
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def _whole_vectors(numel, TAIL: tl.constexpr):
    """``numel`` itself, which the launcher guarantees a multiple of TAIL elements (16 bytes, or
    1): rounding it down tells the compiler so, and the masks of a ragged last chunk then keep
    16-byte loads and stores (over NVLink a masked scalar access per element costs microseconds)."""
    if TAIL > 1:
        numel = numel // TAIL * TAIL
    return numel


@triton.jit
def _chunks(numel, BLOCK: tl.constexpr):
    """(program id, programs, BLOCK-wide chunks, full chunks, lane offsets) of a one-shot call:
    program ``pid`` owns chunks pid, pid + programs, ... (see the module docstring)."""
    return tl.program_id(0), tl.num_programs(0), tl.cdiv(numel, BLOCK), numel // BLOCK, tl.arange(0, BLOCK)


@triton.jit
def _copy(dst, src, offs, end, MASKED: tl.constexpr):
    """dst[offs] = src[offs] (only where offs < end when MASKED)."""
    if MASKED:
        mask = offs < end
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)
    else:
        tl.store(dst + offs, tl.load(src + offs))


@triton.jit
def _sum_stages(region_ptrs, stage_offset, offs, end, WORLD_SIZE: tl.constexpr, ALIGNED: tl.constexpr,
                ELEM: tl.constexpr, MASKED: tl.constexpr):
    """fp32 sum over ranks 0..WORLD_SIZE-1 (fixed order) of stage[offs]."""
    acc = tl.zeros(offs.shape, tl.float32)
    for peer in tl.static_range(WORLD_SIZE):
        src = _stage_ptr(region_ptrs, peer, stage_offset, ALIGNED, ELEM) + offs
        # .cg: peers' data is produced during this kernel, never serve it from L1.
        if MASKED:
            val = tl.load(src, mask=offs < end, other=0.0, cache_modifier=".cg")
        else:
            val = tl.load(src, cache_modifier=".cg")
        acc += val.to(tl.float32)
    return acc


@triton.jit
def _push(x_ptr, region_ptrs, stage_offset, offs, end, val, RANK: tl.constexpr, WORLD_SIZE: tl.constexpr,
          ALIGNED: tl.constexpr, MASKED: tl.constexpr):
    """Store ``val`` at ``offs`` of every peer's stage and of the local ``x``."""
    mask = offs < end
    for step in tl.static_range(WORLD_SIZE):
        peer = (RANK + step) % WORLD_SIZE  # staggered: every rank writes to a different peer first
        if peer == RANK:
            dst = x_ptr + offs
        else:
            dst = _stage_ptr(region_ptrs, peer, stage_offset, ALIGNED, x_ptr.dtype.element_ty) + offs
        if MASKED:
            tl.store(dst, val, mask=mask)
        else:
            tl.store(dst, val)


# Multimem PTX (sm_90+). Predicated on $mask so tails and idle lanes issue nothing. 16-bit types
# reduce with .acc::f32 (the switch accumulates in fp32, PTX ISA 8.6+; ptxas 12.8 accepts it).
def _ld_reduce_asm(vec_type: str) -> str:
    acc = "" if vec_type.endswith("f32") else ".acc::f32"
    return ("{ .reg .pred %p; setp.ne.s32 %p, $5, 0;\n"
            f"@%p multimem.ld_reduce.relaxed.sys.global.add{acc}.{vec_type} {{$0, $1, $2, $3}}, [$4]; }}")


_LD_REDUCE_BF16: tl.constexpr = tl.constexpr(_ld_reduce_asm("v4.bf16x2"))
_LD_REDUCE_F16: tl.constexpr = tl.constexpr(_ld_reduce_asm("v4.f16x2"))
_LD_REDUCE_F32: tl.constexpr = tl.constexpr(_ld_reduce_asm("v4.f32"))
_ST_128: tl.constexpr = tl.constexpr(
    "{ .reg .pred %p; setp.ne.s32 %p, $6, 0;\n"
    "@%p multimem.st.relaxed.sys.global.v4.f32 [$1], {$2, $3, $4, $5}; }")
# Unicast and multicast addresses of one location are virtual aliases: order them explicitly.
_PROXY_FENCE: tl.constexpr = tl.constexpr("fence.proxy.alias;")


@triton.jit
def _multimem_ld_reduce_128(addr, mask, ELEM: tl.constexpr):
    """Sum over all ranks of the 16 bytes at multicast ``addr`` (int64), as four 32-bit words."""
    if ELEM == tl.bfloat16:
        asm: tl.constexpr = _LD_REDUCE_BF16
    elif ELEM == tl.float16:
        asm: tl.constexpr = _LD_REDUCE_F16
    else:
        asm: tl.constexpr = _LD_REDUCE_F32
    return tl.inline_asm_elementwise(asm, "=r,=r,=r,=r,l,r", [addr, mask.to(tl.int32)],
                                     dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32), is_pure=False, pack=1)


@triton.jit
def _multimem_st_128(addr, w0, w1, w2, w3, mask):
    """Store four 32-bit words at multicast ``addr``: they land on every rank."""
    return tl.inline_asm_elementwise(_ST_128, "=r,l,r,r,r,r,r", [addr, w0, w1, w2, w3, mask.to(tl.int32)],
                                     dtype=tl.uint32, is_pure=False, pack=1)


@triton.jit
def _proxy_fence(token):
    tl.inline_asm_elementwise(_PROXY_FENCE, "=r,r", [token], dtype=tl.int32, is_pure=False, pack=1)


# --------------------------------------------------------------------------------------------
# One-shot
# --------------------------------------------------------------------------------------------

#: Self slots (rows of this rank's own column of the 'all_reduce' signal channel, which no signal
#: reaches) of the double-buffered kernels: autosymm.geometry.ALL_REDUCE_ARRIVAL_SLOT / _EPOCH_SLOT.
_ARRIVAL_SLOT: tl.constexpr = tl.constexpr(0)
_EPOCH_SLOT: tl.constexpr = tl.constexpr(1)


@triton.jit
def _epoch_stage(signal_ptrs, stage_offset, half_bytes, pid, n_programs, RANK: tl.constexpr):
    """(arrival counter, epoch address, epoch, stage offset in half ``epoch & 1``) of a
    double-buffered call; counts this program in once it has read the epoch (autosymm.kernels.
    barrier.count_in: the grid's last program then stores ``epoch + 1`` with ``publish``)."""
    own_pad = tl.load(signal_ptrs + RANK).to(tl.pointer_type(tl.int32))
    epoch_slot = own_pad + _EPOCH_SLOT * SLOTS_PER_PROGRAM + RANK
    arrival_slot = own_pad + _ARRIVAL_SLOT * SLOTS_PER_PROGRAM + RANK
    epoch = tl.load(epoch_slot)
    count_in(arrival_slot, pid, n_programs)
    return arrival_slot, epoch_slot, epoch, stage_offset + (epoch & 1).to(tl.int64) * half_bytes


@triton.jit(do_not_specialize=["numel", "stage_offset", "half_bytes"])
def _one_shot_all_reduce(x_ptr, region_ptrs, signal_ptrs, numel: tl.int32, stage_offset: tl.int64,
                         half_bytes: tl.int64, RANK: tl.constexpr, WORLD_SIZE: tl.constexpr, BLOCK: tl.constexpr,
                         ZERO_COPY: tl.constexpr, ALIGNED: tl.constexpr, DOUBLE_BUFFER: tl.constexpr,
                         TAIL: tl.constexpr = 1):
    """x = sum over ranks of x; every rank reads every peer's stage (see the module docstring).

    ZERO_COPY invariant: a peer reads chunk c of our ``x`` before it signals the barrier that
    follows its read of c, and we store chunk c's sum only after that barrier, so no peer ever
    reads a sum where it expects an input. Chunks of later rounds are untouched until their own
    barrier. Without ZERO_COPY the sums go to ``x`` (not the stage) and the end barrier keeps
    the stage alive until every peer has read it.

    DOUBLE_BUFFER (not with ZERO_COPY; ``half_bytes`` is then the distance between the two
    halves, else ignored): the stage is ``stage_offset + (epoch & 1) * half_bytes``, where the
    *epoch* is this rank's self slot ``[_EPOCH_SLOT][RANK]`` of the channel: the number of
    double-buffered calls since the pads were last reset, equal on every rank (every rank runs
    the same calls, and Workspace.reset_signals zeroes it on all ranks together), so all ranks
    use the same half and ``_sum_stages`` reads the peers' copy of the call. Every program reads
    the epoch first and counts in at once (``red.release.gpu`` on self slot
    ``[_ARRIVAL_SLOT][RANK]``: autosymm.kernels.barrier.count_in); the grid's last program, between
    its start barrier's signal and its wait, waits for the others' counts (acquire), zeroes the
    counter and stores epoch + 1 (``publish``). Each program's epoch load precedes its release
    count, which the last program's acquire synchronizes with, so no program of this call reads
    the new epoch; the next call (stream order) reads it. The grid plays no part: any grid
    advances the epoch by exactly one, and the counter is 0 again after every call, so CUDA-graph
    replay needs no host reset; and nothing (no fence, no atomic) is left at the kernel's end.

    Why no end barrier is needed. Rank r overwrites half h of its stage in call m (copy-in,
    before its start barrier) and peer q read r's half h last in the double-buffered call k < m
    of the same parity. Between them lies a double-buffered call j, k < j < m, of the other
    parity (the epoch moves by exactly one per double-buffered call; a reset_signals in between
    is a full device sync of every rank). r's call j kernel completed before call m began
    (stream order), so r's program 0 consumed, in call j's start barrier, a signal in slot
    ``[0][q]``. Every rank launches the same sequence of kernels on this channel, so r consumed
    exactly as many signals from that slot before call j as q sent before its call j; the one r
    consumed in call j was therefore sent by q's call j (or later), which had thus started, so
    q's call k had completed (stream order) with all its loads of r's half h. The release.sys
    signal of q's call j is cumulative over them and r's acquire.sys took it: q's reads of call
    k happen before r's writes of call m. Only program 0 (which every grid has, and which waits
    on every peer) is used: no assumption on the grids of calls k, j, m. Kernels that stage
    elsewhere (single-buffer one-shot, two-shot: the all-reduce region) never touch the halves,
    which is why they sit in a region of their own (autosymm.workspace.symm) at offsets independent of the
    tensor size. Data read from peers, the sums, only go to the local ``x``.

    A timed-out start barrier breaks the argument (as it breaks every result: the host must
    reset the pads, epoch included, on every rank); the epoch still advances by one, so the
    ranks that ran the call stay in step.
    """
    ELEM: tl.constexpr = x_ptr.dtype.element_ty
    tl.static_assert(not (DOUBLE_BUFFER and ZERO_COPY), "a zero-copy input is not staged: no double buffer")
    numel = _whole_vectors(numel, TAIL)
    pid, n_programs, n_chunks, n_full, lane = _chunks(numel, BLOCK)
    if DOUBLE_BUFFER:
        arrival_slot, epoch_slot, epoch, stage_offset = _epoch_stage(signal_ptrs, stage_offset, half_bytes, pid,
                                                                     n_programs, RANK)
    if not ZERO_COPY:
        stage = _stage_ptr(region_ptrs, RANK, stage_offset, ALIGNED, ELEM)
        for chunk in range(pid, n_chunks, n_programs):
            offs = chunk * BLOCK + lane
            if chunk < n_full:
                _copy(stage, x_ptr, offs, numel, False)
            else:
                _copy(stage, x_ptr, offs, numel, True)
    if DOUBLE_BUFFER:  # every stage holds its rank's input; the last program advances the epoch
        barrier_and_publish(signal_ptrs, pid, arrival_slot, epoch_slot, epoch + 1, n_programs, RANK, WORLD_SIZE)
    else:
        barrier(signal_ptrs, pid, RANK, WORLD_SIZE)  # every stage holds its rank's input
    for chunk in range(pid, n_chunks, n_programs):
        offs = chunk * BLOCK + lane
        full = chunk < n_full
        if full:
            acc = _sum_stages(region_ptrs, stage_offset, offs, numel, WORLD_SIZE, ALIGNED, ELEM, False)
        else:
            acc = _sum_stages(region_ptrs, stage_offset, offs, numel, WORLD_SIZE, ALIGNED, ELEM, True)
        if ZERO_COPY:
            barrier(signal_ptrs, pid, RANK, WORLD_SIZE)  # every rank has read this chunk of every x
        if full:
            tl.store(x_ptr + offs, acc.to(ELEM))
        else:
            tl.store(x_ptr + offs, acc.to(ELEM), mask=offs < numel)
    if not DOUBLE_BUFFER and not ZERO_COPY:  # double-buffered: no end barrier (see above)
        barrier(signal_ptrs, pid, RANK, WORLD_SIZE)  # no peer still reads our stage


# --------------------------------------------------------------------------------------------
# Two-shot (peer loads + pushes, or multimem)
# --------------------------------------------------------------------------------------------

@triton.jit
def _copy_segments(dst, src, numel, seg, pid, n_programs, SKIP: tl.constexpr, WORLD_SIZE: tl.constexpr,
                   BLOCK: tl.constexpr):
    """dst = src over this program's chunks of every segment except SKIP (-1: none)."""
    lane = tl.arange(0, BLOCK)
    for s in tl.static_range(WORLD_SIZE):
        if s != SKIP:
            seg_end = tl.minimum(s * seg + seg, numel)
            for chunk in range(pid, tl.cdiv(seg, BLOCK), n_programs):
                start = s * seg + chunk * BLOCK
                if start + BLOCK <= seg_end:
                    _copy(dst, src, start + lane, seg_end, False)
                elif start < seg_end:
                    _copy(dst, src, start + lane, seg_end, True)


@triton.jit
def _reduce_push_chunk(x_ptr, region_ptrs, stage_offset, offs, end, RANK: tl.constexpr,
                       WORLD_SIZE: tl.constexpr, ALIGNED: tl.constexpr, MASKED: tl.constexpr):
    acc = _sum_stages(region_ptrs, stage_offset, offs, end, WORLD_SIZE, ALIGNED, x_ptr.dtype.element_ty, MASKED)
    _push(x_ptr, region_ptrs, stage_offset, offs, end, acc.to(x_ptr.dtype.element_ty), RANK, WORLD_SIZE,
          ALIGNED, MASKED)


@triton.jit
def _multimem_chunk(mc_stage, start, seg_end, vec_end, BLOCK: tl.constexpr, VEC: tl.constexpr,
                    ELEM_BYTES: tl.constexpr, ELEM: tl.constexpr):
    """ld_reduce + st of the whole 16-byte units of elements [start, min(start+BLOCK, vec_end))."""
    unit = start + tl.arange(0, BLOCK // VEC) * VEC  # first element of each 16-byte unit
    mask = unit < tl.minimum(seg_end, vec_end)
    addr = mc_stage + unit.to(tl.int64) * ELEM_BYTES
    w0, w1, w2, w3 = _multimem_ld_reduce_128(addr, mask, ELEM)
    _multimem_st_128(addr, w0, w1, w2, w3, mask)


@triton.jit(do_not_specialize=["numel", "stage_offset", "seg_vecs", "mc_base"])
def _two_shot_all_reduce(x_ptr, region_ptrs, signal_ptrs, numel: tl.int32, stage_offset: tl.int64,
                         seg_vecs: tl.int32, mc_base: tl.int64,
                         RANK: tl.constexpr, WORLD_SIZE: tl.constexpr, BLOCK: tl.constexpr,
                         ZERO_COPY: tl.constexpr, ALIGNED: tl.constexpr, MULTIMEM: tl.constexpr,
                         PHASE: tl.constexpr):
    """x = sum over ranks of x by reduce-scatter + push all-gather (see the module docstring).

    ``seg_vecs``: segment length in 16-byte units (segment r = elements [r*seg, (r+1)*seg) with
    seg = seg_vecs * 16 / element size; the last ones may be short or empty). ``mc_base``: the
    multicast address of the stage (MULTIMEM only, else ignored). PHASE 0 runs everything;
    1, 2, 3 run copy-in + barrier, reduce + push, barrier + copy-out + end barrier alone (tests
    run each phase on every simulated rank in turn).

    In-place invariant (why x may be the stage): in the reduce phase rank r reads only segment
    r of every stage and writes only segment r of every stage, and each element of segment r is
    read and then written by the same thread of the same program of rank r; segment r of a peer
    is read by nobody else before the barrier, and after it the peer only reads (copy-out).
    """
    ELEM: tl.constexpr = x_ptr.dtype.element_ty
    ELEM_BYTES: tl.constexpr = ELEM.primitive_bitwidth // 8
    VEC: tl.constexpr = 16 // ELEM_BYTES
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    seg = seg_vecs * VEC
    stage = _stage_ptr(region_ptrs, RANK, stage_offset, ALIGNED, ELEM)

    if PHASE == 0 or PHASE == 1:
        if not ZERO_COPY:
            _copy_segments(stage, x_ptr, numel, seg, pid, n_programs, -1, WORLD_SIZE, BLOCK)
        if MULTIMEM:
            _proxy_fence(pid)  # our unicast stage writes before peers' multicast reads
        barrier(signal_ptrs, pid, RANK, WORLD_SIZE)  # every stage holds its rank's input
        if MULTIMEM:
            _proxy_fence(pid)

    if PHASE == 0 or PHASE == 2:
        seg_start = RANK * seg
        seg_end = tl.minimum(seg_start + seg, numel)
        lane = tl.arange(0, BLOCK)
        for chunk in range(pid, tl.cdiv(seg, BLOCK), n_programs):
            start = seg_start + chunk * BLOCK
            if MULTIMEM:
                vec_end = numel // VEC * VEC  # the < VEC ragged elements go through peers' stages
                if start < seg_end:
                    _multimem_chunk(mc_base + stage_offset, start, seg_end, vec_end, BLOCK, VEC, ELEM_BYTES, ELEM)
                if (start <= vec_end) & (vec_end < tl.minimum(start + BLOCK, seg_end)):
                    tail = vec_end + tl.arange(0, VEC)
                    _reduce_push_chunk(stage, region_ptrs, stage_offset, tail, seg_end, RANK, WORLD_SIZE,
                                       ALIGNED, True)
            elif start + BLOCK <= seg_end:
                _reduce_push_chunk(x_ptr, region_ptrs, stage_offset, start + lane, seg_end, RANK, WORLD_SIZE,
                                   ALIGNED, False)
            elif start < seg_end:
                _reduce_push_chunk(x_ptr, region_ptrs, stage_offset, start + lane, seg_end, RANK, WORLD_SIZE,
                                   ALIGNED, True)

    if PHASE == 0 or PHASE == 3:
        if MULTIMEM:
            _proxy_fence(pid)  # our multicast stores before peers' unicast reads
        barrier(signal_ptrs, pid, RANK, WORLD_SIZE)  # every segment's sum is in every stage
        if MULTIMEM:
            _proxy_fence(pid)
        if not ZERO_COPY:
            # Multimem stored our own segment into the stage too; peers' loads pushed it to x.
            SKIP: tl.constexpr = -1 if MULTIMEM else RANK
            _copy_segments(x_ptr, stage, numel, seg, pid, n_programs, SKIP, WORLD_SIZE, BLOCK)
            # End barrier: our copy-out reads our stage, which a peer's next kernel may write
            # before any barrier of its own (the push one-shots push first; see the module docstring).
            barrier(signal_ptrs, pid, RANK, WORLD_SIZE)
