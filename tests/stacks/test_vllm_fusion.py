"""autosymm's fusion pass on the graphs vLLM 0.33.0's real layers make after ``vllm.all_reduce``
(RMSNorm / GemmaRMSNorm, then QuantFP8 or NVFP4's ``scaled_fp4_quant`` as vLLM's linear layers call
them), and the plugin's config hook, against the real vLLM modules.

Each graph is the one inductor hands its post-grad pre pass under vLLM: traced with fake tensors,
vLLM's own pre-grad pass (its in-place IR overloads made functional, compilation/backends.py:967),
then inductor's ``compile_fx`` (AOT functionalization with ``auto_functionalized`` v1, vLLM's
setting, and inductor's decompositions) up to the graph its inner compile receives."""

from __future__ import annotations

import operator
import types

import pytest

import stubs

stubs.require_real_sources()

import torch  # noqa: E402
from torch._inductor import config as inductor_config  # noqa: E402
from torch._inductor.compile_fx import compile_fx  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402
from torch.fx.passes.fake_tensor_prop import FakeTensorProp  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

import vllm.distributed.parallel_state  # noqa: E402,F401  (registers torch.ops.vllm.all_reduce)
import vllm.platforms.cuda  # noqa: E402,F401  (imports the extension stub: declares torch.ops._C's quant ops)
from vllm import _custom_ops as ops  # noqa: E402
from vllm.config import (CompilationConfig, CompilationMode, DeviceConfig, VllmConfig, set_current_vllm_config)  # noqa: E402
from vllm.compilation.passes.inductor_pass import pass_context  # noqa: E402
from vllm.config.utils import Range  # noqa: E402
from vllm.compilation.passes.ir.inplace_functionalization import VllmIRInplaceFunctionalizationPass  # noqa: E402
from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm  # noqa: E402
from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8  # noqa: E402
from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape  # noqa: E402

from autosymm.integrations import vllm_fusion  # noqa: E402

HIDDEN, TOKENS, EPS = 16, 4, 1e-6
FUSED = torch.ops.autosymm.vllm_all_reduce_rmsnorm.default
FUSED_QUANT = torch.ops.autosymm.vllm_all_reduce_rmsnorm_quant.default
AUTO_FUNCTIONALIZED = torch.ops.higher_order.auto_functionalized


def _quant(kind, config):
    """``out -> (quantized, scales)`` as vLLM's quantized linear layers call it: QuantFP8 static
    per-tensor through its CUDA dispatch (``ops.scaled_fp8_quant`` -> ``_C.static_scaled_fp8_quant``)
    or its native torch code (``QuantFP8.enabled()`` False, vLLM's default), QuantFP8 dynamic per
    token, or NVFP4's ``ops.scaled_fp4_quant`` (nvfp4/cutlass.py:57)."""
    with set_current_vllm_config(config):
        per_tensor = QuantFP8(True, GroupShape.PER_TENSOR)
        per_token = QuantFP8(False, GroupShape.PER_TOKEN)
    return {
        "fp8": lambda out, scale: QuantFP8.forward_cuda(per_tensor, out, scale),
        "fp8_native": lambda out, scale: per_tensor.forward_native(out, scale),
        "fp8_per_token": lambda out, scale: QuantFP8.forward_cuda(per_token, out),
        "nvfp4": lambda out, scale: ops.scaled_fp4_quant(out, scale),
    }[kind]


def _graph(layer_cls, with_residual: bool, quant=None, weight_dtype=torch.bfloat16, also_read=False):
    """The post-grad graph (module docstring) of vLLM's ``layer_cls.forward_native`` after
    ``vllm.all_reduce``, then ``quant`` of the norm's output (see :func:`_quant`); ``also_read``:
    the norm's output is read again beside the quant."""
    config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    with set_current_vllm_config(config):
        layer = layer_cls(HIDDEN, eps=EPS)
    layer.weight.data = torch.randn(HIDDEN).to(weight_dtype)
    quantize = _quant(quant, config) if quant else None

    def step(x, residual, scale):
        summed = torch.ops.vllm.all_reduce(x, "tp:0")
        out = layer.forward_native(summed, residual if with_residual else None)
        norm, rest = out if with_residual else (out, summed * 2)  # the sum read again, as layer 0's residual is
        if quantize is None:
            return norm, rest
        return (*quantize(norm, scale), rest) + ((norm * 3,) if also_read else ())

    x = torch.randn(TOKENS, HIDDEN, dtype=torch.bfloat16)
    args = (x, torch.randn_like(x), torch.tensor([0.5]))
    gm = make_fx(step, tracing_mode="fake", _allow_non_fake_inputs=True)(*args)
    with set_current_vllm_config(config), pass_context(Range(1, 8)):
        VllmIRInplaceFunctionalizationPass(config)(gm.graph)
    gm.recompile()
    captured = []

    def inner_compile(graph_module, example_inputs, **kwargs):
        captured.append(graph_module)
        return graph_module.forward

    v2 = "enable_auto_functionalized_v2"
    with set_current_vllm_config(config), inductor_config.patch({v2: CompilationConfig().inductor_compile_config[v2]}), \
            torch.no_grad():  # vLLM compiles for inference: the forward graph alone
        compile_fx(gm, list(args), inner_compile=inner_compile)
    (post_grad,) = captured
    return post_grad


