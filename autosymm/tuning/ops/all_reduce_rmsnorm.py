"""The fused all-reduce + RMSNorm's tuning side: small multiples of 1/4 for x and the (replicated)
residual and weight, so the updated residual is exact; the expected result is that residual
stacked on its RMSNorm * weight computed in fp32 (a launcher's result is stacked the same way,
:meth:`FusedTuning.result`); the fused backends' stages in the all-reduce region.

Other epilogues (the problem's autosymm.epilogue.Epilogue) are checked against
autosymm.epilogue.reference of the exact sum: the residual, the output and the scales, flattened
to one fp32 vector (:func:`_flat`); quantized values (e4m3 and e2m1 codes, the NVFP4 block scales)
as signed code ordinals, where a code one step from the reference's counts as the reference's
(the kernels' sum of squares may round the fp32 norm's last bit otherwise, which moves a value
sitting on a rounding boundary by one step), so a candidate fails on any value two steps off.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ...spec import ALL_REDUCE_RMSNORM as RECORD
from ...epilogue import DEFAULT, reference
from ...problem import Problem
from .base import SEED, TuningOp, quarters
from ...collectives.all_reduce_rmsnorm import all_reduce_rmsnorm

EPS = 1e-6
#: The validation's scales: FP8's per-tensor scale (|y| <= 4.48 unclipped) and NVFP4's global scale.
FP8_SCALE, NVFP4_GLOBAL_SCALE = 0.01, 448.0 * 6.0 / 8.0


class FusedTuning(TuningOp):
    def allocate(self, data, gen: torch.Generator) -> None:
        p, dev = data.problem, data.device
        shape = (p.n_tokens_local, p.hidden)
        data.val_input = quarters(shape, gen, dev, data.dtype)
        same = torch.Generator(device=dev).manual_seed(SEED)  # residual and weight: replicated
        data.residual, data.weight = quarters(shape, same, dev, data.dtype), quarters((p.hidden,), same, dev, data.dtype)
        data.timing = [torch.empty(shape, dtype=data.dtype, device=dev) for _ in range(data.n_inputs)]
        data.timing_residuals = [torch.empty_like(t) for t in data.timing]
        scale = {"fp8": FP8_SCALE, "nvfp4": NVFP4_GLOBAL_SCALE}.get(_epilogue(p).quant)
        data.scale = None if scale is None else torch.tensor(scale, dtype=torch.float32, device=dev)

    def build_reference(self, data) -> None:
        total = data.val_input.clone()
        dist.all_reduce(total, group=data.group)  # exact: small multiples of 1/4
        epilogue = _epilogue(data.problem)
        if epilogue != DEFAULT:
            want = reference(total.float(), data.residual if epilogue.residual else None, data.weight, EPS, epilogue,
                             data.scale)
            data.want = want
            data.expected = _flat(want, want)
            return
        new = data.residual.float() + total.float()
        out = new * torch.rsqrt(new.pow(2).mean(-1, keepdim=True) + EPS) * data.weight.float()
        data.expected = torch.stack((new.to(data.dtype), out.to(data.dtype)))

    def validation_args(self, data) -> tuple:
        # residual updated in place; x may be (NCCL)
        epilogue = _epilogue(data.problem)
        if epilogue == DEFAULT:
            return (data.val_input.clone(), data.residual.clone(), data.weight, EPS)
        residual = data.residual.clone() if epilogue.residual else None
        return (data.val_input.clone(), residual, data.weight, EPS, data.scale)

    def result(self, data, out: Any, args: tuple) -> Any:
        """The updated residual stacked on the output (the expected value's layout); another
        epilogue's results flattened beside the reference's (:func:`_flat`)."""
        if _epilogue(data.problem) != DEFAULT:
            out, scales = out if isinstance(out, tuple) else (out, None)
            return _flat(type(data.want)(out, args[1], scales), data.want)
        return torch.stack((args[1], out)) if isinstance(out, torch.Tensor) else out

    def timing_args(self, data) -> list[tuple]:
        epilogue = _epilogue(data.problem)
        if epilogue == DEFAULT:
            return [(t, r, data.weight, EPS) for t, r in zip(data.timing, data.timing_residuals)]
        return [(t, r if epilogue.residual else None, data.weight, EPS, data.scale)
                for t, r in zip(data.timing, data.timing_residuals)]

    def callable(self, data, launcher: Any) -> Any:
        """An epilogue's launcher takes ``scale`` by keyword; validation and timing pass it last."""
        if _epilogue(data.problem) == DEFAULT:
            return launcher

        def call(x, residual, weight, eps, scale):
            return launcher(x, residual, weight, eps, scale=scale)

        return call

    def public_call(self, data):
        """autosymm.all_reduce_rmsnorm with the problem's epilogue (its keywords)."""
        epilogue = _epilogue(data.problem)
        if epilogue == DEFAULT:
            return all_reduce_rmsnorm

        def call(x, residual, weight, eps, scale):
            return all_reduce_rmsnorm(x, residual, weight, eps, gemma=epilogue.gemma, quant=epilogue.quant,
                                      scale=scale)

        return call

    def workspace_bytes(self, problem: Problem) -> tuple[int, int]:
        from ...backends import triton_fused  # this backend imports the Triton kernels: only a tune's sizing needs it

        # the largest stage of any fused algorithm (the two-shot's x and out rows)
        return triton_fused.largest_stage_bytes(problem.nbytes, problem.world_size), 0


def _epilogue(problem: Problem):
    return problem.epilogue or DEFAULT


def _flat(got, want) -> torch.Tensor:
    """One fp32 vector of an epilogue's results ``got`` (out, residual, scales: an
    autosymm.epilogue.EpilogueResult), quantized tensors as code ordinals snapped to ``want``'s
    within one step (module docstring); ``_flat(want, want)`` is the expected vector."""
    parts = []
    for name in ("residual", "out", "scales"):
        g, w = getattr(got, name), getattr(want, name)
        if w is None:
            continue
        if g is None or g.shape != w.shape or g.dtype != w.dtype:
            return torch.full((1,), float("nan"), device=w.device)  # the wrong outputs: never passes
        if g.dtype == torch.float8_e4m3fn or g.dtype == torch.uint8:
            ordinal, wanted = _ordinals(g), _ordinals(w)
            parts.append(torch.where((ordinal - wanted).abs() <= 1, wanted, ordinal).float().reshape(-1))
        else:
            parts.append(g.float().reshape(-1))
    return torch.cat(parts)


def _ordinals(t: torch.Tensor) -> torch.Tensor:
    """Signed code ordinals (adjacent values differ by 1): e4m3 bytes, or two e2m1 nibbles a byte."""
    bits = t.view(torch.uint8).to(torch.int32)
    if t.dtype == torch.uint8:  # NVFP4's packed e2m1 pairs
        bits = torch.stack((bits & 0xF, bits >> 4), -1)
        magnitude, negative = bits & 0x7, bits & 0x8
    else:
        magnitude, negative = bits & 0x7F, bits & 0x80
    return torch.where(negative != 0, -magnitude, magnitude)


ALL_REDUCE_RMSNORM = FusedTuning(RECORD)
