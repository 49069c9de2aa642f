"""MoE dp->ep / ep->dp backend ``nccl_all_to_all``: what a user would write without autosymm.

Split sizes computed locally from the global expt_indx, rows gathered, ``dist.all_to_all_single``,
rows scattered into the layout of autosymm.routing. The split sizes go through the host
(``.tolist()``), so it is eager only, not CUDA-graph capturable (the dispatcher never picks it in
graph mode).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..problem import MOE_OPS, Problem
from ..routing import ExptAssignment
from .base import Backend, BackendError, Capabilities, Needs, RunContext
from .moe_inputs import check_inputs, shape_reason


class NcclAllToAll(Backend):
    """``dist.all_to_all_single`` with locally computed split sizes (eager only)."""

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
        exchange = _nccl_dp_to_ep if problem.op == "dp_to_ep" else _nccl_ep_to_dp
        outputs: dict[tuple, torch.Tensor] = {}

        def launcher(src, assignment, expt_indx, indx):
            check_inputs(problem, src.device, world_size, src, assignment, expt_indx, indx)
            return exchange(src, assignment, expt_indx, indx, rank, world_size, group, outputs)

        return launcher


def _pair_owner(assignment: ExptAssignment, expt_indx: torch.Tensor) -> torch.Tensor:
    """int64 [n_pairs] on expt_indx's device: owning rank per pair, -1 for a dropped pair."""
    e = expt_indx.reshape(-1).long()
    n = assignment.n_expts_tot
    return torch.where((e >= 0) & (e < n), assignment.expt_owner.long()[e.clamp(0, n - 1)], -1)


def _output(outputs: dict, shape: tuple[int, int], src: torch.Tensor) -> torch.Tensor:
    key = (shape, src.dtype, src.device)
    out = outputs.get(key)
    if out is None:
        out = outputs[key] = torch.empty(shape, dtype=src.dtype, device=src.device)
    return out


def _rank_counts(ranks: torch.Tensor, world_size: int) -> torch.Tensor:
    """int64 [world_size]: how many entries of ``ranks`` equal each rank (-1 counts nowhere)."""
    return (ranks[:, None] == torch.arange(world_size, device=ranks.device)).sum(0)


def _grouped(ranks: torch.Tensor, world_size: int) -> torch.Tensor:
    """Positions of ``ranks`` stably sorted by rank, entries of -1 last (cut them off by count)."""
    return torch.argsort(torch.where(ranks >= 0, ranks, world_size), stable=True)


def _exchange(send, n_recv_rows, send_counts, recv_counts, group):
    import torch.distributed as dist

    recv = send.new_empty((n_recv_rows, send.shape[1]))
    dist.all_to_all_single(recv, send, recv_counts, send_counts, group=group)
    return recv


def _nccl_dp_to_ep(src, assignment, expt_indx, gate_indx, rank, world_size, group, outputs):
    k = expt_indx.shape[1]
    n_pairs_local = src.shape[0] * k
    owner = _pair_owner(assignment, expt_indx)
    mine = owner[rank * n_pairs_local:(rank + 1) * n_pairs_local]
    here = (owner == rank).to(torch.int8)
    # The only host sync: every split size in one transfer.
    counts = torch.cat([_rank_counts(mine, world_size), here.view(world_size, -1).sum(1)]).tolist()
    send_counts, recv_counts = counts[:world_size], counts[world_size:]
    # Send: this rank's pairs grouped by owner, in pair order within a group.
    send_pairs = _grouped(mine, world_size)[:sum(send_counts)]
    # Receive: every pair owned here, in pair order = grouped by sender, pair order within.
    recv_pairs = torch.argsort(1 - here, stable=True)[:sum(recv_counts)]
    recv = _exchange(src[send_pairs // k], len(recv_pairs), send_counts, recv_counts, group)
    out = _output(outputs, (owner.numel(), src.shape[1]), src)
    out[gate_indx.reshape(-1).long()[recv_pairs]] = recv
    return out


def _nccl_ep_to_dp(src, assignment, expt_indx, topk_indx, rank, world_size, group, outputs):
    n_pairs = src.shape[0]
    n_pairs_local = n_pairs // world_size
    owner = _pair_owner(assignment, expt_indx)
    mine = owner[rank * n_pairs_local:(rank + 1) * n_pairs_local]
    here = (owner == rank).to(torch.int8)
    counts = torch.cat([here.view(world_size, -1).sum(1), _rank_counts(mine, world_size)]).tolist()
    send_counts, recv_counts = counts[:world_size], counts[world_size:]
    topk = topk_indx.reshape(-1).long()
    gate = torch.empty_like(topk)
    gate[topk] = torch.arange(n_pairs, device=topk.device)
    # Send: the pairs of this rank's experts in pair order (= grouped by home rank).
    send_pairs = torch.argsort(1 - here, stable=True)[:sum(send_counts)]
    # Receive: this rank's pairs grouped by owner (sender), pair order within.
    recv_pairs = _grouped(mine, world_size)[:sum(recv_counts)]
    recv = _exchange(src[gate[send_pairs]], len(recv_pairs), send_counts, recv_counts, group)
    out = _output(outputs, (n_pairs_local, src.shape[1]), src)
    out[recv_pairs] = recv
    return out


NCCL_ALL_TO_ALL = NcclAllToAll()
