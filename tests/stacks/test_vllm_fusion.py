"""autosymm's fusion pass on the graphs vLLM 0.33.0's real RMSNorm / GemmaRMSNorm layer code makes
after ``vllm.all_reduce``, and the plugin's config hook, against the real vLLM modules."""

from __future__ import annotations

import types

import pytest

import stubs

stubs.require_real_sources()

import torch  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

import vllm.distributed.parallel_state  # noqa: E402,F401  (registers torch.ops.vllm.all_reduce)
from vllm.config import CompilationConfig, CompilationMode, DeviceConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.compilation.passes.inductor_pass import pass_context  # noqa: E402
from vllm.config.utils import Range  # noqa: E402
from vllm.compilation.passes.ir.inplace_functionalization import VllmIRInplaceFunctionalizationPass  # noqa: E402
from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm  # noqa: E402

from autosymm.integrations import vllm_fusion  # noqa: E402

HIDDEN, EPS = 16, 1e-6


def _graph(layer_cls, with_residual: bool, extra=None):
    """vLLM's layer ``forward_native`` after ``vllm.all_reduce``, traced with fake tensors, then
    vLLM's own pre-grad pass (its in-place IR overloads made functional, compilation/backends.py:967)."""
    config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    with set_current_vllm_config(config):
        layer = layer_cls(HIDDEN, eps=EPS)
    layer.weight.data = torch.randn(HIDDEN).bfloat16()

    def step(x, residual):
        summed = torch.ops.vllm.all_reduce(x, "tp:0")
        out = layer.forward_native(summed, residual if with_residual else None)
        out = out if with_residual else (out, summed * 2)  # the sum read again, as layer 0's residual is
        return extra(out) if extra else out

    x = torch.randn(4, HIDDEN, dtype=torch.bfloat16)
    gm = make_fx(step, tracing_mode="fake", _allow_non_fake_inputs=True)(x, torch.randn_like(x))
    with set_current_vllm_config(config), pass_context(Range(1, 8)):
        VllmIRInplaceFunctionalizationPass(config)(gm.graph)
    return gm


def _targets(gm) -> list:
    return [node.target for node in gm.graph.nodes if node.op == "call_function"]


@pytest.mark.parametrize("layer_cls", [RMSNorm, GemmaRMSNorm])
@pytest.mark.parametrize("with_residual", [True, False])
def test_the_four_unquantized_patterns_are_rewritten(layer_cls, with_residual):
    gm = _graph(layer_cls, with_residual)
    norm_op = torch.ops.vllm_ir.fused_add_rms_norm.default if with_residual else torch.ops.vllm_ir.rms_norm.default
    assert torch.ops.vllm.all_reduce.default in _targets(gm) and norm_op in _targets(gm)
    fusion = vllm_fusion.VllmAllReduceRMSNormPass()
    fusion(gm.graph)
    gm.graph.eliminate_dead_code()
    assert fusion.rewrites == 1
    targets = _targets(gm)
    assert torch.ops.vllm.all_reduce.default not in targets and norm_op not in targets
    (fused,) = [n for n in gm.graph.nodes if n.target is torch.ops.autosymm.vllm_all_reduce_rmsnorm.default]
    x, residual, weight, eps, group, gemma, max_tokens = fused.args
    assert (eps, group, gemma, max_tokens) == (EPS, "tp:0", layer_cls is GemmaRMSNorm, 0)
    assert (residual is not None) == with_residual
    assert weight.meta["val"].dtype == torch.bfloat16  # Gemma's raw weight, not w.float() + 1
    assert torch.ops.aten.add.Tensor not in targets or not with_residual  # Gemma's w + 1 is dead


def test_a_norm_feeding_an_fp8_quant_is_left_to_vllms_pass():
    def fp8(out):
        return (out[0] / 0.5).clamp(-448, 448).to(torch.float8_e4m3fn), out[1]

    gm = _graph(RMSNorm, True, extra=fp8)
    fusion = vllm_fusion.VllmAllReduceRMSNormPass()
    fusion(gm.graph)
    assert fusion.rewrites == 0 and torch.ops.vllm.all_reduce.default in _targets(gm)


def test_the_plugin_hook_puts_the_pass_before_vllms_pass_manager():
    config = types.SimpleNamespace(parallel_config=types.SimpleNamespace(tensor_parallel_size=2),
                                   compilation_config=CompilationConfig(mode=CompilationMode.VLLM_COMPILE))
    assert vllm_fusion.install(config)
    assert config.compilation_config.inductor_compile_config[vllm_fusion.PRE_PASS_KEY] is vllm_fusion.PASS
    assert vllm_fusion.install(config)  # once only
    assert config.compilation_config.inductor_compile_config[vllm_fusion.PRE_PASS_KEY] is vllm_fusion.PASS
    single = types.SimpleNamespace(parallel_config=types.SimpleNamespace(tensor_parallel_size=1),
                                   compilation_config=CompilationConfig(mode=CompilationMode.VLLM_COMPILE))
    assert not vllm_fusion.install(single)
    assert vllm_fusion.PRE_PASS_KEY not in single.compilation_config.inductor_compile_config
