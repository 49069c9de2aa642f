"""The fp32 reference of all_reduce_rmsnorm and the one-ulp check the fused tests share."""

from __future__ import annotations

import torch

MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}


def reference(xs, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + sum of xs, RMSNorm of it * weight) in float64: the exact values to round."""
    new = residual.double() + torch.stack([x.double() for x in xs]).sum(0)
    return new, rmsnorm(new, weight, eps)


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
    """The updated residual and out each within one ulp of the exact values (16-bit types; fp32
    sums of a few terms cancel, so there a relative and absolute 1e-5)."""
    exact_res, exact_out = reference(xs, residual_in, weight, eps)
    if residual.dtype == torch.float32:
        torch.testing.assert_close(residual.double(), exact_res, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.double(), exact_out, rtol=1e-5, atol=1e-5)
        return
    assert ulps_off(residual, exact_res) <= 1.0, f"residual {ulps_off(residual, exact_res):.2f} ulp off"
    assert ulps_off(out, exact_out) <= 1.0, f"out {ulps_off(out, exact_out):.2f} ulp off"
