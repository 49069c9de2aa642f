"""``all_reduce_rmsnorm``: the all-reduce of a tensor-parallel layer fused with the residual add and
the RMSNorm after it, and the epilogues after the norm (``autosymm.all_reduce_rmsnorm``,
autosymm.fused; the epilogue record autosymm.epilogue.Epilogue), and its custom ops
``torch.ops.autosymm.all_reduce_rmsnorm`` (one output: unquantized or static FP8),
``all_reduce_rmsnorm_quant`` (two outputs: per-token FP8, NVFP4) and
``all_reduce_rmsnorm_functional`` (differentiable, the unquantized epilogues).

Problem: ``n_tokens_local`` rows of ``hidden`` elements and the epilogue; bucket: tokens per rank;
shape: ``'h{hidden}'`` for the default epilogue (residual add, RMSNorm, x's dtype), else
``'h{hidden}_{epilogue.key}'``. Cache key: ``(record, dtype, x shape, capturing)`` for the default
epilogue, ``(record, dtype, x shape, epilogue, capturing)`` for the others.
"""

from __future__ import annotations

import re
from functools import partial
from typing import Optional

import torch
from torch import Tensor

from ..configs import FlashInferFusedConfig, FusedConfig
from . import autograd
from ..problem import DTYPE_NAMES, Problem, dtype_name
from .base import Collective, CustomOp, PointRequest, TuningPoints
from .fused_epilogue import (DEFAULT, NVFP4_BLOCK, TWO_OUTPUT_QUANTS, Epilogue, check_problem_epilogue, check_scale,
                             outputs_like, single_rank_launcher)
from .moe import TOKENS

#: Hidden sizes of the default sweep (the hidden sizes of common tensor-parallel models), at
#: :data:`TOKENS` and :data:`EXTRA_TOKENS`, eager and graph: 4 x 10 x 2 = 80 (problem, mode) pairs.
HIDDEN = (4096, 5120, 7168, 8192)
#: Token counts also tuned, inside the asked-for range: where the op's targets are stated (fused
#: within 1 us of the all-reduce alone up to 128 tokens, 1.5x NCCL + rms_norm up to 2048), so the
#: DB holds a measured row there rather than a neighbour's config.
EXTRA_TOKENS = (128, 2048)


def with_extra_tokens(tokens, extra=EXTRA_TOKENS) -> list[int]:
    """``tokens`` plus the ``extra`` counts within their range, sorted."""
    if not tokens:
        return []
    return sorted(set(tokens) | {t for t in extra if min(tokens) <= t <= max(tokens)})


