"""``torch.ops.autosymm.vllm_all_reduce_rmsnorm`` at run time, on 2 gloo ranks, against vLLM 0.33.0:
the op autosymm's pass writes where vLLM's own pass would not fuse (no vLLM pass compiling here).

Each of the 4 unquantized patterns is written as vLLM's graphs hold it (``torch.ops.vllm.all_reduce``
then the real ``RMSNorm`` / ``GemmaRMSNorm.forward_native``), compiled with inductor (FX graph
cache off) through vLLM's own pre-grad pass (``VllmIRInplaceFunctionalizationPass``, as
compilation/backends.py:962-969 installs it) and autosymm's pass as inductor's post-grad pre pass,
and run over a real vLLM ``GroupCoordinator`` whose device communicator is the plugin's
``AutosymmCudaCommunicator`` (vLLM's real ``CudaCommunicator`` on the gloo groups). Two branches:

* a tuned row decides autosymm's fused op (tests/_adapter_decisions.py): no vLLM call;
* no row (gloo: autosymm's decision is its NCCL fallback, untuned): vLLM's all-reduce then its
  norm op, their new tensors returned as they are.

Outputs are compared with vLLM's unfused composition run eagerly: the norm within one ulp of the
output dtype, the residual ``residual + sum(x)`` bit-exact. autosymm sums in fp32 and rounds once
(autosymm/epilogue.py), vLLM rounds the bf16 sum and then the add: the inputs are multiples of 1/8
whose sums are exact in bf16, where the two formulas give the same residual. The form autosymm
writes where vLLM's pass would fuse (vLLM's FlashInfer replacement with autosymm's op in front)
runs in tests/stacks/test_vllm_compile.py, through vLLM's own compile pipeline.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import stubs
import torch
from _adapter_decisions import adapter_decisions
from _gloo import run_gloo

stubs.require_real_sources()

HIDDEN, EPS, TOKENS = 64, 1e-6, 12
FUSED = "torch.ops.autosymm.vllm_all_reduce_rmsnorm.default("


def _coordinator(rank, world_size):
    """A real vLLM GroupCoordinator 'tp:0' over gloo with the plugin's communicator on it."""
    from vllm.distributed.parallel_state import GroupCoordinator

    from autosymm.integrations import vllm_plugin

    coordinator = GroupCoordinator([list(range(world_size))], rank, "gloo", use_device_communicator=False,
                                   group_name="tp")
    assert coordinator.unique_name == "tp:0"
    coordinator.device_communicator = vllm_plugin.AutosymmCudaCommunicator(
        cpu_group=coordinator.cpu_group, device=torch.device("cpu"), device_group=coordinator.device_group,
        unique_name=coordinator.unique_name)
    return coordinator


def _within_one_ulp(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    up = torch.nextafter(want, torch.full_like(want, float("inf"))).float() - want.float()
    down = want.float() - torch.nextafter(want, torch.full_like(want, float("-inf"))).float()
    err = (got.float() - want.float()).abs()
    assert bool((err <= torch.maximum(up, down)).all()), f"max error {err.max().item()} beyond one ulp"


def _run(rank, world_size, gemma, with_residual, branch):
    """Compile the pattern, run it in ``branch`` ('autosymm', 'untuned'); returns (rewrites, the
    shapes of vLLM's all-reduces the op ran)."""
    import torch._dynamo
    from torch._inductor.utils import run_and_get_code
    from vllm.compilation.passes.inductor_pass import pass_context
    from vllm.compilation.passes.ir.inplace_functionalization import VllmIRInplaceFunctionalizationPass
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.config.utils import Range
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm

    from autosymm.integrations import vllm_fusion

    coordinator = _coordinator(rank, world_size)
    comm = coordinator.device_communicator
    sums = []
    chain = comm.all_reduce
    comm.all_reduce = lambda t: sums.append(tuple(t.shape)) or chain(t)
    config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    with set_current_vllm_config(config):
        layer = (GemmaRMSNorm if gemma else RMSNorm)(HIDDEN, eps=EPS)
    gen = torch.Generator().manual_seed(11)
    layer.weight.data = (torch.randn(HIDDEN, generator=gen) * 0.5).bfloat16()
    # Multiples of 1/8 below 8: every sum here is exact in bf16, so autosymm's fp32 sum rounded
    # once and vLLM's bf16 sum then fp32 add agree bit for bit (autosymm/epilogue.py's formula).
    x = ((torch.randn(TOKENS, HIDDEN, generator=gen) + rank) * 8).round().clamp(-24, 24).div(8).bfloat16()
    residual = (torch.randn(TOKENS, HIDDEN, generator=gen) * 8).round().clamp(-16, 16).div(8).bfloat16()

    def step(x, residual):
        summed = torch.ops.vllm.all_reduce(x, "tp:0")
        if with_residual:
            return layer.forward_native(summed, residual)
        return layer.forward_native(summed), summed * 2  # the sum read again, as layer 0's residual is

    with torch.no_grad(), set_current_vllm_config(config):
        want = step(x, residual)
        sums.clear()
        fusion = vllm_fusion.VllmAllReduceRMSNormPass()
        options = {"pre_grad_custom_pass": VllmIRInplaceFunctionalizationPass(config),
                   vllm_fusion.PRE_PASS_KEY: fusion, "fx_graph_cache": False}
        torch._dynamo.reset()
        compiled = torch.compile(step, dynamic=False, options=options)
        decisions = adapter_decisions(backend="triton_fused_one_shot") if branch == "autosymm" else nullcontext()
        with pass_context(Range(1, 16)), decisions:  # else gloo's own decision: NCCL, untuned
            assert comm.autosymm.serves_fused(x) is (branch == "autosymm")
            got, code = run_and_get_code(compiled, x, residual)
    assert "\n".join(code).count(FUSED) == 1 and fusion.rewrites == 1
    _within_one_ulp(got[0], want[0])
    assert torch.equal(got[1], want[1]), "residual + sum(x) not bit-exact"
    return fusion.rewrites, sums


PATTERNS = [pytest.param(gemma, res, id=f"{'gemma' if gemma else 'rms'}-{'add' if res else 'noadd'}")
            for gemma in (False, True) for res in (True, False)]
ENV = {"VLLM_DISABLE_PYNCCL": "1"}


@pytest.mark.parametrize("gemma,with_residual", PATTERNS)
def test_runtime_autosymm_branch_equals_vllms_unfused_ops(tmp_path, gemma, with_residual):
    env = {"all": {"AUTOSYMM_DB": str(tmp_path / "none.sqlite"), **ENV}}
    out = run_gloo(_run, 2, gemma, with_residual, "autosymm", env=env, deadline_s=400)
    assert out == {0: (1, []), 1: (1, [])}  # autosymm's fused op: not vLLM's sum


@pytest.mark.parametrize("gemma,with_residual", PATTERNS[::3])
def test_runtime_untuned_runs_vllms_unfused_ops(tmp_path, gemma, with_residual):
    env = {"all": {"AUTOSYMM_DB": str(tmp_path / "none.sqlite"), **ENV}}
    out = run_gloo(_run, 2, gemma, with_residual, "untuned", env=env, deadline_s=400)
    assert out == {0: (1, [(TOKENS, HIDDEN)]), 1: (1, [(TOKENS, HIDDEN)])}
