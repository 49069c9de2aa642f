"""``AutosymmAll2AllManager``: MoE token dispatch/combine over autosymm's dp->ep / ep->dp conversions.

The role of vLLM's ``All2AllManagerBase`` (``dispatch``/``combine``/``destroy``) and of SGLang's
token dispatchers, with autosymm's layout (autosymm.routing). Every rank holds ``n_tokens_local``
tokens, the same number on every rank (pad with tokens whose ids are all -1).
``dispatch(hidden_states, topk_ids, topk_weights=None)`` returns a :class:`Dispatched`
(expert-ordered rows, their ``local_expert_ids``, ``tokens_per_expert``, the ``handle``);
``combine(expert_output, handle, reduce=True)`` returns each token's weighted sum (fp32
accumulation) or, ``reduce=False``, its per-pair rows. A pair whose expert id is outside ``[0,
n_experts)`` is dropped. No rank is left waiting because another raised: every call first
all-gathers a fixed-size header (its checks' verdict and the call's shape) from every rank.

Design notes: docs/INTEGRATIONS.md#integrations-moe-all2all
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from autosymm.api import init
from autosymm.collectives.moe import convert_dp_to_ep, convert_ep_to_dp
from autosymm.dist_compat import group_device
from autosymm.runtime.group import state_of, stream_capturing
from autosymm.routing import ExptAssignment, route, make_expt_assignment, make_expt_dict_uniform

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
        init(group)

    @property
    def local_experts(self) -> list[int]:
        """Global ids of this rank's experts, in local-id order."""
        return torch.nonzero(self.assignment.expt_boolmask[self.rank].cpu()).flatten().tolist()

    def agree_dispatch(self, hidden_states, topk_ids, topk_weights=None, *,
                       caller_error: Optional[Exception] = None) -> None:
        """The dispatch's checks (and ``caller_error``, an adapter's own) agreed by every rank
        (collective): raises on every rank where one failed or the ranks' calls differ."""
        error = caller_error or error_of(self._check_inputs, hidden_states, topk_ids, topk_weights)
        self.agree("dispatch", error, (_dim(topk_ids, 0), _dim(topk_ids, 1), _dim(hidden_states, 1),
                                       _dtype_code(hidden_states)))

    def dispatch(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: Optional[torch.Tensor] = None, *,
                 caller_error: Optional[Exception] = None, agreed: bool = False) -> Dispatched:
        """Send each local token's row to its top-k experts' ranks (see the module docstring).
        ``caller_error``: what an adapter's own checks of the call raised, agreed like the manager's;
        ``agreed``: the caller ran :meth:`agree_dispatch` for this call already."""
        if not agreed:
            self.agree_dispatch(hidden_states, topk_ids, topk_weights, caller_error=caller_error)
        hidden_states = hidden_states.contiguous()
        n_tokens_local, k = topk_ids.shape
        if topk_ids.dtype == torch.int64:  # an id outside int32 is dropped, never wrapped into range
            topk_ids = torch.where((topk_ids >= 0) & (topk_ids < self.n_experts), topk_ids, -1)
        expt_indx = self._gather_ids(topk_ids.to(torch.int32).contiguous())
        gate_indx, topk_indx = route(expt_indx, self.n_experts)
        rows = convert_dp_to_ep(hidden_states, self.assignment, expt_indx, gate_indx, group=self.group)
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

    def combine(self, expert_output: torch.Tensor, handle: DispatchHandle, reduce: bool = True, *,
                caller_error: Optional[Exception] = None) -> torch.Tensor:
        """Return processed rows to their tokens' ranks; weighted sum per token when ``reduce``
        (``caller_error``: as :meth:`dispatch`)."""
        error = caller_error or error_of(self._check_output, expert_output, handle)
        self.agree("combine", error, (_dim(expert_output, 0), -1, _dim(expert_output, 1), _dtype_code(expert_output)))
        rows = convert_ep_to_dp(expert_output.contiguous(), self.assignment, handle.expt_indx,
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

    def agree(self, call: str, error: Optional[Exception], shape: tuple[int, ...]) -> None:
        """Every rank learns every rank's verdict and ``shape`` (tokens, top-k, d_model, dtype code)
        of this ``call`` before any collective of it; raises on every rank when one failed or the
        shapes differ (this rank's own ``error`` where it has one)."""
        header = (int(error is None), *shape)
        if stream_capturing():  # no read-back inside a capture: the host-side agreement channel
            channel = state_of(self.group).channel
            reports = channel.exchange(channel.round_tag(f"moe_{call}"), {"header": header})
            rows = [tuple(report["header"]) for report in reports]
        else:
            mine = torch.tensor(header, dtype=torch.int64).to(self.device)
            rows = [tuple(row) for row in self._gather_ids(mine.view(1, -1)).tolist()]
        if error is not None:
            raise error
        failed = [rank for rank, row in enumerate(rows) if not row[0]]
        if failed:
            raise ValueError(f"{call}: rank(s) {failed} of the group failed their checks of this {call} (their own "
                             f"error names the argument); no rank went on")
        if len({row[1:] for row in rows}) > 1:
            said = ", ".join(f"rank {rank} {_described(row)}" for rank, row in enumerate(rows))
            raise ValueError(f"{call}: the ranks' calls differ ({said}); every rank must hold the same number "
                             f"of tokens (pad with ids -1), top-k, d_model and dtype")

    def _check_output(self, expert_output, handle: DispatchHandle) -> None:
        n_pairs = handle.expt_indx.numel()
        if (not isinstance(expert_output, torch.Tensor) or expert_output.dim() != 2
                or expert_output.shape[0] != n_pairs or expert_output.device != self.device):
            raise ValueError(f"combine: expert_output has shape {tuple(getattr(expert_output, 'shape', ()))} on "
                             f"{getattr(expert_output, 'device', type(expert_output).__name__)}; expected "
                             f"[n_tokens_global * k = {n_pairs}, d_model] on {self.device}")

    def _check_inputs(self, hidden_states, topk_ids, topk_weights) -> None:
        if self.destroyed:
            raise RuntimeError("AutosymmAll2AllManager.dispatch after destroy()")
        for name, value in (("hidden_states", hidden_states), ("topk_ids", topk_ids)):
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"dispatch: {name} must be a torch.Tensor, got {type(value).__name__}")
        if hidden_states.dim() != 2 or hidden_states.device != self.device:
            raise ValueError(f"dispatch: hidden_states has shape {tuple(hidden_states.shape)} on "
                             f"{hidden_states.device}; expected [n_tokens_local, d_model] on {self.device}")
        if (topk_ids.dim() != 2 or topk_ids.shape[0] != hidden_states.shape[0] or topk_ids.dtype not in _ID_DTYPES
                or topk_ids.device != self.device):
            raise ValueError(f"dispatch: topk_ids has shape {tuple(topk_ids.shape)}, dtype {topk_ids.dtype} on "
                             f"{topk_ids.device}; expected integer [n_tokens_local={hidden_states.shape[0]}, k] "
                             f"on {self.device}")
        if topk_weights is not None and (not isinstance(topk_weights, torch.Tensor) or topk_weights.shape !=
                                         topk_ids.shape or topk_weights.device != self.device):
            raise ValueError(f"dispatch: topk_weights has shape {tuple(getattr(topk_weights, 'shape', ()))} on "
                             f"{getattr(topk_weights, 'device', type(topk_weights).__name__)}; expected "
                             f"{tuple(topk_ids.shape)} on {self.device}")


#: dtype codes of the agreement header (the row dtypes the conversions take; 0: anything else)
_DTYPE_CODES = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}
_CODE_NAMES = {code: str(dtype).replace("torch.", "") for dtype, code in _DTYPE_CODES.items()}


def error_of(check, *args) -> Optional[Exception]:
    """What ``check(*args)`` raised (agreed before it propagates), or None."""
    try:
        check(*args)
    except (TypeError, ValueError, RuntimeError) as exc:
        return exc
    return None


def _dim(t, axis: int) -> int:
    """``t.shape[axis]``, or -1 where ``t`` has no such dimension (a bad argument, agreed as such)."""
    shape = getattr(t, "shape", ())
    return int(shape[axis]) if isinstance(t, torch.Tensor) and len(shape) > axis else -1


def _dtype_code(t) -> int:
    return _DTYPE_CODES.get(getattr(t, "dtype", None), 0)


def _described(row: tuple) -> str:
    tokens, k, d_model, code = row[1:]
    return (f"{tokens} tokens" + (f" x top-{k}" if k >= 0 else "") + f", d_model {d_model}, "
            f"{_CODE_NAMES.get(code, 'another dtype')}")
