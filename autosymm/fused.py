"""``all_reduce_rmsnorm``: the all-reduce of a tensor-parallel layer fused with the residual add
and the RMSNorm that follow it. Its record (problem, checks, custom op
``torch.ops.autosymm.all_reduce_rmsnorm``) is autosymm.collectives.all_reduce_rmsnorm.

Calls are decided and prepared through the group state of autosymm.runtime.group (the same databases,
rank agreement, workspace and cache of prepared calls as ``all_reduce``), keyed by
(record, dtype, x shape, capturing): a repeated call is its arguments' checks (shapes, dtypes,
devices, contiguity, no aliasing: before anything runs), a dict lookup and the launcher. An
eager call whose launcher replays (autosymm.runtime.replay.FusedReplay) becomes the group's hot call
(autosymm.runtime.replay.FUSED_HOT): a repeat of its dtype and shape skips the key, and its replay checks
the arguments (a plan only at the checked call's addresses, a miss through check_args).

The epilogues (``residual=None``, ``gemma``, ``quant``; autosymm.collectives.fused_epilogue) take
the keyed path with the epilogue in the key, ``(record, dtype, x shape, epilogue, capturing)``;
their arguments are checked on every call (:func:`autosymm.collectives.fused_epilogue.epilogue_of`
and ``check_scale`` beside ``check_args``), and eager replay serves the default epilogue only.
"""

from __future__ import annotations

import torch

from typing import Optional

from .collectives import ALL_REDUCE_RMSNORM, prepare_call
from .collectives.all_reduce_rmsnorm import check_args
from .collectives.fused_epilogue import DEFAULT, TWO_OUTPUT_QUANTS, Epilogue, check_scale, epilogue_of
from .dist_compat import group_name as name_of_group
from .runtime.group import STATES, check_traced, current_raw_stream, state_of, stream_capturing
from .runtime.replay import FUSED_HOT, FusedReplay, HotFused

_dynamo_compiling = torch.compiler.is_dynamo_compiling


def all_reduce_rmsnorm(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float = 1e-6,
                       group=None, *, gemma: bool = False, quant: Optional[str] = None,
                       scale: Optional[torch.Tensor] = None):
    """On every rank of ``group``: ``residual += all_reduce(x)`` (in place) and return
    ``rmsnorm(residual) * weight`` as a new tensor.

    Epilogues (keyword-only; docs/INTEGRATIONS.md states each reference formula,
    autosymm.epilogue.reference computes it): ``residual=None``: no add, the norm reads the sum
    itself and only new tensors are written (every path of an epilogue call leaves x unchanged);
    ``gemma=True``: the weight applied as ``(1 + weight)``; ``quant="fp8"`` with ``scale`` (float32, one element):
    out is float8_e4m3fn ``clamp(norm * (1 / scale), -448, 448)``; ``quant="fp8_per_token"``:
    returns ``(out e4m3, scales [tokens, 1] float32)``; ``quant="nvfp4"`` with ``scale`` the
    float32 global scale: returns ``(packed uint8 [tokens, hidden / 2], e4m3 block scales in
    vLLM's swizzled layout)``, hidden a multiple of 16. A bad argument (a scale of the wrong
    dtype, shape or device, a missing scale or one no quant mode takes, an unknown quant, a
    hidden size NVFP4 cannot pack) raises a ValueError naming it before anything is written.
    Quantized outputs have no gradient: a quantized call whose input requires grad raises.

    ``x`` and ``residual``: [tokens, hidden], contiguous, one dtype (bf16, fp16 or fp32) and
    ``residual`` the same on every rank (tensor parallelism); ``weight``: [hidden], same dtype.
    Sums and the norm are taken in fp32 (the norm of the unrounded sum) and rounded once; every
    rank ends with bit-identical ``residual`` and output. ``x`` is scratch (default epilogue): the
    Triton kernels leave it unchanged, the NCCL path leaves the sum in it. Under torch.compile (or another tracer,
    which hands over tensor subclasses) the call is ``torch.ops.autosymm.all_reduce_rmsnorm``.
    Where an input requires grad it is ``all_reduce_rmsnorm_functional`` (differentiable:
    autosymm.collectives.autograd) and the new residual is copied into ``residual``.
    """
    if residual is None or gemma is not False or quant is not None or scale is not None:
        return _epilogue_call(x, residual, weight, eps, group, gemma, quant, scale)
    if (x.requires_grad or residual.requires_grad or weight.requires_grad) and torch.is_grad_enabled():
        out, new_residual = torch.ops.autosymm.all_reduce_rmsnorm_functional(x, residual, weight, eps,
                                                                             name_of_group(group))
        residual.copy_(new_residual)
        return out
    if type(x) is not torch.Tensor or _dynamo_compiling():
        check_traced(x, "all_reduce_rmsnorm")
        return torch.ops.autosymm.all_reduce_rmsnorm(x, residual, weight, eps, name_of_group(group))
    # The hot path: the group's last prepared eager call (replay.FUSED_HOT), of x's dtype and shape,
    # while nothing captures (on torch's default stream nothing can); its replay checks the rest.
    hot = FUSED_HOT.get(group)
    if (hot is not None and hot.dtype is x.dtype and hot.shape == x.shape
            and (current_raw_stream(hot.device_index) == 0 or not stream_capturing())):
        hot.entry.calls += 1
        return hot.call(x, residual, weight, eps)
    return fused_call(x, residual, weight, eps, group)


