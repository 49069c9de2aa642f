"""The MoE conversions' tuning side, one :class:`MoETuning` per direction: random rows routed by
the same expert indices on every rank; the reference is computed by plain torch from a gathered
copy of every rank's input (:func:`moe_reference_for_rank`), compared bit for bit on the rows the
conversion writes; both conversions' buffers in the MoE region; `bench` over shapes x tokens."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...collectives.moe import convert_dp_to_ep, convert_ep_to_dp
from ...spec import DP_TO_EP as DP_TO_EP_RECORD, EP_TO_DP as EP_TO_DP_RECORD
from ...problem import Problem
from .base import SEED, TuningOp
from ...geometry import moe_region_bytes
from ...routing import make_expt_assignment, make_expt_dict_uniform, random_expt_indx, route

_TO_EXPERTS = {DP_TO_EP_RECORD.name: True, EP_TO_DP_RECORD.name: False}


def _to_experts(op: str) -> bool:
    """True for dp->ep, False for ep->dp; ValueError naming any other op."""
    if op not in _TO_EXPERTS:
        raise ValueError(f"op={op!r} is not one of {tuple(_TO_EXPERTS)}")
    return _TO_EXPERTS[op]


class MoETuning(TuningOp):
    exact = True  # pure copies: compared bit for bit

    def allocate(self, data, gen: torch.Generator) -> None:
        p, dev = data.problem, data.device
        shape, world_size = p.shape, p.world_size
        n_global = world_size * p.n_tokens_local
        data.assignment = make_expt_assignment(world_size, shape.n_expts_tot,
                                               make_expt_dict_uniform(world_size, shape.n_expts_tot), dev)
        data.expt_indx = random_expt_indx(n_global, shape.n_expts_tot, shape.n_expts_act,
                                          seed=SEED + p.n_tokens_local, device=dev)  # same on every rank
        gate_indx, topk_indx = route(data.expt_indx, shape.n_expts_tot)
        data.indx = gate_indx if self.record.to_experts else topk_indx
        rows = self.record.src_rows(p.n_tokens_local, n_global * shape.n_expts_act)
        data.val_input = torch.randn((rows, shape.d_model), generator=gen, device=dev).to(data.dtype)
        data.timing = [torch.empty_like(data.val_input) for _ in range(data.n_inputs)]
        data.extra = (data.assignment, data.expt_indx, data.indx)

    def build_reference(self, data) -> None:
        p = data.problem
        gathered = torch.empty((p.world_size, *data.val_input.shape), dtype=data.dtype, device=data.device)
        dist.all_gather(list(gathered.unbind(0)), data.val_input, group=data.group)  # stable API, any torch
        e = data.expt_indx.reshape(-1).long()
        n_expts = data.assignment.n_expts_tot
        owner = torch.where((e >= 0) & (e < n_expts), data.assignment.expt_owner.long()[e.clamp(0, n_expts - 1)], -1)
        data.expected, data.mask = moe_reference_for_rank(p.op, gathered, owner, data.indx, data.rank)

    def workspace_bytes(self, problem: Problem) -> tuple[int, int]:
        shape = problem.shape
        return 0, moe_region_bytes(problem.n_tokens_local, shape.n_expts_act, shape.d_model * problem.elem_bytes,
                                   problem.world_size)

    def autosymm_call(self):
        """autosymm's public function of this conversion."""
        return convert_dp_to_ep if self.record.to_experts else convert_ep_to_dp

    def public_call(self, data):
        return self.autosymm_call()  # (src, assignment, expt_indx, indx): the launcher's arguments

    def bench_indx(self, gate_indx: torch.Tensor, topk_indx: torch.Tensor) -> torch.Tensor:
        """The index argument of this direction (gate_indx dp->ep, topk_indx ep->dp)."""
        return gate_indx if self.record.to_experts else topk_indx


def moe_reference_for_rank(op: str, gathered: torch.Tensor, owner_of_pair: torch.Tensor, indx: torch.Tensor,
                           rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(expected output, bool mask of the rows the op writes) of ``rank``, on ``gathered``'s
    device. ``gathered`` [R, rows, d] holds every rank's src; ``owner_of_pair`` [n_pairs] the
    rank owning each (token, k) pair's expert (-1: dropped); ``indx`` is gate_indx (dp_to_ep) or
    topk_indx (ep_to_dp). Tested against the tests' CPU references of every rank at once (tests/_moe_ref.py)."""
    world_size, rows, d_model = gathered.shape
    owner = owner_of_pair.reshape(-1).long()
    n_pairs = owner.numel()
    idx = indx.reshape(-1).long()
    if _to_experts(op):
        k = n_pairs // (world_size * rows)
        x = gathered.reshape(world_size * rows, d_model)
        pairs = torch.nonzero(owner == rank).flatten()
        ref = torch.zeros((n_pairs, d_model), dtype=gathered.dtype, device=gathered.device)
        mask = torch.zeros(n_pairs, dtype=torch.bool, device=gathered.device)
        ref[idx[pairs]] = x[pairs // k]
        mask[idx[pairs]] = True
        return ref, mask
    n_local_pairs = n_pairs // world_size
    sorted_rows = torch.arange(n_pairs, device=gathered.device)
    pairs = idx[sorted_rows]
    sender = owner[pairs]
    sel = (sender >= 0) & (pairs // n_local_pairs == rank)
    ref = torch.zeros((n_local_pairs, d_model), dtype=gathered.dtype, device=gathered.device)
    mask = torch.zeros(n_local_pairs, dtype=torch.bool, device=gathered.device)
    dest = pairs[sel] - rank * n_local_pairs
    ref[dest] = gathered[sender[sel], sorted_rows[sel]]
    mask[dest] = True
    return ref, mask


DP_TO_EP = MoETuning(DP_TO_EP_RECORD)
EP_TO_DP = MoETuning(EP_TO_DP_RECORD)
