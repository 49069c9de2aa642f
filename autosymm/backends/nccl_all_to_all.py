"""MoE dp->ep / ep->dp backend ``nccl_all_to_all``: one gather, ONE ``all_to_all_single``, one scatter.

Both ops exchange *items* (rows) whose sender, receiver, source and destination rows every rank
computes from the global routing tensors (autosymm.routing; the Triton kernels' skip rules).
Every rank partitions (stably) the items it sends by receiver and those it receives by sender, so
both sides agree on the order within each split without talking: on a CUDA device through
autosymm.kernels.moe_splits, on the CPU through :func:`dp_to_ep_splits` / :func:`ep_to_dp_splits`
(also the kernel's reference). The split sizes' one host copy is the only sync: eager only, not
CUDA-graph capturable. Rows of skipped items are written by neither op.

Design notes: docs/BACKENDS.md#backends-nccl-all-to-all
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..spec import get as collective
from ..problem import Problem, next_pow2
from .base import Backend, BackendError, Capabilities, Needs, RunContext
from .launch import LeanLauncher, interpreter_active
from .moe_inputs import check_inputs, shape_reason

#: Calls of at most this many items (n_tokens_global * k) plan in one program, one launch; larger
#: ones in two launches of SPLIT_GRID programs of SPLIT_WARPS warps, each walking its chunk in
#: tiles of SPLIT_BLOCK items (autosymm.kernels.moe_splits). Estimates, not yet measured: a tile
#: costs a few dependent loads (~2-3 us), a launch ~7 us of host time, so one program walking two
#: tiles twice is about as fast as two launches.
ONE_PROGRAM_MAX_ITEMS = 4096
SPLIT_BLOCK = 2048
SPLIT_GRID = 64
SPLIT_WARPS = 8


class NcclAllToAll(Backend):
    """``dist.all_to_all_single`` with device-computed split sizes (eager only)."""

    name = "nccl_all_to_all"
    batch_invariant = True  # rows are copied, never summed
    # split sizes go through the host (.tolist()): no CUDA-graph capture
    needs = Needs(graph_capturable=False)

    def limits(self, problem: Problem, caps: Capabilities) -> Optional[str]:
        return shape_reason(problem)

    def prepare(self, problem: Problem, config: None, ctx: RunContext):
        group = ctx.group
        world_size, rank = dist.get_world_size(group), dist.get_rank(group)
        if world_size != problem.world_size:
            raise BackendError(f"group has world size {world_size}, the problem {problem.world_size}")
        to_experts = problem.record.to_experts
        plan = dp_to_ep_splits if to_experts else ep_to_dp_splits
        device_plan = DeviceSplits(problem.op, rank, world_size)
        outputs: dict[tuple, torch.Tensor] = {}
        tables: dict[tuple, torch.Tensor] = {}

        def launcher(src, assignment, expt_indx, indx):
            n_tokens_local = check_inputs(problem, src.device, world_size, src, assignment, expt_indx, indx)
            if src.is_cuda or interpreter_active():  # the kernel; under the interpreter on the CPU too
                split = device_plan(assignment.expt_owner, expt_indx, indx)
            else:
                split = plan(owner_table(assignment, world_size, tables), expt_indx, indx, n_tokens_local, rank,
                             world_size)
            n_out = expt_indx.numel() // (1 if to_experts else world_size)
            out = _output(outputs, (n_out, src.shape[1]), src)
            exchange(src, out, split, world_size, group)
            return out

        return launcher


class Splits:
    """This rank's side of an exchange: rows to send (source rows, grouped by receiver) and
    their split sizes; where the received rows go (destination rows, grouped by sender) and
    theirs."""

    __slots__ = ("send_rows", "send_counts", "recv_rows", "recv_counts")

    def __init__(self, send_rows, send_counts, recv_rows, recv_counts) -> None:
        self.send_rows, self.send_counts = send_rows, send_counts
        self.recv_rows, self.recv_counts = recv_rows, recv_counts


class DeviceSplits:
    """The Splits of one op on one rank from autosymm.kernels.moe_splits: its buffers cached per
    device and stream (grown when a call needs more), its launchers per specialisation (top-k,
    index dtypes, pointer alignment)."""

    def __init__(self, op: str, rank: int, world_size: int) -> None:
        self.op, self.rank, self.world_size = op, rank, world_size
        self._buffers: dict[tuple, tuple[tuple[torch.Tensor, ...], tuple[int, ...]]] = {}
        self._launchers: dict[tuple, tuple[LeanLauncher, ...]] = {}

    def __call__(self, expt_owner: torch.Tensor, expt_indx: torch.Tensor, indx: torch.Tensor) -> Splits:
        """``expt_owner`` int32 [n_expts_tot]; ``expt_indx``, ``indx`` contiguous [n_tokens_global, k]
        / [n_tokens_global * k] (unchecked: the backend's launcher validates)."""
        world_size, n_items = self.world_size, expt_indx.numel()
        one = n_items <= ONE_PROGRAM_MAX_ITEMS
        addrs = (expt_indx.data_ptr(), indx.data_ptr(), expt_owner.data_ptr())
        key = (one, expt_indx.shape[1], expt_indx.dtype, indx.dtype, *(addr % 16 == 0 for addr in addrs))
        passes = self._launchers.get(key) or self._make_launchers(key)
        device = expt_indx.device
        # Per stream: this call's exchange may still read the rows after the host moved on.
        place = (device, torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0)
        buffers, buffer_addrs = self._buffers.get(place) or self._make_buffers(n_items, place)
        if buffers[1].numel() < n_items:
            buffers, buffer_addrs = self._make_buffers(n_items, place)
        sizes = (n_items // world_size, expt_owner.numel(),
                 n_items if one else -(-n_items // (SPLIT_GRID * SPLIT_BLOCK)) * SPLIT_BLOCK)
        for launch in passes:
            direct = launch.direct
            if direct is not None:  # bound: int addresses, no per-pointer driver query
                direct(*addrs, *buffer_addrs, *sizes)
            else:
                launch(expt_indx, indx, expt_owner, *buffers, *sizes)
        counts = buffers[-1].tolist()  # the one host sync
        send_counts, recv_counts = counts[:world_size], counts[world_size:]
        return Splits(buffers[1][:sum(send_counts)], send_counts, buffers[2][:sum(recv_counts)], recv_counts)

    def _make_launchers(self, key: tuple) -> tuple[LeanLauncher, ...]:
        # Triton kernels load at the first launch: a CPU group imports none
        from ..kernels.moe_splits import _moe_splits

        one, k = key[:2]
        constexprs = dict(RANK=self.rank, WORLD_SIZE=self.world_size, N_EXPTS_ACT=k, DP_TO_EP=collective(self.op).to_experts,
                          KEYS=next_pow2(self.world_size), BLOCK=SPLIT_BLOCK, GRID=1 if one else SPLIT_GRID)
        passes = [(1, 2)] if one else [(SPLIT_GRID, 0), (SPLIT_GRID, 1)]
        launchers = self._launchers[key] = tuple(LeanLauncher(_moe_splits, (grid,), dict(constexprs, PASS=step),
                                                              num_warps=SPLIT_WARPS) for grid, step in passes)
        return launchers

    def _make_buffers(self, n_items: int, place: tuple) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...]]:
        """(block_counts int32 [SPLIT_GRID, 2, KEYS], send_rows, recv_rows int64 [>= n_items],
        counts int32 [2 * world_size]) and their addresses, one set per (device, stream), grown to
        the next power of two of the largest call; reused call after call (stream order keeps
        that safe)."""
        device, rows = place[0], next_pow2(n_items)
        buffers = (torch.empty((SPLIT_GRID, 2, next_pow2(self.world_size)), dtype=torch.int32, device=device),
                   torch.empty(rows, dtype=torch.int64, device=device),
                   torch.empty(rows, dtype=torch.int64, device=device),
                   torch.empty(2 * self.world_size, dtype=torch.int32, device=device))
        entry = self._buffers[place] = (buffers, tuple(b.data_ptr() for b in buffers))
        return entry


def owner_table(assignment, world_size: int, cache: dict) -> torch.Tensor:
    """uint8 [n_expts_tot + 2]: entry ``e + 1`` is expert e's owner, entries 0 and -1 (ids < 0 and
    >= n_expts_tot, clamped there by :func:`_slots`) and owners outside the group are
    ``world_size`` (skipped). Made once per assignment (its owner tensor and version)."""
    owner = assignment.expt_owner
    key = (owner.data_ptr(), owner._version, owner.numel(), world_size)
    table = cache.get(key)
    if table is None:
        cache.clear()
        valid = (owner >= 0) & (owner < world_size)
        table = torch.full((owner.numel() + 2,), world_size, dtype=torch.uint8, device=owner.device)
        table[1:-1] = torch.where(valid, owner, world_size).to(torch.uint8)
        table = cache[key] = table
    return table


def _slots(expt: torch.Tensor, n_expts_tot: int) -> torch.Tensor:
    """Index of each expert id into :func:`owner_table` (out-of-range ids land on its skip ends)."""
    expt = expt.to(torch.int32) if expt.dtype == torch.int16 else expt  # index_select takes int32/int64
    return expt.clamp(-1, n_expts_tot).add_(1)


def _ranks(world_size: int, device) -> torch.Tensor:
    return torch.arange(world_size + 1, dtype=torch.uint8, device=device)


def dp_to_ep_splits(table, expt_indx, gate_indx, n_tokens_local: int, rank: int, world_size: int) -> Splits:
    """Items are pairs ``p``; this rank sends its own pairs ``[rank * n_pairs_local, ...)`` grouped
    by receiver (the owner), and receives the pairs it owns in pair order (= grouped by sender)."""
    n_pairs_local = n_tokens_local * expt_indx.shape[1]
    n_pairs = n_pairs_local * world_size
    gate = gate_indx.reshape(-1).long()
    receiver = table.index_select(0, _slots(expt_indx.reshape(-1), table.numel() - 2))
    receiver = torch.where(gate.clamp(0, n_pairs - 1) == gate, receiver, world_size)  # gate row out of range: skip
    send_sorted, send_items = torch.sort(receiver[rank * n_pairs_local:(rank + 1) * n_pairs_local], stable=True)
    others = receiver.ne(rank)
    _, recv_items = torch.sort(others.view(torch.uint8), stable=True)  # stable: this rank's pairs first, in order
    counts = torch.cat([torch.searchsorted(send_sorted, _ranks(world_size, gate.device)),
                        others.logical_not().view(world_size, n_pairs_local).sum(1)])
    send_rows = torch.div(send_items, expt_indx.shape[1], rounding_mode="floor")
    recv_rows = gate.index_select(0, recv_items)
    counts = counts.tolist()  # the one host sync
    starts, recv_counts = counts[:world_size + 1], counts[world_size + 1:]
    return Splits(send_rows[:starts[-1]], _diffs(starts), recv_rows[:sum(recv_counts)], recv_counts)


def ep_to_dp_splits(table, expt_indx, topk_indx, n_tokens_local: int, rank: int, world_size: int) -> Splits:
    """Items are expert-sorted rows ``s`` (pair ``topk_indx[s]``); this rank sends the rows of its
    experts grouped by receiver (the pair's home rank) and receives its pairs' rows grouped by
    sender (the owner), each in row order."""
    n_pairs_local = n_tokens_local * expt_indx.shape[1]
    n_pairs = n_pairs_local * world_size
    topk = topk_indx.reshape(-1).long()
    pair = topk.clamp(0, n_pairs - 1)
    sender = table.index_select(0, _slots(expt_indx.reshape(-1).index_select(0, pair), table.numel() - 2))
    sender = torch.where(pair == topk, sender, world_size)  # topk entry out of range: skip
    home = torch.div(pair, n_pairs_local, rounding_mode="floor")
    send_key = torch.where(sender == rank, home.to(torch.uint8), world_size)
    recv_key = torch.where(home == rank, sender, world_size)  # a skipped item's sender is world_size
    send_sorted, send_items = torch.sort(send_key, stable=True)
    recv_sorted, recv_items = torch.sort(recv_key, stable=True)
    ranks = _ranks(world_size, topk.device)
    starts = torch.cat([torch.searchsorted(send_sorted, ranks), torch.searchsorted(recv_sorted, ranks)])
    recv_rows = pair.index_select(0, recv_items) - rank * n_pairs_local
    starts = starts.tolist()  # the one host sync
    send_starts, recv_starts = starts[:world_size + 1], starts[world_size + 1:]
    return Splits(send_items[:send_starts[-1]], _diffs(send_starts), recv_rows[:recv_starts[-1]],
                  _diffs(recv_starts))


def _diffs(starts: list[int]) -> list[int]:
    return [b - a for a, b in zip(starts, starts[1:])]


def exchange(src: torch.Tensor, out: torch.Tensor, split: Splits, world_size: int, group) -> None:
    """Send ``src``'s rows ``split.send_rows``, write the received rows into ``out``'s rows
    ``split.recv_rows``: one index_select, one ``all_to_all_single``, one index_copy_."""
    src_w, out_w = _words(src), _words(out)
    send = src_w.index_select(0, split.send_rows)
    if world_size == 1:
        recv = send
    else:
        recv = out_w.new_empty((split.recv_rows.numel(), out_w.shape[1]))
        dist.all_to_all_single(recv, send, split.recv_counts, split.send_counts, group=group)
    out_w.index_copy_(0, split.recv_rows, recv)


def _words(t: torch.Tensor) -> torch.Tensor:
    """``t`` [rows, cols] viewed as rows of the widest of 8-/4-byte words that tiles them (bits)."""
    row_bytes = t.shape[1] * t.element_size()
    offset_bytes = t.storage_offset() * t.element_size()
    for word in (torch.int64, torch.int32):
        size = word.itemsize
        if size > t.element_size() and row_bytes % size == 0 and offset_bytes % size == 0:
            return t.view(word)
    return t


def _output(outputs: dict, shape: tuple[int, int], src: torch.Tensor) -> torch.Tensor:
    key = (shape, src.dtype, src.device)
    out = outputs.get(key)
    if out is None:
        out = outputs[key] = torch.empty(shape, dtype=src.dtype, device=src.device)
    return out


NCCL_ALL_TO_ALL = NcclAllToAll()
