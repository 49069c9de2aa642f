"""``autosymm.convert_dp_to_ep`` / ``convert_ep_to_dp``: the MoE token conversions, their checks
and their custom ops ``torch.ops.autosymm.dp_to_ep`` / ``ep_to_dp`` (differentiable: each
direction's backward is the other). Their specs: autosymm.spec.moe.

Call key: ``call_key(spec, src dtype, src shape, src device, capturing, (n_expts_tot, expt_indx
shape))``; the call's arguments ``(src, assignment, expt_indx, gate/topk indx)``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..backends.moe_inputs import check_index_ranges, check_inputs, ids_digest
from ..dist_compat import group_name, resolve_group
from ..problem import Problem
from ..routing import ExptAssignment
from ..runtime import moe_room
from ..runtime.entry import CustomOp, Door, prepare_call
from ..runtime.group import STATES, check_tensor, check_traced, state_of, stream_capturing
from ..spec import DP_TO_EP, EP_TO_DP, KEY_EXTRA, call_key
from ..spec.moe import MoEConversionSpec
from . import autograd

_Tensor = torch.Tensor
_dynamo_compiling = torch.compiler.is_dynamo_compiling


class MoEDoor(Door):
    """A MoE conversion's entry (``spec``: DP_TO_EP or EP_TO_DP)."""

    spec: MoEConversionSpec
    prepare_in_check = False  # growing the MoE region is collective: after the agreed check

    def call_text(self, key, args: tuple, mode: str) -> str:
        src, _, expt_indx, _ = args
        text = (f"{self.name} of {src.dtype} {tuple(src.shape)} with {key[KEY_EXTRA][0]} experts, expt_indx "
                f"{tuple(expt_indx.shape)}, in {mode} mode")
        if mode == "eager":  # the ids must be the same on every rank: compared by digest (a read-back)
            text += f", expt_indx digest {ids_digest(expt_indx)}"
        return text

    def fingerprint(self, key, args: tuple, mode: str) -> dict:
        """Door.fingerprint, and in eager mode the digest of ``expt_indx`` (every rank's ids must
        be the same)."""
        found = super().fingerprint(key, args, mode)
        if mode == "eager":
            found["expt_indx digest"] = ids_digest(args[2])
        return found

    def check_tensors(self, state, args: tuple, mode: str) -> None:
        src, assignment, expt_indx, indx = args
        check_tensor(src, state, self.name, "src")
        if src.dim() != 2 or expt_indx.dim() != 2:
            raise ValueError(f"autosymm.{self.name}: src {tuple(src.shape)} and expt_indx {tuple(expt_indx.shape)} "
                             f"must be 2-D ([rows, d_model], [n_tokens_global, k])")
        check_inputs(self.problem(state, None, args, mode), state.device, state.world_size, src, assignment,
                     expt_indx, indx)
        if mode == "eager":  # a range check reads the indices back: not inside a capture
            check_index_ranges(self.name, expt_indx, indx, assignment.expt_owner, state.world_size)

    def problem(self, state, key, args: tuple, mode: str) -> Problem:
        src, assignment, expt_indx, _ = args
        return self.spec.problem_of_key(_key(self.spec, src, assignment, expt_indx, mode == "graph"),
                                        state.world_size)

    def prepare(self, state, problem, mode: str):
        """After growing the MoE region (eager; collective) where only room stops the Triton
        conversion (autosymm.runtime.moe_room)."""
        return moe_room.prepare(state, problem, mode)

    def custom_ops(self) -> tuple[CustomOp, ...]:
        # differentiable: each direction's backward is the other one with the same routing
        if self.spec.to_experts:
            return (CustomOp(self.name, _dp_to_ep, _dp_to_ep_fake, backward=autograd.dp_to_ep_backward,
                             setup_context=autograd.moe_setup),)
        return (CustomOp(self.name, _ep_to_dp, _ep_to_dp_fake, backward=autograd.ep_to_dp_backward,
                         setup_context=autograd.moe_setup),)


DP_TO_EP_DOOR = MoEDoor(DP_TO_EP, arg_names=("src", "assignment", "expt_indx", "gate_indx"))
EP_TO_DP_DOOR = MoEDoor(EP_TO_DP, arg_names=("src", "assignment", "expt_indx", "topk_indx"))


def convert_dp_to_ep(src: torch.Tensor, expt_assignment, expt_indx: torch.Tensor, gate_indx: torch.Tensor,
                     group=None) -> torch.Tensor:
    """Send each local token's row to the ranks owning its top-k experts (see autosymm.routing).

    ``src`` [n_tokens_local, d_model]; ``expt_indx`` [n_tokens_global, k] global expert ids;
    ``gate_indx`` from ``autosymm.route``. Returns this rank's [n_tokens_global * k, d_model]
    expert-ordered buffer. Eager: a workspace view, valid until the next dp->ep call (no copy).
    Under torch.compile, or for a ``src`` that requires grad: ``torch.ops.autosymm.dp_to_ep``, a
    tensor the caller owns (one copy; differentiable: its backward is ep->dp).
    """
    if type(src) is not _Tensor or src.requires_grad or _dynamo_compiling():
        check_traced(src, "convert_dp_to_ep")
        tensors, per_shard = _assignment_args(expt_assignment)
        return torch.ops.autosymm.dp_to_ep(src, tensors, per_shard, expt_indx, gate_indx, group_name(group))
    return _moe_call(DP_TO_EP_DOOR, src, expt_assignment, expt_indx, gate_indx, group)


