"""MoE token conversion over symmetric memory: dp->ep and ep->dp (Triton, device side only).

Both kernels move *pair rows*: one row of ``d_model`` elements per (token, top-k slot) pair,
read from a local source row and stored straight into a row of some rank's destination buffer
in the workspace's 'moe' region (push over NVLink; the local rank's rows are plain stores).
With ``p = t * K + j`` (``t`` a global token, ``j`` its top-k slot, ``e = expt_indx[p]``):

* dp->ep, rank r, local pair ``q`` in ``[0, n_tokens_local * K)``, ``p = r * n_tokens_local * K + q``:
  src row ``q // K`` -> rank ``expt_owner[e]``, row ``gate_indx[p]`` of its
  ``[n_tokens_global * K, d_model]`` buffer. A token's row is read once per pair; the K reads of
  one token come from neighbouring programs at nearly the same time, so they hit L2 (local
  reads are ~10x cheaper than the NVLink stores they feed).
* ep->dp, rank r, expert-sorted row ``s`` in ``[0, n_tokens_global * K)``, ``p = topk_indx[s]``:
  copied only when ``expt_owner[e] == r``: src row ``s`` -> rank ``p // (n_tokens_local * K)``,
  row ``p % (n_tokens_local * K)`` of its ``[n_tokens_local * K, d_model]`` buffer.

Any top-k works without padding: pairs are flattened, K only divides. Any world size 1..8
works without padding: a row's destination base address is gathered from the int64 tensor
``dst_ptrs`` [WORLD_SIZE] at its owner/home rank. Invalid pairs are skipped (nothing is
written for them): an expert id < 0 or >= n_expts_tot (-1 marks a dropped pair; compared at
the ids' own width, so an int64 id of 2**32 or more is skipped, never wrapped), or an
index (gate/topk row, owner) out of range, so a bad index never writes outside a buffer.

Launch shape: a program copies ``ROWS`` pair rows per step, ``BLOCK_N`` columns at a time, and
strides over the row groups ``range(pid, n_groups, num_programs)`` (a persistent grid when the
host launches fewer programs than groups). ``d_model = d_vecs * VEC``: VEC (a power of two, at
most 16 bytes of elements) divides d_model, which lets the compiler prove every row start
``VEC``-element aligned and emit 16-byte vector accesses; destination bases are 256-byte
aligned (asserted with ``tl.multiple_of``).

End barrier (the receiver must not read rows still in flight). Either the host launches
``barrier._barrier_kernel`` after the kernel (stream order publishes: it starts only once every
store of the copy kernel has completed, and its release.sys signals follow), or
``FUSED_BARRIER``: every program, after its
stores, does ``debug_barrier`` (all its threads issued their stores) then one
``atom.add.acq_rel.sys`` on an arrival counter. The release half makes the program's stores,
including those over NVLink, visible at system scope before its arrival counts; the program
that sees ``num_programs - 1`` earlier arrivals is the last one, and the acquire half makes
every other program's stores happen-before its own later operations. It resets the counter to
0 (so a CUDA graph replays without a host reset) and runs the signal-pad barrier with the same
program slot on every peer (release.sys signals are cumulative: they publish every program's
stores; acquire.sys waits). Programs other than the last never wait, so the barrier needs no
co-residency. The counter is this rank's slot ``[0][RANK]`` of the channel ``signal_ptrs``
points at: signals only ever land in slots ``[program][sender != RANK]``, so it is free. It is
zero whenever no conversion of this op runs: the last program resets it before it signals,
also when its wait then times out (bounded waits, autosymm.kernels.barrier). Checked on the
sm_90 PTX: every scalar atomic of the end barrier (arrival, reset, signal, poll, consume) is
issued by thread 0 of the program only (``@p atom``/``red`` with ``p = tid.x == 0``) and the
arrival count reaches the other threads through shared memory between two ``bar.sync``.
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
