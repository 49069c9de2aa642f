"""``torch.ops.autosymm.vllm_all_reduce_rmsnorm`` at run time, on 2 gloo ranks, against vLLM 0.33.0.

Each of the 4 unquantized patterns is written as vLLM's graphs hold it (``torch.ops.vllm.all_reduce``
then the real ``RMSNorm`` / ``GemmaRMSNorm.forward_native``), compiled with inductor (FX graph
cache off) through vLLM's own pre-grad pass (``VllmIRInplaceFunctionalizationPass``, as
compilation/backends.py:962-969 installs it) and autosymm's pass as inductor's post-grad pre pass,
and run over a real vLLM ``GroupCoordinator`` whose device communicator is the plugin's
``AutosymmCudaCommunicator`` (vLLM's real ``CudaCommunicator`` on the gloo groups). Three branches:

* autosymm's decision not NCCL (tests/_adapter_decisions.py): autosymm's fused op, no vLLM call;
* autosymm's decision NCCL (gloo) and the call inside vLLM's FlashInfer table (vLLM's
  ``AllReduceFusionPass`` in the post pass, applicable for the compile range): vLLM's
  ``flashinfer_trtllm_fused_allreduce_norm`` called with the arguments vLLM's own replacement
  passes (allreduce_rms_fusion.py:379-400, 445-462, 515-535), recorded by a fake of that op
  (stubs.STAND_INS: flashinfer cannot import on a CPU) that computes vLLM's unfused composition;
* beyond the table: vLLM's all-reduce then its norm op, no FlashInfer call.

Outputs are compared with vLLM's unfused composition run eagerly: the norm within one ulp of the
output dtype, the residual ``residual + sum(x)`` bit-exact. autosymm sums in fp32 and rounds once
(autosymm/fused.py), vLLM rounds the bf16 sum and then the add: the inputs are multiples of 1/8
whose sums are exact in bf16, where the two formulas give the same residual.
"""

from __future__ import annotations

import types
from contextlib import nullcontext

import pytest
import stubs
import torch
from torch._inductor.custom_graph_pass import CustomGraphPass
from _adapter_decisions import adapter_decisions
from _gloo import run_gloo

stubs.require_real_sources()

HIDDEN, EPS, TABLE_TOKENS = 64, 1e-6, 8
FUSED = "torch.ops.autosymm.vllm_all_reduce_rmsnorm.default("
#: flashinfer.comm.AllReduceFusionPattern.kARResidualRMSNorm (flashinfer/comm/trtllm_ar.py).
K_AR_RESIDUAL_RMSNORM = 1
RECORDED: list[dict] = []


def _fake_flashinfer_fused(allreduce_in: torch.Tensor, residual: torch.Tensor, rms_gamma: torch.Tensor,
                           rms_eps: float, world_size: int, launch_with_pdl: bool, fp32_acc: bool,
                           max_token_num: int, pattern_code: int, norm_out: torch.Tensor | None = None,
                           quant_out: torch.Tensor | None = None, scale_out: torch.Tensor | None = None,
                           scale_factor: torch.Tensor | None = None, weight_bias: float = 0.0) -> None:
    """vLLM's op (same schema, same mutated arguments); records its call and writes FlashInfer's
    outputs (norm into ``norm_out`` or ``allreduce_in``, the sum into ``allreduce_in`` or
    ``residual``) as vLLM's unfused all-reduce and norm ops compute them."""
    RECORDED.append(dict(rms_eps=rms_eps, world_size=world_size, launch_with_pdl=launch_with_pdl,
                         fp32_acc=fp32_acc, max_token_num=max_token_num, pattern_code=pattern_code,
                         norm_out=norm_out is not None, quant_out=quant_out, scale_out=scale_out,
                         scale_factor=scale_factor, weight_bias=weight_bias, tokens=allreduce_in.shape[0],
                         gamma_dtype=rms_gamma.dtype, residual_in_zero=not bool(residual.any())))
    summed = allreduce_in.clone()
    torch.distributed.all_reduce(summed)  # the sum vLLM's chain ends in on gloo (the 2 ranks' world)
    gamma = rms_gamma.float() + weight_bias if weight_bias else rms_gamma
    if norm_out is None:
        out, total = torch.ops.vllm_ir.fused_add_rms_norm.default(summed, residual, gamma, rms_eps, None)
        allreduce_in.copy_(out)
        residual.copy_(total)
    else:
        norm_out.copy_(torch.ops.vllm_ir.rms_norm.default(summed, gamma, rms_eps, None))
        allreduce_in.copy_(summed)


