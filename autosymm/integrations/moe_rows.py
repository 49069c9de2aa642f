"""vLLM's all-gather / reduce-scatter MoE layout over autosymm's dp->ep / ep->dp conversions.

vLLM 0.33.0's ``AgRsAll2AllManager`` hands every rank every rank's tokens in rank order
(``sizes[r]`` from rank r, uneven under data parallelism) and reduce-scatters the per-token
partial outputs back. :class:`GatheredRows` produces the same two layouts through
:class:`~autosymm.integrations.AutosymmAll2AllManager`: ``dispatch(hidden_states, topk_ids, sizes)``
-> (``hidden_states`` [sum(sizes), d], ``topk_ids``, a :class:`GatheredCall`), a token's row sent
only to the ranks owning one of its experts (the other rows zero, which vLLM's experts skip), and
``combine(partial, call)`` -> this rank's [sizes[rank], d] (fp32 accumulation, one rounding).
Ranks pad to ``max(sizes)`` with ids -1; 1-byte rows travel as 2-byte words where they can.

Design notes: docs/INTEGRATIONS.md#integrations-moe-rows
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .moe_all2all import AutosymmAll2AllManager, DispatchHandle, error_of

#: dtypes the conversions move and ``combine`` sums
SUMMED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def row_view(t: torch.Tensor) -> Optional[torch.Tensor]:
    """``t`` [n, d] as rows the conversions move (itself for bf16 / fp16 / fp32; a 1-byte dtype
    with even ``d`` viewed as fp16 [n, d / 2], a bit copy), or None when neither applies."""
    if t.dtype in SUMMED_DTYPES:
        return t
    if t.element_size() == 1 and t.shape[1] % 2 == 0 and t.is_contiguous():
        return t.view(torch.float16)
    return None


def unpadded_rows(sizes: list[int], device) -> torch.Tensor:
    """int64 [sum(sizes)] on ``device``: the row of each rank's tokens (rank order) among
    ``len(sizes)`` blocks of ``max(sizes)`` rows (made there: no host copy, capturable)."""
    width = max(sizes, default=0)
    return torch.cat([torch.arange(size, dtype=torch.int64, device=device) + rank * width
                      for rank, size in enumerate(sizes)])


@dataclass
class GatheredCall:
    """What ``combine`` needs from its ``dispatch``."""

    handle: DispatchHandle
    sizes: tuple[int, ...]
    rows: torch.Tensor  #: int64 [sum(sizes)]: each gathered token's row among the padded blocks


class GatheredRows:
    """vLLM's gathered-rows MoE layout (module docstring) on ``group`` for ``n_experts`` experts
    in vLLM's linear placement (``expert_map_manager.py:22``: blocks of consecutive ids, the first
    ``n_experts % R`` ranks one more), which is autosymm's uniform placement. Collective to build."""

    def __init__(self, n_experts: int, group=None) -> None:
        self.manager = AutosymmAll2AllManager(n_experts, group, copy_outputs=False)
        self.rank, self.world_size = self.manager.rank, self.manager.world_size
        self._rows: dict[tuple[int, ...], torch.Tensor] = {}

    def check_sizes(self, sizes, n_tokens: int) -> tuple[int, ...]:
        """``sizes`` as a tuple: one count >= 0 per rank, this rank's equal to ``n_tokens``."""
        sizes = tuple(int(size) for size in sizes)
        if len(sizes) != self.world_size or min(sizes) < 0 or sizes[self.rank] != n_tokens:
            raise ValueError(f"sizes={list(sizes)}: expected {self.world_size} token counts >= 0 with this rank's "
                             f"(rank {self.rank}) equal to its {n_tokens} tokens")
        return sizes

    def _check_dispatch(self, hidden_states, topk_ids, sizes) -> None:
        for name, value in (("hidden_states", hidden_states), ("topk_ids", topk_ids)):
            if not isinstance(value, torch.Tensor) or value.dim() != 2:
                raise ValueError(f"dispatch: {name} must be a 2-D tensor, got {getattr(value, 'shape', value)!r}")
        self.check_sizes(sizes, hidden_states.shape[0])
        if row_view(hidden_states.contiguous()) is None:
            raise ValueError(f"dispatch: hidden_states of {hidden_states.dtype} {tuple(hidden_states.shape)} is "
                             f"neither bf16/fp16/fp32 nor a 1-byte dtype with an even row length")

    def dispatch(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, sizes):
        """(hidden_states [sum(sizes), d], topk_ids [sum(sizes), k] in ``topk_ids``' dtype,
        :class:`GatheredCall`): every rank's tokens in rank order, zero rows where this rank owns
        none of the token's experts. A bad argument on one rank raises on every rank."""
        error = error_of(self._check_dispatch, hidden_states, topk_ids, sizes)
        if error is not None:  # agreed in the manager's dispatch: no rank is left in a collective
            self.manager.dispatch(None, None, caller_error=error)
        sizes = self.check_sizes(sizes, hidden_states.shape[0])
        rows_in = row_view(hidden_states.contiguous())
        width, n_tokens = max(max(sizes), 1), hidden_states.shape[0]
        padded = rows_in.new_zeros((width, rows_in.shape[1]))
        padded[:n_tokens] = rows_in
        ids = topk_ids.new_full((width, topk_ids.shape[1]), -1)
        ids[:n_tokens] = topk_ids
        out = self.manager.dispatch(padded, ids)
        handle = out.handle
        n_padded, k = handle.expt_indx.shape
        # the token of each expert-ordered row; rows of other ranks' experts go to a scratch row
        token = torch.where(out.local_expert_ids >= 0, handle.topk_indx.long() // k, n_padded)
        gathered = out.hidden_states.new_zeros((n_padded + 1, rows_in.shape[1]))
        gathered.index_copy_(0, token, out.hidden_states)  # a token's local rows are copies of one row
        rows = self._rows.get(sizes)
        if rows is None:
            rows = self._rows[sizes] = unpadded_rows(list(sizes), gathered.device)
        hidden = gathered[rows].view(hidden_states.dtype)
        return hidden, handle.expt_indx[rows].to(topk_ids.dtype), GatheredCall(handle, sizes, rows)

    def combine(self, partial: torch.Tensor, call: GatheredCall) -> torch.Tensor:
        """This rank's [sizes[rank], d] rows of the sum over ranks of ``partial`` [sum(sizes), d]."""
        handle = call.handle
        if (not isinstance(partial, torch.Tensor) or partial.dim() != 2 or partial.shape[0] != call.rows.numel()
                or partial.dtype not in SUMMED_DTYPES):
            error = ValueError(f"combine: partial has shape {tuple(getattr(partial, 'shape', ()))} and dtype "
                               f"{getattr(partial, 'dtype', None)}; expected [sum(sizes) = {call.rows.numel()}, "
                               f"d_model] of bf16, fp16 or fp32")
            self.manager.combine(None, handle, caller_error=error)  # raises on every rank
        n_padded, k = handle.expt_indx.shape
        padded = partial.new_zeros((n_padded, partial.shape[1]))
        padded.index_copy_(0, call.rows, partial.contiguous())
        manager = self.manager
        expt = handle.expt_indx.long()
        local_map = manager.assignment.expt_map[self.rank].to(expt.device)
        in_range = (expt >= 0) & (expt < manager.n_experts)
        local = in_range & (local_map[expt.clamp(0, manager.n_experts - 1)] >= 0)  # [n_padded, k]
        first = torch.argmax(local.to(torch.int8), dim=1)  # the first local pair of each token
        pair = handle.topk_indx.long()
        token, slot = pair // k, pair % k
        send = local.reshape(-1)[pair] & (slot == first[token])  # this rank's partial, once per token
        rows = torch.where(send[:, None], padded[token], torch.zeros((), dtype=partial.dtype, device=partial.device))
        mine = manager.combine(rows, handle, reduce=True)
        return mine[:call.sizes[self.rank]]

    def destroy(self) -> None:
        self.manager.destroy()
