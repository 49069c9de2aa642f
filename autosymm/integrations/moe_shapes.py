"""The MoE manager (:class:`~autosymm.integrations.AutosymmAll2AllManager`) in torchtitan's shape.

:class:`TitanTokenDispatcher`: torchtitan's EP token dispatcher (``AllToAllTokenDispatcher``):
``dispatch(x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E) ->
(routed_input_RD, num_tokens_per_local_expert_e, metadata)``, the rows of this rank's experts
compact and expert-major, and ``combine(routed_output_RD, metadata, x_TD, *,
num_local_tokens_after_padding, local_seq_len_after_padding) -> out_TD``: the score-weighted sum
per token (fp32, cast once) at torchtitan's sequence-parallel position, zero elsewhere. Where no
tuned row decides both conversions of a call, torchtitan's own collectives run instead
(:class:`TitanAllToAll`), giving the same rows, counts and output. Every rank holds the same
number of tokens (pad with ids -1); one dispatch, then its combine.

Design notes: docs/INTEGRATIONS.md#integrations-moe-shapes
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

import torch.distributed as dist

from .moe_all2all import AutosymmAll2AllManager, DispatchHandle
from . import serving  # its gate: what every adapter asks
from autosymm.problem import DTYPES, MoEShape, Problem, dtype_name
from autosymm.spec import DP_TO_EP, EP_TO_DP


@dataclass
class TitanDispatchMetadata:
    """What :meth:`TitanTokenDispatcher.combine` needs from its dispatch."""

    handle: DispatchHandle
    rows: torch.Tensor  #: int64 [R]: the expert-ordered rows of this rank's experts, in order
    n_rows: int  #: n_tokens_global * k


class TitanTokenDispatcher:
    """torchtitan's EP token-dispatcher interface over autosymm's conversions (see the module
    docstring). ``n_experts``, ``group``, ``assignment``: as :class:`AutosymmAll2AllManager`;
    ``sp_size`` / ``sp_rank``: torchtitan's sequence-parallel coordinates (its TP mesh's size and
    this rank's coordinate; :meth:`wire_meshes` sets them as torchtitan does)."""

    def __init__(self, n_experts: int, group=None, assignment=None, *, sp_size: int = 1, sp_rank: int = 0) -> None:
        self.manager = AutosymmAll2AllManager(n_experts, group, assignment)
        self._set_sp(sp_size, sp_rank)

    def _set_sp(self, sp_size: int, sp_rank: int) -> None:
        self._decided: dict[tuple, bool] = {}
        if not (isinstance(sp_size, int) and isinstance(sp_rank, int) and 0 <= sp_rank < sp_size):
            raise ValueError(f"sp_size={sp_size!r}, sp_rank={sp_rank!r}: expected ints with 0 <= sp_rank < sp_size")
        self.sp_size, self.sp_rank = sp_size, sp_rank

    def wire_meshes(self, *, ep_mesh=None, tp_mesh=None) -> None:
        """torchtitan's ``BaseEPTokenDispatcher.wire_meshes``: the SP coordinates from ``tp_mesh``
        (1-D); ``ep_mesh`` must span this dispatcher's group (ValueError otherwise)."""
        if ep_mesh is not None:
            mine = dist.get_process_group_ranks(self.manager.group or dist.group.WORLD)
            if dist.get_process_group_ranks(ep_mesh.get_group()) != mine:
                raise ValueError(f"wire_meshes: ep_mesh spans ranks {dist.get_process_group_ranks(ep_mesh.get_group())}"
                                 f", this dispatcher's group {mine}")
        if tp_mesh is not None:
            self._set_sp(tp_mesh.size(), tp_mesh.get_local_rank())

    def dispatch(self, x_TD: torch.Tensor, topk_scores_TK: torch.Tensor, topk_expert_ids_TK: torch.Tensor,
                 num_local_tokens_per_expert_E: torch.Tensor):
        """(routed_input_RD, num_tokens_per_local_expert_e, metadata): the rows of this rank's
        experts, expert-major. ``num_local_tokens_per_expert_E`` [n_experts] is checked for shape
        only: the counts follow from the gathered ids."""
        error = None
        if tuple(getattr(num_local_tokens_per_expert_E, "shape", ())) != (self.manager.n_experts,):
            error = ValueError(f"dispatch: num_local_tokens_per_expert_E has shape "
                               f"{tuple(getattr(num_local_tokens_per_expert_E, 'shape', ()))}; expected "
                               f"({self.manager.n_experts},)")
        self.manager.agree_dispatch(x_TD, topk_expert_ids_TK, topk_scores_TK, caller_error=error)
        if not self._tuned(x_TD, topk_expert_ids_TK.shape[1]):
            return TitanAllToAll(self.manager).dispatch(x_TD, topk_scores_TK, topk_expert_ids_TK)
        out = self.manager.dispatch(x_TD, topk_expert_ids_TK, topk_scores_TK, agreed=True)
        rows = torch.nonzero(out.local_expert_ids >= 0).flatten()  # host sync, as torchtitan's splits
        metadata = TitanDispatchMetadata(out.handle, rows, out.hidden_states.shape[0])
        return out.hidden_states[rows], out.tokens_per_expert, metadata

    def combine(self, routed_output_RD: torch.Tensor, metadata: TitanDispatchMetadata, x_TD: torch.Tensor, *,
                num_local_tokens_after_padding: Optional[int] = None,
                local_seq_len_after_padding: Optional[int] = None) -> torch.Tensor:
        """out_TD [num_local_tokens_after_padding * sp_size, D] in x_TD's dtype: each token's sum
        over its top-k pairs of score * expert output at its sequence-parallel position, zero rows
        elsewhere (module docstring). The two counts default to x_TD's tokens (no padding)."""
        n_tokens = int(x_TD.shape[0]) if isinstance(x_TD, torch.Tensor) and x_TD.dim() == 2 else -1
        padded = n_tokens if num_local_tokens_after_padding is None else num_local_tokens_after_padding
        seq_len = padded if local_seq_len_after_padding is None else local_seq_len_after_padding
        error = _padding_error(n_tokens, padded, seq_len, self.sp_size)
        if error is None and (not isinstance(routed_output_RD, torch.Tensor) or routed_output_RD.dim() != 2
                              or routed_output_RD.shape[0] != metadata.rows.numel()):
            error = ValueError(f"combine: routed_output_RD has shape {tuple(getattr(routed_output_RD, 'shape', ()))}; "
                               f"expected [R = {metadata.rows.numel()}, D]")
        if isinstance(metadata, TitanAllToAllMetadata):
            combined = TitanAllToAll(self.manager).combine(routed_output_RD, metadata, error).to(x_TD.dtype)
            return self._placed(combined, n_tokens, padded, seq_len)
        if error is not None:
            return self.manager.combine(None, metadata.handle, caller_error=error)  # every rank learns of it
        full = routed_output_RD.new_zeros((metadata.n_rows, routed_output_RD.shape[1]))
        full.index_copy_(0, metadata.rows, routed_output_RD)
        combined = self.manager.combine(full, metadata.handle, reduce=True).to(x_TD.dtype)
        return self._placed(combined, n_tokens, padded, seq_len)

    def _tuned(self, x_TD: torch.Tensor, k: int) -> bool:
        """Whether tuned rows decide both conversions of this (agreed) call for autosymm's
        conversion, not NCCL (autosymm.integrations.serving.serves); asked once per call shape."""
        key = (x_TD.shape[0], x_TD.shape[1], k, x_TD.dtype)
        if key not in self._decided:
            manager = self.manager
            self._decided[key] = x_TD.dtype in DTYPES.values() and all(
                serving.serves(serving.explained(manager.group, spec, Problem.moe(
                    spec.name, MoEShape(x_TD.shape[1], manager.n_experts, k), x_TD.shape[0], dtype_name(x_TD.dtype),
                    manager.world_size), "eager"), spec)
                for spec in (DP_TO_EP, EP_TO_DP))
        return self._decided[key]

    def _placed(self, combined: torch.Tensor, n_tokens: int, padded: int, seq_len: int) -> torch.Tensor:
        """``combined`` [n_tokens, D] at torchtitan's sequence-parallel positions (module docstring)."""
        out = combined.new_zeros((padded * self.sp_size, combined.shape[1]))
        token = torch.arange(n_tokens, device=combined.device)
        if self.sp_size > 1:  # torchtitan's BaseEPTokenDispatcher._sp_global_token_indices
            token = (token // seq_len) * (seq_len * self.sp_size) + self.sp_rank * seq_len + token % seq_len
        return out.index_copy_(0, token, combined)


@dataclass
class TitanAllToAllMetadata:
    """What :meth:`TitanAllToAll.combine` needs from its dispatch."""

    order: torch.Tensor  #: int64 [P]: this rank's routed pairs (token * k + slot), in the order sent
    send_splits: list[int]  #: rows sent to each rank
    recv_splits: list[int]  #: rows received from each rank
    to_expert_major: torch.Tensor  #: int64 [R]: the received row at each expert-major position
    scores: torch.Tensor  #: [T, k] the router scores
    rows: torch.Tensor  #: [R] placeholder of the routed rows' count (TitanTokenDispatcher.combine checks it)


class TitanAllToAll:
    """torchtitan's own token all-to-all (``AllToAllTokenDispatcher``: the counts, then the rows
    by ``all_to_all_single``, then the local permute) over the manager's group and placement."""

    def __init__(self, manager: AutosymmAll2AllManager) -> None:
        self.manager = manager

    def _expert_order(self) -> torch.Tensor:
        """int64 [E]: the rank of each expert in (owner rank, local id) order: each rank's block contiguous."""
        assignment = self.manager.assignment
        owner = assignment.expt_owner.long().cpu()
        local = assignment.expt_map.long().cpu().max(0).values
        order = torch.argsort(owner * assignment.n_expts_tot + local, stable=True)
        return torch.empty_like(order).scatter_(0, order, torch.arange(order.numel()))

    def dispatch(self, x: torch.Tensor, scores: torch.Tensor, ids: torch.Tensor):
        """(routed_input_RD, num_tokens_per_local_expert_e, metadata) as the autosymm path's."""
        manager = self.manager
        group, world, n_experts = manager.group, manager.world_size, manager.n_experts
        per_rank = list(manager.assignment.n_expts_per_shard)
        n_local = per_rank[manager.rank]
        flat = ids.reshape(-1).long()
        valid = (flat >= 0) & (flat < n_experts)
        rank_of = self._expert_order().to(x.device)
        key = torch.where(valid, rank_of[flat.clamp(0, n_experts - 1)], n_experts)
        order = torch.argsort(key, stable=True)[:int(valid.sum())]  # pairs by expert (owner-major), then pair
        counts = torch.bincount(key[valid], minlength=n_experts)
        received = counts.new_empty(world * n_local)
        dist.all_to_all_single(received, counts, [n_local] * world, per_rank, group=group)
        received = received.view(world, n_local)  # [source rank, local expert]
        send_splits = [int(part.sum()) for part in torch.split(counts, per_rank)]  # host syncs, as torchtitan's
        recv_splits = received.sum(1).tolist()
        rows = x.new_empty((sum(recv_splits), x.shape[1]))
        dist.all_to_all_single(rows, x[order // ids.shape[1]].contiguous(), recv_splits, send_splits, group=group)
        expert_of_row = torch.cat([torch.repeat_interleave(torch.arange(n_local, device=x.device), received[r])
                                   for r in range(world)])
        source_of_row = torch.repeat_interleave(torch.arange(world, device=x.device), received.sum(1))
        to_expert_major = torch.argsort(expert_of_row * world + source_of_row, stable=True)
        metadata = TitanAllToAllMetadata(order, send_splits, recv_splits, to_expert_major, scores,
                                         torch.empty(rows.shape[0], device=x.device))
        return rows[to_expert_major], received.sum(0), metadata

    def combine(self, routed_output: torch.Tensor, metadata: TitanAllToAllMetadata,
                error: Exception | None) -> torch.Tensor:
        """Each token's score-weighted sum of its pairs' expert outputs (fp32, one cast), the rows
        sent back as they came; a bad call on one rank raises on every rank."""
        manager = self.manager
        width = routed_output.shape[1] if error is None else -1
        manager.agree("combine", error, (-1, -1, width, 0))  # row counts differ by rank; the width does not
        back = torch.empty_like(routed_output)
        back[metadata.to_expert_major] = routed_output
        pairs = routed_output.new_empty((sum(metadata.send_splits), routed_output.shape[1]))
        dist.all_to_all_single(pairs, back, metadata.send_splits, metadata.recv_splits, group=manager.group)
        n_tokens, k = metadata.scores.shape
        out = torch.zeros((n_tokens * k, routed_output.shape[1]), dtype=torch.float32, device=routed_output.device)
        out[metadata.order] = pairs.float()
        return out.view(n_tokens, k, -1).mul_(metadata.scores.float().unsqueeze(-1)).sum(1)


def _padding_error(n_tokens: int, padded, seq_len, sp_size: int) -> Optional[ValueError]:
    """Why combine's padding arguments cannot place ``n_tokens`` local tokens, or None."""
    if n_tokens < 0:
        return ValueError("combine: x_TD must be a [T, D] tensor")
    for name, value in (("num_local_tokens_after_padding", padded), ("local_seq_len_after_padding", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            return ValueError(f"combine: {name}={value!r} must be an int >= 0")
    if padded < n_tokens:
        return ValueError(f"combine: num_local_tokens_after_padding={padded} is fewer than x_TD's {n_tokens} tokens")
    if sp_size > 1 and (seq_len < 1 or padded % seq_len):
        return ValueError(f"combine: with sp_size={sp_size}, local_seq_len_after_padding={seq_len} must divide "
                          f"num_local_tokens_after_padding={padded} (batch x local sequence length)")
    return None
