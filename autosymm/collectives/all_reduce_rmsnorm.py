"""``autosymm.all_reduce_rmsnorm``: the all-reduce of a tensor-parallel layer fused with the
residual add, the RMSNorm after it and an epilogue (autosymm.epilogue.Epilogue), its hot path,
and its custom ops ``torch.ops.autosymm.all_reduce_rmsnorm`` (one output: unquantized or static
FP8), ``all_reduce_rmsnorm_quant`` (two outputs: per-token FP8, NVFP4) and
``all_reduce_rmsnorm_functional`` (differentiable, the unquantized epilogues). Its spec:
autosymm.spec.all_reduce_rmsnorm; its argument checks: autosymm.collectives.fused_checks.

Call key: ``call_key(ALL_REDUCE_RMSNORM, dtype, x shape, device, capturing, epilogue)``. A
repeated call is its arguments' checks (before anything runs), a dict lookup and the launcher.
An eager default-epilogue call whose launcher replays (autosymm.runtime.replay.FusedReplay)
becomes the group's hot call (``FUSED_HOT``): a repeat of its dtype and shape skips the key, and
its replay checks the arguments.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..dist_compat import group_name as name_of_group, resolve_group
from ..epilogue import DEFAULT, Epilogue, outputs_like
from ..problem import Problem, dtype_name
from ..runtime.entry import CustomOp, Door, prepare_call, refuse_call
from ..runtime.group import STATES, check_traced, current_raw_stream, state_of, stream_capturing
from ..runtime.replay import FUSED_HOT, FusedReplay, HotFused
from ..spec import ALL_REDUCE_RMSNORM, KEY_CAPTURING, KEY_EXTRA, call_key
from ..spec.all_reduce_rmsnorm import TWO_OUTPUT_QUANTS
from . import autograd
from .fused_checks import check_args, check_scale, epilogue_of

_dynamo_compiling = torch.compiler.is_dynamo_compiling


class AllReduceRMSNormDoor(Door):
    """The fused op's entry; a call's arguments ``(x, residual, weight, scale, eps, gemma, quant)``
    (the keywords as the caller gave them: checked with every rank)."""

    def call_text(self, key, args: tuple, mode: str) -> str:
        x, epilogue = args[0], key[KEY_EXTRA]
        ending = "" if epilogue == DEFAULT else f" with epilogue {epilogue.key}"
        return f"{self.name} of {x.dtype} {tuple(x.shape)}{ending} in {mode} mode"

    def fingerprint(self, key, args: tuple, mode: str) -> dict:
        """Door.fingerprint, and in eager mode the scale's value (a read-back: every rank's
        quantized output depends on it; inside a capture only its presence, dtype and shape)."""
        found = super().fingerprint(key, args, mode)
        scale = args[3]
        if mode == "eager" and isinstance(scale, Tensor) and scale.numel() == 1 and not scale.is_meta:
            found["scale value"] = float(scale.reshape(-1)[0])
        return found

    def check_options(self, state, args: tuple) -> None:
        x, residual, weight, scale, eps, gemma, quant = args
        epilogue_of(residual, gemma, quant, scale)  # ValueError naming gemma, quant or scale
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
            raise ValueError(f"autosymm.{self.name}: eps={eps!r} must be a float >= 0")

    def check_tensors(self, state, args: tuple, mode: str) -> None:
        x, residual, weight, scale, eps, gemma, quant = args
        check_args(x, residual, weight, state.device, self.name)
        epilogue = epilogue_of(residual, gemma, quant, scale)
        check_scale(x, epilogue, scale, state.device, self.name)
        if quant is not None and torch.is_grad_enabled() and any(
                getattr(t, "requires_grad", False) for t in (x, residual, weight)):
            raise RuntimeError(f"autosymm.{self.name}: quant={quant!r} output has no gradient (a quantized output "
                               "feeds a GEMM, not autograd); detach the inputs or run under torch.no_grad()")

    def problem(self, state, key, args: tuple, mode: str) -> Problem:
        x, residual, weight, scale, eps, gemma, quant = args
        return Problem.all_reduce_rmsnorm(int(x.shape[0]), int(x.shape[1]), dtype_name(x.dtype), state.world_size,
                                          epilogue=epilogue_of(residual, gemma, quant, scale))

    def custom_ops(self) -> tuple[CustomOp, ...]:
        # x is declared mutated: the NCCL path sums into it
        return (CustomOp(self.name, _all_reduce_rmsnorm, _all_reduce_rmsnorm_fake, mutates_args=("x", "residual")),
                CustomOp(f"{self.name}_quant", _quant, _quant_fake, mutates_args=("x", "residual")),
                CustomOp(f"{self.name}_functional", _functional, _functional_fake, backward=autograd.fused_backward,
                         setup_context=autograd.fused_setup))


DOOR = AllReduceRMSNormDoor(ALL_REDUCE_RMSNORM, arg_names=("x", "residual", "weight", "scale", "eps", "gemma", "quant"))


def all_reduce_rmsnorm(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float = 1e-6,
                       group=None, *, gemma: bool = False, quant: Optional[str] = None,
                       scale: Optional[torch.Tensor] = None):
    """On every rank of ``group``: ``residual += all_reduce(x)`` (in place) and return
    ``rmsnorm(residual) * weight`` as a new tensor.

    Epilogues (keyword-only; docs/EPILOGUE.md states each reference formula,
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
    try:
        epilogue = epilogue_of(residual, gemma, quant, scale)  # ValueError naming the argument
    except ValueError:
        return _refuse(x, residual, weight, eps, group, gemma, quant, scale)
    tensors = (x, weight) if residual is None else (x, residual, weight)
    if torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in tensors):
        if quant is not None:  # no gradient of a quantized output: the door's checks say so, on every rank
            return _refuse(x, residual, weight, eps, group, gemma, quant, scale)
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


