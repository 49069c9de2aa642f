"""References of all_reduce_rmsnorm (float64, and the kernels' fp32 in-order sum) and the
one-ulp check the fused tests share."""

from __future__ import annotations

import torch

MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}


def reference(xs, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + sum of xs, RMSNorm of it * weight) in float64: the exact values to round."""
    new = residual.double() + torch.stack([x.double() for x in xs]).sum(0)
    return new, rmsnorm(new, weight, eps)


def fp32_sum(xs, residual: torch.Tensor) -> torch.Tensor:
    """The kernels' s (autosymm.kernels.fused_rmsnorm): fp32, the xs of ranks 0..W-1 in order,
    then the residual, every add rounded to fp32."""
    acc = torch.zeros(residual.shape, dtype=torch.float32, device=residual.device)
    for x in xs:
        acc = acc + x.to(residual.device).float()
    return acc + residual.float()


def rmsnorm(residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    res = residual.double()
    return res * torch.rsqrt(res.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def ulps_off(got: torch.Tensor, exact: torch.Tensor) -> float:
    """Largest |got - exact| in units of the last place of ``got``'s dtype at ``exact``."""
    exact = exact.double().to(got.device)
    _, exponent = torch.frexp(exact.abs().clamp_min(torch.finfo(got.dtype).tiny))
    ulp = torch.ldexp(torch.ones_like(exact), exponent - 1 - MANTISSA_BITS[got.dtype])
    off = (got.double() - exact).abs() / ulp
    assert not torch.isnan(got).any(), "an element was never written (NaN)"
    return float(off.max()) if off.numel() else 0.0


def check(residual: torch.Tensor, out: torch.Tensor, xs, residual_in: torch.Tensor, weight: torch.Tensor,
          eps: float) -> None:
    """16-bit types: the updated residual and out each within one ulp of the kernels' fp32
    in-order sum (:func:`fp32_sum`) and of its exact RMSNorm. Not of the exact sum: an fp32 add
    drops the low bits of a term 2**17 times smaller, which a later add's cancellation exposes
    (bf16 1.8984375 - 1.98e-6 - 1.8984375 sums to -2.03e-6, 3 ulp off; about one element in
    2.5e8 of randn data). fp32: a relative and absolute 1e-5 of the exact values."""
    if residual.dtype == torch.float32:
        exact_res, exact_out = reference(xs, residual_in, weight, eps)
        torch.testing.assert_close(residual.double(), exact_res, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.double(), exact_out, rtol=1e-5, atol=1e-5)
        return
    exact_res = fp32_sum(xs, residual_in).double()
    exact_out = rmsnorm(exact_res, weight, eps)
    assert ulps_off(residual, exact_res) <= 1.0, f"residual {ulps_off(residual, exact_res):.2f} ulp off"
    assert ulps_off(out, exact_out) <= 1.0, f"out {ulps_off(out, exact_out):.2f} ulp off"
