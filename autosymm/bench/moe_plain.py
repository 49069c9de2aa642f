"""The plain MoE exchange a user writes without autosymm: the MoE baseline of `autosymm bench` and
scripts/bench_moe_fallback.py.

Per call: the owners of the pairs from the routing tensors, this rank's rows sorted by
destination rank (stable ``argsort``), the split sizes as one-hot sums on the device (no
``bincount``: it syncs), ONE host copy of the counts (``tolist``), one ``index_select`` and one
``dist.all_to_all_single``. The received rows stay in arrival order (by sender, then in the
sender's order); nothing scatters them into the routing layout autosymm's conversions return.
:func:`plain_rows` names, for checking, which rows of that layout they are. The host copy makes
the path eager only (not CUDA-graph capturable).

Arguments as ``autosymm.convert_dp_to_ep`` / ``convert_ep_to_dp`` take them (autosymm.routing);
every pair routed to a valid expert (no dropped pairs: a user with drops would filter them).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from ..tuning.ops import get
from ..tuning.ops.moe import MoETuning

PLAIN_IMPL = "plain_all_to_all"
#: Why the plain path has no graph-mode measurement.
NOT_CAPTURABLE = "split sizes go through the host (tolist): not CUDA-graph capturable"


def _owners(assignment, expt_indx: torch.Tensor) -> torch.Tensor:
    """int64 [n_pairs]: the rank owning each pair's expert."""
    return assignment.expt_owner.long()[expt_indx.reshape(-1).long()]


def plain_dp_to_ep(rank: int, world_size: int, group=None) -> Callable[..., torch.Tensor]:
    """``call(src, assignment, expt_indx, gate_indx)`` -> the rows this rank's experts receive:
    every sender's pairs owned here, senders in rank order, each sender's in pair order."""
    def call(src, assignment, expt_indx, gate_indx):
        k = expt_indx.shape[1]
        ranks = torch.arange(world_size, device=src.device)
        owner = _owners(assignment, expt_indx).view(world_size, -1)
        local = owner[rank]
        order = torch.argsort(local, stable=True)
        counts = torch.cat([(local[:, None] == ranks).sum(0), (owner == rank).sum(1)]).tolist()
        send = src.index_select(0, order // k)
        recv = src.new_empty((sum(counts[world_size:]), src.shape[1]))
        dist.all_to_all_single(recv, send, counts[world_size:], counts[:world_size], group=group)
        return recv

    return call


def plain_ep_to_dp(rank: int, world_size: int, group=None) -> Callable[..., torch.Tensor]:
    """``call(src, assignment, expt_indx, topk_indx)`` -> the rows of this rank's tokens: from
    every expert rank in rank order, each sender's in its expert-sorted row order."""
    def call(src, assignment, expt_indx, topk_indx):
        n_pairs_local = src.shape[0] // world_size
        ranks = torch.arange(world_size, device=src.device)
        pair = topk_indx.long()
        owner = _owners(assignment, expt_indx)[pair]
        home = pair // n_pairs_local
        key = torch.where(owner == rank, home, world_size)  # rows of other ranks' experts sort last
        order = torch.argsort(key, stable=True)
        arriving = (home == rank)[:, None] & (owner[:, None] == ranks)
        counts = torch.cat([(key[:, None] == ranks).sum(0), arriving.sum(0)]).tolist()
        send = src.index_select(0, order[:sum(counts[:world_size])])
        recv = src.new_empty((sum(counts[world_size:]), src.shape[1]))
        dist.all_to_all_single(recv, send, counts[world_size:], counts[:world_size], group=group)
        return recv

    return call


def plain(op: str, rank: int, world_size: int, group=None) -> Callable[..., torch.Tensor]:
    """The plain path of ``op`` ('dp_to_ep' | 'ep_to_dp') on ``group``."""
    return (plain_dp_to_ep if _to_experts(op) else plain_ep_to_dp)(rank, world_size, group)


def _to_experts(op: str) -> bool:
    """Whether ``op`` is the MoE conversion to the experts (dp->ep); ValueError naming any op
    that is not a MoE conversion."""
    if not isinstance(get(op), MoETuning):
        raise ValueError(f"op={op!r} is not a MoE conversion (dp_to_ep or ep_to_dp)")
    return get(op).record.to_experts


def plain_rows(op: str, assignment, expt_indx: torch.Tensor, indx: torch.Tensor, rank: int,
               world_size: int) -> torch.Tensor:
    """int64: the rows of ``op``'s output in the routing layout (what autosymm's conversion
    returns on ``rank``) that the plain path returns, in its order; ``indx`` is ``gate_indx``
    (dp_to_ep) or ``topk_indx`` (ep_to_dp). ``plain_out == layout_out[plain_rows(...)]``."""
    to_experts = _to_experts(op)
    owner = _owners(assignment, expt_indx)
    if to_experts:  # pairs owned here, in pair order; each lands on its gate row
        return indx.reshape(-1).long()[torch.nonzero(owner == rank).flatten()]
    n_pairs_local = owner.numel() // world_size
    gate = torch.empty_like(indx, dtype=torch.int64)
    gate[indx.long()] = torch.arange(indx.numel(), device=indx.device)  # pair -> expert-sorted row
    pairs = slice(rank * n_pairs_local, (rank + 1) * n_pairs_local)
    # arrival order: by sender (the expert's owner), then by the sender's sorted row
    return torch.argsort(owner[pairs] * owner.numel() + gate[pairs])
