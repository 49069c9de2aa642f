"""The epilogues' custom ops: ``torch.ops.autosymm.all_reduce_rmsnorm`` (one output: unquantized,
fp8) and ``all_reduce_rmsnorm_quant`` (two outputs: fp8 per token, nvfp4): fake impls, opcheck,
torch.compile(fullgraph=True) with the eager bits, and autograd of the unquantized epilogues (Gemma,
no residual) against torch's composition, on 2 gloo ranks."""

from __future__ import annotations

import pytest
import torch
from _gloo import run_gloo
from torch._subclasses.fake_tensor import FakeTensorMode

import autosymm  # noqa: F401  (registers the ops)

TOKENS, HIDDEN, EPS = 5, 64, 1e-6
# (gemma, quant, residual?, expected (out dtype, out shape), (scales dtype, scales shape) or None)
FAKES = [
    (False, None, False, (torch.bfloat16, (TOKENS, HIDDEN)), None),
    (True, None, True, (torch.bfloat16, (TOKENS, HIDDEN)), None),
    (False, "fp8", True, (torch.float8_e4m3fn, (TOKENS, HIDDEN)), None),
    (True, "fp8", False, (torch.float8_e4m3fn, (TOKENS, HIDDEN)), None),
    (False, "fp8_per_token", True, (torch.float8_e4m3fn, (TOKENS, HIDDEN)), (torch.float32, (TOKENS, 1))),
    (False, "nvfp4", False, (torch.uint8, (TOKENS, HIDDEN // 2)), (torch.float8_e4m3fn, (128, 4))),
]


def _scale(quant):
    return torch.tensor(0.05 if quant == "fp8" else 600.0) if quant in ("fp8", "nvfp4") else None


def _op(quant):
    return torch.ops.autosymm.all_reduce_rmsnorm_quant if quant in ("fp8_per_token", "nvfp4") else \
        torch.ops.autosymm.all_reduce_rmsnorm


@pytest.mark.parametrize("gemma,quant,has_residual,out,scales", FAKES)
def test_fake_impls_give_every_variants_outputs(gemma, quant, has_residual, out, scales):
    with FakeTensorMode():
        x = torch.empty(TOKENS, HIDDEN, dtype=torch.bfloat16)
        residual = torch.empty_like(x) if has_residual else None
        weight = torch.empty(HIDDEN, dtype=torch.bfloat16)
        scale = torch.empty((), dtype=torch.float32) if quant in ("fp8", "nvfp4") else None
        got = _op(quant)(x, residual, weight, EPS, "no-such-group", gemma, quant, scale)
    got = got if isinstance(got, tuple) else (got,)
    assert (got[0].dtype, tuple(got[0].shape)) == out
    if scales is not None:
        assert (got[1].dtype, tuple(got[1].shape)) == scales


def test_the_ops_refuse_a_quant_mode_of_the_other_arity():
    x = torch.ones(2, 16)
    with pytest.raises(ValueError, match="returns two tensors: call torch.ops.autosymm.all_reduce_rmsnorm_quant"):
        torch.ops.autosymm.all_reduce_rmsnorm(x, None, torch.ones(16), EPS, "g", False, "fp8_per_token", None)
    with pytest.raises(ValueError, match=r"quant='fp8' is not one of \('fp8_per_token', 'nvfp4'\)"):
        torch.ops.autosymm.all_reduce_rmsnorm_quant(x, None, torch.ones(16), EPS, "g", False, "fp8", _scale("fp8"))


def _inputs(rank):
    gen = torch.Generator().manual_seed(rank + 3)
    x = torch.randn(TOKENS, HIDDEN, generator=gen)
    shared = torch.Generator().manual_seed(99)
    return x, torch.randn(TOKENS, HIDDEN, generator=shared), torch.rand(HIDDEN, generator=shared) + 0.5


def _bits(result):
    result = result if isinstance(result, tuple) else (result,)
    return [t.view(torch.uint8).clone() for t in result]


def _compiled_and_checked(rank, world_size):
    from torch._dynamo.testing import CompileCounterWithBackend

    from autosymm.dist_compat import group_name

    x, residual_in, weight = _inputs(rank)
    for gemma, quant, has_residual, _, _ in FAKES:
        scale = _scale(quant)

        def call(x, residual, weight, scale):
            return autosymm.all_reduce_rmsnorm(x, residual, weight, EPS, gemma=gemma, quant=quant, scale=scale)

        res_eager = residual_in.clone() if has_residual else None
        eager = _bits(call(x.clone(), res_eager, weight, scale))
        counter = CompileCounterWithBackend("aot_eager")
        res_compiled = residual_in.clone() if has_residual else None
        compiled = _bits(torch.compile(call, fullgraph=True, backend=counter)(x.clone(), res_compiled, weight, scale))
        assert counter.frame_count == 1, (gemma, quant)
        assert all(torch.equal(a, b) for a, b in zip(eager, compiled)), (gemma, quant)
        assert not has_residual or torch.equal(res_eager, res_compiled)
        args = (x.clone(), residual_in.clone() if has_residual else None, weight, EPS, group_name(), gemma, quant,
                scale)
        torch.library.opcheck(_op(quant).default, args)
    return True


def _grads(rank, world_size):
    """Gemma and no-residual gradients: the functional op, the drop-in and torch's composition."""
    import torch.distributed.nn.functional as dnn

    x0, residual0, weight0 = _inputs(rank)
    a = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(7 + rank))
    for gemma, has_residual in ((True, True), (True, False), (False, False)):
        def ours(x, residual, weight):
            res = residual * 1.0 if has_residual else None
            return (autosymm.all_reduce_rmsnorm(x * 1.5, res, weight, EPS, gemma=gemma) * a).sum() + \
                ((res * a).sum() if has_residual else 0.0)

        def theirs(x, residual, weight):
            s = dnn.all_reduce(x * 1.5) + (residual * 1.0 if has_residual else 0.0)
            w = weight + 1.0 if gemma else weight
            out = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + EPS) * w
            return (out * a).sum() + ((s * a).sum() if has_residual else 0.0)

        grads = []
        for fn in (ours, theirs):
            leaves = [t.clone().requires_grad_() for t in (x0, residual0, weight0)]
            loss = fn(*leaves)
            loss.backward()
            grads.append((loss.detach(), leaves[0].grad, leaves[1].grad if has_residual else None, leaves[2].grad))
        torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-5)
    return True


def _both(rank, world_size):
    return _compiled_and_checked(rank, world_size) and _grads(rank, world_size)


def test_compile_opcheck_and_grads_on_two_gloo_ranks(tmp_path):
    env = {"all": {"AUTOSYMM_DB": str(tmp_path / "none.sqlite")}}
    assert run_gloo(_both, 2, env=env, deadline_s=400) == {0: True, 1: True}
