"""``all_reduce_rmsnorm``'s spec: the all-reduce of a tensor-parallel layer fused with the residual
add, the RMSNorm after it and the epilogue after the norm (autosymm.epilogue.Epilogue). Problem:
``n_tokens_local`` rows of ``hidden`` elements and the epilogue; bucket: tokens per rank; shape:
``'h{hidden}'`` for the default epilogue (residual add, RMSNorm, x's dtype), else
``'h{hidden}_{epilogue.key}'``. Its front door: autosymm.collectives.all_reduce_rmsnorm."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..configs import FlashInferFusedConfig, FusedConfig
from ..epilogue import DEFAULT, NVFP4_BLOCK, QUANTS, Epilogue
from ..problem import DTYPES, Problem
from .base import PointRequest, ShapeKind, TokensKeyed, TuningPoints
from .moe import TOKENS

#: Hidden sizes of the default sweep (the hidden sizes of common tensor-parallel models), at
#: :data:`TOKENS` and :data:`EXTRA_TOKENS`, eager and graph: 4 x 10 x 2 = 80 (problem, mode) pairs.
HIDDEN = (4096, 5120, 7168, 8192)
#: Token counts also tuned, inside the asked-for range: where the op's targets are stated (fused
#: within 1 us of the all-reduce alone up to 128 tokens, 1.5x NCCL + rms_norm up to 2048), so the
#: DB holds a measured row there rather than a neighbour's config.
EXTRA_TOKENS = (128, 2048)

#: The epilogues autosymm serves (vLLM 0.33's AllReduceFusionPass patterns, then per-token FP8),
#: each tuned under its own shape key when asked for (``autosymm tune --epilogues``; the default
#: sweep tunes the default epilogue only).
EPILOGUES = tuple(Epilogue(residual=r, gemma=g, quant=q) for g, q in (
    (False, None), (False, "fp8"), (False, "nvfp4"), (True, None), (False, "fp8_per_token")) for r in (True, False))

#: Quant modes that take a caller's ``scale`` (the static per-tensor FP8 scale; NVFP4's global scale).
SCALED_QUANTS = tuple(q for q in QUANTS if Epilogue(quant=q).needs_scale)
#: Quant modes that return two tensors (the quantized output and its scales).
TWO_OUTPUT_QUANTS = tuple(q for q in QUANTS if Epilogue(quant=q).has_scales)


def with_extra_tokens(tokens, extra=EXTRA_TOKENS) -> list[int]:
    """``tokens`` plus the ``extra`` counts within their range, sorted."""
    if not tokens:
        return []
    return sorted(set(tokens) | {t for t in extra if min(tokens) <= t <= max(tokens)})


def shape_key(hidden: int, epilogue: Epilogue) -> str:
    """The database ``shape`` of the fused op: 'h{hidden}' (default epilogue), else
    'h{hidden}_{epilogue.key}'."""
    return f"h{hidden}" if epilogue == DEFAULT else f"h{hidden}_{epilogue.key}"


def split_key(key: str) -> tuple[int, Epilogue]:
    """(hidden, epilogue) of a shape key :func:`shape_key` wrote; ValueError naming ``key``."""
    match = re.fullmatch(r"h([1-9][0-9]*)(?:_(.+))?", str(key))
    if match is None:
        raise ValueError(f"{key!r} is not a hidden-size key like 'h8192' or 'h8192_<epilogue>'")
    try:
        epilogue = DEFAULT if match.group(2) is None else Epilogue.of_key(match.group(2))
    except ValueError as exc:
        raise ValueError(f"{key!r}: {exc}") from None
    return int(match.group(1)), epilogue


def parse_epilogues(text: str) -> tuple[Epilogue, ...]:
    """'default,add_rms_fp8,rms' -> those epilogues (keys of Epilogue.key; 'default' the default
    add + RMSNorm, 'all' every one of :data:`EPILOGUES`); ValueError naming a bad item."""
    found = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        if item == "all":
            found += EPILOGUES
            continue
        try:
            found.append(DEFAULT if item == "default" else Epilogue.of_key(item))
        except ValueError as exc:
            raise ValueError(f"epilogue {item!r}: {exc}; known: default, all, "
                             f"{', '.join(e.key for e in EPILOGUES if e.key)}") from None
    if not found:
        raise ValueError(f"no epilogue in {text!r} (examples: default, add_rms_fp8, rms_nvfp4, all)")
    return tuple(dict.fromkeys(found))


def check_problem_epilogue(epilogue: Epilogue, hidden: int, op: str) -> None:
    """ValueError unless ``epilogue`` is an Epilogue whose quant mode can pack ``hidden``."""
    if not isinstance(epilogue, Epilogue):
        raise ValueError(f"{op}: epilogue must be an autosymm.epilogue.Epilogue, got {type(epilogue).__name__}")
    if epilogue.quant == "nvfp4" and hidden % NVFP4_BLOCK:
        raise ValueError(f"{op}: quant='nvfp4' needs hidden % {NVFP4_BLOCK} == 0, got hidden={hidden}")


#: The hidden size (elements per row) and epilogue, the `shape` column of the fused op's rows.
HIDDEN_SHAPE = ShapeKind("hidden", option="--hidden", option_dest="hidden", request_field="hidden",
                         points_field="hidden", takes_epilogue=True, of_key=lambda key: split_key(key)[0],
                         row_elements=int, sort_key=int)


@dataclass(frozen=True, eq=False)
class AllReduceRMSNormSpec(TokensKeyed):
    def check_problem(self, problem: Problem) -> None:
        if problem.hidden < 0 or problem.n_tokens_local < 0:
            raise ValueError(f"all_reduce_rmsnorm needs hidden >= 0 and n_tokens_local >= 0, got "
                             f"hidden={problem.hidden}, n_tokens_local={problem.n_tokens_local}")
        if problem.dtype not in DTYPES:
            raise ValueError(f"all_reduce_rmsnorm: dtype={problem.dtype!r} is not one of {sorted(DTYPES)}")
        if problem.epilogue is None:  # a Problem built without one: the default epilogue
            object.__setattr__(problem, "epilogue", DEFAULT)
        check_problem_epilogue(problem.epilogue, problem.hidden, self.name)

    def shape_key(self, problem: Problem) -> str:
        return shape_key(problem.hidden, problem.epilogue or DEFAULT)

    def problems(self, request: PointRequest) -> list[Problem]:
        hidden = self.points.hidden if request.hidden is None else request.hidden
        tokens = list(self.points.tokens if request.tokens is None else request.tokens)
        if request.extra_tokens:
            tokens = with_extra_tokens(tokens, self.points.extra_tokens)
        epilogues = self.points.epilogues if request.epilogues is None else request.epilogues
        return [Problem.all_reduce_rmsnorm(t, h, d, request.world_size, epilogue=e)
                for d in request.dtypes for e in epilogues for h in hidden for t in tokens
                if e.quant != "nvfp4" or h % NVFP4_BLOCK == 0]  # NVFP4 packs blocks of 16

    def problem_of_row(self, row) -> Problem:
        hidden, epilogue = split_key(row.shape)
        return Problem.all_reduce_rmsnorm(row.bucket, hidden, row.dtype, row.world_size, epilogue=epilogue)

    def one_rank_reason(self, deterministic: bool) -> str:
        # deterministic: the ordered fallback, whose norm follows its fixed tree (torch's may not)
        return "" if deterministic else "world size 1: nothing to exchange; add + rms_norm"

    def empty_reason(self, problem: Problem) -> str:
        return "no rows: nothing to exchange" if problem.n_tokens_local == 0 or problem.hidden == 0 else ""

    def problem_hint(self) -> str:
        return "autosymm.Problem.all_reduce_rmsnorm(n_tokens_local, hidden, dtype, world_size, epilogue=...)"


_BACKENDS = "autosymm.backends."
ALL_REDUCE_RMSNORM = AllReduceRMSNormSpec(
    "all_reduce_rmsnorm", fallback="nccl_fused", fallback_order=("nccl_fused",), shape=HIDDEN_SHAPE,
    config_type=FusedConfig, other_config_types=(FlashInferFusedConfig,),
    door="autosymm.collectives.all_reduce_rmsnorm:DOOR",
    backends={"nccl_fused": _BACKENDS + "nccl_fused:nccl_fused",
              "nccl_ordered_fused": _BACKENDS + "nccl_ordered:nccl_ordered_fused",
              "triton_fused_one_shot": _BACKENDS + "triton_fused:triton_fused_one_shot",
              "triton_fused_one_shot_push": _BACKENDS + "triton_fused:triton_fused_one_shot_push",
              "triton_fused_two_shot": _BACKENDS + "triton_fused:triton_fused_two_shot",
              "flashinfer_fused": _BACKENDS + "flashinfer_fused:flashinfer_fused"},
    tuning="autosymm.tuning.ops.all_reduce_rmsnorm:ALL_REDUCE_RMSNORM", bench="autosymm.bench.fused:FUSED_BENCH",
    points=TuningPoints(hidden=HIDDEN, tokens=TOKENS, extra_tokens=EXTRA_TOKENS, epilogues=(DEFAULT,)),
    tuned_by_default=False, invariant_fallback="nccl_ordered_fused", local="autosymm.epilogue:local_launcher")
