"""``all_reduce_rmsnorm``'s spec: the all-reduce of a tensor-parallel layer fused with the residual
add, the RMSNorm after it and the epilogue after the norm (autosymm.epilogue.Epilogue). Problem:
``n_tokens_local`` rows of ``hidden`` elements and the epilogue; bucket: tokens per rank; shape:
``'h{hidden}'`` for the default epilogue (residual add, RMSNorm, x's dtype), else
``'h{hidden}_{epilogue.key}'``. Its front door: autosymm.collectives.all_reduce_rmsnorm."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..configs import FlashInferFusedConfig, FusedConfig
from ..epilogue import DEFAULT, NVFP4_BLOCK, QUANTS, SINGLE_ROUNDING, Epilogue
from ..problem import DTYPES, Problem
from .base import STACK_BACKENDS, TokensKeyed, TuningPoints
from .kinds import TOKEN_COUNTS, Option, OptionError, ShapeKind, Values, parse_count

#: Hidden sizes of the default sweep (the hidden sizes of common tensor-parallel models), at
#: autosymm.spec.kinds.TOKEN_COUNTS and :data:`EXTRA_TOKENS`, eager and graph: 4 x 10 x 2 = 80
#: (problem, mode) pairs.
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


@dataclass(frozen=True)
class HiddenShape:
    """The fused op's shape: ``hidden`` (elements per row) and its ``epilogue``; ``key`` is the
    database ``shape`` column (:func:`shape_key`)."""

    hidden: int
    epilogue: Epilogue = DEFAULT

    @property
    def key(self) -> str:
        return shape_key(self.hidden, self.epilogue)

    @classmethod
    def from_key(cls, key: str) -> "HiddenShape":
        """Inverse of :attr:`key`; a ValueError naming ``key`` for any other text."""
        return cls(*split_key(key))


HIDDEN_OPTION = Option("--hidden", "the hidden size (elements per row)", parse_count)
QUANT_OPTION = Option("--quant", "the output quantization (default: none, x's dtype)", str, choices=QUANTS)
GEMMA_OPTION = Option("--gemma", "the Gemma norm (weight applied as 1 + w)")
NO_RESIDUAL_OPTION = Option("--no-residual", "no residual add")
EPILOGUE_OPTION = Option("--epilogue", "the epilogue by key (e.g. add_rms_fp8, rms_nvfp4, gemma; 'default'), "
                         "instead of --quant/--gemma/--no-residual", parse_epilogues)
EPILOGUES_OPTION = Option("--epilogues", "epilogues by key (default, rms, add_rms_fp8, rms_nvfp4, add_gemma, "
                          "add_rms_fp8_per_token, ...; 'all': every served one), each tuned under its own shape key",
                          parse_epilogues, default="default")


def asked_epilogues(values: Values) -> tuple[Epilogue, ...]:
    """The epilogues option ``values`` ask for: `tune`'s ``--epilogues``, or `explain`'s
    ``--epilogue`` or ``--quant``/``--gemma``/``--no-residual`` (the default where none is given).
    OptionError naming the option whose values no call has."""
    many = EPILOGUES_OPTION.of(values)
    if many is not None:
        return tuple(many)
    quant, gemma = QUANT_OPTION.of(values), bool(GEMMA_OPTION.of(values))
    no_residual = bool(NO_RESIDUAL_OPTION.of(values))
    flags = quant is not None or gemma or no_residual
    one = EPILOGUE_OPTION.of(values)
    if one is None:
        return (Epilogue(residual=not no_residual, gemma=gemma, quant=quant),)
    if flags:
        raise OptionError(EPILOGUE_OPTION.flag, "give --epilogue or --quant/--gemma/--no-residual, not both")
    if len(one) != 1:
        raise OptionError(EPILOGUE_OPTION.flag, f"{', '.join(e.key or 'default' for e in one)} is not one epilogue")
    return tuple(one)


def _pick(values: Values, candidates) -> list[HiddenShape]:
    """The asked-for hidden size (else every candidate's) with each asked-for epilogue."""
    hidden = HIDDEN_OPTION.of(values)
    hiddens = [hidden] if hidden is not None else list(dict.fromkeys(shape.hidden for shape in candidates))
    return [HiddenShape(h, e) for e in asked_epilogues(values) for h in hiddens]


#: The hidden size (elements per row) and epilogue, the `shape` column of the fused op's rows.
HIDDEN_SHAPE = ShapeKind("hidden", HIDDEN_OPTION, of_key=HiddenShape.from_key, row_elements=lambda shape: shape.hidden,
                         sort_key=lambda shape: (shape.hidden, shape.epilogue.key),
                         refine=(QUANT_OPTION, GEMMA_OPTION, NO_RESIDUAL_OPTION, EPILOGUE_OPTION),
                         sweep=(EPILOGUES_OPTION,), pick=_pick)


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

    def problem_at(self, dtype: str, world_size: int, size: int, shape=None) -> Problem:
        return Problem.all_reduce_rmsnorm(size, shape.hidden, dtype, world_size, epilogue=shape.epilogue)

    def no_calls(self, shape: HiddenShape) -> str:
        if shape.epilogue.quant == "nvfp4" and shape.hidden % NVFP4_BLOCK:
            return (f"epilogue {shape.epilogue.key!r} cannot serve hidden={shape.hidden} (NVFP4 packs blocks of "
                    f"{NVFP4_BLOCK})")
        return ""

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
              "triton_fused_lamport": _BACKENDS + "triton_fused:triton_fused_lamport",
              "flashinfer_fused": _BACKENDS + "flashinfer_fused:flashinfer_fused", **STACK_BACKENDS},
    tuning="autosymm.tuning.ops.all_reduce_rmsnorm:ALL_REDUCE_RMSNORM", bench="autosymm.bench.fused:FUSED_BENCH",
    points=TuningPoints(sizes=TOKEN_COUNTS, shapes=tuple(HiddenShape(hidden) for hidden in HIDDEN),
                        extra_sizes=EXTRA_TOKENS),
    tuned_by_default=False, invariant_fallback="nccl_ordered_fused", local="autosymm.epilogue:local_launcher",
    formula=SINGLE_ROUNDING)
