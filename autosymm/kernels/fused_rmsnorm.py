"""Fused all-reduce + residual add + RMSNorm kernels (Triton, device side only).

Every rank holds ``x`` and ``residual`` of [n_rows, HIDDEN] (contiguous, bf16/fp16/fp32) and
``weight`` [HIDDEN]; each kernel leaves on every rank ``s = residual + sum over ranks of x`` (fp32,
ranks 0..W-1 in order), ``residual = ELEM(s)`` and ``out = ELEM(s * rsqrt(mean(s^2) + eps) *
weight)`` (autosymm.epilogue states the formula; HAS_RESIDUAL, GEMMA and QUANT are compile-time
variants, autosymm.kernels.fused_epilogue). ``x`` is left unchanged. A program owns whole rows (a
[ROWS, BLOCK] tile; the norm of the unrounded fp32 sum, both results rounded once), or SPLIT
programs share a row. The stage layout, barriers and double-buffer epoch, and their
memory-ordering arguments, are those of autosymm.kernels.all_reduce and push_all_reduce.
Kernels: ``_one_shot_all_reduce_rmsnorm``, ``_push_one_shot_all_reduce_rmsnorm``,
``_two_shot_all_reduce_rmsnorm``.

Design notes: docs/KERNELS.md#kernels-fused-rmsnorm
"""

import triton
import triton.language as tl

from .all_reduce import _epoch_stage, _stage_ptr
from .barrier import barrier, barrier_and_publish
from .fused_epilogue import _normalise_and_store, _store_block_scales, _store_outputs, _tile
from .lamport_all_reduce import (lamport_bases, lamport_buffer, lamport_count_in, lamport_error_slot, lamport_offset,
                                 lamport_rotate, lamport_sum, push_wire)
from .push_all_reduce import _slot_ptr


