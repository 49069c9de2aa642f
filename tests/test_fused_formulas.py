"""Each path of the fused ``all_reduce_rmsnorm`` computes the formula its backend names
(``Backend.formula``; docs/EPILOGUE.md#each-paths-formula), on gloo ranks on the CPU:

* ``nccl_fused``, default epilogue: 'native-chain': NCCL's sum in x's dtype, the residual add in
  x's dtype, torch's ``rms_norm`` (what the stacks' unfused ops compute);
* ``nccl_fused``, every other epilogue, and ``nccl_ordered_fused``: 'single-rounding':
  ``autosymm.epilogue.reference`` of the fp32 sum in rank order (the ordered path's norm by its
  fixed tree: the reference's steps with that tree, within an ulp of the reference);
* the world-size-1 launcher (backend ``noop``): the native chain for the default epilogue, the
  reference for the others;

and every backend of the op answers ``formula()`` with one of the two names."""

from __future__ import annotations

import pytest
import torch

from autosymm import spec
from autosymm.backends import get_backend
from autosymm.backends.base import RunContext
from autosymm.backends.nccl_ordered import ordered_inv_rms, ordered_sum
from autosymm.epilogue import (DEFAULT, NATIVE_CHAIN, SINGLE_ROUNDING, Epilogue, normalized, quantize, reference,
                               residual_sum)
from autosymm.problem import Problem

from _fused_ref import ulps_off
from _gloo import run_gloo

FORMULAS = (SINGLE_ROUNDING, NATIVE_CHAIN)
KEYS = ["", "rms", "gemma", "add_gemma", "add_rms_fp8", "rms_fp8_per_token", "add_rms_nvfp4"]
SCALE = {"fp8": 0.5, "nvfp4": 20.0}
TOKENS, HIDDEN, EPS, DTYPE = 5, 64, 1e-6, torch.bfloat16


def _inputs(world_size: int, seed: int = 0):
    """Every rank's x [W, tokens, hidden], the residual and the weight (the same on every rank)."""
    gen = torch.Generator().manual_seed(seed)
    xs = torch.randn(world_size, TOKENS, HIDDEN, generator=gen).to(DTYPE)
    residual = torch.randn(TOKENS, HIDDEN, generator=gen).to(DTYPE)
    weight = (1 + 0.5 * torch.randn(HIDDEN, generator=gen)).to(DTYPE)
    return xs, residual, weight


def _scale(epilogue: Epilogue):
    return torch.tensor([SCALE[epilogue.quant]], dtype=torch.float32) if epilogue.needs_scale else None


def _call(launcher, epilogue: Epilogue, x, residual, weight):
    """(out, scales or None) of a launcher of ``epilogue`` (the default one takes no scale)."""
    if epilogue == DEFAULT:
        return launcher(x, residual, weight, EPS), None
    got = launcher(x, residual if epilogue.residual else None, weight, EPS, scale=_scale(epilogue))
    return got if epilogue.has_scales else (got, None)


def _equal(got, want) -> bool:
    if got is None or want is None:
        return got is None and want is None
    return got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def _native_chain(summed, residual, weight):
    """The stacks' unfused chain from the sum already in x's dtype: (out, new residual)."""
    new_residual = residual + summed  # in x's dtype: a second rounding
    return torch.nn.functional.rms_norm(new_residual, (HIDDEN,), weight, EPS), new_residual


def _problem(world_size: int, epilogue: Epilogue) -> Problem:
    return Problem.all_reduce_rmsnorm(TOKENS, HIDDEN, "bf16", world_size, epilogue=epilogue)