def _install_flashinfer_fake() -> None:
    """Register the fake as ``torch.ops.vllm.flashinfer_trtllm_fused_allreduce_norm`` (vLLM's
    direct_register_custom_op, vLLM's mutates_args) and give vLLM's fusion module the pattern enum."""
    import vllm._C_stable_libtorch  # noqa: F401  (the stub declaring the _C ops vLLM's fusion modules name)
    from vllm.compilation.passes.fusion import allreduce_rms_fusion as fusion
    from vllm.utils.torch_utils import direct_register_custom_op

    if not hasattr(torch.ops.vllm, "flashinfer_trtllm_fused_allreduce_norm"):
        direct_register_custom_op(op_name="flashinfer_trtllm_fused_allreduce_norm", op_func=_fake_flashinfer_fused,
                                  mutates_args=["allreduce_in", "residual", "norm_out", "quant_out", "scale_out"])
    fusion.flashinfer_comm = types.SimpleNamespace(
        AllReduceFusionPattern=types.SimpleNamespace(kARResidualRMSNorm=K_AR_RESIDUAL_RMSNORM))


class _PostPass(CustomGraphPass):
    """Where vLLM's PostGradPassManager sits (inductor's post-grad post pass), holding vLLM's
    ``AllReduceFusionPass`` as its ``passes``: the pass autosymm reads vLLM's table from. It
    rewrites nothing here (autosymm's pre pass has taken the pairs)."""

    def __init__(self, vllm_pass) -> None:
        self.passes = [vllm_pass]

    def __call__(self, graph) -> None:
        pass

    def uuid(self) -> bytes:
        return b"vllm-post-pass-holder"


def _vllm_fusion_pass(max_token_num: int):
    """vLLM's AllReduceFusionPass as its __init__ leaves it on sm90 with a FlashInfer workspace
    (allreduce_rms_fusion.py:1022-1027, 1123): enabled, bf16, ``max_token_num`` from the table;
    its patterns empty (the workspace needs CUDA)."""
    from torch._inductor.pattern_matcher import PatternMatcherPass
    from vllm.compilation.passes.fusion.allreduce_rms_fusion import AllReduceFusionPass

    vllm_pass = AllReduceFusionPass.__new__(AllReduceFusionPass)
    vllm_pass.disabled, vllm_pass.model_dtype, vllm_pass.max_token_num = False, torch.bfloat16, max_token_num
    vllm_pass.patterns = PatternMatcherPass()
    return vllm_pass


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
    """Compile the pattern, run it in ``branch`` ('autosymm', 'flashinfer', 'unfused'); returns
    (rewrites, FlashInfer calls recorded, vLLM all-reduces run by the op)."""
    import torch._dynamo
    from torch._inductor.utils import run_and_get_code
    from vllm.compilation.passes.inductor_pass import pass_context
    from vllm.compilation.passes.ir.inplace_functionalization import VllmIRInplaceFunctionalizationPass
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.config.utils import Range
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm

    from autosymm.integrations import vllm_fusion

    _install_flashinfer_fake()
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
    tokens = 12 if branch == "unfused" else 4
    # Multiples of 1/8 below 8: every sum here is exact in bf16, so autosymm's fp32 sum rounded
    # once and vLLM's bf16 sum then fp32 add agree bit for bit (autosymm/fused.py's formula).
    x = ((torch.randn(tokens, HIDDEN, generator=gen) + rank) * 8).round().clamp(-24, 24).div(8).bfloat16()
    residual = (torch.randn(tokens, HIDDEN, generator=gen) * 8).round().clamp(-16, 16).div(8).bfloat16()

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
                   vllm_fusion.PRE_PASS_KEY: fusion, "fx_graph_cache": False,
                   "post_grad_custom_post_pass": _PostPass(_vllm_fusion_pass(TABLE_TOKENS))}
        torch._dynamo.reset()
        compiled = torch.compile(step, dynamic=False, options=options)
        compile_range = Range(1, 16 if branch == "unfused" else TABLE_TOKENS)  # 'unfused': beyond the table
        decisions = adapter_decisions(backend="triton_fused_one_shot") if branch == "autosymm" else nullcontext()
        with pass_context(compile_range), decisions:  # else gloo's own decision: NCCL
            assert comm.autosymm.serves_fused(x) is (branch == "autosymm")
            RECORDED.clear()
            got, code = run_and_get_code(compiled, x, residual)
    assert "\n".join(code).count(FUSED) == 1 and fusion.rewrites == 1
    _within_one_ulp(got[0], want[0])
    assert torch.equal(got[1], want[1]), "residual + sum(x) not bit-exact"
    return fusion.rewrites, list(RECORDED), sums


