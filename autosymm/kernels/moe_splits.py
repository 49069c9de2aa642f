"""Split planning of the NCCL MoE exchange (autosymm.backends.nccl_all_to_all), on the device.

From the global routing tensors every rank computes for each item (the items and skip rules of
autosymm.backends.nccl_all_to_all) a *send key* (its receiver, or WORLD_SIZE: not sent by this
rank) and a *receive key* (its sender, or WORLD_SIZE), and writes a stable partition by key:
``send_rows`` and ``recv_rows`` (int64, grouped by receiver / sender, each group in item order, so
both sides agree on the order within a split) and ``counts`` (int32 [2 * WORLD_SIZE]: rows sent to,
then received from, each rank). PASS 0 and 1 are two launches of GRID programs (each chunk's key
counts, then the placement); PASS 2 does both in one program, for small calls. No program waits
for another: no co-residency is needed, and the kernel runs under the interpreter.

Design notes: docs/KERNELS.md#kernels-moe-splits
"""

import triton
import triton.language as tl


@triton.jit
def _item_keys(offs, stop, expt_indx_ptr, indx_ptr, owner_ptr, n_pairs_local, n_expts_tot,
               RANK: tl.constexpr, WORLD_SIZE: tl.constexpr, N_EXPTS_ACT: tl.constexpr, DP_TO_EP: tl.constexpr):
    """(send key, source row, receive key, destination row) of the items ``offs`` (< ``stop``).
    Indices are compared as int64, so no out-of-range int64 id wraps into range."""
    n_pairs = n_pairs_local * WORLD_SIZE
    live = offs < stop
    if DP_TO_EP:  # item = pair p
        pair = offs.to(tl.int64)
        expt = tl.load(expt_indx_ptr + offs, mask=live, other=-1).to(tl.int64)
        dst_row = tl.load(indx_ptr + offs, mask=live, other=-1).to(tl.int64)  # gate row
        ok = live & (dst_row >= 0) & (dst_row < n_pairs)
        src_row = (pair % n_pairs_local) // N_EXPTS_ACT
    else:  # item = expert-sorted row s, pair topk[s]
        pair = tl.load(indx_ptr + offs, mask=live, other=-1).to(tl.int64)
        ok = live & (pair >= 0) & (pair < n_pairs)
        expt = tl.load(expt_indx_ptr + pair, mask=ok, other=-1).to(tl.int64)
        dst_row = pair % n_pairs_local
        src_row = offs.to(tl.int64)
    ok = ok & (expt >= 0) & (expt < n_expts_tot)
    owner = tl.load(owner_ptr + expt, mask=ok, other=-1)
    ok = ok & (owner >= 0) & (owner < WORLD_SIZE)
    home = (pair // n_pairs_local).to(tl.int32)
    if DP_TO_EP:
        sender, receiver = home, owner
    else:
        sender, receiver = owner, home
    send_key = tl.where(ok & (sender == RANK), receiver, WORLD_SIZE)
    recv_key = tl.where(ok & (receiver == RANK), sender, WORLD_SIZE)
    return send_key, src_row, recv_key, dst_row


@triton.jit
def _one_hot(keys, WORLD_SIZE: tl.constexpr, KEYS: tl.constexpr):
    """int32 [BLOCK, KEYS]: 1 where the item's key is the column (key WORLD_SIZE: no column)."""
    cols = tl.arange(0, KEYS)
    return ((keys[:, None] == cols[None, :]) & (cols[None, :] < WORLD_SIZE)).to(tl.int32)


@triton.jit
def _chunk_counts(start, stop, expt_indx_ptr, indx_ptr, owner_ptr, n_pairs_local, n_expts_tot,
                  RANK: tl.constexpr, WORLD_SIZE: tl.constexpr, N_EXPTS_ACT: tl.constexpr,
                  DP_TO_EP: tl.constexpr, KEYS: tl.constexpr, BLOCK: tl.constexpr):
    """int32 [KEYS] twice: send and receive key counts of the items [start, stop)."""
    send = tl.zeros([KEYS], dtype=tl.int32)
    recv = tl.zeros([KEYS], dtype=tl.int32)
    for base in range(start, stop, BLOCK):
        offs = base + tl.arange(0, BLOCK)
        send_key, _, recv_key, _ = _item_keys(offs, stop, expt_indx_ptr, indx_ptr, owner_ptr, n_pairs_local,
                                              n_expts_tot, RANK, WORLD_SIZE, N_EXPTS_ACT, DP_TO_EP)
        send += tl.sum(_one_hot(send_key, WORLD_SIZE, KEYS), axis=0)
        recv += tl.sum(_one_hot(recv_key, WORLD_SIZE, KEYS), axis=0)
    return send, recv


@triton.jit
def _place(keys, values, next_pos, rows_ptr, WORLD_SIZE: tl.constexpr, KEYS: tl.constexpr):
    """Store each keyed item's value at its key's next position (item order); return the
    positions after this tile."""
    hot = _one_hot(keys, WORLD_SIZE, KEYS)
    before = tl.cumsum(hot, axis=0) - hot  # items of the same key earlier in the tile
    pos = tl.sum(hot * (next_pos[None, :] + before), axis=1)
    tl.store(rows_ptr + pos, values, mask=keys < WORLD_SIZE)
    return next_pos + tl.sum(hot, axis=0)


@triton.jit
def _moe_splits(
    expt_indx_ptr,  # int [n_tokens_global * K]: global expert ids
    indx_ptr,  # int [n_tokens_global * K]: gate_indx (dp->ep) or topk_indx (ep->dp)
    owner_ptr,  # int32 [n_expts_tot]: rank owning each expert
    block_counts_ptr,  # int32 [GRID, 2, KEYS]: each chunk's send, then receive key counts (PASS 0, 1)
    send_rows_ptr,  # int64 [n_tokens_global * K]: out, source rows grouped by receiver
    recv_rows_ptr,  # int64 [n_tokens_global * K]: out, destination rows grouped by sender
    counts_ptr,  # int32 [2 * WORLD_SIZE]: out (PASS 1, 2), rows sent to / received from each rank
    n_pairs_local: tl.int32, n_expts_tot: tl.int32, chunk: tl.int32,  # annotated: not specialised
    RANK: tl.constexpr, WORLD_SIZE: tl.constexpr, N_EXPTS_ACT: tl.constexpr, DP_TO_EP: tl.constexpr,
    KEYS: tl.constexpr, BLOCK: tl.constexpr, GRID: tl.constexpr, PASS: tl.constexpr,
):
    pid = tl.program_id(0)
    n_items = n_pairs_local * WORLD_SIZE
    start = pid * chunk
    stop = tl.minimum(start + chunk, n_items)
    cols = tl.arange(0, KEYS)
    if PASS == 0:
        send, recv = _chunk_counts(start, stop, expt_indx_ptr, indx_ptr, owner_ptr, n_pairs_local, n_expts_tot,
                                   RANK, WORLD_SIZE, N_EXPTS_ACT, DP_TO_EP, KEYS, BLOCK)
        tl.store(block_counts_ptr + pid * 2 * KEYS + cols, send)
        tl.store(block_counts_ptr + pid * 2 * KEYS + KEYS + cols, recv)
    else:
        if PASS == 1:
            chunks = tl.arange(0, GRID)[:, None]
            ptrs = block_counts_ptr + chunks * 2 * KEYS + cols[None, :]
            send_all, recv_all = tl.load(ptrs), tl.load(ptrs + KEYS)
            send_total, recv_total = tl.sum(send_all, axis=0), tl.sum(recv_all, axis=0)
            send_next = tl.sum(tl.where(chunks < pid, send_all, 0), axis=0)  # earlier chunks' items
            recv_next = tl.sum(tl.where(chunks < pid, recv_all, 0), axis=0)
        else:
            send_total, recv_total = _chunk_counts(start, stop, expt_indx_ptr, indx_ptr, owner_ptr, n_pairs_local,
                                                   n_expts_tot, RANK, WORLD_SIZE, N_EXPTS_ACT, DP_TO_EP, KEYS,
                                                   BLOCK)
            send_next = tl.zeros([KEYS], dtype=tl.int32)
            recv_next = tl.zeros([KEYS], dtype=tl.int32)
        send_next += tl.cumsum(send_total, axis=0) - send_total  # + the start of each key's group
        recv_next += tl.cumsum(recv_total, axis=0) - recv_total
        for base in range(start, stop, BLOCK):
            offs = base + tl.arange(0, BLOCK)
            send_key, src_row, recv_key, dst_row = _item_keys(offs, stop, expt_indx_ptr, indx_ptr, owner_ptr,
                                                              n_pairs_local, n_expts_tot, RANK, WORLD_SIZE,
                                                              N_EXPTS_ACT, DP_TO_EP)
            send_next = _place(send_key, src_row, send_next, send_rows_ptr, WORLD_SIZE, KEYS)
            recv_next = _place(recv_key, dst_row, recv_next, recv_rows_ptr, WORLD_SIZE, KEYS)
        first = cols < tl.where(pid == 0, WORLD_SIZE, 0)  # program 0 writes the totals
        tl.store(counts_ptr + cols, send_total, mask=first)
        tl.store(counts_ptr + WORLD_SIZE + cols, recv_total, mask=first)


__all__ = ["_moe_splits"]