def _epilogue_call(x, residual, weight, eps, group, gemma, quant, scale):
    """:func:`all_reduce_rmsnorm` with a non-default epilogue."""
    epilogue = epilogue_of(residual, gemma, quant, scale)  # ValueError naming the argument, before anything runs
    tensors = (x, weight) if residual is None else (x, residual, weight)
    if torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in tensors):
        if quant is not None:
            raise RuntimeError(f"autosymm.all_reduce_rmsnorm: quant={quant!r} output has no gradient (a quantized "
                               "output feeds a GEMM, not autograd); detach the inputs or run under torch.no_grad()")
        out, new_residual = torch.ops.autosymm.all_reduce_rmsnorm_functional(x, residual, weight, eps,
                                                                             name_of_group(group), gemma)
        if residual is not None:
            residual.copy_(new_residual)
        return out
    if type(x) is not torch.Tensor or _dynamo_compiling():
        check_traced(x, "all_reduce_rmsnorm")
        op = torch.ops.autosymm.all_reduce_rmsnorm_quant if quant in TWO_OUTPUT_QUANTS else \
            torch.ops.autosymm.all_reduce_rmsnorm
        return op(x, residual, weight, eps, name_of_group(group), gemma, quant, scale)
    return fused_call(x, residual, weight, eps, group, epilogue, scale)


def fused_call(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float, group,
               epilogue: Epilogue = DEFAULT, scale: Optional[torch.Tensor] = None):
    """The keyed eager path of :func:`all_reduce_rmsnorm` for plain tensors (the custom ops' impls)."""
    state = STATES.get(group) or state_of(group)
    default = epilogue == DEFAULT
    if default:
        key, args = (ALL_REDUCE_RMSNORM, x.dtype, x.shape, stream_capturing()), (x, residual, weight)
    else:
        key, args = (ALL_REDUCE_RMSNORM, x.dtype, x.shape, epilogue, stream_capturing()), (x, residual, weight, scale)
    try:
        check_args(x, residual, weight, state.device)  # every call, before anything runs (the key names x only)
        if not default:
            check_scale(x, epilogue, scale, state.device)
    except ValueError:
        # a new call (or checked mode): every rank learns of it, as prepare_call checks the call with
        # every rank, then raises; a prepared one raises here alone, as its peers agree on nothing
        if state.check_calls or key not in state.cache:
            prepare_call(state, ALL_REDUCE_RMSNORM, key, args)
        raise
    entry = state.cache.get(key)
    if entry is None:
        entry = prepare_call(state, ALL_REDUCE_RMSNORM, key, args)
    entry.calls += 1
    launcher = entry.launcher
    if not default:
        return launcher(x, residual, weight, eps, scale=scale)
    if not key[-1] and type(launcher) is FusedReplay and not state.check_calls:  # checked: never hot
        FUSED_HOT[group] = HotFused(x.dtype, x.shape, launcher.device_index, entry, launcher)
    return launcher(x, residual, weight, eps)