def _refuse(x, residual, weight, eps, group, gemma, quant, scale):
    """A call whose keywords or grad requirements the door refuses: its error on every rank of a
    first call (autosymm.runtime.entry.refuse_call); a tracer's call raises it alone (nothing runs)."""
    args = (x, residual, weight, scale, eps, gemma, quant)
    if type(x) is not torch.Tensor or _dynamo_compiling():
        state = STATES.get(group)
        device = state.device if state is not None else getattr(x, "device", None)
        DOOR.check_options(None, args)
        DOOR.check_tensors(_Placed(device), args, "eager")
    return refuse_call(STATES.get(group) or state_of(group), DOOR, args)


class _Placed:
    """The group state's one field a tracer's checks read (the device)."""

    def __init__(self, device) -> None:
        self.device = device


def fused_call(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float, group,
               epilogue: Epilogue = DEFAULT, scale: Optional[torch.Tensor] = None):
    """The keyed eager path of :func:`all_reduce_rmsnorm` for plain tensors (the custom ops' impls)."""
    state = STATES.get(group) or state_of(group)
    default = epilogue == DEFAULT
    key = call_key(ALL_REDUCE_RMSNORM, x.dtype, x.shape, x.device, stream_capturing(), epilogue)
    args = (x, residual, weight, scale, eps, epilogue.gemma, epilogue.quant)
    try:
        check_args(x, residual, weight, state.device)  # every call, before anything runs (the key names x only)
        if not default:
            check_scale(x, epilogue, scale, state.device)
    except ValueError:
        # a new call (or checked mode): every rank learns of it, as prepare_call checks the call with
        # every rank, then raises; a prepared one raises here alone, as its peers agree on nothing
        if state.check_calls or key not in state.cache:
            prepare_call(state, DOOR, key, args)
        raise
    entry = state.cache.get(key)
    if entry is None:
        entry = prepare_call(state, DOOR, key, args)
    entry.calls += 1
    launcher = entry.launcher
    if not default:
        return launcher(x, residual, weight, eps, scale=scale)
    if not key[KEY_CAPTURING] and type(launcher) is FusedReplay and not state.check_calls:  # checked: never hot
        FUSED_HOT[group] = HotFused(x.dtype, x.shape, launcher.device_index, entry, launcher)
    return launcher(x, residual, weight, eps)


def _call(x: Tensor, residual: Optional[Tensor], weight: Tensor, eps: float, group_name: str, gemma: bool,
          quant: Optional[str], scale: Optional[Tensor]):
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
