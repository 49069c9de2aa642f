"""MoE token conversion over symmetric memory: dp->ep and ep->dp (Triton, device side only).

Both kernels move *pair rows*: one row of ``d_model`` elements per (token, top-k slot) pair, read
from a local source row and stored straight into a row of some rank's destination buffer in the
workspace's 'moe' region (push over NVLink). dp->ep sends each local pair's token row to rank
``expt_owner[e]``, row ``gate_indx[p]``; ep->dp sends each expert-sorted row this rank owns back to
its token's rank. Invalid pairs (an expert id or an index out of range) write nothing, so a bad
index never writes outside a buffer; any top-k and world size 1..8, without padding. The receiver
must not read rows still in flight: an end barrier follows, a separate ``barrier._barrier_kernel``
launch or ``FUSED_BARRIER`` (an acq_rel arrival counter at system scope, then the signal-pad
barrier run by the last program; the counter is back to 0 after every call).

Design notes: docs/KERNELS.md#kernels-moe-conversion
"""

import triton
import triton.language as tl

from .barrier import signal_peers, wait_peers


@triton.jit
def _copy_rows(dst_row_ptrs, src_row_ptrs, row_mask, d_model, BLOCK_N: tl.constexpr):
    """Copy ``d_model`` elements of every src row to its dst row where ``row_mask`` holds."""
    cols = tl.arange(0, BLOCK_N)
    for start in range(0, d_model, BLOCK_N):
        offs = start + cols
        mask = row_mask[:, None] & (offs < d_model)[None, :]
        x = tl.load(src_row_ptrs[:, None] + offs[None, :], mask=mask)
        tl.store(dst_row_ptrs[:, None] + offs[None, :], x, mask=mask)


@triton.jit
def _dst_row_ptrs(dst_ptrs, dst_rank, dst_row, valid, d_model, ELEM_PTR: tl.constexpr):
    """Address of row ``dst_row`` in rank ``dst_rank``'s buffer (base addresses are 256-byte aligned)."""
    base = tl.multiple_of(tl.load(dst_ptrs + dst_rank, mask=valid, other=0).to(ELEM_PTR), 16)
    return base + dst_row.to(tl.int64) * d_model


@triton.jit
def _end_barrier(signal_ptrs, RANK: tl.constexpr, WORLD_SIZE: tl.constexpr):
    """Fused end barrier: count this program's arrival; the grid's last program syncs with peers."""
    if WORLD_SIZE > 1:
        tl.debug_barrier()
        counter = tl.load(signal_ptrs + RANK).to(tl.pointer_type(tl.int32)) + RANK
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="sys")
        if arrived == tl.num_programs(0) - 1:
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
            signal_peers(signal_ptrs, 0, RANK, WORLD_SIZE)
            wait_peers(signal_ptrs, 0, RANK, WORLD_SIZE)


