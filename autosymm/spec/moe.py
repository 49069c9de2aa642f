"""The MoE token conversions' specs, ``dp_to_ep`` and ``ep_to_dp``, one per direction. Problem: a
MoEShape (d_model x experts x top-k) and ``n_tokens_local``; bucket: tokens per rank; shape:
``MoEShape.key``. Without rows for a shape the dispatcher uses the nearest tuned shape's. Their
front door: autosymm.collectives.moe."""

from __future__ import annotations

from dataclasses import dataclass

from ..configs import MoEConfig
from ..problem import DTYPES, MODEL_SHAPES, MoEShape, Problem, dtype_name
from .base import KEY_DTYPE, KEY_EXTRA, KEY_SHAPE, CallKey, Lookups, TokensKeyed, TuningPoints
from .kinds import TOKEN_COUNTS, Option, ShapeKind


def parse_moe_shapes(text: str) -> dict[str, MoEShape]:
    """'deepseek-v3,d5120_e160_k6' -> {item: shape}: model names (any case, autosymm.problem.MODEL_SHAPES)
    or any d{D}_e{E}_k{K} key; ValueError naming a bad item."""
    out = {}
    models = {name.lower(): shape for name, shape in MODEL_SHAPES.items()}
    for item in (t.strip() for t in text.split(",") if t.strip()):
        try:
            out[item] = models[item.lower()] if item.lower() in models else MoEShape.from_key(item)
        except ValueError as exc:
            raise ValueError(f"{item!r}: {exc} (model names: {', '.join(MODEL_SHAPES)})") from None
    if not out:
        raise ValueError(f"no MoE shape in {text!r}")
    return out


def parse_moe_shape(text: str) -> MoEShape:
    """The one MoE shape of ``text`` (a model name or d{D}_e{E}_k{K}); ValueError otherwise."""
    shapes = list(parse_moe_shapes(text).values())
    if len(shapes) != 1:
        raise ValueError(f"{text!r} is not one MoE shape (a model name or a key like d7168_e256_k8)")
    return shapes[0]


#: A MoE layer's routing shape, the `shape` column of its rows (`explain --shape`, `tune --shapes`).
MOE_SHAPE = ShapeKind(
    "moe_shape", Option("--shape", "the MoE shape: a model name or d{D}_e{E}_k{K}", parse_moe_shape),
    of_key=MoEShape.from_key, row_elements=lambda shape: shape.d_model, sort_key=lambda shape: shape.key,
    sweep=(Option("--shapes", "MoE shapes: model names or d{D}_e{E}_k{K}",
                  lambda text: tuple(parse_moe_shapes(text).values()), default=",".join(MODEL_SHAPES)),))


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

    def problem_at(self, dtype: str, world_size: int, size: int, shape=None) -> Problem:
        return Problem.moe(self.name, shape, size, dtype, world_size)

    def problem_hint(self) -> str:
        return f"autosymm.Problem.moe({self.name!r}, shape, n_tokens_local, dtype, world_size)"

    def problem_of_key(self, key: CallKey, world_size: int) -> Problem:
        """The key's shape is src's; its extra (experts in total, expt_indx's shape)."""
        n_expts_tot, indx_shape = key[KEY_EXTRA]
        n_expts_act, rows, d_model = int(indx_shape[1]), int(key[KEY_SHAPE][0]), int(key[KEY_SHAPE][1])
        n_tokens_local = rows if self.to_experts else rows // (n_expts_act * world_size)
        return Problem.moe(self.name, MoEShape(d_model, n_expts_tot, n_expts_act), max(1, n_tokens_local),
                           dtype_name(key[KEY_DTYPE]), world_size)


_POINTS = TuningPoints(sizes=TOKEN_COUNTS, shapes=tuple(MODEL_SHAPES.values()))
# No NCCL path is graph-capturable: where no row serves, the Triton conversion's default config first.
_SHARED = dict(fallback="nccl_all_to_all", fallback_order=("triton_moe", "nccl_all_to_all"), config_type=MoEConfig,
               backends={"triton_moe": "autosymm.backends.triton_moe:TRITON_MOE",
                         "nccl_all_to_all": "autosymm.backends.nccl_all_to_all:NCCL_ALL_TO_ALL"},
               bench="autosymm.bench.run:MOE_BENCH", points=_POINTS, lookups=Lookups(nearest_shape=True),
               shape=MOE_SHAPE, formula="copy")
DP_TO_EP = MoEConversionSpec("dp_to_ep", door="autosymm.collectives.moe:DP_TO_EP_DOOR",
                             tuning="autosymm.tuning.ops.moe:DP_TO_EP", to_experts=True, index_name="gate_indx",
                             **_SHARED)
EP_TO_DP = MoEConversionSpec("ep_to_dp", door="autosymm.collectives.moe:EP_TO_DP_DOOR",
                             tuning="autosymm.tuning.ops.moe:EP_TO_DP", to_experts=False, index_name="topk_indx",
                             **_SHARED)
