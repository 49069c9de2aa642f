"""The checks of ``autosymm.all_reduce_rmsnorm``'s arguments, run on every call before anything is
written (a ValueError naming the bad argument): the tensors (:func:`check_args`), the epilogue a
call's keywords ask for (:func:`epilogue_of`) and the quant scale (:func:`check_scale`).

Which tensors a call writes: ``residual`` (when given) takes ``residual + all_reduce(x)``, rounded
once to its dtype; every output (``out``; ``scales`` / block scales) is a new tensor; ``x``,
``weight`` and ``scale`` are read only (the Triton kernels read x; the NCCL fallback reduces an
fp32 copy and the ordered one gathers it; only the default epilogue's NCCL path, unchanged,
leaves its sum in x).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..epilogue import NVFP4_BLOCK, QUANTS, Epilogue
from ..problem import DTYPE_NAMES
from ..runtime.replay import OVERLAP_ERROR
from ..spec.all_reduce_rmsnorm import SCALED_QUANTS


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
    return OVERLAP_ERROR


def epilogue_of(residual: Optional[Tensor], gemma, quant, scale: Optional[Tensor],
                what: str = "all_reduce_rmsnorm") -> Epilogue:
    """The epilogue a call's keyword arguments ask for; ValueError naming ``gemma``, ``quant`` or
    ``scale`` when they do not describe one (the tensors' own checks: :func:`check_scale`)."""
    if not isinstance(gemma, bool):
        raise ValueError(f"autosymm.{what}: gemma must be True or False, got {gemma!r}")
    if quant is not None and quant not in QUANTS:
        raise ValueError(f"autosymm.{what}: quant={quant!r} is not one of {tuple(QUANTS)} (or None: x's dtype)")
    if scale is not None and quant not in SCALED_QUANTS:
        takes = "computes its own per-token scales" if quant == "fp8_per_token" else "quantizes nothing"
        raise ValueError(f"autosymm.{what}: scale is given but quant={quant!r} {takes}; scale is the float32 "
                         f"scalar of quant in {SCALED_QUANTS}")
    if scale is None and quant in SCALED_QUANTS:
        raise ValueError(f"autosymm.{what}: quant={quant!r} needs scale, a float32 scalar tensor on x's device "
                         f"({'the per-tensor FP8 scale: out = norm * (1 / scale)' if quant == 'fp8' else 'the NVFP4 global scale'})")
    return Epilogue(residual=residual is not None, gemma=gemma, quant=quant)


def check_scale(x: Tensor, epilogue: Epilogue, scale: Optional[Tensor], device: torch.device,
                what: str = "all_reduce_rmsnorm") -> None:
    """ValueError naming ``scale`` (float32, one element, shape () or (1,), on ``device``) or the
    hidden size NVFP4 cannot pack (a multiple of :data:`NVFP4_BLOCK`); x's own checks come first."""
    if scale is not None:
        if not isinstance(scale, Tensor):
            raise ValueError(f"autosymm.{what}: scale must be a torch.Tensor, got {type(scale).__name__}")
        if scale.dtype != torch.float32:
            raise ValueError(f"autosymm.{what}: scale has dtype {scale.dtype}; quant={epilogue.quant!r} takes a "
                             "float32 scalar tensor")
        if tuple(scale.shape) not in ((), (1,)):
            raise ValueError(f"autosymm.{what}: scale of shape {tuple(scale.shape)} must be one float32 value, "
                             "shape () or (1,)")
        if scale.device != device:
            raise ValueError(f"autosymm.{what}: scale is on {scale.device}; x and the group are on {device}")
    if epilogue.quant == "nvfp4" and x.dim() == 2 and x.shape[1] % NVFP4_BLOCK:
        raise ValueError(f"autosymm.{what}: quant='nvfp4' packs blocks of {NVFP4_BLOCK} elements, but x's hidden "
                         f"size {x.shape[1]} is not a multiple of {NVFP4_BLOCK}")