@triton.jit
def _copy_rows(dst, src, row0, row_end, col0, HIDDEN: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """dst[rows] = src[rows] for one row group (columns col0 .. col0 + BLOCK - 1)."""
    offs, mask, cols = _tile(row0, row_end, col0, HIDDEN, BLOCK, ROWS)
    tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


@triton.jit
def _push_rows(x_ptr, region_ptrs, lam, stage_offset, slot_bytes, row0, row_end, col0, RANK: tl.constexpr,
               WORLD_SIZE: tl.constexpr, HIDDEN: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
               LAMPORT: tl.constexpr):
    """Store one row group of x (columns col0 .. col0 + BLOCK - 1) into this rank's slot of every
    peer's stage (posted writes); LAMPORT: in wire form, into the Lamport buffer at ``stage_offset``
    (the same slot layout, autosymm.kernels.lamport_all_reduce; ``lam[0]`` the regions' bases)."""
    ELEM: tl.constexpr = x_ptr.dtype.element_ty
    offs, mask, cols = _tile(row0, row_end, col0, HIDDEN, BLOCK, ROWS)
    val = tl.load(x_ptr + offs, mask=mask)
    if LAMPORT:
        push_wire(val, lam[0], stage_offset, slot_bytes, offs, mask, RANK, WORLD_SIZE, True)
    else:
        for step in tl.static_range(1, WORLD_SIZE):
            peer = (RANK + step) % WORLD_SIZE  # staggered: every rank writes to a different peer first
            dst = _slot_ptr(region_ptrs, peer, RANK, stage_offset, slot_bytes, True, WORLD_SIZE, ELEM)
            tl.store(dst + offs, val, mask=mask)


@triton.jit
def _sum_ranks(x_ptr, region_ptrs, lam, stage_offset, slot_bytes, offs, mask, RANK: tl.constexpr,
               WORLD_SIZE: tl.constexpr, PUSH: tl.constexpr, LAMPORT: tl.constexpr, SPIN: tl.constexpr):
    """fp32 sum over ranks 0..WORLD_SIZE-1 (fixed order) of their x at ``offs``: from every
    rank's stage, or (PUSH) from x itself and the peers' slots of this rank's stage, or (LAMPORT)
    from x itself and the peers' wire words in this rank's Lamport buffer once they arrived (then
    re-armed: autosymm.kernels.lamport_all_reduce.lamport_sum; ``lam``: the regions' bases, the
    error slot and its count, SPIN its per-thread spin)."""
    ELEM: tl.constexpr = x_ptr.dtype.element_ty
    if LAMPORT:
        own = tl.load(x_ptr + offs, mask=mask, other=0.0)
        return lamport_sum(own, lam[0], lam[1], lam[2], stage_offset, slot_bytes, offs, mask, RANK, WORLD_SIZE,
                           True, SPIN)
    acc = tl.zeros(offs.shape, tl.float32)
    for peer in tl.static_range(WORLD_SIZE):
        if PUSH:
            if peer == RANK:
                src = x_ptr + offs
            else:
                src = _slot_ptr(region_ptrs, RANK, peer, stage_offset, slot_bytes, True, WORLD_SIZE, ELEM) + offs
        else:
            src = _stage_ptr(region_ptrs, peer, stage_offset, True, ELEM) + offs
        # .cg: stages are written by peers during this kernel, never serve them from L1.
        acc += tl.load(src, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    return acc


@triton.jit
def _scatter(region_ptrs, offset, offs, mask, val, RANK: tl.constexpr, WORLD_SIZE: tl.constexpr):
    """Store ``val`` at ``offs`` of every peer's stage area at ``offset`` bytes (two-shot)."""
    for step in tl.static_range(1, WORLD_SIZE):
        peer = (RANK + step) % WORLD_SIZE
        tl.store(_stage_ptr(region_ptrs, peer, offset, True, val.dtype) + offs, val, mask=mask)


@triton.jit
def _fused_rows(x_ptr, res_ptr, w_ptr, out_ptr, scale_ptr, scales_ptr, region_ptrs, lam, stage_offset,
                slot_bytes, out_offset, scales_offset, row0, row_end, eps, RANK: tl.constexpr, WORLD_SIZE: tl.constexpr,
                HIDDEN: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, PUSH: tl.constexpr,
                SCATTER: tl.constexpr, HAS_RESIDUAL: tl.constexpr, GEMMA: tl.constexpr, QUANT: tl.constexpr,
                LAMPORT: tl.constexpr, SPIN: tl.constexpr = 0):
    """For one row group: s = sum of x (+ the residual, then written back rounded once), and out
    (and scales) from the norm of the unrounded fp32 s (autosymm.kernels.fused_epilogue). SCATTER
    (two-shot): both also go to every peer's stage, the residual over the x rows just read there,
    out at ``out_offset`` and the scales (row-major) at ``scales_offset``. ``lam``, SPIN: the
    Lamport exchange's (:func:`_sum_ranks`; unused otherwise)."""
    ELEM: tl.constexpr = x_ptr.dtype.element_ty
    offs, mask, cols = _tile(row0, row_end, 0, HIDDEN, BLOCK, ROWS)
    acc = _sum_ranks(x_ptr, region_ptrs, lam, stage_offset, slot_bytes, offs, mask, RANK, WORLD_SIZE, PUSH,
                     LAMPORT, SPIN)
    if HAS_RESIDUAL:
        acc += tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        new_residual = acc.to(ELEM)
        tl.store(res_ptr + offs, new_residual, mask=mask)
    inv_rms = tl.math.rsqrt(tl.sum(acc * acc, axis=1) / HIDDEN + eps)
    values, scales = _normalise_and_store(acc, inv_rms, w_ptr, out_ptr, scale_ptr, scales_ptr, row0, row_end, HIDDEN,
                                          BLOCK, ROWS, GEMMA, QUANT)
    if SCATTER:
        if HAS_RESIDUAL:
            _scatter(region_ptrs, stage_offset, offs, mask, new_residual, RANK, WORLD_SIZE)
        for step in tl.static_range(1, WORLD_SIZE):
            peer = (RANK + step) % WORLD_SIZE
            _store_outputs(values, scales, _stage_ptr(region_ptrs, peer, out_offset, True, out_ptr.dtype.element_ty),
                           _stage_ptr(region_ptrs, peer, scales_offset, True, scales_ptr.dtype.element_ty), row0,
                           row_end, HIDDEN, BLOCK, ROWS, QUANT, False)


@triton.jit
def _finish_row(w_ptr, out_ptr, scale_ptr, scales_ptr, partials_ptr, stash_ptr, row, eps, HIDDEN: tl.constexpr,
                BLOCK: tl.constexpr, SPLIT: tl.constexpr, N_PARTS: tl.constexpr, GEMMA: tl.constexpr,
                QUANT: tl.constexpr):
    """out (and scales) of a whole row from its parts' stores: the fp32 sums s in the stash, the
    sum of squares = the sum of the parts' partial sums. The whole row is one tile, so its loads
    are in flight together (one L2 round trip, not one per part)."""
    # .cg: the other parts were stored by other programs (other SMs); L2 is where they are.
    parts = tl.arange(0, SPLIT)
    partial = tl.load(partials_ptr + row * N_PARTS + parts, mask=parts < N_PARTS, other=0.0, cache_modifier=".cg")
    offs, mask, cols = _tile(row, row + 1, 0, HIDDEN, BLOCK, 1)
    s = tl.load(stash_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")
    inv_rms = tl.math.rsqrt(tl.sum(partial, axis=0) / HIDDEN + eps) + tl.zeros((1,), tl.float32)
    _normalise_and_store(s, inv_rms, w_ptr, out_ptr, scale_ptr, scales_ptr, row, row + 1, HIDDEN, BLOCK, 1, GEMMA,
                         QUANT)


@triton.jit
def _split_part(x_ptr, res_ptr, w_ptr, out_ptr, scale_ptr, scales_ptr, region_ptrs, lam, stage_offset,
                slot_bytes, counts_ptr, partials_ptr, stash_ptr, row, part, eps, RANK: tl.constexpr,
                WORLD_SIZE: tl.constexpr, HIDDEN: tl.constexpr, BLOCK: tl.constexpr, SPLIT: tl.constexpr,
                PUSH: tl.constexpr, HAS_RESIDUAL: tl.constexpr, GEMMA: tl.constexpr, QUANT: tl.constexpr,
                LAMPORT: tl.constexpr, SPIN: tl.constexpr):
    """One part (BLOCK / SPLIT columns) of a row shared by N_PARTS programs (see the one-shot
    kernel): reduce, store the residual part, then count in; the row's last program writes its out."""
    ELEM: tl.constexpr = x_ptr.dtype.element_ty
    CHUNK: tl.constexpr = BLOCK // SPLIT
    N_PARTS: tl.constexpr = (HIDDEN + CHUNK - 1) // CHUNK
    offs, mask, cols = _tile(row, row + 1, part * CHUNK, HIDDEN, CHUNK, 1)
    acc = _sum_ranks(x_ptr, region_ptrs, lam, stage_offset, slot_bytes, offs, mask, RANK, WORLD_SIZE, PUSH,
                     LAMPORT, SPIN)
    if HAS_RESIDUAL:
        acc += tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(res_ptr + offs, acc.to(ELEM), mask=mask)
    tl.store(stash_ptr + offs, acc, mask=mask)  # unrounded: out is rounded once, as with whole rows
    tl.store(partials_ptr + row * N_PARTS + part, tl.sum(tl.sum(acc * acc, axis=1), axis=0))
    tl.debug_barrier()  # every thread's stores of this part precede the release below
    arrived = tl.atomic_add(counts_ptr + row, 1, sem="acq_rel", scope="gpu")
    if arrived == N_PARTS - 1:
        tl.atomic_xchg(counts_ptr + row, 0, sem="relaxed", scope="gpu")  # 0 again for the next call
        tl.debug_barrier()  # every thread reads after the acquire
        _finish_row(w_ptr, out_ptr, scale_ptr, scales_ptr, partials_ptr, stash_ptr, row, eps, HIDDEN, BLOCK, SPLIT,
                    N_PARTS, GEMMA, QUANT)


@triton.jit(do_not_specialize=["n_rows", "stage_offset", "slot_bytes", "half_bytes"])
def _one_shot_all_reduce_rmsnorm(x_ptr, res_ptr, w_ptr, out_ptr, scale_ptr, scales_ptr, region_ptrs, signal_ptrs,
                                 counts_ptr, partials_ptr, stash_ptr, header_ptr, n_rows: tl.int32, eps,
                                 stage_offset: tl.int64,
                                 slot_bytes: tl.int64, half_bytes: tl.int64, RANK: tl.constexpr,
                                 WORLD_SIZE: tl.constexpr, HIDDEN: tl.constexpr, BLOCK: tl.constexpr,
                                 ROWS: tl.constexpr, SPLIT: tl.constexpr, PUSH: tl.constexpr,
                                 DOUBLE_BUFFER: tl.constexpr, HAS_RESIDUAL: tl.constexpr = True,
                                 GEMMA: tl.constexpr = False, QUANT: tl.constexpr = 0,
                                 LAMPORT: tl.constexpr = False, SPIN: tl.constexpr = 0):
    """One-shot, pull (every rank reads every stage) or PUSH (every rank writes its x into its
    slot, ``slot_bytes`` apart, of every peer's stage). DOUBLE_BUFFER: the stage alternates
    between the halves at ``stage_offset`` and ``stage_offset + half_bytes`` by the epoch of
    autosymm.kernels.all_reduce (shared with its double-buffered kernels) and there is no end
    barrier (the argument of ``_one_shot_all_reduce`` / ``_push_one_shot_all_reduce``).

    LAMPORT (with PUSH): the Lamport one-shot's exchange (autosymm.kernels.lamport_all_reduce):
    ``region_ptrs`` is the Lamport region's table, ``header_ptr`` this rank's header, ``slot_bytes``
    its slot stride; x goes in wire form into this rank's slot of buffer k % 3 of every peer, no
    barrier at all, each row group polls its peers' words until they arrived, sums them with its
    own x and re-arms them; the grid's last program advances the rotation after its pushes. It
    shares the rotation with the Lamport all-reduce (one sequence of Lamport calls per rank).
    ``header_ptr`` is read only then (any valid pointer otherwise). SPIN (world size 2, GPUs): the
    words a thread waits on together in the Lamport wait's per-thread spin (lamport_sum), 0 for the
    CTA-uniform wait.

    SPLIT > 1 (ROWS == 1, n_rows <= autosymm.geometry.FUSED_SPLIT_MAX_ROWS, the stash holds
    n_rows x HIDDEN fp32): a row is cut in parts of CHUNK = BLOCK / SPLIT columns, N_PARTS of them
    holding columns < HIDDEN; work item ``row * N_PARTS + part`` belongs to program
    ``item % num_programs`` in every phase on every rank, so the barrier invariant above (a peer's
    elements are read only by the program index that staged them) holds unchanged. A part's
    program reduces its columns, stores the residual part and its unrounded fp32 sums (in
    ``stash_ptr``, laid out as x), its partial sum of squares in ``partials_ptr[row][part]``
    (fp32), and counts in on ``counts_ptr[row]`` (this rank's scratch, autosymm.geometry: the
    counters and partials in the signal region, the stash a region of its own).

    Memory ordering: a CTA barrier, then one thread's ``atom.add.acq_rel.gpu`` (release: every
    thread's stores of the part are visible at gpu scope before the count); the program that
    sees N_PARTS - 1 earlier arrivals (acquire: it sees every part's stores) is the row's last,
    resets the counter to 0 and, after a CTA barrier, reads the row's sums back from L2 (.cg)
    (one tile) and writes ``out``. No program waits for another, so any schedule finishes (the interpreter
    runs programs one after another). The counter is 0 after every call (every part arrives
    exactly once), so CUDA-graph replays need no host reset; the partials and the stash are
    written before they are read in every call; a rank's scratch is touched only by its own
    stream-ordered fused calls (all-reduce signal channel). Every rank sums the same partials
    with the same code, so out stays bit-identical across ranks."""
    tl.static_assert(BLOCK >= HIDDEN, "a row group is held in registers: BLOCK >= HIDDEN")
    tl.static_assert(SPLIT == 1 or ROWS == 1, "rows are split only one row at a time")
    tl.static_assert(QUANT != 3 or (HIDDEN % 16 == 0 and BLOCK >= 16), "nvfp4 packs whole blocks of 16")
    tl.static_assert(not LAMPORT or (PUSH and not DOUBLE_BUFFER), "the Lamport exchange pushes, into its own buffers")
    CHUNK: tl.constexpr = BLOCK // SPLIT
    N_PARTS: tl.constexpr = (HIDDEN + CHUNK - 1) // CHUNK
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    n_groups = tl.cdiv(n_rows, ROWS)
    n_items = n_groups * N_PARTS  # (row group, part) pairs; N_PARTS == 1 without SPLIT
    if DOUBLE_BUFFER:
        arrival_slot, epoch_slot, epoch, stage_offset = _epoch_stage(signal_ptrs, stage_offset, half_bytes, pid,
                                                                     n_programs, RANK)
    if LAMPORT:  # the W bases and the error count in flight together, before the header's load
        bases = lamport_bases(region_ptrs, WORLD_SIZE)
        errors, failed = lamport_error_slot(signal_ptrs, WORLD_SIZE)
        lam = (bases, errors, failed)
        buffer = lamport_buffer(header_ptr)
        stage_offset = lamport_offset(buffer, slot_bytes, WORLD_SIZE)
        lamport_count_in(header_ptr, pid, n_programs)
    else:
        lam = signal_ptrs  # unused: the stage and the barriers'
    if PUSH:
        for item in range(pid, n_items, n_programs):
            _push_rows(x_ptr, region_ptrs, lam, stage_offset, slot_bytes, (item // N_PARTS) * ROWS, n_rows,
                       (item % N_PARTS) * CHUNK, RANK, WORLD_SIZE, HIDDEN, CHUNK, ROWS, LAMPORT)
    else:
        stage = _stage_ptr(region_ptrs, RANK, stage_offset, True, x_ptr.dtype.element_ty)
        for item in range(pid, n_items, n_programs):
            _copy_rows(stage, x_ptr, (item // N_PARTS) * ROWS, n_rows, (item % N_PARTS) * CHUNK, HIDDEN, CHUNK, ROWS)
    # every rank's x is staged (pull: own stage; push: ours): a barrier, or the Lamport words' own marks
    if LAMPORT:
        lamport_rotate(header_ptr, signal_ptrs, buffer, pid, n_programs, WORLD_SIZE)
    elif DOUBLE_BUFFER:  # the last program advances the epoch between its signal and its wait
        barrier_and_publish(signal_ptrs, pid, arrival_slot, epoch_slot, epoch + 1, n_programs, RANK, WORLD_SIZE)
    else:
        barrier(signal_ptrs, pid, RANK, WORLD_SIZE)
    for item in range(pid, n_items, n_programs):
        if SPLIT == 1:
            _fused_rows(x_ptr, res_ptr, w_ptr, out_ptr, scale_ptr, scales_ptr, region_ptrs, lam, stage_offset,
                        slot_bytes, 0, 0, item * ROWS, n_rows, eps, RANK, WORLD_SIZE, HIDDEN, BLOCK, ROWS, PUSH, False,
                        HAS_RESIDUAL, GEMMA, QUANT, LAMPORT, SPIN)
        else:
            _split_part(x_ptr, res_ptr, w_ptr, out_ptr, scale_ptr, scales_ptr, region_ptrs, lam, stage_offset,
                        slot_bytes, counts_ptr, partials_ptr, stash_ptr, item // N_PARTS, item % N_PARTS, eps, RANK,
                        WORLD_SIZE, HIDDEN, BLOCK, SPLIT, PUSH, HAS_RESIDUAL, GEMMA, QUANT, LAMPORT, SPIN)
    if not DOUBLE_BUFFER and not LAMPORT:
        barrier(signal_ptrs, pid, RANK, WORLD_SIZE)  # no peer still reads our stage


@triton.jit
def _copy_outputs(out_ptr, scales_ptr, region_ptrs, out_offset, scales_offset, row0, row_end, RANK: tl.constexpr,
                  HIDDEN: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, QUANT: tl.constexpr):
    """Copy one row group's out (and scales) from this rank's stage (as ``_fused_rows`` scattered
    them) to ``out_ptr`` (and ``scales_ptr``; nvfp4: swizzled)."""
    out_stage = _stage_ptr(region_ptrs, RANK, out_offset, True, out_ptr.dtype.element_ty)
    if QUANT == 3:
        _copy_rows(out_ptr, out_stage, row0, row_end, 0, HIDDEN // 2, BLOCK // 2, ROWS)
        scale_stage = _stage_ptr(region_ptrs, RANK, scales_offset, True, scales_ptr.dtype.element_ty)
        offs, mask, _ = _tile(row0, row_end, 0, HIDDEN // 16, BLOCK // 16, ROWS)
        _store_block_scales(scales_ptr, tl.load(scale_stage + offs, mask=mask), row0, row_end, HIDDEN, BLOCK, ROWS,
                            True)
    else:
        _copy_rows(out_ptr, out_stage, row0, row_end, 0, HIDDEN, BLOCK, ROWS)
        if QUANT == 2:
            scale_stage = _stage_ptr(region_ptrs, RANK, scales_offset, True, scales_ptr.dtype.element_ty)
            _copy_rows(scales_ptr, scale_stage, row0, row_end, 0, 1, 1, ROWS)


@triton.jit(do_not_specialize=["n_rows", "stage_offset", "out_offset"])
def _two_shot_all_reduce_rmsnorm(x_ptr, res_ptr, w_ptr, out_ptr, scale_ptr, scales_ptr, region_ptrs, signal_ptrs,
                                 n_rows: tl.int32, eps, stage_offset: tl.int64, out_offset: tl.int64,
                                 RANK: tl.constexpr, WORLD_SIZE: tl.constexpr, HIDDEN: tl.constexpr,
                                 BLOCK: tl.constexpr, ROWS: tl.constexpr, PHASE: tl.constexpr,
                                 HAS_RESIDUAL: tl.constexpr = True, GEMMA: tl.constexpr = False,
                                 QUANT: tl.constexpr = 0):
    """Two-shot by rows (see the module docstring). The stage holds x's rows at ``stage_offset``
    and the out rows at ``out_offset`` (bytes into the region), quantized ones followed by their
    scales (row-major: fp32 per token, e4m3 [rows, HIDDEN / 16] for nvfp4) at the next 16 bytes;
    they fit the area of x's rows. PHASE 0 runs everything; 1, 2, 3 run copy-in + barrier, reduce
    + normalise + scatter, barrier + copy-out + end barrier alone (tests).

    In-place invariant (as the all-reduce two-shot's): in phase 2 rank r reads and writes only
    segment r's rows of every stage, each element read and then overwritten (with the new
    residual) by the same thread of the same program; no other rank touches segment r of any
    stage between the two barriers, and after the second every rank reads only its own stage.
    """
    ELEM: tl.constexpr = x_ptr.dtype.element_ty
    tl.static_assert(BLOCK >= HIDDEN, "a row group is held in registers: BLOCK >= HIDDEN")
    tl.static_assert(QUANT != 3 or (HIDDEN % 16 == 0 and BLOCK >= 16), "nvfp4 packs whole blocks of 16")
    OUT_ROW_BYTES: tl.constexpr = HIDDEN // 2 if QUANT == 3 else HIDDEN  # quantized rows (the scales follow)
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    seg = tl.cdiv(n_rows, WORLD_SIZE)
    seg_groups = tl.cdiv(seg, ROWS)
    scales_offset = out_offset + tl.cdiv(n_rows.to(tl.int64) * OUT_ROW_BYTES, 16) * 16
    stage = _stage_ptr(region_ptrs, RANK, stage_offset, True, ELEM)
    if PHASE == 0 or PHASE == 1:
        for s in tl.static_range(WORLD_SIZE):
            seg_end = tl.minimum(s * seg + seg, n_rows)
            for group in range(pid, seg_groups, n_programs):
                _copy_rows(stage, x_ptr, s * seg + group * ROWS, seg_end, 0, HIDDEN, BLOCK, ROWS)
        barrier(signal_ptrs, pid, RANK, WORLD_SIZE)  # every stage holds its rank's x
    if PHASE == 0 or PHASE == 2:
        seg_end = tl.minimum(RANK * seg + seg, n_rows)
        for group in range(pid, seg_groups, n_programs):
            _fused_rows(x_ptr, res_ptr, w_ptr, out_ptr, scale_ptr, scales_ptr, region_ptrs, signal_ptrs, stage_offset,
                        0, out_offset, scales_offset, RANK * seg + group * ROWS, seg_end, eps, RANK, WORLD_SIZE,
                        HIDDEN, BLOCK, ROWS, False, True, HAS_RESIDUAL, GEMMA, QUANT, False)
    if PHASE == 0 or PHASE == 3:
        barrier(signal_ptrs, pid, RANK, WORLD_SIZE)  # every segment's rows are in every stage
        for s in tl.static_range(WORLD_SIZE):
            if s != RANK:
                seg_end = tl.minimum(s * seg + seg, n_rows)
                for group in range(pid, seg_groups, n_programs):
                    if HAS_RESIDUAL:
                        _copy_rows(res_ptr, stage, s * seg + group * ROWS, seg_end, 0, HIDDEN, BLOCK, ROWS)
                    _copy_outputs(out_ptr, scales_ptr, region_ptrs, out_offset, scales_offset, s * seg + group * ROWS,
                                  seg_end, RANK, HIDDEN, BLOCK, ROWS, QUANT)
        barrier(signal_ptrs, pid, RANK, WORLD_SIZE)  # no peer still reads its stage (module docstring)