class AllReduceRMSNorm(Collective):
    def check_problem(self, problem: Problem) -> None:
        if problem.hidden < 1 or problem.n_tokens_local < 1:
            raise ValueError(f"all_reduce_rmsnorm needs hidden >= 1 and n_tokens_local >= 1, got "
                             f"hidden={problem.hidden}, n_tokens_local={problem.n_tokens_local}")
        if problem.epilogue is None:  # a Problem built without one: the default epilogue
            object.__setattr__(problem, "epilogue", DEFAULT)
        check_problem_epilogue(problem.epilogue, problem.hidden, self.name)

    def shape_key(self, problem: Problem) -> str:
        return shape_key(problem.hidden, problem.epilogue or DEFAULT)

    def shape_of_key(self, key: str) -> int:
        """The hidden size of a shape key 'h{hidden}' or 'h{hidden}_{epilogue key}'."""
        return split_key(key)[0]

    def problems(self, request: PointRequest) -> list[Problem]:
        hidden = self.points.hidden if request.hidden is None else request.hidden
        tokens = list(self.points.tokens if request.tokens is None else request.tokens)
        if request.extra_tokens:
            tokens = with_extra_tokens(tokens, self.points.extra_tokens)
        epilogues = self.points.epilogues if request.epilogues is None else request.epilogues
        return [Problem.all_reduce_rmsnorm(t, h, d, request.world_size, epilogue=e)
                for d in request.dtypes for e in epilogues for h in hidden for t in tokens
                if e.quant != "nvfp4" or h % NVFP4_BLOCK == 0]  # NVFP4 packs blocks of 16

    def one_rank_reason(self, deterministic: bool) -> str:
        # deterministic: the ordered fallback, whose norm follows its fixed tree (torch's may not)
        return "" if deterministic else "world size 1: nothing to exchange; add + rms_norm"

    def problem_hint(self) -> str:
        return "autosymm.Problem.all_reduce_rmsnorm(n_tokens_local, hidden, dtype, world_size, epilogue=...)"

    def call_text(self, key: tuple, args: tuple, mode: str) -> str:
        x, epilogue = args[0], epilogue_of_key(key)
        ending = "" if epilogue == DEFAULT else f" with epilogue {epilogue.key}"
        return f"{self.name} of {x.dtype} {tuple(x.shape)}{ending} in {mode} mode"

    def check_call(self, state, key: tuple, args: tuple, mode: str):
        """This rank's checks (ValueError naming the bad tensor): the Problem, or a 'noop' Entry
        without rows (the same on every rank: x's shape is replicated)."""
        from ..runtime.dispatch import Decision
        from ..runtime.group import Entry

        x, residual, weight = args[:3]
        epilogue = epilogue_of_key(key)
        check_args(x, residual, weight, state.device, self.name)
        check_scale(x, epilogue, args[3] if len(args) > 3 else None, state.device, self.name)
        dtype = dtype_name(x.dtype)
        n_tokens, hidden = int(x.shape[0]), int(x.shape[1])
        default = epilogue == DEFAULT
        if n_tokens == 0 or hidden == 0:
            empty = _empty_call if default else partial(_empty_epilogue_call, epilogue)
            return Entry(Decision("noop", None, "no rows: nothing to exchange", mode=mode), empty)
        one_rank = self.one_rank_reason(state.deterministic) if state.world_size == 1 else ""
        if one_rank:
            single = _single_rank_call if default else single_rank_launcher(epilogue)
            return Entry(Decision("noop", None, one_rank, mode=mode), single)
        return Problem.all_reduce_rmsnorm(n_tokens, hidden, dtype, state.world_size, epilogue=epilogue)

    def custom_ops(self) -> tuple[CustomOp, ...]:
        # x is declared mutated: the NCCL path sums into it
        return (CustomOp(self.name, _all_reduce_rmsnorm, _all_reduce_rmsnorm_fake, mutates_args=("x", "residual")),
                CustomOp(f"{self.name}_quant", _quant, _quant_fake, mutates_args=("x", "residual")),
                CustomOp(f"{self.name}_functional", _functional, _functional_fake, backward=autograd.fused_backward,
                         setup_context=autograd.fused_setup))


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


def epilogue_of_key(key: tuple) -> Epilogue:
    """The epilogue of a cache key (module docstring)."""
    return key[3] if len(key) == 5 else DEFAULT


def check_args(x: Tensor, residual: Optional[Tensor], weight: Tensor, device: torch.device,
               what: str = "all_reduce_rmsnorm") -> None:
    """ValueError naming the bad argument unless ``x`` and ``residual`` (None: no residual add)
    are [tokens, hidden] and ``weight`` [hidden], all of one supported dtype (bf16, fp16, fp32),
    contiguous, on ``device`` and disjoint in memory (a residual aliasing x would add the sum to
    itself; the NCCL path writes x). Local and cheap: every call runs it before anything is
    launched, so a bad call changes nothing."""
    no_residual = residual is None
    if no_residual:
        residual = x  # checked as x; no overlap of the two to refuse
    try:
        dtype, shape = x.dtype, x.shape
        _, hidden = shape  # ValueError unless 2-D
        if (dtype in DTYPE_NAMES and residual.dtype is dtype and weight.dtype is dtype and residual.shape == shape
                and weight.dim() == 1 and weight.size(0) == hidden and x.device == device and residual.device == device
                and weight.device == device and x.is_contiguous() and residual.is_contiguous()
                and weight.is_contiguous()):
            nbytes, wbytes = x.numel() * x.element_size(), weight.numel() * weight.element_size()
            lo, hi = sorted((x.data_ptr(), residual.data_ptr()))
            wp = weight.data_ptr()
            if nbytes == 0 or ((no_residual or hi - lo >= nbytes) and (wp + wbytes <= lo or wp >= hi + nbytes
                                                      or lo + nbytes <= wp <= hi - wbytes)):
                return
    except (AttributeError, TypeError, ValueError):  # not a tensor, or x not 2-D: named below
        pass
    raise ValueError(f"autosymm.{what}: {_what_is_wrong(x, None if no_residual else residual, weight, device)}")


