"""The epilogue arguments of ``autosymm.all_reduce_rmsnorm`` (``residual=None``, ``gemma``,
``quant``, ``scale``): the :class:`autosymm.epilogue.Epilogue` a call asks for, their checks (a
ValueError naming the bad argument, before anything is written) and the one-rank path.

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

from ..epilogue import DEFAULT, NVFP4_BLOCK, QUANTS, Epilogue, normalized, quantize, reference, residual_sum

#: The epilogues autosymm serves (vLLM 0.33's AllReduceFusionPass patterns, then per-token FP8),
#: each tuned under its own shape key when asked for (``autosymm tune --epilogues``; the default
#: sweep tunes the default epilogue only).
EPILOGUES = tuple(Epilogue(residual=r, gemma=g, quant=q) for g, q in (
    (False, None), (False, "fp8"), (False, "nvfp4"), (True, None), (False, "fp8_per_token")) for r in (True, False))

#: Quant modes that take a caller's ``scale`` (the static per-tensor FP8 scale; NVFP4's global scale).
SCALED_QUANTS = tuple(q for q in QUANTS if Epilogue(quant=q).needs_scale)
#: Quant modes that return two tensors (the quantized output and its scales).
TWO_OUTPUT_QUANTS = tuple(q for q in QUANTS if Epilogue(quant=q).has_scales)


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


def epilogue_launcher(epilogue: Epilogue, total, inv_rms=None):
    """``launcher(x, residual, weight, eps, *, scale=None)`` of a non-default ``epilogue``:
    ``total(x)`` gives the fp32 sum of every rank's x (unrounded where the path keeps it so),
    then :func:`autosymm.epilogue.reference` (with ``inv_rms(s, eps)``: its steps with that
    inverse RMS, the ordered fallback's fixed tree), the new residual (where there is one)
    written in place. Returns out, or (out, scales)."""

    def launcher(x: Tensor, residual: Optional[Tensor], weight: Tensor, eps: float = 1e-6, *,
                 scale: Optional[Tensor] = None):
        if inv_rms is None:
            out, new_residual, scales = reference(total(x), residual, weight, float(eps), epilogue, scale)
        else:
            new_residual = s = residual_sum(total(x), residual, epilogue)
            out, scales = quantize(normalized(s, inv_rms(s, float(eps)), weight, epilogue), epilogue, weight.dtype,
                                   scale)
        if residual is not None:
            residual.copy_(new_residual)  # rounded once to residual's dtype
        return out if scales is None else (out, scales)

    return launcher


def single_rank_launcher(epilogue: Epilogue):
    """World size 1 (non-default epilogue): the sum is ``x`` itself (left as it is), no collective."""
    return epilogue_launcher(epilogue, lambda x: x.float())


def outputs_like(x: Tensor, epilogue: Epilogue):
    """Empty outputs of ``epilogue`` for ``x`` [tokens, hidden] (the fakes' and an empty call's):
    out, or (out, scales) (autosymm.epilogue.Epilogue.empty_outputs)."""
    out, scales = epilogue.empty_outputs(x.shape[0], x.shape[1], x.dtype, x.device)
    return out if scales is None else (out, scales)
