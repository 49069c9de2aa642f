"""``AutosymmAll2AllManager``: MoE token dispatch/combine over autosymm's dp->ep / ep->dp conversions.

The role of vLLM's ``All2AllManagerBase`` (``dispatch``/``combine``/``destroy``) and of SGLang's
token dispatchers, with autosymm's layout (see ``autosymm.routing``). Contract, per rank of a
group of ``R`` ranks, every rank holding ``n_tokens_local`` tokens (the same number on every
rank: pad with tokens whose ids are all -1):

``dispatch(hidden_states [n_tokens_local, d_model], topk_ids [n_tokens_local, k], topk_weights=None)``
  gathers every rank's ``topk_ids`` (one all-gather of ``k`` ints per token), routes them, and
  sends each token's row to the ranks owning its experts. Returns a :class:`Dispatched`:

  * ``hidden_states`` [n_tokens_global * k, d_model]: expert-ordered rows (ascending global
    expert id, the rows of one expert contiguous, token order within). Only the rows with
    ``local_expert_ids >= 0`` are this rank's to process; the others hold garbage.
  * ``local_expert_ids`` int32 [n_tokens_global * k]: the local id (0 .. n_local_experts-1, in
    ascending global id) of each row's expert when this rank owns it, else -1.
  * ``tokens_per_expert`` int64 [n_local_experts]: rows per local expert (a device tensor, no
    host sync: dispatch and combine stay CUDA-graph capturable).
  * ``handle``: what ``combine`` needs.

  ``hidden_states`` is a tensor the caller owns (a copy of autosymm's workspace view) unless the
  manager was built with ``copy_outputs=False``: then it is a workspace view, valid until the
  next dispatch on the group.

``combine(expert_output [n_tokens_global * k, d_model], handle, reduce=True)``
  sends the rows this rank processed (same order as ``Dispatched.hidden_states``; rows of other
  ranks' experts are ignored) back to their tokens' ranks. ``reduce=True``: returns the tokens'
  [n_tokens_local, d_model] = sum over the valid top-k pairs of ``topk_weights * row`` (weights
  1 when dispatch got none), accumulated in fp32, in ``expert_output``'s dtype. ``reduce=False``:
  the per-pair rows [n_tokens_local, k, d_model], dropped pairs zeroed. Either is a new tensor.

A pair whose expert id is outside ``[0, n_experts)`` (e.g. -1) is dropped: it is sent nowhere
and contributes nothing to ``combine``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

import autosymm
from autosymm.dist_compat import group_device
from autosymm.routing import ExptAssignment, make_expt_assignment, make_expt_dict_uniform

_ID_DTYPES = (torch.int16, torch.int32, torch.int64)


@dataclass
class DispatchHandle:
    """What ``combine`` needs from its ``dispatch`` (routing of the whole group's tokens)."""

    expt_indx: torch.Tensor  #: int32 [n_tokens_global, k]: every rank's top-k ids, gathered
    topk_indx: torch.Tensor  #: int32 [n_tokens_global * k]: sorted row -> pair
    valid: torch.Tensor  #: bool [n_tokens_local, k]: this rank's pairs that were sent somewhere
    topk_weights: Optional[torch.Tensor]  #: [n_tokens_local, k] router weights, or None


@dataclass
class Dispatched:
    """The result of ``dispatch`` (see the module docstring)."""

    hidden_states: torch.Tensor
    local_expert_ids: torch.Tensor
    tokens_per_expert: torch.Tensor
    handle: DispatchHandle


class AutosymmAll2AllManager:
    """Expert-parallel dispatch/combine over ``group`` with autosymm's tuned conversions.

    ``n_experts``: experts in the layer; ``assignment``: their placement on the group's ranks
    (default: contiguous blocks, ``autosymm.make_expt_dict_uniform``). Constructing is
    collective (``autosymm.init(group)``).
    """

    def __init__(self, n_experts: int, group=None, assignment: Optional[ExptAssignment] = None,
                 copy_outputs: bool = True) -> None:
        if not dist.is_initialized():
            raise RuntimeError("AutosymmAll2AllManager needs torch.distributed initialised")
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.device = group_device(group)
        if assignment is None:
            assignment = make_expt_assignment(self.world_size, n_experts,
                                              make_expt_dict_uniform(self.world_size, n_experts), self.device)
        if assignment.n_expts_tot != n_experts or assignment.n_expt_shard != self.world_size:
            raise ValueError(f"assignment places {assignment.n_expts_tot} experts on {assignment.n_expt_shard} "
                             f"shards; expected {n_experts} experts on {self.world_size} ranks")
        self.n_experts = n_experts
        self.assignment = assignment
        self.copy_outputs = copy_outputs
        self.destroyed = False
        self._local_map = assignment.expt_map[self.rank].to(self.device, torch.int32)  # global -> local id or -1
        self.n_local_experts = int(assignment.n_expts_per_shard[self.rank])
        autosymm.init(group)

    @property
    def local_experts(self) -> list[int]:
        """Global ids of this rank's experts, in local-id order."""
        return torch.nonzero(self.assignment.expt_boolmask[self.rank].cpu()).flatten().tolist()

    def dispatch(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: Optional[torch.Tensor] = None) -> Dispatched:
        """Send each local token's row to its top-k experts' ranks (see the module docstring)."""
        self._check_inputs(hidden_states, topk_ids, topk_weights)
        hidden_states = hidden_states.contiguous()
        n_tokens_local, k = topk_ids.shape
        expt_indx = self._gather_ids(topk_ids.to(torch.int32).contiguous())
        gate_indx, topk_indx = autosymm.route(expt_indx, self.n_experts)
        rows = autosymm.convert_dp_to_ep(hidden_states, self.assignment, expt_indx, gate_indx, group=self.group)
        if self.copy_outputs:
            rows = rows.clone()
        expert_of_row = expt_indx.reshape(-1)[topk_indx.long()].long()
        in_range = (expert_of_row >= 0) & (expert_of_row < self.n_experts)
        local_ids = torch.where(in_range, self._local_map[expert_of_row.clamp(0, self.n_experts - 1)], -1)
        owned = local_ids >= 0
        tokens_per_expert = torch.zeros(self.n_local_experts, dtype=torch.int64, device=self.device)
        tokens_per_expert.index_add_(0, local_ids.clamp(min=0).long(), owned.long())
        mine = expt_indx[self.rank * n_tokens_local:(self.rank + 1) * n_tokens_local]
        valid = (mine >= 0) & (mine < self.n_experts)
        handle = DispatchHandle(expt_indx, topk_indx, valid, topk_weights)
        return Dispatched(rows, local_ids.to(torch.int32), tokens_per_expert, handle)

    def combine(self, expert_output: torch.Tensor, handle: DispatchHandle, reduce: bool = True) -> torch.Tensor:
        """Return processed rows to their tokens' ranks; weighted sum per token when ``reduce``."""
        n_pairs = handle.expt_indx.numel()
        if expert_output.dim() != 2 or expert_output.shape[0] != n_pairs or expert_output.device != self.device:
            raise ValueError(f"combine: expert_output has shape {tuple(expert_output.shape)} on "
                             f"{expert_output.device}; expected [n_tokens_global * k = {n_pairs}, d_model] "
                             f"on {self.device}")
        rows = autosymm.convert_ep_to_dp(expert_output.contiguous(), self.assignment, handle.expt_indx,
                                         handle.topk_indx, group=self.group)
        n_tokens_local, k = handle.valid.shape
        pairs = rows.view(n_tokens_local, k, rows.shape[1])
        valid = handle.valid.unsqueeze(-1)
        if not reduce:  # dropped pairs' rows were written by no one: zero them
            return torch.where(valid, pairs, torch.zeros((), dtype=pairs.dtype, device=pairs.device))
        weights = handle.topk_weights.float() if handle.topk_weights is not None else torch.ones_like(
            handle.valid, dtype=torch.float32)
        weights = torch.where(handle.valid, weights, 0.0)
        summed = torch.where(valid, pairs.float(), 0.0).mul_(weights.unsqueeze(-1)).sum(1)
        return summed.to(expert_output.dtype)

    def destroy(self) -> None:
        """Stop serving: later calls raise (the workspace belongs to autosymm's group state)."""
        self.destroyed = True

    def _gather_ids(self, topk_ids: torch.Tensor) -> torch.Tensor:
        gathered = topk_ids.new_empty((self.world_size * topk_ids.shape[0], topk_ids.shape[1]))
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(gathered, topk_ids, group=self.group)
        return gathered

    def _check_inputs(self, hidden_states, topk_ids, topk_weights) -> None:
        if self.destroyed:
            raise RuntimeError("AutosymmAll2AllManager.dispatch after destroy()")
        if hidden_states.dim() != 2 or hidden_states.device != self.device:
            raise ValueError(f"dispatch: hidden_states has shape {tuple(hidden_states.shape)} on "
                             f"{hidden_states.device}; expected [n_tokens_local, d_model] on {self.device}")
        if (topk_ids.dim() != 2 or topk_ids.shape[0] != hidden_states.shape[0] or topk_ids.dtype not in _ID_DTYPES
                or topk_ids.device != self.device):
            raise ValueError(f"dispatch: topk_ids has shape {tuple(topk_ids.shape)}, dtype {topk_ids.dtype} on "
                             f"{topk_ids.device}; expected integer [n_tokens_local={hidden_states.shape[0]}, k] "
                             f"on {self.device}")
        if topk_weights is not None and (topk_weights.shape != topk_ids.shape or topk_weights.device != self.device):
            raise ValueError(f"dispatch: topk_weights has shape {tuple(topk_weights.shape)} on {topk_weights.device}; "
                             f"expected {tuple(topk_ids.shape)} on {self.device}")
