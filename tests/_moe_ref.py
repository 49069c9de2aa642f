"""CPU references of the MoE conversions, every rank at once: the oracles the MoE tests check the
kernels, the NCCL path and the tuner's per-rank reference (autosymm.tuning.ops.moe) against."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from autosymm.routing import ExptAssignment


def _pair_owner(assignment: ExptAssignment, expt_indx: torch.Tensor) -> torch.Tensor:
    """int64 [n_pairs]: owning rank of each pair, -1 for a dropped pair."""
    e = expt_indx.reshape(-1).long().cpu()
    owner = assignment.expt_owner.long().cpu()
    valid = (e >= 0) & (e < owner.numel())
    return torch.where(valid, owner[e.clamp(0, owner.numel() - 1)], -1)


def _outputs(out, world_size: int, shape: tuple[int, int], like: torch.Tensor) -> list[torch.Tensor]:
    if out is None:
        return [torch.zeros(shape, dtype=like.dtype) for _ in range(world_size)]
    if len(out) != world_size or any(tuple(o.shape) != shape for o in out):
        raise ValueError(f"out must be {world_size} tensors of shape {shape}")
    return [o.detach().cpu().clone() for o in out]


def reference_dp_to_ep(srcs: Sequence[torch.Tensor], assignment: ExptAssignment, expt_indx: torch.Tensor,
                       gate_indx: torch.Tensor, out: Optional[Sequence[torch.Tensor]] = None) -> list[torch.Tensor]:
    """Every rank's dp->ep buffer [n_tokens_global * k, d_model] (CPU), from every rank's ``src``.

    Rows no pair writes are taken from ``out`` (copied, default zeros).
    """
    world_size = len(srcs)
    n_tokens_local, d_model = srcs[0].shape
    n_expts_act = expt_indx.shape[1]
    x = torch.cat([s.detach().cpu() for s in srcs])  # [n_tokens_global, d_model]
    dsts = _outputs(out, world_size, (x.shape[0] * n_expts_act, d_model), x)
    owner = _pair_owner(assignment, expt_indx)
    gate = gate_indx.reshape(-1).long().cpu()
    for rank in range(world_size):
        pairs = torch.nonzero(owner == rank).flatten()
        dsts[rank][gate[pairs]] = x[pairs // n_expts_act]
    return dsts


def reference_ep_to_dp(srcs: Sequence[torch.Tensor], assignment: ExptAssignment, expt_indx: torch.Tensor,
                       topk_indx: torch.Tensor, out: Optional[Sequence[torch.Tensor]] = None) -> list[torch.Tensor]:
    """Every rank's ep->dp buffer [n_tokens_local * k, d_model] (CPU), from every rank's
    expert-sorted ``src`` [n_tokens_global * k, d_model] (only its own experts' rows are read)."""
    world_size = len(srcs)
    n_rows, d_model = srcs[0].shape
    n_pairs_local = n_rows // world_size
    dsts = _outputs(out, world_size, (n_pairs_local, d_model), srcs[0])
    owner = _pair_owner(assignment, expt_indx)
    topk = topk_indx.reshape(-1).long().cpu()
    for rank in range(world_size):
        rows = torch.nonzero(owner[topk] == rank).flatten()
        pairs = topk[rows]
        src = srcs[rank].detach().cpu()
        for home in range(world_size):
            mine = (pairs // n_pairs_local) == home
            dsts[home][pairs[mine] - home * n_pairs_local] = src[rows[mine]]
    return dsts


def rows_written(op: str, assignment: ExptAssignment, expt_indx: torch.Tensor, indx: torch.Tensor,
                 world_size: int) -> list[torch.Tensor]:
    """bool mask of the destination rows ``op`` writes on each rank (CPU); ``indx`` is
    gate_indx for 'dp_to_ep', topk_indx for 'ep_to_dp' (unused there: every valid pair's row)."""
    owner = _pair_owner(assignment, expt_indx)
    n_pairs = owner.numel()
    if op == "dp_to_ep":
        gate = indx.reshape(-1).long().cpu()
        masks = [torch.zeros(n_pairs, dtype=torch.bool) for _ in range(world_size)]
        for rank in range(world_size):
            masks[rank][gate[owner == rank]] = True
        return masks
    if op == "ep_to_dp":
        return list((owner >= 0).view(world_size, n_pairs // world_size).unbind(0))
    raise ValueError(f"op={op!r} is not 'dp_to_ep' or 'ep_to_dp'")
