"""MoE dp->ep / ep->dp backend ``nccl_all_to_all``: one gather, ONE ``all_to_all_single``, one scatter.

Both ops are an exchange of *items* (rows), each with a sender, a receiver, a source row on the
sender and a destination row on the receiver, all computable on every rank from the global
routing tensors (identical on all ranks), with the meaning of autosymm.routing and the exact
skip rules of the Triton kernels (autosymm.kernels.moe_conversion):

* dp->ep, item = pair ``p`` (``n_pairs_local = n_tokens_local * k``): sender ``p // n_pairs_local``,
  receiver ``expt_owner[expt_indx[p]]``, source row ``(p % n_pairs_local) // k``, destination row
  ``gate_indx[p]``; skipped when the expert id is outside ``[0, n_expts_tot)`` or the gate row
  outside ``[0, n_pairs)``.
* ep->dp, item = expert-sorted row ``s``, ``p = topk_indx[s]``: sender ``expt_owner[expt_indx[p]]``,
  receiver ``p // n_pairs_local``, source row ``s``, destination row ``p % n_pairs_local``; skipped
  when ``p`` is outside ``[0, n_pairs)`` or its expert id outside ``[0, n_expts_tot)``.

Every rank sorts (stable, 1-byte keys) the items it sends by receiver and the items it receives
by sender: both sides then agree on the order of the rows within each split without talking.
The split sizes come from the sorted keys on the device; their one host copy (``tolist``) is
the only sync, so the path is eager only, not CUDA-graph capturable. Rows travel as 8- or 4-byte
words where the row size allows (bit copies; index kernels move fewer, wider elements). Rows of
skipped items are written by neither op: the output buffer (one per shape, reused call after
call, like triton_moe's workspace view) keeps what it held.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..problem import MOE_OPS, Problem
from .base import Backend, BackendError, Capabilities, Needs, RunContext
from .moe_inputs import check_inputs, shape_reason


class NcclAllToAll(Backend):
    """``dist.all_to_all_single`` with device-computed split sizes (eager only)."""

    name = "nccl_all_to_all"
    # split sizes go through the host (.tolist()): no CUDA-graph capture
    needs = Needs(ops=MOE_OPS, graph_capturable=False)

    def limits(self, problem: Problem, caps: Capabilities) -> Optional[str]:
        return shape_reason(problem)

    def prepare(self, problem: Problem, config: None, ctx: RunContext):
        import torch.distributed as dist

        group = ctx.group
        world_size, rank = dist.get_world_size(group), dist.get_rank(group)
        if world_size != problem.world_size:
            raise BackendError(f"group has world size {world_size}, the problem {problem.world_size}")
        items = _dp_to_ep_items if problem.op == "dp_to_ep" else _ep_to_dp_items
        outputs: dict[tuple, torch.Tensor] = {}

        def launcher(src, assignment, expt_indx, indx):
            n_tokens_local = check_inputs(problem, src.device, world_size, src, assignment, expt_indx, indx)
            sender, receiver, src_row, dst_row = items(assignment, expt_indx, indx, n_tokens_local, world_size)
            n_out = expt_indx.numel() // (1 if problem.op == "dp_to_ep" else world_size)
            out = _output(outputs, (n_out, src.shape[1]), src)
            exchange(src, out, Plan(sender, receiver, src_row, dst_row), rank, world_size, group)
            return out

        return launcher


class Plan:
    """int64 [n_items] tensors of an exchange: sender and receiver rank (``world_size`` for a
    skipped item), source row on the sender, destination row on the receiver."""

    __slots__ = ("sender", "receiver", "src_row", "dst_row")

    def __init__(self, sender, receiver, src_row, dst_row) -> None:
        self.sender, self.receiver, self.src_row, self.dst_row = sender, receiver, src_row, dst_row


def _owner(assignment, expt: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(owner rank per expert id, validity): ids outside [0, n_expts_tot) are invalid."""
    n_expts_tot = assignment.n_expts_tot
    valid = valid & (expt >= 0) & (expt < n_expts_tot)
    owner = assignment.expt_owner.long()[expt.clamp(0, n_expts_tot - 1)]
    return owner, valid & (owner >= 0) & (owner < assignment.n_expt_shard)