def _what_is_wrong(x, residual, weight, device) -> str:
    """The first argument :func:`check_args` refuses, and why (``residual`` None: not given)."""
    if residual is None:
        residual = x if isinstance(x, torch.Tensor) else None
        named = (("x", x), ("weight", weight))
    else:
        named = (("x", x), ("residual", residual), ("weight", weight))
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            return f"{name} must be a torch.Tensor, got {type(t).__name__}"
    if x.dim() != 2 or residual.shape != x.shape:
        return f"x {tuple(x.shape)} and residual {tuple(residual.shape)} must both be [tokens, hidden]"
    if tuple(weight.shape) != (x.shape[1],):
        return f"weight {tuple(weight.shape)} must be [hidden] = [{x.shape[1]}]"
    if residual.dtype != x.dtype or weight.dtype != x.dtype:
        return f"x {x.dtype}, residual {residual.dtype} and weight {weight.dtype} must share one dtype"
    if x.dtype not in DTYPE_NAMES:
        return f"dtype {x.dtype} is not supported: x, residual and weight must be one of " + \
            ", ".join(map(str, DTYPE_NAMES))
    for name, t in named:
        if t.device != device:
            held = "a meta tensor holds no data" if t.is_meta else f"the group's device is {device}"
            return f"{name} is on {t.device}: {held}"
        if not t.is_contiguous():
            return f"{name} of shape {tuple(t.shape)} with strides {t.stride()} is not contiguous"
    return _OVERLAP


_OVERLAP = ("x, residual and weight must not overlap in memory (residual += all_reduce(x) reads x while writing "
            "residual, and the NCCL path writes x): pass distinct tensors")


def check_disjoint(x: Tensor, residual: Optional[Tensor], weight: Tensor, what: str = "all_reduce_rmsnorm") -> None:
    """ValueError unless the memory spans of the three tensors (any layout) are disjoint: the check
    of :func:`check_args` that the launchers' own checks do not make."""
    spans = sorted(_span(t) for t in (x, residual, weight) if t is not None and t.numel())
    if any(end > start for (_, end), (start, _) in zip(spans, spans[1:])):
        raise ValueError(f"autosymm.{what}: {_OVERLAP}")


