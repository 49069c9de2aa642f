"""autosymm.all_reduce_rmsnorm's epilogues (residual=None, gemma, quant="fp8" / "fp8_per_token" /
"nvfp4") on 3 gloo ranks, the NCCL fallback (gloo standing in) and the ordered one (deterministic),
against the stated composition: every rank's x summed in fp32 in rank order, then
autosymm.epilogue.reference (add, norm of the unrounded sum, quant). fp32 inputs: at least 99.9 %
of the quantized values identical to it; bf16 inputs: every value within one e4m3 step. Then the
bad arguments, each refused before anything is written; and one rank (no collective)."""

from __future__ import annotations

import pytest
import torch
from _gloo import run_gloo

from autosymm.epilogue import Epilogue, reference

TOKENS, HIDDEN, EPS, WORLD = 7, 256, 1e-6, 3
VARIANTS = [dict(quant="fp8"), dict(quant="fp8_per_token"), dict(quant="nvfp4"), dict(residual=False),
            dict(gemma=True), dict(gemma=True, residual=False), dict(residual=False, quant="fp8"),
            dict(residual=False, quant="nvfp4")]


def _inputs(dtype, seed=5):
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(TOKENS, HIDDEN, generator=gen).to(dtype) for _ in range(WORLD)]
    residual = torch.randn(TOKENS, HIDDEN, generator=gen).to(dtype)
    weight = (torch.rand(HIDDEN, generator=gen) + 0.5).to(dtype)
    return xs, residual, weight


def _scale_of(quant):
    if quant == "fp8":
        return torch.tensor(0.02, dtype=torch.float32)
    if quant == "nvfp4":
        return torch.tensor(448.0 * 6.0 / 4.0, dtype=torch.float32)  # global scale for |y| up to ~4
    return None


def _expected(xs, residual, weight, variant):
    """The stated composition: the fp32 sum in rank order, then the reference epilogue."""
    total = torch.zeros(xs[0].shape, dtype=torch.float32)
    for x in xs:
        total = total + x.float()
    epilogue = Epilogue(residual=variant.get("residual", True), gemma=variant.get("gemma", False),
                        quant=variant.get("quant"))
    return reference(total, residual if epilogue.residual else None, weight, EPS, epilogue,
                     _scale_of(epilogue.quant))


def _calls(rank, world_size, dtype):
    import autosymm

    xs, residual_in, weight = _inputs(dtype)
    results = []
    for variant in VARIANTS:
        has_residual = variant.get("residual", True)
        residual = residual_in.clone() if has_residual else None
        kwargs = {k: v for k, v in variant.items() if k != "residual"}
        got = autosymm.all_reduce_rmsnorm(xs[rank].clone(), residual, weight, EPS, **kwargs,
                                          scale=_scale_of(variant.get("quant")))
        got = got if isinstance(got, tuple) else (got, None)
        results.append(((_pack(got[0]), _pack(got[1])), _pack(residual)))
    return results


def _pack(t):
    """A tensor as plain data (a queue would share its memory with a process about to exit)."""
    return None if t is None else (str(t.dtype).replace("torch.", ""), tuple(t.shape), t.view(torch.uint8).numpy().tobytes())


def _unpack(packed):
    if packed is None:
        return None
    dtype, shape, data = packed
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(getattr(torch, dtype)).reshape(shape)


def _e4m3_ordinal(t):
    """e4m3 values as signed ordinals: adjacent representable values differ by 1 (+-0 are 0)."""
    bits = t.view(torch.uint8).to(torch.int32)
    magnitude = bits & 0x7F
    return torch.where(bits & 0x80 != 0, -magnitude, magnitude)


def _e2m1_ordinal(packed):
    codes = torch.stack((packed & 0xF, packed >> 4), -1).to(torch.int32)
    magnitude = codes & 0x7
    return torch.where(codes & 0x8 != 0, -magnitude, magnitude)