PATTERNS = [pytest.param(gemma, res, id=f"{'gemma' if gemma else 'rms'}-{'add' if res else 'noadd'}")
            for gemma in (False, True) for res in (True, False)]


@pytest.mark.parametrize("gemma,with_residual", PATTERNS)
def test_runtime_autosymm_branch_equals_vllms_unfused_ops(tmp_path, gemma, with_residual):
    env = {"all": {"AUTOSYMM_DB": str(tmp_path / "none.sqlite"), "VLLM_DISABLE_PYNCCL": "1"}}
    out = run_gloo(_run, 2, gemma, with_residual, "autosymm", env=env, deadline_s=400)
    assert out == {0: (1, [], []), 1: (1, [], [])}  # autosymm's fused op: neither FlashInfer nor vLLM's sum


@pytest.mark.parametrize("gemma,with_residual", PATTERNS)
def test_runtime_flashinfer_branch_called_as_vllms_replacement(tmp_path, gemma, with_residual):
    env = {"all": {"AUTOSYMM_DB": str(tmp_path / "none.sqlite"), "VLLM_DISABLE_PYNCCL": "1"}}
    out = run_gloo(_run, 2, gemma, with_residual, "flashinfer", env=env, deadline_s=400)
    call = dict(rms_eps=EPS, world_size=2, launch_with_pdl=True, fp32_acc=True, max_token_num=TABLE_TOKENS,
                pattern_code=K_AR_RESIDUAL_RMSNORM, norm_out=not with_residual, quant_out=None, scale_out=None,
                scale_factor=None, weight_bias=1.0 if gemma else 0.0, tokens=4,
                gamma_dtype=torch.bfloat16, residual_in_zero=not with_residual)  # Gemma: its raw weight
    assert out == {0: (1, [call], []), 1: (1, [call], [])}  # vLLM's sum ran only inside the fake's composition


@pytest.mark.parametrize("gemma,with_residual", PATTERNS[::3])
def test_runtime_beyond_the_table_runs_vllms_unfused_ops(tmp_path, gemma, with_residual):
    env = {"all": {"AUTOSYMM_DB": str(tmp_path / "none.sqlite"), "VLLM_DISABLE_PYNCCL": "1"}}
    out = run_gloo(_run, 2, gemma, with_residual, "unfused", env=env, deadline_s=400)
    assert out == {0: (1, [], [(12, HIDDEN)]), 1: (1, [], [(12, HIDDEN)])}