def _dp_to_ep_items(assignment, expt_indx, gate_indx, n_tokens_local: int, world_size: int):
    k = expt_indx.shape[1]
    n_pairs_local = n_tokens_local * k
    n_pairs = n_pairs_local * world_size
    pair = torch.arange(n_pairs, device=expt_indx.device)
    gate = gate_indx.reshape(-1).long()
    owner, valid = _owner(assignment, expt_indx.reshape(-1).long(), (gate >= 0) & (gate < n_pairs))
    sender = torch.div(pair, n_pairs_local, rounding_mode="floor")
    return sender, torch.where(valid, owner, world_size), (pair - sender * n_pairs_local) // k, gate


def _ep_to_dp_items(assignment, expt_indx, topk_indx, n_tokens_local: int, world_size: int):
    n_pairs_local = n_tokens_local * expt_indx.shape[1]
    n_pairs = n_pairs_local * world_size
    pair = topk_indx.reshape(-1).long()
    in_range = (pair >= 0) & (pair < n_pairs)
    pair = torch.where(in_range, pair, 0)
    owner, valid = _owner(assignment, expt_indx.reshape(-1).long()[pair], in_range)
    home = torch.div(pair, n_pairs_local, rounding_mode="floor")
    row = torch.arange(n_pairs, device=pair.device)
    return torch.where(valid, owner, world_size), torch.where(valid, home, world_size), row, pair - home * n_pairs_local


class Splits:
    """This rank's side of an exchange: rows to send (source rows, grouped by receiver) and
    their split sizes; where the received rows go (destination rows, grouped by sender) and
    theirs."""

    __slots__ = ("send_rows", "send_counts", "recv_rows", "recv_counts")

    def __init__(self, send_rows, send_counts, recv_rows, recv_counts) -> None:
        self.send_rows, self.send_counts = send_rows, send_counts
        self.recv_rows, self.recv_counts = recv_rows, recv_counts


def splits(plan: Plan, rank: int, world_size: int) -> Splits:
    """Rank ``rank``'s :class:`Splits` of ``plan``: two stable sorts of 1-byte keys, the split
    sizes from the sorted keys, one host copy of them (the only sync)."""
    skip = world_size  # key of the items this rank neither sends nor receives: sorted last
    send_key = torch.where(plan.sender == rank, plan.receiver, skip).to(torch.uint8)
    recv_key = torch.where(plan.receiver == rank, plan.sender, skip).to(torch.uint8)
    send_sorted, send_items = torch.sort(send_key, stable=True)
    recv_sorted, recv_items = torch.sort(recv_key, stable=True)
    ranks = torch.arange(world_size + 1, dtype=torch.uint8, device=send_key.device)
    starts = torch.searchsorted(torch.stack([send_sorted, recv_sorted]), ranks.expand(2, -1).contiguous())
    send_rows, recv_rows = plan.src_row[send_items], plan.dst_row[recv_items]  # queued before the sync
    send_starts, recv_starts = starts.tolist()
    return Splits(send_rows[:send_starts[-1]], [b - a for a, b in zip(send_starts, send_starts[1:])],
                  recv_rows[:recv_starts[-1]], [b - a for a, b in zip(recv_starts, recv_starts[1:])])


def exchange(src: torch.Tensor, out: torch.Tensor, plan: Plan, rank: int, world_size: int, group) -> None:
    """Send ``src``'s rows of this rank's items, write the received rows into ``out``: one
    index_select, one ``all_to_all_single``, one index_copy_."""
    import torch.distributed as dist

    split = splits(plan, rank, world_size)
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