def _span(t: Tensor) -> tuple[int, int]:
    """[first byte, last byte + 1) of ``t``'s elements (non-negative strides)."""
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def _empty_call(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> Tensor:
    """No rows (on every rank alike): nothing to exchange."""
    return torch.empty_like(x)


def _single_rank_call(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> Tensor:
    """World size 1: the sum is ``x`` itself (left as it is, as the NCCL path leaves the sum), so
    ``residual += x`` and the norm, without a collective."""
    residual.add_(x)
    return torch.nn.functional.rms_norm(residual, (x.shape[1],), weight, eps)


def _empty_epilogue_call(epilogue: Epilogue, x: Tensor, residual: Optional[Tensor], weight: Tensor, eps: float, *,
                         scale: Optional[Tensor] = None):
    """No rows, a non-default epilogue: its empty outputs."""
    return outputs_like(x, epilogue)


def _call(x: Tensor, residual: Optional[Tensor], weight: Tensor, eps: float, group_name: str, gemma: bool,
          quant: Optional[str], scale: Optional[Tensor]):
    from ..dist_compat import resolve_group
    from ..fused import fused_call

    epilogue = Epilogue(residual=residual is not None, gemma=gemma, quant=quant)
    return fused_call(x, residual, weight, eps, resolve_group(group_name), epilogue, scale)


def _all_reduce_rmsnorm(x: Tensor, residual: Optional[Tensor], weight: Tensor, eps: float, group_name: str,
                        gemma: bool = False, quant: Optional[str] = None, scale: Optional[Tensor] = None) -> Tensor:
    """``torch.ops.autosymm.all_reduce_rmsnorm(x, residual, weight, eps, group_name, gemma=False,
    quant=None, scale=None)``: the custom op of autosymm.all_reduce_rmsnorm's one-output
    epilogues (``quant`` None or 'fp8')."""
    if quant in TWO_OUTPUT_QUANTS:
        raise ValueError(f"torch.ops.autosymm.all_reduce_rmsnorm: quant={quant!r} returns two tensors: call "
                         "torch.ops.autosymm.all_reduce_rmsnorm_quant")
    return _call(x, residual, weight, eps, group_name, gemma, quant, scale)


def _all_reduce_rmsnorm_fake(x: Tensor, residual: Optional[Tensor], weight: Tensor, eps: float, group_name: str,
                             gemma: bool = False, quant: Optional[str] = None,
                             scale: Optional[Tensor] = None) -> Tensor:
    return outputs_like(x, Epilogue(residual=residual is not None, gemma=gemma, quant=quant))


def _quant(x: Tensor, residual: Optional[Tensor], weight: Tensor, eps: float, group_name: str, gemma: bool,
           quant: str, scale: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """``torch.ops.autosymm.all_reduce_rmsnorm_quant(x, residual, weight, eps, group_name, gemma,
    quant, scale)``: the two-output epilogues (``quant`` 'fp8_per_token': (out, scales);
    'nvfp4': (packed, block scales))."""
    if quant not in TWO_OUTPUT_QUANTS:
        raise ValueError(f"torch.ops.autosymm.all_reduce_rmsnorm_quant: quant={quant!r} is not one of "
                         f"{TWO_OUTPUT_QUANTS} (the one-output modes are torch.ops.autosymm.all_reduce_rmsnorm's)")
    return _call(x, residual, weight, eps, group_name, gemma, quant, scale)


def _quant_fake(x: Tensor, residual: Optional[Tensor], weight: Tensor, eps: float, group_name: str, gemma: bool,
                quant: str, scale: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    return outputs_like(x, Epilogue(residual=residual is not None, gemma=gemma, quant=quant))


def _functional(x: Tensor, residual: Optional[Tensor], weight: Tensor, eps: float, group_name: str,
                gemma: bool = False) -> tuple[Tensor, Tensor]:
    """``torch.ops.autosymm.all_reduce_rmsnorm_functional``: (out, new residual), the inputs left
    unchanged (copies are reduced): the differentiable form of the unquantized epilogues
    (autosymm.collectives.autograd). Without ``residual`` the new residual is the sum itself (a zero residual
    added: the same fp32 value)."""
    from ..dist_compat import resolve_group
    from ..fused import fused_call

    if residual is None:
        new_residual = torch.zeros_like(x, memory_format=torch.contiguous_format)
    else:
        new_residual = residual.clone(memory_format=torch.contiguous_format)
    epilogue = Epilogue(residual=True, gemma=gemma)
    out = fused_call(x.clone(memory_format=torch.contiguous_format), new_residual, weight.contiguous(), eps,
                     resolve_group(group_name), epilogue)
    return out, new_residual


def _functional_fake(x: Tensor, residual: Optional[Tensor], weight: Tensor, eps: float, group_name: str,
                     gemma: bool = False) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x, memory_format=torch.contiguous_format), \
        torch.empty_like(x, memory_format=torch.contiguous_format)


ALL_REDUCE_RMSNORM = AllReduceRMSNorm("all_reduce_rmsnorm", "tokens", fallback="nccl_fused",
                                      fallback_order=("nccl_fused",), shape_param="hidden", config_type=FusedConfig,
                                      other_config_types=(FlashInferFusedConfig,),
                                      points=TuningPoints(hidden=HIDDEN, tokens=TOKENS, extra_tokens=EXTRA_TOKENS,
                                                          epilogues=(DEFAULT,)),
                                      tuned_by_default=False, invariant_fallback="nccl_ordered_fused",
                                      arg_names=("x", "residual", "weight", "scale"))