def _compare(variant, got, want, residual, dtype):
    """fp32: >= 99.9 % of quantized values (and every block scale) identical; bf16: each within one
    step (NVFP4: block scales within one step, codes within two); unquantized outputs within an ulp-level tolerance."""
    (out, scales), quant = got, variant.get("quant")
    if want.residual is not None:  # NCCL's sum in x's dtype, then the fp32 add: rounding-level
        tol = 1e-6 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(residual.float(), want.residual.float(), rtol=tol, atol=tol)
    assert out.dtype == want.out.dtype and out.shape == want.out.shape
    if quant is None:
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.float(), want.out.float(), rtol=tol, atol=tol)
        return
    if quant == "fp8_per_token":
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(scales, want.scales, rtol=tol, atol=0.0)
    if quant == "nvfp4":
        if dtype == torch.float32:
            assert (scales.view(torch.uint8) == want.scales.view(torch.uint8)).float().mean() >= 0.999
        else:
            assert (_e4m3_ordinal(scales) - _e4m3_ordinal(want.scales)).abs().max() <= 1
        got_codes, want_codes = _e2m1_ordinal(out), _e2m1_ordinal(want.out)
        identical = (got_codes == want_codes).float().mean()
    else:
        got_codes, want_codes = _e4m3_ordinal(out), _e4m3_ordinal(want.out)
        identical = (got_codes == want_codes).float().mean()
    if dtype == torch.float32:
        assert identical >= 0.999, f"{variant}: only {float(identical):.4%} of the quantized values identical"
    elif quant != "nvfp4":
        assert (got_codes - want_codes).abs().max() <= 1, f"{variant}: a value more than one e4m3 step off"
    else:  # a block scale one step off rescales its block's codes
        assert identical >= 0.95 and (got_codes - want_codes).abs().max() <= 2