def _targets(gm) -> list:
    return [node.target for node in gm.graph.nodes if node.op == "call_function"]


def _quant_ops(gm) -> list:
    """The quant nodes of vLLM's patterns left in ``gm``: auto_functionalized _C quant calls, the
    native FP8 chain's reciprocal and clamps."""
    native = (torch.ops.aten.reciprocal.default, torch.ops.aten.clamp_min.default, torch.ops.aten.clamp_max.default)
    return [n for n in gm.graph.nodes if n.target is AUTO_FUNCTIONALIZED or n.target in native]


def _outputs(gm) -> list:
    """(dtype, shape) of the graph's outputs, propagated through fake tensors of its inputs."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fakes = [mode.from_tensor(torch.empty(n.meta["val"].shape, dtype=n.meta["val"].dtype)) for n in placeholders]
    gm.recompile()
    FakeTensorProp(gm, mode).propagate(*fakes)
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    return [(a.meta["val"].dtype, tuple(a.meta["val"].shape)) for a in output.args[0]]


def _rewrite(gm):
    """autosymm's pass on ``gm``: (the pass, the graph's outputs before, after), the graph checked."""
    before = _outputs(gm)
    fusion = vllm_fusion.VllmAllReduceRMSNormPass()
    fusion(gm.graph)
    gm.graph.lint()
    return fusion, before, _outputs(gm)


@pytest.mark.parametrize("layer_cls", [RMSNorm, GemmaRMSNorm])
@pytest.mark.parametrize("with_residual", [True, False])
def test_the_four_unquantized_patterns_are_rewritten(layer_cls, with_residual):
    gm = _graph(layer_cls, with_residual)
    norm_op = torch.ops.vllm_ir.fused_add_rms_norm.default if with_residual else torch.ops.vllm_ir.rms_norm.default
    assert torch.ops.vllm.all_reduce.default in _targets(gm) and norm_op in _targets(gm)
    fusion, before, after = _rewrite(gm)
    gm.graph.eliminate_dead_code()
    pattern = ("add_" if with_residual else "") + ("gemma" if layer_cls is GemmaRMSNorm else "rms")
    assert fusion.rewrites == 1 and fusion.patterns == {pattern: 1} and after == before
    targets = _targets(gm)
    assert torch.ops.vllm.all_reduce.default not in targets and norm_op not in targets
    (fused,) = [n for n in gm.graph.nodes if n.target is FUSED]
    x, residual, weight, eps, group, gemma = fused.args  # no vLLM pass compiling: the functional op
    assert (eps, group, gemma) == (EPS, "tp:0", layer_cls is GemmaRMSNorm)
    assert (residual is not None) == with_residual
    assert weight.meta["val"].dtype == torch.bfloat16  # Gemma's raw weight, not w.float() + 1
    assert torch.ops.aten.add.Tensor not in targets or not with_residual  # Gemma's w + 1 is dead


@pytest.mark.parametrize("quant", ["fp8", "fp8_native", "nvfp4"])
@pytest.mark.parametrize("with_residual", [True, False])
def test_the_four_quantized_patterns_are_rewritten(quant, with_residual):
    """RMSNorm (with and without the add) then static FP8 (either QuantFP8 form) or NVFP4: one
    fused quant call, vLLM's all-reduce, norm and quant gone, the graph's outputs (quantized values,
    NVFP4's int32 swizzled scales viewed as e4m3, the sum) read from its items."""
    gm = _graph(RMSNorm, with_residual, quant)
    assert _quant_ops(gm)
    fusion, before, after = _rewrite(gm)
    mode = "nvfp4" if quant == "nvfp4" else "fp8"
    assert fusion.rewrites == 1 and fusion.patterns == {("add_" if with_residual else "") + "rms_" + mode: 1}
    assert after == before  # the same dtypes and shapes: e4m3 / packed uint8, e4m3 scales, the sum
    targets = _targets(gm)
    assert not _quant_ops(gm) and FUSED not in targets
    assert not {torch.ops.vllm.all_reduce.default, torch.ops.vllm_ir.fused_add_rms_norm.default,
                torch.ops.vllm_ir.rms_norm.default, torch.ops.aten.empty.memory_format} & set(targets)
    (fused,) = [n for n in gm.graph.nodes if n.target is FUSED_QUANT]
    x, residual, weight, eps, group, form, scale = fused.args
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert (eps, group, form) == (EPS, "tp:0", quant)
    assert {x, weight, scale} <= set(placeholders) and (residual is not None) == with_residual
    assert scale.meta["val"].dtype == torch.float32 and weight.meta["val"].shape == (HIDDEN,)
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    outs = output.args[0]
    items = {n.args[1]: n for n in fused.users}
    assert outs[0] is items[0]  # the quantized values
    assert (outs[-1] if with_residual else outs[-1].args[0]) is items[1]  # the new residual; the sum, read again
    if quant == "nvfp4":  # vLLM's own view of its int32 scales as e4m3 reads item 2
        assert outs[1].target is torch.ops.aten.view.dtype and outs[1].args[0] is items[2]
        assert items[2].meta["val"].dtype == torch.int32


def test_a_quant_vllms_patterns_do_not_take_stays_and_the_norm_fuses_unquantized():
    """Dynamic per-token FP8, an FP8 chain whose norm output is read again, an NVFP4 quant beside
    another reader: vLLM's quantized patterns match none (matcher_utils.py:36 keys the static one
    only; a pattern's inner node has no other reader), its unquantized one takes the norm. So does
    autosymm's pass; the quant stays."""
    for gm in (_graph(RMSNorm, True, "fp8_per_token"), _graph(RMSNorm, True, "fp8_native", also_read=True),
               _graph(RMSNorm, False, "nvfp4", also_read=True)):
        quant_nodes = len(_quant_ops(gm))
        fusion, before, after = _rewrite(gm)
        assert fusion.rewrites == 1 and set(fusion.patterns) <= {"add_rms", "rms"} and after == before
        assert FUSED in _targets(gm) and FUSED_QUANT not in _targets(gm) and len(_quant_ops(gm)) == quant_nodes


def test_a_gemma_norm_before_a_quant_fuses_unquantized():
    """vLLM's quantized patterns take a weight of x's dtype (allreduce_rms_fusion.py:66-79); Gemma's
    fp32 ``1 + w`` is not: its pass fuses the Gemma norm alone, and so does autosymm's."""
    gm = _graph(GemmaRMSNorm, True, "fp8_native")
    fusion, before, after = _rewrite(gm)
    assert fusion.patterns == {"add_gemma": 1} and after == before and _quant_ops(gm)


@pytest.mark.parametrize("quant", [None, "fp8", "nvfp4"])
def test_a_norm_with_a_weight_of_another_dtype_is_left_alone(quant):
    """An fp32 RMSNorm weight on bf16 activations: vLLM's patterns refuse it (their dtype check),
    autosymm's fused op takes one dtype: the graph stays as it is."""
    gm = _graph(RMSNorm, True, quant, weight_dtype=torch.float32)
    fusion, before, after = _rewrite(gm)
    assert fusion.rewrites == 0 and torch.ops.vllm.all_reduce.default in _targets(gm) and after == before


def test_vllms_own_decision_for_a_quant_chain():
    """What the run-time op falls back to, as vLLM's pass would fuse the chain: its FlashInfer
    quantized pattern where it registered it (+max tokens), its unquantized one where not (-max)."""
    vllm_pass = types.SimpleNamespace(disabled=False, model_dtype=torch.bfloat16, max_token_num=64,
                                      supports_quant_fusion=True, is_applicable_for_range=lambda r: r.end <= 64)
    x, w = torch.empty(TOKENS, HIDDEN, dtype=torch.bfloat16), torch.empty(HIDDEN, dtype=torch.bfloat16)
    decide = vllm_fusion._vllm_fused_max_tokens
    config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    with set_current_vllm_config(config), pass_context(Range(1, 8)):
        assert not QuantFP8.enabled()  # vLLM's default: its pattern matches QuantFP8's native code
        assert [decide(vllm_pass, x, w, EPS, form) for form in (None, "fp8_native", "fp8")] == [64, 64, -64]
        assert decide(vllm_pass, x, w, EPS, "nvfp4") == -64  # no sm100 here: no NVFP4 pattern
        assert decide(vllm_pass, x, w, 1e-3, "fp8_native") == 0  # an epsilon vLLM's pass has no pattern of
        assert decide(types.SimpleNamespace(**{**vars(vllm_pass), "supports_quant_fusion": False}), x, w, EPS,
                      "fp8_native") == -64
    with set_current_vllm_config(config), pass_context(Range(1, 128)):
        assert decide(vllm_pass, x, w, EPS, "fp8_native") == 0  # a compile range above vLLM's size table


def test_the_plugin_hook_puts_the_pass_before_vllms_pass_manager():
    from vllm.config.vllm import OptimizationLevel

    compilation = CompilationConfig(mode=CompilationMode.VLLM_COMPILE)
    compilation.pass_config.fuse_allreduce_rms = True
    config = types.SimpleNamespace(parallel_config=types.SimpleNamespace(tensor_parallel_size=2),
                                   compilation_config=compilation, optimization_level=OptimizationLevel.O2)
    assert vllm_fusion.install(config)
    assert config.compilation_config.inductor_compile_config[vllm_fusion.PRE_PASS_KEY] is vllm_fusion.PASS
    assert vllm_fusion.install(config)  # once only
    assert config.compilation_config.inductor_compile_config[vllm_fusion.PRE_PASS_KEY] is vllm_fusion.PASS
    single = types.SimpleNamespace(parallel_config=types.SimpleNamespace(tensor_parallel_size=1),
                                   compilation_config=CompilationConfig(mode=CompilationMode.VLLM_COMPILE))
    assert not vllm_fusion.install(single)
    assert vllm_fusion.PRE_PASS_KEY not in single.compilation_config.inductor_compile_config