@triton.jit
def _convert_dp_to_ep(
    dst_ptrs,  # int64 [WORLD_SIZE]: each rank's [n_tokens_global * K, d_model] buffer
    src_ptr,  # [n_tokens_local, d_model] this rank's tokens, contiguous
    expt_owner_ptr,  # int32 [n_expts_tot]: rank owning each expert
    expt_indx_ptr,  # int [n_tokens_global, K]: global expert ids (-1: dropped pair)
    gate_indx_ptr,  # int [n_tokens_global, K]: pair -> row in the expert-sorted order
    signal_ptrs,  # int64 [WORLD_SIZE + 1]: each rank's end-barrier slot, then this rank's error slot (FUSED_BARRIER only)
    n_tokens_local: tl.int32, n_expts_tot: tl.int32, d_vecs: tl.int32,  # annotated: not specialised
    N_EXPTS_ACT: tl.constexpr, RANK: tl.constexpr, WORLD_SIZE: tl.constexpr, VEC: tl.constexpr,
    BLOCK_N: tl.constexpr, ROWS: tl.constexpr, ROWS_PAD: tl.constexpr, FUSED_BARRIER: tl.constexpr,
):
    d_model = d_vecs * VEC
    n_pairs_local = n_tokens_local * N_EXPTS_ACT
    n_dst_rows = n_pairs_local * WORLD_SIZE
    first_pair = RANK * n_pairs_local
    offs = tl.arange(0, ROWS_PAD)
    for group in range(tl.program_id(0), tl.cdiv(n_pairs_local, ROWS), tl.num_programs(0)):
        pair = group * ROWS + offs
        valid = (offs < ROWS) & (pair < n_pairs_local)
        expt = tl.load(expt_indx_ptr + first_pair + pair, mask=valid, other=-1)
        valid &= (expt >= 0) & (expt < n_expts_tot)  # at the ids' own width: an int64 id >= 2**32 is dropped
        expt = expt.to(tl.int32)  # in range now where valid: narrowing is exact
        owner = tl.load(expt_owner_ptr + expt, mask=valid, other=-1)
        dst_row = tl.load(gate_indx_ptr + first_pair + pair, mask=valid, other=-1)
        valid &= (owner >= 0) & (owner < WORLD_SIZE) & (dst_row >= 0) & (dst_row < n_dst_rows)
        dst = _dst_row_ptrs(dst_ptrs, owner, dst_row, valid, d_model, src_ptr.dtype)
        src = src_ptr + (pair // N_EXPTS_ACT).to(tl.int64) * d_model
        _copy_rows(dst, src, valid, d_model, BLOCK_N)
    if FUSED_BARRIER:
        _end_barrier(signal_ptrs, RANK, WORLD_SIZE)


@triton.jit
def _convert_ep_to_dp(
    dst_ptrs,  # int64 [WORLD_SIZE]: each rank's [n_tokens_local * K, d_model] buffer
    src_ptr,  # [n_tokens_global * K, d_model] expert-sorted rows (this rank's experts'), contiguous
    expt_owner_ptr,  # int32 [n_expts_tot]: rank owning each expert
    expt_indx_ptr,  # int [n_tokens_global, K]: global expert ids (-1: dropped pair)
    topk_indx_ptr,  # int [n_tokens_global * K]: sorted row -> pair
    signal_ptrs,  # int64 [WORLD_SIZE + 1]: each rank's end-barrier slot, then this rank's error slot (FUSED_BARRIER only)
    n_tokens_local: tl.int32, n_expts_tot: tl.int32, d_vecs: tl.int32,  # annotated: not specialised
    N_EXPTS_ACT: tl.constexpr, RANK: tl.constexpr, WORLD_SIZE: tl.constexpr, VEC: tl.constexpr,
    BLOCK_N: tl.constexpr, ROWS: tl.constexpr, ROWS_PAD: tl.constexpr, FUSED_BARRIER: tl.constexpr,
):
    d_model = d_vecs * VEC
    n_pairs_local = n_tokens_local * N_EXPTS_ACT
    n_rows = n_pairs_local * WORLD_SIZE
    offs = tl.arange(0, ROWS_PAD)
    for group in range(tl.program_id(0), tl.cdiv(n_rows, ROWS), tl.num_programs(0)):
        row = group * ROWS + offs
        valid = (offs < ROWS) & (row < n_rows)
        pair = tl.load(topk_indx_ptr + row, mask=valid, other=-1)
        valid &= (pair >= 0) & (pair < n_rows)
        expt = tl.load(expt_indx_ptr + pair, mask=valid, other=-1)
        valid &= (expt >= 0) & (expt < n_expts_tot)  # at the ids' own width: an int64 id >= 2**32 is dropped
        expt = expt.to(tl.int32)
        owner = tl.load(expt_owner_ptr + expt, mask=valid, other=-1)
        valid &= owner == RANK
        # Only 1/WORLD_SIZE of the sorted rows are this rank's: skip idle groups outright.
        if tl.max(valid.to(tl.int32), axis=0) > 0:
            home = pair // n_pairs_local
            dst = _dst_row_ptrs(dst_ptrs, home, pair - home * n_pairs_local, valid, d_model, src_ptr.dtype)
            src = src_ptr + row.to(tl.int64) * d_model
            _copy_rows(dst, src, valid, d_model, BLOCK_N)
    if FUSED_BARRIER:
        _end_barrier(signal_ptrs, RANK, WORLD_SIZE)


__all__ = ["_convert_dp_to_ep", "_convert_ep_to_dp"]