@pytest.mark.parametrize("deterministic", ["0", "1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_epilogues_match_the_composition_on_three_ranks(tmp_path, dtype, deterministic):
    env = {"all": {"AUTOSYMM_DB": str(tmp_path / "none.sqlite"), "AUTOSYMM_DETERMINISTIC": deterministic}}
    reports = run_gloo(_calls, WORLD, dtype, env=env, deadline_s=180)
    xs, residual_in, weight = _inputs(dtype)
    for variant, *per_rank in zip(VARIANTS, *(reports[r] for r in range(WORLD))):
        want = _expected(xs, residual_in, weight, variant)
        per_rank = [((_unpack(out), _unpack(scales)), _unpack(res)) for (out, scales), res in per_rank]
        for got, residual in per_rank:
            _compare(variant, got, want, residual, dtype)
        (out0, scales0), res0 = per_rank[0]
        for (out, scales), res in per_rank[1:]:  # every rank ends with the same bits
            assert torch.equal(out.view(torch.uint8), out0.view(torch.uint8))
            assert (scales is None and scales0 is None) or torch.equal(scales.view(torch.uint8),
                                                                      scales0.view(torch.uint8))
            assert (res is None and res0 is None) or torch.equal(res, res0)


def _single_rank(rank, world_size):
    import autosymm

    xs, residual_in, weight = _inputs(torch.bfloat16)
    for variant in VARIANTS:
        residual = residual_in.clone() if variant.get("residual", True) else None
        kwargs = {k: v for k, v in variant.items() if k != "residual"}
        got = autosymm.all_reduce_rmsnorm(xs[0].clone(), residual, weight, EPS, **kwargs,
                                          scale=_scale_of(variant.get("quant")))
        want = _expected(xs[:1], residual_in, weight, variant)
        got = got if isinstance(got, tuple) else (got, None)
        assert torch.equal(got[0].view(torch.uint8), want.out.view(torch.uint8)), variant  # the sum is x: exact
        if want.scales is not None:
            assert torch.equal(got[1].view(torch.uint8), want.scales.view(torch.uint8)), variant
        if residual is not None:
            assert torch.equal(residual, want.residual)
    assert autosymm.stats()["noop"]["calls"] == len(VARIANTS)
    return True


def test_one_rank_runs_the_reference_without_a_collective(tmp_path):
    env = {"all": {"AUTOSYMM_DB": str(tmp_path / "none.sqlite")}}
    assert run_gloo(_single_rank, 1, env=env, deadline_s=120) == {0: True}


def _refused(rank, world_size):
    """Every bad epilogue argument raises a ValueError naming it; x and residual keep their bits."""
    import autosymm

    x, residual, weight = torch.full((4, 64), 3.0), torch.full((4, 64), 5.0), torch.ones(64)
    autosymm.all_reduce_rmsnorm(x.clone(), residual.clone(), weight, EPS, quant="fp8",
                                scale=torch.tensor(1.0))  # warm-up: the key is cached
    one = torch.tensor(1.0)
    cases = [
        (dict(quant="fp4"), r"quant='fp4' is not one of \('fp8', 'fp8_per_token', 'nvfp4'\)"),
        (dict(quant="fp8"), "quant='fp8' needs scale"),
        (dict(quant="nvfp4"), "quant='nvfp4' needs scale"),
        (dict(scale=one), "scale is given but quant=None"),
        (dict(quant="fp8_per_token", scale=one), "scale is given but quant='fp8_per_token'"),
        (dict(quant="fp8", scale=torch.tensor(1.0, dtype=torch.float64)), "scale has dtype torch.float64"),
        (dict(quant="fp8", scale=torch.tensor(1.0).bfloat16()), "scale has dtype torch.bfloat16"),
        (dict(quant="fp8", scale=torch.ones(2)), r"scale of shape \(2,\) must be one float32 value"),
        (dict(quant="fp8", scale=torch.ones(1, 1)), r"scale of shape \(1, 1\)"),
        (dict(quant="fp8", scale=torch.ones((), device="meta")), "scale is on meta"),
        (dict(quant="fp8", scale=[1.0]), "scale must be a torch.Tensor"),
        (dict(gemma=1), "gemma must be True or False"),
    ]
    for kwargs, match in cases:
        xc, rc = x.clone(), residual.clone()
        with pytest.raises(ValueError, match=match):
            autosymm.all_reduce_rmsnorm(xc, rc, weight, EPS, **kwargs)
        assert torch.equal(xc, x) and torch.equal(rc, residual), match
    odd = torch.ones(4, 72)
    with pytest.raises(ValueError, match="hidden size 72 is not a multiple of 16"):
        autosymm.all_reduce_rmsnorm(odd.clone(), None, torch.ones(72), EPS, quant="nvfp4", scale=one)
    with pytest.raises(ValueError, match=r"weight \(65,\) must be \[hidden\] = \[64\]"):
        autosymm.all_reduce_rmsnorm(x.clone(), None, torch.ones(65), EPS, gemma=True)
    grad = torch.ones(4, 64, requires_grad=True)
    with pytest.raises(RuntimeError, match="quant='fp8' output has no gradient"):
        autosymm.all_reduce_rmsnorm(grad, residual.clone(), weight, EPS, quant="fp8", scale=one)
    out = autosymm.all_reduce_rmsnorm(x.clone(), residual.clone(), weight, EPS, quant="fp8", scale=one)
    assert out.dtype == torch.float8_e4m3fn  # still in step
    return True


def test_bad_epilogue_arguments_raise_before_anything_changes(tmp_path):
    env = {"all": {"AUTOSYMM_DB": str(tmp_path / "none.sqlite"), "AUTOSYMM_AGREE_TIMEOUT_S": "10"}}
    assert run_gloo(_refused, 2, env=env, deadline_s=120) == {0: True, 1: True}


def _checked(rank, world_size):
    """The checked mode compares an epilogue call's scale too: a float64 scale on rank 1 alone
    raises there (naming it) and on rank 0 (naming the difference); the ranks stay in step."""
    import autosymm
    from autosymm.runtime.call_check import CallMismatchError

    x, residual, weight = torch.full((4, 64), float(rank + 1)), torch.zeros(4, 64), torch.ones(64)
    out = autosymm.all_reduce_rmsnorm(x.clone(), residual, weight, EPS, quant="fp8", scale=torch.tensor(1.0))
    assert out.dtype == torch.float8_e4m3fn and torch.equal(residual, torch.full_like(residual, 3.0))
    scale = torch.tensor(1.0, dtype=torch.float64 if rank == 1 else torch.float32)
    error = ValueError if rank == 1 else CallMismatchError
    with pytest.raises(error, match="scale has dtype torch.float64" if rank == 1 else "scale"):
        autosymm.all_reduce_rmsnorm(x.clone(), residual.clone(), weight, EPS, quant="fp8", scale=scale)
    packed, scales = autosymm.all_reduce_rmsnorm(x.clone(), None, weight, EPS, quant="nvfp4",
                                                 scale=torch.tensor(100.0))
    assert packed.shape == (4, 32) and scales.shape == (128, 4)
    return True


def test_the_checked_mode_compares_epilogue_arguments(tmp_path):
    env = {"all": {"AUTOSYMM_DB": str(tmp_path / "none.sqlite"), "AUTOSYMM_CHECK_CALLS": "1",
                   "AUTOSYMM_AGREE_TIMEOUT_S": "20"}}
    assert run_gloo(_checked, 2, env=env, deadline_s=120) == {0: True, 1: True}