def convert_ep_to_dp(src: torch.Tensor, expt_assignment, expt_indx: torch.Tensor, topk_indx: torch.Tensor,
                     group=None) -> torch.Tensor:
    """Send expert outputs back to their tokens' home ranks (inverse of convert_dp_to_ep).

    ``src`` [n_tokens_global * k, d_model] in expert order; returns this rank's
    [n_tokens_local * k, d_model] rows. Eager: a workspace view, valid until the next ep->dp
    call. Under torch.compile, or for a ``src`` that requires grad: ``torch.ops.autosymm.ep_to_dp``,
    a tensor the caller owns (differentiable: its backward is dp->ep).
    """
    if type(src) is not _Tensor or src.requires_grad or _dynamo_compiling():
        check_traced(src, "convert_ep_to_dp")
        tensors, per_shard = _assignment_args(expt_assignment)
        return torch.ops.autosymm.ep_to_dp(src, tensors, per_shard, expt_indx, topk_indx, group_name(group))
    return _moe_call(EP_TO_DP_DOOR, src, expt_assignment, expt_indx, topk_indx, group)


def _moe_call(door: MoEDoor, src, expt_assignment, expt_indx, indx, group):
    """A MoE conversion of plain tensors, eager or captured."""
    state = STATES.get(group) or state_of(group)
    key = _key(door.spec, src, expt_assignment, expt_indx, stream_capturing())
    entry = state.cache.get(key)
    if entry is None:
        entry = prepare_call(state, door, key, (src, expt_assignment, expt_indx, indx))
    entry.calls += 1
    return entry.launcher(src, expt_assignment, expt_indx, indx)


def _key(spec, src: Tensor, assignment, expt_indx: Tensor, capturing: bool):
    """A conversion's call key: src's dtype, shape and device, (experts in total, expt_indx's shape)."""
    return call_key(spec, src.dtype, src.shape, src.device, capturing, (int(assignment.expt_map.shape[1]),
                                                                        expt_indx.shape))


def _assignment_args(a) -> tuple[list[torch.Tensor], list[int]]:
    """An ExptAssignment as the MoE ops take it (:func:`assignment_from` rebuilds it)."""
    if not isinstance(a, ExptAssignment):
        raise TypeError(f"autosymm: the expert assignment must be an ExptAssignment, got {type(a).__name__}")
    return [a.expt_bitmask, a.expt_boolmask, a.expt_map, a.expt_owner], list(a.n_expts_per_shard)


def assignment_from(assignment: list[Tensor], n_expts_per_shard: list[int]) -> ExptAssignment:
    """The ExptAssignment the MoE ops' arguments describe (the inverse of :func:`_assignment_args`)."""
    if len(assignment) != 4:
        raise ValueError(f"autosymm MoE ops: assignment must be [expt_bitmask, expt_boolmask, expt_map, "
                         f"expt_owner], got {len(assignment)} tensors")
    bitmask, boolmask, expt_map, owner = assignment
    return ExptAssignment(bitmask, boolmask, expt_map, [int(n) for n in n_expts_per_shard], owner)


def _call(door: MoEDoor, src, assignment, n_expts_per_shard, expt_indx, indx, group_name) -> Tensor:
    rows = _moe_call(door, src, assignment_from(assignment, n_expts_per_shard), expt_indx, indx,
                     resolve_group(group_name))
    return rows.clone(memory_format=torch.contiguous_format)


def _dp_to_ep(src: Tensor, assignment: list[Tensor], n_expts_per_shard: list[int], expt_indx: Tensor,
              gate_indx: Tensor, group_name: str) -> Tensor:
    """autosymm.convert_dp_to_ep, returning [n_tokens_global * k, d_model] rows the caller owns."""
    return _call(DP_TO_EP_DOOR, src, assignment, n_expts_per_shard, expt_indx, gate_indx, group_name)


def _dp_to_ep_fake(src, assignment, n_expts_per_shard, expt_indx, gate_indx, group_name):
    return src.new_empty((expt_indx.shape[0] * expt_indx.shape[1], src.shape[1]))


def _ep_to_dp(src: Tensor, assignment: list[Tensor], n_expts_per_shard: list[int], expt_indx: Tensor,
              topk_indx: Tensor, group_name: str) -> Tensor:
    """autosymm.convert_ep_to_dp, returning [n_tokens_local * k, d_model] rows the caller owns."""
    return _call(EP_TO_DP_DOOR, src, assignment, n_expts_per_shard, expt_indx, topk_indx, group_name)


def _ep_to_dp_fake(src, assignment, n_expts_per_shard, expt_indx, topk_indx, group_name):
    world_size = assignment[2].shape[0]  # expt_map [n_expt_shard, n_expts_tot]: one shard per rank
    return src.new_empty((expt_indx.shape[0] * expt_indx.shape[1] // world_size, src.shape[1]))
