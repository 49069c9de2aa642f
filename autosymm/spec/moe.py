"""The MoE token conversions' specs, ``dp_to_ep`` and ``ep_to_dp``, one per direction. Problem: a
MoEShape (d_model x experts x top-k) and ``n_tokens_local``; bucket: tokens per rank; shape:
``MoEShape.key``. Without rows for a shape the dispatcher uses the nearest tuned shape's. Their
front door: autosymm.collectives.moe."""

from __future__ import annotations

from dataclasses import dataclass

from ..configs import MoEConfig
from ..problem import DTYPES, MODEL_SHAPES, MoEShape, Problem, dtype_name
from .base import KEY_DTYPE, KEY_EXTRA, KEY_SHAPE, CallKey, Lookups, PointRequest, ShapeKind, TokensKeyed, TuningPoints

#: Tokens per rank of the default sweep: powers of four from 1 to 4096, and 8192. The dispatcher
#: serves a count in between from its tuned neighbours, so the range 1..8192 is covered with 8
#: points instead of 14 (a sweep of minutes, not tens).
TOKENS = (1, 4, 16, 64, 256, 1024, 4096, 8192)

#: A MoE layer's routing shape, the `shape` column of its rows (`explain --shape`).
MOE_SHAPE = ShapeKind("moe_shape", option="--shape", option_dest="shape", request_field="moe_shapes",
                      points_field="moe_shapes", of_key=MoEShape.from_key, row_elements=lambda shape: shape.d_model,
                      sort_key=lambda shape: shape.key)


@dataclass(frozen=True, eq=False)
class MoEConversionSpec(TokensKeyed):
    """A MoE conversion: ``to_experts`` (dp -> ep: ``src`` holds the local tokens; else the
    expert-ordered rows of every rank's tokens) and the name of its index argument."""

    to_experts: bool = True
    index_name: str = "gate_indx"

    def check_problem(self, problem: Problem) -> None:
        if not isinstance(problem.shape, MoEShape) or problem.n_tokens_local < 1:
            raise ValueError(f"{problem.op} needs a MoEShape and n_tokens_local >= 1")

    def shape_key(self, problem: Problem) -> str:
        return problem.shape.key

    def moved_ratio(self, problem: Problem, row) -> float:
        """Bytes moved: tokens x top-k x d_model x element bytes, the row's of its own shape."""
        shape, other = problem.shape, MoEShape.from_key(row.shape)
        return ((problem.bucket * shape.n_expts_act * shape.d_model * DTYPES[problem.dtype].itemsize)
                / (row.bucket * other.n_expts_act * other.d_model * DTYPES[row.dtype].itemsize))

    def src_rows(self, n_tokens_local: int, n_pairs: int) -> int:
        """Rows of ``src``: the local tokens (dp -> ep), or every (token, k) pair (ep -> dp)."""
        return n_tokens_local if self.to_experts else n_pairs

    def problems(self, request: PointRequest) -> list[Problem]:
        shapes = self.points.moe_shapes if request.moe_shapes is None else request.moe_shapes
        tokens = self.points.tokens if request.tokens is None else request.tokens
        return [Problem.moe(self.name, shape, t, d, request.world_size)
                for d in request.dtypes for shape in shapes for t in tokens]

    def problem_of_row(self, row) -> Problem:
        return Problem.moe(self.name, MoEShape.from_key(row.shape), row.bucket, row.dtype, row.world_size)

    def problem_hint(self) -> str:
        return f"autosymm.Problem.moe({self.name!r}, shape, n_tokens_local, dtype, world_size)"

    def problem_of_key(self, key: CallKey, world_size: int) -> Problem:
        """The key's shape is src's; its extra (experts in total, expt_indx's shape)."""
        n_expts_tot, indx_shape = key[KEY_EXTRA]
        n_expts_act, rows, d_model = int(indx_shape[1]), int(key[KEY_SHAPE][0]), int(key[KEY_SHAPE][1])
        n_tokens_local = rows if self.to_experts else rows // (n_expts_act * world_size)
        return Problem.moe(self.name, MoEShape(d_model, n_expts_tot, n_expts_act), max(1, n_tokens_local),
                           dtype_name(key[KEY_DTYPE]), world_size)


_POINTS = TuningPoints(moe_shapes=tuple(MODEL_SHAPES.values()), tokens=TOKENS)
# No NCCL path is graph-capturable: where no row serves, the Triton conversion's default config first.
_SHARED = dict(fallback="nccl_all_to_all", fallback_order=("triton_moe", "nccl_all_to_all"), config_type=MoEConfig,
               backends={"triton_moe": "autosymm.backends.triton_moe:TRITON_MOE",
                         "nccl_all_to_all": "autosymm.backends.nccl_all_to_all:NCCL_ALL_TO_ALL"},
               bench="autosymm.bench.run:MOE_BENCH", points=_POINTS, lookups=Lookups(nearest_shape=True), shape=MOE_SHAPE)
DP_TO_EP = MoEConversionSpec("dp_to_ep", door="autosymm.collectives.moe:DP_TO_EP_DOOR",
                             tuning="autosymm.tuning.ops.moe:DP_TO_EP", to_experts=True, index_name="gate_indx",
                             **_SHARED)
EP_TO_DP = MoEConversionSpec("ep_to_dp", door="autosymm.collectives.moe:EP_TO_DP_DOOR",
                             tuning="autosymm.tuning.ops.moe:EP_TO_DP", to_experts=False, index_name="topk_indx",
                             **_SHARED)