def _fallback_paths(rank, world_size):
    import torch.distributed as dist

    xs, residual_in, weight = _inputs(world_size)
    in_order = ordered_sum(xs)  # the ranks' x in fp32, in rank order from +0.0, unrounded
    for key in KEYS:
        epilogue = Epilogue.of_key(key)
        problem = _problem(world_size, epilogue)
        # nccl_fused
        backend = get_backend("nccl_fused")
        x, residual = xs[rank].clone(), residual_in.clone()
        out, scales = _call(backend.prepare(problem, None, RunContext(group=None)), epilogue, x, residual, weight)
        if epilogue == DEFAULT:
            assert backend.formula(problem) == NATIVE_CHAIN
            nccl_sum = xs[rank].clone()
            dist.all_reduce(nccl_sum)  # NCCL's sum in x's dtype (gloo plays NCCL)
            want_out, want_residual = _native_chain(nccl_sum, residual_in, weight)
            assert torch.equal(x, nccl_sum), "the default fallback leaves its sum in x"
            assert _equal(residual, want_residual) and _equal(out, want_out), "nccl_fused: not the native chain"
            single = reference(in_order, residual_in, weight, EPS)
            assert not torch.equal(out, single.out), "the two formulas agree on these inputs: the test proves nothing"
        else:
            assert backend.formula(problem) == SINGLE_ROUNDING
            want = reference(in_order, residual_in, weight, EPS, epilogue, _scale(epilogue))
            assert torch.equal(x, xs[rank]), "x is left unchanged"
            assert _equal(out, want.out) and _equal(scales, want.scales), f"nccl_fused {key}: not the reference"
            assert not epilogue.residual or _equal(residual, want.residual)
        # nccl_ordered_fused: the reference, its norm's sum of squares by the fixed tree
        backend = get_backend("nccl_ordered_fused")
        assert backend.formula(problem) == SINGLE_ROUNDING
        x, residual = xs[rank].clone(), residual_in.clone()
        out, scales = _call(backend.prepare(problem, None, RunContext(group=None)), epilogue, x, residual, weight)
        s = residual_sum(in_order, residual_in, epilogue)
        want_out, want_scales = quantize(normalized(s, ordered_inv_rms(s, EPS), weight, epilogue), epilogue, DTYPE,
                                         _scale(epilogue))
        want = reference(in_order, residual_in, weight, EPS, epilogue, _scale(epilogue))
        assert _equal(out, want_out) and _equal(scales, want_scales), f"nccl_ordered_fused {key}: not its formula"
        assert not epilogue.residual or _equal(residual, want.residual), "the residual is the reference's, bit for bit"
        if epilogue.quant is None:
            assert ulps_off(out, want.out.double()) <= 1, "the fixed tree moves the norm by at most an ulp"
    return True


def test_each_fallback_computes_the_formula_it_names_on_two_gloo_ranks():
    assert run_gloo(_fallback_paths, 2, deadline_s=180) == {0: True, 1: True}


@pytest.mark.parametrize("key", KEYS, ids=lambda k: k or "default")
def test_the_one_rank_launcher_computes_the_tables_formula(key):
    """World size 1 (backend ``noop``): the default epilogue runs the native chain with the sum
    being x itself; the others the reference of x (docs/EPILOGUE.md's table)."""
    epilogue = Epilogue.of_key(key)
    xs, residual_in, weight = _inputs(1)
    x, residual = xs[0].clone(), residual_in.clone()
    launcher = get_backend("noop").prepare(_problem(1, epilogue), None, RunContext())
    out, scales = _call(launcher, epilogue, x, residual, weight)
    assert torch.equal(x, xs[0]), "x is left unchanged"
    if epilogue == DEFAULT:
        want_out, want_residual = _native_chain(xs[0], residual_in, weight)
        assert _equal(out, want_out) and _equal(residual, want_residual)
        assert not torch.equal(out, reference(xs[0].float(), residual_in, weight, EPS).out)
    else:
        want = reference(xs[0].float(), residual_in, weight, EPS, epilogue, _scale(epilogue))
        assert _equal(out, want.out) and _equal(scales, want.scales)
        assert not epilogue.residual or _equal(residual, want.residual)


def test_the_one_rank_default_path_names_the_native_chain():
    assert get_backend("noop").formula(_problem(1, DEFAULT)) == NATIVE_CHAIN


@pytest.mark.parametrize("world_size", [1, 2, 8])
def test_every_fused_backend_names_one_of_the_two_formulas(world_size):
    names = [*spec.ALL_REDUCE_RMSNORM.backends, "noop"]
    assert {"nccl_fused", "nccl_ordered_fused", "triton_fused_one_shot", "flashinfer_fused"} <= set(names)
    for name in names:
        for key in KEYS:
            assert get_backend(name).formula(_problem(world_size, Epilogue.of_key(key))) in FORMULAS, (name, key)
    assert SINGLE_ROUNDING == "single-rounding" and NATIVE_CHAIN == "native-chain"  # the names the docs use
