"""The MoE token conversions ``dp_to_ep`` and ``ep_to_dp`` (``autosymm.convert_dp_to_ep`` /
``convert_ep_to_dp``), one record per direction, and their custom ops ``torch.ops.autosymm.dp_to_ep``
/ ``ep_to_dp``.

Problem: a MoEShape (d_model x experts x top-k) and ``n_tokens_local``; bucket: tokens per rank;
shape: ``MoEShape.key``. Cache key: ``(record, src dtype, src shape, n_expts_tot, expt_indx shape,
src device, capturing)``. Without rows for a shape the dispatcher uses the nearest tuned shape's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from . import autograd
from ..configs import MoEConfig
from ..problem import MODEL_SHAPES, MoEShape, Problem, dtype_name
from .base import Collective, CustomOp, Lookups, PointRequest, TuningPoints

#: Tokens per rank of the default sweep: powers of four from 1 to 4096, and 8192. The dispatcher
#: serves a count in between from its tuned neighbours, so the range 1..8192 is covered with 8
#: points instead of 14 (a sweep of minutes, not tens).
TOKENS = (1, 4, 16, 64, 256, 1024, 4096, 8192)
_ELEM_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True, eq=False)
class MoEConversion(Collective):
    """A MoE conversion: ``to_experts`` (dp -> ep: ``src`` holds the local tokens; else the
    expert-ordered rows of every rank's tokens) and the name of its index argument."""

    to_experts: bool = True
    index_name: str = "gate_indx"

    def check_problem(self, problem: Problem) -> None:
        if problem.shape is None or problem.n_tokens_local < 1:
            raise ValueError(f"{problem.op} needs a MoEShape and n_tokens_local >= 1")

    def shape_key(self, problem: Problem) -> str:
        return problem.shape.key

    def shape_of_key(self, key: str) -> MoEShape:
        return MoEShape.from_key(key)

    def moved_ratio(self, problem: Problem, row) -> float:
        """Bytes moved: tokens x top-k x d_model x element bytes, the row's of its own shape."""
        shape, other = problem.shape, MoEShape.from_key(row.shape)
        return ((problem.bucket * shape.n_expts_act * shape.d_model * _ELEM_BYTES[problem.dtype])
                / (row.bucket * other.n_expts_act * other.d_model * _ELEM_BYTES[row.dtype]))

    def src_rows(self, n_tokens_local: int, n_pairs: int) -> int:
        """Rows of ``src``: the local tokens (dp -> ep), or every (token, k) pair (ep -> dp)."""
        return n_tokens_local if self.to_experts else n_pairs

    def problems(self, request: PointRequest) -> list[Problem]:
        shapes = self.points.moe_shapes if request.moe_shapes is None else request.moe_shapes
        tokens = self.points.tokens if request.tokens is None else request.tokens
        return [Problem.moe(self.name, shape, t, d, request.world_size)
                for d in request.dtypes for shape in shapes for t in tokens]

    def problem_hint(self) -> str:
        return f"autosymm.Problem.moe({self.name!r}, shape, n_tokens_local, dtype, world_size)"

    def call_text(self, key: tuple, args: tuple, mode: str) -> str:
        src, _, expt_indx, _ = args
        text = (f"{self.name} of {src.dtype} {tuple(src.shape)} with {key[3]} experts, expt_indx "
                f"{tuple(expt_indx.shape)}, in {mode} mode")
        if mode == "eager":  # the ids must be the same on every rank: compared by digest (a read-back)
            from ..backends.moe_inputs import ids_digest

            text += f", expt_indx digest {ids_digest(expt_indx)}"
        return text

    def fingerprint(self, key: tuple, args: tuple, mode: str) -> dict:
        """Collective.fingerprint, and in eager mode the digest of ``expt_indx`` (every rank's ids
        must be the same)."""
        from ..backends.moe_inputs import ids_digest

        found = super().fingerprint(key, args, mode)
        if mode == "eager":
            found["expt_indx digest"] = ids_digest(args[2])
        return found

    def check_call(self, state, key: tuple, args: tuple, mode: str) -> Problem:
        from ..backends.moe_inputs import check_index_ranges, check_inputs
        from ..runtime.group import check_tensor

        src, assignment, expt_indx, indx = args
        check_tensor(src, state, self.name, "src")
        if src.dim() != 2 or expt_indx.dim() != 2:
            raise ValueError(f"autosymm.{self.name}: src {tuple(src.shape)} and expt_indx {tuple(expt_indx.shape)} "
                             f"must be 2-D ([rows, d_model], [n_tokens_global, k])")
        problem = self.problem_of_key(key, state.world_size)
        check_inputs(problem, state.device, state.world_size, src, assignment, expt_indx, indx)
        if mode == "eager":  # a range check reads the indices back: not inside a capture
            check_index_ranges(self.name, expt_indx, indx, assignment.expt_owner, state.world_size)
        return problem

    def prepare(self, state, problem: Problem, mode: str):
        """After growing the MoE region (eager; collective) where only room stops the Triton
        conversion (autosymm.runtime.moe_room)."""
        from ..runtime import moe_room

        return moe_room.prepare(state, problem, mode)

    def problem_of_key(self, key: tuple, world_size: int) -> Problem:
        _, dtype, src_shape, n_expts_tot, indx_shape = key[:5]
        n_expts_act = int(indx_shape[1])
        rows = int(src_shape[0])
        n_tokens_local = rows if self.to_experts else rows // (n_expts_act * world_size)
        return Problem.moe(self.name, MoEShape(int(src_shape[1]), n_expts_tot, n_expts_act), max(1, n_tokens_local),
                           dtype_name(dtype), world_size)

    def custom_ops(self) -> tuple[CustomOp, ...]:
        # differentiable: each direction's backward is the other one with the same routing
        if self.to_experts:
            return (CustomOp(self.name, _dp_to_ep, _dp_to_ep_fake, backward=autograd.dp_to_ep_backward,
                             setup_context=autograd.moe_setup),)
        return (CustomOp(self.name, _ep_to_dp, _ep_to_dp_fake, backward=autograd.ep_to_dp_backward,
                         setup_context=autograd.moe_setup),)


def _call(record: Collective, src, assignment, n_expts_per_shard, expt_indx, indx, group_name) -> Tensor:
    from .. import api
    from ..dist_compat import resolve_group
    from ..ops import assignment_from

    rows = api._moe_call(record, src, assignment_from(assignment, n_expts_per_shard), expt_indx, indx,
                         resolve_group(group_name))
    return rows.clone(memory_format=torch.contiguous_format)


def _dp_to_ep(src: Tensor, assignment: list[Tensor], n_expts_per_shard: list[int], expt_indx: Tensor,
              gate_indx: Tensor, group_name: str) -> Tensor:
    """autosymm.convert_dp_to_ep, returning [n_tokens_global * k, d_model] rows the caller owns."""
    return _call(DP_TO_EP, src, assignment, n_expts_per_shard, expt_indx, gate_indx, group_name)


def _dp_to_ep_fake(src, assignment, n_expts_per_shard, expt_indx, gate_indx, group_name):
    return src.new_empty((expt_indx.shape[0] * expt_indx.shape[1], src.shape[1]))


def _ep_to_dp(src: Tensor, assignment: list[Tensor], n_expts_per_shard: list[int], expt_indx: Tensor,
              topk_indx: Tensor, group_name: str) -> Tensor:
    """autosymm.convert_ep_to_dp, returning [n_tokens_local * k, d_model] rows the caller owns."""
    return _call(EP_TO_DP, src, assignment, n_expts_per_shard, expt_indx, topk_indx, group_name)


def _ep_to_dp_fake(src, assignment, n_expts_per_shard, expt_indx, topk_indx, group_name):
    world_size = assignment[2].shape[0]  # expt_map [n_expt_shard, n_expts_tot]: one shard per rank
    return src.new_empty((expt_indx.shape[0] * expt_indx.shape[1] // world_size, src.shape[1]))


_POINTS = TuningPoints(moe_shapes=tuple(MODEL_SHAPES.values()), tokens=TOKENS)
# No NCCL path is graph-capturable: where no row serves, the Triton conversion's default config first.
_FALLBACKS = dict(fallback="nccl_all_to_all", fallback_order=("triton_moe", "nccl_all_to_all"), config_type=MoEConfig)
DP_TO_EP = MoEConversion("dp_to_ep", "tokens", points=_POINTS, lookups=Lookups(nearest_shape=True),
                         shape_param="moe_shape", prepare_in_check=False, to_experts=True, index_name="gate_indx",
                         arg_names=("src", "assignment", "expt_indx", "gate_indx"),
                         **_FALLBACKS)
EP_TO_DP = MoEConversion("ep_to_dp", "tokens", points=_POINTS, lookups=Lookups(nearest_shape=True),
                         shape_param="moe_shape", prepare_in_check=False, to_experts=False, index_name="topk_indx",
                         arg_names=("src", "assignment", "expt_indx", "topk_indx"),
                         **_FALLBACKS)
