"""The MoE manager (:class:`~autosymm.integrations.AutosymmAll2AllManager`) in the shapes stacks call.

* :class:`VllmAll2AllManager`: vLLM 0.33.0's ``All2AllManagerBase`` contract as its all-gather /
  reduce-scatter manager (``AgRsAll2AllManager``, ``distributed/device_communicators/all2all.py``)
  defines it: ``dispatch(hidden_states, topk_weights, topk_ids, is_sequence_parallel=False,
  extra_tensors=None) -> (hidden_states, topk_weights, topk_ids[, extras])``, every rank's tokens
  in rank order; ``combine(hidden_states, is_sequence_parallel=False)``: the sum over ranks of
  each rank's [n_tokens_global, d_model] partial expert output, this rank's rows. Through
  autosymm's dp->ep / ep->dp a token's row travels only to the ranks owning its experts, not
  to every rank: rows of tokens routed to no local expert come back zero (vLLM's experts skip
  them through ``expert_map``), and combine sends each rank's partial once per token.
* :class:`TitanTokenDispatcher`: torchtitan's EP token dispatcher (``models/common/
  token_dispatcher.py``, head b5bcd76): ``dispatch(x_TD, topk_scores_TK, topk_expert_ids_TK,
  num_local_tokens_per_expert_E) -> (routed_input_RD, num_tokens_per_local_expert_e, metadata)``
  with the rows of this rank's experts compact and expert-major; ``combine(routed_output_RD,
  metadata, x_TD) -> out_TD``: the score-weighted sum per token (fp32, cast once).

SGLang 0.5.23's ``BaseDispatcher.dispatch(hidden_states, topk_output) -> DispatchOutput`` hands
its result to MoE runners chosen by the output's ``format`` (standard, DeepEP, ...); no runner
reads autosymm's layout, so no SGLang shape is offered here (docs/INTEGRATIONS.md).

Every rank must hold the same number of tokens (pad with ids -1); one dispatch, then its combine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from autosymm.dist_compat import group_device

from .groups import device_group_for, serving_backend
from .moe_all2all import AutosymmAll2AllManager, DispatchHandle, error_of


def _gather_rows(t: torch.Tensor, group, world_size: int) -> torch.Tensor:
    """Every rank's ``t`` stacked along dim 0 in rank order (one all-gather)."""
    t = t.contiguous()
    out = t.new_empty((world_size * t.shape[0], *t.shape[1:]))
    dist.all_gather_into_tensor(out, t, group=group)
    return out


