"""The epilogue arguments of ``autosymm.all_reduce_rmsnorm`` (``residual=None``, ``gemma``,
``quant``, ``scale``): the :class:`autosymm.epilogue.Epilogue` a call asks for, their checks (a
ValueError naming the bad argument, before anything is written) and the one-rank path.

Which tensors a call writes: ``residual`` (when given) takes ``residual + all_reduce(x)``, rounded
once to its dtype; every output (``out``; ``scales`` / block scales) is a new tensor; ``x`` is
scratch, as for the default epilogue (the Triton kernels leave it unchanged, the NCCL paths leave
the sum in it). ``weight`` and ``scale`` are read only.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..epilogue import QUANTS, Epilogue, reference

#: The default epilogue (residual add, plain RMSNorm, output in x's dtype): today's op, whose
#: database rows keep the shape key 'h{hidden}'.
DEFAULT = Epilogue()

#: Quant modes that take a caller's ``scale`` (the static per-tensor FP8 scale; NVFP4's global scale).
SCALED_QUANTS = ("fp8", "nvfp4")
#: Quant modes that return two tensors (the quantized output and its scales).
TWO_OUTPUT_QUANTS = ("fp8_per_token", "nvfp4")
#: Elements per NVFP4 block (one e4m3 scale each; two e2m1 values a byte).
NVFP4_BLOCK = 16


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
                         f"({'the per-tensor FP8 scale: out = x / scale' if quant == 'fp8' else 'the NVFP4 global scale'})")
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


def check_problem_epilogue(epilogue: Epilogue, hidden: int, op: str) -> None:
    """ValueError unless ``epilogue`` is an Epilogue whose quant mode can pack ``hidden``."""
    if not isinstance(epilogue, Epilogue):
        raise ValueError(f"{op}: epilogue must be an autosymm.epilogue.Epilogue, got {type(epilogue).__name__}")
    if epilogue.quant == "nvfp4" and hidden % NVFP4_BLOCK:
        raise ValueError(f"{op}: quant='nvfp4' needs hidden % {NVFP4_BLOCK} == 0, got hidden={hidden}")


def epilogue_launcher(epilogue: Epilogue, total):
    """``launcher(x, residual, weight, eps, scale=None)`` of a non-default ``epilogue``:
    ``total(x)`` gives the fp32 sum of every rank's x (unrounded where the path keeps it so),
    then :func:`autosymm.epilogue.reference`, writing the new residual (when there is one) in
    place. Returns the reference's output(s)."""

    def launcher(x: Tensor, residual: Optional[Tensor], weight: Tensor, eps: float = 1e-6,
                 scale: Optional[Tensor] = None):
        return reference_into(total(x), residual, weight, eps, epilogue, scale)

    return launcher


def reference_into(sum_fp32: Tensor, residual: Optional[Tensor], weight: Tensor, eps: float, epilogue: Epilogue,
                   scale: Optional[Tensor]):
    """The reference epilogue of the fp32 ``sum_fp32``, ``residual`` (if any) updated in place
    to ``residual + sum`` rounded once; returns out, or (out, scales)."""
    new_residual, outputs = reference(sum_fp32, residual, weight, eps, epilogue, scale)
    if residual is not None:
        residual.copy_(new_residual)
    return outputs


def single_rank_launcher(epilogue: Epilogue):
    """World size 1 (non-default epilogue): the sum is ``x`` itself (left as it is), no collective."""
    return epilogue_launcher(epilogue, lambda x: x.float())


def outputs_like(x: Tensor, epilogue: Epilogue):
    """Empty outputs of ``epilogue`` for ``x`` [tokens, hidden] (the fakes' and an empty call's):
    out (x's dtype, or float8_e4m3fn), or (out e4m3, scales [tokens, 1] fp32), or (packed uint8
    [tokens, hidden / 2], block scales uint8 in the swizzled layout, :func:`nvfp4_scales_shape`)."""
    tokens, hidden = x.shape
    if epilogue.quant is None:
        return x.new_empty((tokens, hidden))
    if epilogue.quant == "fp8":
        return x.new_empty((tokens, hidden), dtype=torch.float8_e4m3fn)
    if epilogue.quant == "fp8_per_token":
        return x.new_empty((tokens, hidden), dtype=torch.float8_e4m3fn), x.new_empty((tokens, 1), dtype=torch.float32)
    return (x.new_empty((tokens, hidden // 2), dtype=torch.uint8),
            x.new_empty(nvfp4_scales_shape(tokens, hidden), dtype=torch.float8_e4m3fn))


def nvfp4_scales_shape(tokens, hidden) -> tuple:
    """The block scales' shape in vLLM's swizzled layout: rows padded to 128, scale columns
    (hidden / 16) padded to 4 (``scaled_fp4_quant``'s ``[round_up(m, 128), round_up(n / 16, 4)]``)."""
    return (-(-tokens // 128) * 128, -(-(hidden // NVFP4_BLOCK) // 4) * 4)
