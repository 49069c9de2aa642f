"""The fused launchers with an epilogue (one simulated rank, interpreter): what they return and
write, bit-equal to the formula (as tests/test_kernels_fused_epilogue.py states it), and the
BackendErrors naming a bad residual, scale or output."""

import pytest
import torch

from autosymm.backends.base import BackendError, RunContext
from autosymm.backends.triton_fused import BACKENDS, _FusedLauncher, epilogue_of
from autosymm.configs import FusedConfig
from autosymm.epilogue import DEFAULT, Epilogue
from autosymm.problem import Problem
from autosymm.workspace.symm import simulated_workspaces

from _all_reduce_sim import requires_interpreter
from test_kernels_fused_epilogue import SCALE, _bits, _expected

pytestmark = requires_interpreter

TOKENS, HIDDEN = 3, 256


def _launcher(epilogue, backend=BACKENDS[0], hidden=HIDDEN):
    (ws,) = simulated_workspaces(1, all_reduce_bytes=1 << 17, moe_bytes=256, double_buffer_bytes=1 << 15)
    problem = Problem.all_reduce_rmsnorm(TOKENS, hidden, "fp16", 1)
    return _FusedLauncher(problem, FusedConfig(backend.algorithm, 256, 4, 2), ws, epilogue)


def _tensors(seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(TOKENS, HIDDEN, generator=gen).half()
    return x, torch.randn(TOKENS, HIDDEN, generator=gen).half(), (0.5 * torch.randn(HIDDEN, generator=gen)).half()


def test_a_problem_without_an_epilogue_gets_the_default():
    assert epilogue_of(Problem.all_reduce_rmsnorm(3, 64, "bf16", 2)) == DEFAULT


@pytest.mark.parametrize("backend", BACKENDS[:2], ids=lambda b: b.algorithm)
@pytest.mark.parametrize("key", ["rms", "add_gemma", "add_rms_fp8", "rms_fp8_per_token", "add_rms_nvfp4"])
def test_launcher_returns_the_formulas_outputs(key, backend):
    epilogue = Epilogue.of_key(key)
    launcher = _launcher(epilogue, backend)
    x, residual_in, weight = _tensors()
    residual = residual_in.clone() if epilogue.residual else None
    scale = torch.tensor([SCALE.get(epilogue.quant, 1.0)])
    got = launcher(x, residual, weight, 1e-6, scale=scale)
    out, scales = got if epilogue.has_scales else (got, None)
    want_out, want_residual, want_scales = _expected([x], residual_in, weight, epilogue, scale, 256, 1)
    assert out.dtype == epilogue.out_dtype(torch.float16) and torch.equal(_bits(out), _bits(want_out))
    if epilogue.residual:
        assert torch.equal(residual, want_residual)
    if epilogue.has_scales:
        assert torch.equal(_bits(scales), _bits(want_scales))
    else:
        assert isinstance(got, torch.Tensor)


def test_bad_epilogue_arguments_are_named():
    x, residual, weight = _tensors()
    with pytest.raises(BackendError, match="residual is None, but the epilogue add_rms adds it"):
        _launcher(DEFAULT)(x, None, weight)
    with pytest.raises(BackendError, match="a residual was passed to the epilogue rms"):
        _launcher(Epilogue(residual=False))(x, residual, weight)
    fp8 = _launcher(Epilogue(quant="fp8"))
    for scale in (None, torch.tensor([0.5], dtype=torch.float64), torch.tensor([0.5, 0.5])):
        with pytest.raises(BackendError, match="reads a float32 scale of one element"):
            fp8(x, residual.clone(), weight, scale=scale)
    with pytest.raises(BackendError, match=r"writes out torch.float8_e4m3fn \(3, 256\) \(got torch.float16"):
        fp8(x, residual.clone(), weight, out=torch.empty_like(x), scale=torch.tensor([0.5]))
    nvfp4 = _launcher(Epilogue(quant="nvfp4"))
    out = torch.empty(TOKENS, HIDDEN // 2, dtype=torch.uint8)
    with pytest.raises(BackendError, match=r"writes scales \(128, 16\)"):
        nvfp4(x, residual.clone(), weight, out=(out, torch.zeros(TOKENS, 16, dtype=torch.float8_e4m3fn)),
              scale=torch.tensor([1.0]))


def test_nvfp4_needs_a_hidden_size_of_whole_blocks():
    (ws,) = simulated_workspaces(1, all_reduce_bytes=1 << 16, moe_bytes=256, double_buffer_bytes=1 << 15)
    problem = Problem.all_reduce_rmsnorm(3, 40, "bf16", 1)
    object.__setattr__(problem, "epilogue", Epilogue(quant="nvfp4"))  # as the op's problems carry it
    with pytest.raises(BackendError, match="hidden=40 is not a multiple"):
        BACKENDS[0].prepare(problem, FusedConfig("one_shot", 128, 4, 2), RunContext(workspace=ws))