class VllmAll2AllManager:
    """vLLM's all-gather / reduce-scatter MoE contract over autosymm's conversions.

    ``cpu_group``, ``tcp_store_group``: as vLLM's managers take them (the latter must be None);
    ``n_experts`` and ``assignment``: as :class:`AutosymmAll2AllManager`; ``device``: this rank's
    device (default: the current CUDA device, else the group's); ``sequence_parallel``: the
    ``is_sequence_parallel`` every call passes (a manager serves one group). Collective over the
    group's ranks.
    """

    def __init__(self, cpu_group, tcp_store_group=None, *, n_experts: int, assignment=None,
                 device: Optional[torch.device] = None, sequence_parallel: bool = False) -> None:
        if tcp_store_group is not None:
            raise ValueError("VllmAll2AllManager serves torch.distributed groups; a stateless "
                             "tcp_store_group has no device group for autosymm")
        if device is None:  # where vLLM's managers compute: the current CUDA device
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else \
                group_device(cpu_group)
        device = torch.device(device)
        self.cpu_group = cpu_group
        self.group = device_group_for(cpu_group, serving_backend(device))
        self.manager = AutosymmAll2AllManager(n_experts, self.group, assignment)
        self.rank, self.world_size = self.manager.rank, self.manager.world_size
        self.sequence_parallel = sequence_parallel
        self._handle: Optional[DispatchHandle] = None

    def _check(self, is_sequence_parallel: bool) -> None:
        if is_sequence_parallel != self.sequence_parallel:
            raise ValueError(f"is_sequence_parallel={is_sequence_parallel}, but this manager serves the group of "
                             f"sequence_parallel={self.sequence_parallel}: build one manager per group")

    def dispatch(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 is_sequence_parallel: bool = False, extra_tensors: Optional[list[torch.Tensor]] = None):
        """(hidden_states, topk_weights, topk_ids[, extras]) of every rank's tokens, in rank order;
        ``hidden_states`` holds only the rows of tokens routed to this rank's experts (zeros elsewhere)."""
        error = error_of(self._check_dispatch, is_sequence_parallel, topk_weights, topk_ids)
        out = self.manager.dispatch(hidden_states, topk_ids, caller_error=error)  # every rank learns of an error
        self._handle = handle = out.handle
        n_global, k = handle.expt_indx.shape
        # token of each expert-ordered row; rows of other ranks' experts go to a scratch row
        token = torch.where(out.local_expert_ids >= 0, handle.topk_indx.long() // k, n_global)
        gathered = out.hidden_states.new_zeros((n_global + 1, hidden_states.shape[1]))
        gathered.index_copy_(0, token, out.hidden_states)  # a token's local rows are copies of one row
        result = (gathered[:n_global], _gather_rows(topk_weights, self.group, self.world_size),
                  handle.expt_indx.to(topk_ids.dtype))
        if extra_tensors is None:
            return result
        return (*result, [_gather_rows(t, self.group, self.world_size) for t in extra_tensors])

    def combine(self, hidden_states: torch.Tensor, is_sequence_parallel: bool = False) -> torch.Tensor:
        """This rank's [n_tokens_local, d_model] rows of the sum over ranks of ``hidden_states``
        [n_tokens_global, d_model] (each rank's partial output for every token)."""
        handle = self._handle
        if handle is None:
            raise RuntimeError("VllmAll2AllManager.combine before dispatch")
        error = error_of(self._check_combine, is_sequence_parallel, hidden_states)
        if error is not None:  # every rank learns of it in the manager's combine
            return self.manager.combine(None, handle, caller_error=error)
        n_global, k = handle.expt_indx.shape
        expt = handle.expt_indx.long()
        local_map = self.manager.assignment.expt_map[self.rank].to(expt.device)
        in_range = (expt >= 0) & (expt < self.manager.n_experts)
        local = in_range & (local_map[expt.clamp(0, self.manager.n_experts - 1)] >= 0)  # [n_global, k]
        first = torch.argmax(local.to(torch.int8), dim=1)  # the first local pair of each token
        pair = handle.topk_indx.long()
        token, slot = pair // k, pair % k
        send = local.reshape(-1)[pair] & (slot == first[token])  # this rank's partial, once per token
        rows = torch.where(send[:, None], hidden_states[token], torch.zeros((), dtype=hidden_states.dtype,
                                                                               device=hidden_states.device))
        return self.manager.combine(rows, handle, reduce=True)

    def _check_dispatch(self, is_sequence_parallel: bool, topk_weights, topk_ids) -> None:
        self._check(is_sequence_parallel)
        if getattr(topk_weights, "shape", None) != getattr(topk_ids, "shape", ()):
            raise ValueError(f"dispatch: topk_weights {tuple(getattr(topk_weights, 'shape', ()))} and topk_ids "
                             f"{tuple(getattr(topk_ids, 'shape', ()))} must both be [n_tokens_local, k]")

    def _check_combine(self, is_sequence_parallel: bool, hidden_states) -> None:
        self._check(is_sequence_parallel)
        n_global = self._handle.expt_indx.shape[0]
        if (not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 2
                or hidden_states.shape[0] != n_global):
            raise ValueError(f"combine: hidden_states has shape {tuple(getattr(hidden_states, 'shape', ()))}; "
                             f"expected [n_tokens_global = {n_global}, d_model]")

    def destroy(self) -> None:
        self.manager.destroy()


@dataclass
class TitanDispatchMetadata:
    """What :meth:`TitanTokenDispatcher.combine` needs from its dispatch."""

    handle: DispatchHandle
    rows: torch.Tensor  #: int64 [R]: the expert-ordered rows of this rank's experts, in order
    n_rows: int  #: n_tokens_global * k


class TitanTokenDispatcher:
    """torchtitan's EP token-dispatcher interface over autosymm's conversions (see the module
    docstring). ``n_experts``, ``group``, ``assignment``: as :class:`AutosymmAll2AllManager`."""

    def __init__(self, n_experts: int, group=None, assignment=None) -> None:
        self.manager = AutosymmAll2AllManager(n_experts, group, assignment)

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
        out = self.manager.dispatch(x_TD, topk_expert_ids_TK, topk_scores_TK, caller_error=error)
        rows = torch.nonzero(out.local_expert_ids >= 0).flatten()  # host sync, as torchtitan's splits
        metadata = TitanDispatchMetadata(out.handle, rows, out.hidden_states.shape[0])
        return out.hidden_states[rows], out.tokens_per_expert, metadata

    def combine(self, routed_output_RD: torch.Tensor, metadata: TitanDispatchMetadata,
                x_TD: torch.Tensor) -> torch.Tensor:
        """out_TD: each token's sum over its top-k pairs of score * expert output, in x_TD's dtype."""
        if (not isinstance(routed_output_RD, torch.Tensor) or routed_output_RD.dim() != 2
                or routed_output_RD.shape[0] != metadata.rows.numel()):
            error = ValueError(f"combine: routed_output_RD has shape {tuple(getattr(routed_output_RD, 'shape', ()))}; "
                               f"expected [R = {metadata.rows.numel()}, D]")
            return self.manager.combine(None, metadata.handle, caller_error=error)  # every rank learns of it
        full = routed_output_RD.new_zeros((metadata.n_rows, routed_output_RD.shape[1]))
        full.index_copy_(0, metadata.rows, routed_output_RD)
        return self.manager.combine(full, metadata.handle, reduce=True).to(x_TD.dtype)
