"""autosymm.integrations.fusion_pass on 2 gloo ranks: torch.compile (inductor) with the pass puts
``autosymm.all_reduce_rmsnorm`` into the compiled code of the example's decoder layer, an HF
Llama-style layer (autosymm.all_reduce, the manual RMSNorm, bf16, [batch, seq, hidden]) and a
torchtitan-style block (functional all-reduce, nn.RMSNorm), with the outputs of the unfused
layer; a sum read elsewhere is left alone."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from _gloo import run_gloo

ROOT = Path(__file__).resolve().parent.parent
FUSED = "torch.ops.autosymm.all_reduce_rmsnorm.default("  # a call in inductor's generated code


def _compile(fn, fusion):
    import torch._dynamo

    torch._dynamo.reset()
    return torch.compile(fn, dynamic=False, options={"post_grad_custom_post_pass": fusion})


def _run(fn, *args):
    """(outputs, the generated code) of a compiled fn."""
    from torch._inductor.utils import run_and_get_code

    out, code = run_and_get_code(fn, *args)
    return out, "\n".join(code)


def _example_layer(rank, world_size):
    sys.path.insert(0, str(ROOT / "examples"))
    from tp_decoder_layer import TINY, ShardWeights, TPDecoderLayer, compile_step, make_all_reduce

    weights = ShardWeights(TINY, rank, world_size, torch.float32, "cpu")
    layer = TPDecoderLayer(weights, make_all_reduce("autosymm"))
    x = torch.randn(3, TINY.hidden, generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        want = layer.decode(x)
        torch._dynamo.reset()
        got, code = _run(compile_step(layer.decode, cuda_graphs=False, dynamic=False), x)
        torch._dynamo.reset()
        plain, plain_code = _run(compile_step(layer.decode, fuse=False, cuda_graphs=False, dynamic=False), x)
    assert code.count(FUSED) == 1 and FUSED not in plain_code
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(plain, want, rtol=1e-5, atol=1e-5)


class _LlamaRMSNorm(torch.nn.Module):
    """HF transformers' LlamaRMSNorm, as its forward is written."""

    def __init__(self, hidden, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class _RowParallel(torch.nn.Module):
    """A row-parallel linear: this rank's partial product, summed by ``reduce``."""

    def __init__(self, n_in, n_out, reduce):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n_out, n_in) / n_in ** 0.5)
        self.reduce = reduce

    def forward(self, x):
        return self.reduce(torch.nn.functional.linear(x, self.weight))


class _LlamaStyleLayer(torch.nn.Module):
    """HF LlamaDecoderLayer's residual structure: norm -> attention (o_proj all-reduced) -> add,
    norm -> MLP (down_proj all-reduced) -> add; attention reduced to a projection pair."""

    def __init__(self, hidden, inter, reduce, norm):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = norm(hidden), norm(hidden)
        self.qkv = torch.nn.Linear(hidden, hidden, bias=False)
        self.o_proj = _RowParallel(hidden, hidden, reduce)
        self.gate_up = torch.nn.Linear(hidden, 2 * inter, bias=False)
        self.down_proj = _RowParallel(inter, hidden, reduce)

    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = self.o_proj(torch.tanh(self.qkv(self.input_layernorm(hidden_states))))
        hidden_states = residual + hidden_states
        residual = hidden_states
        gate, up = self.gate_up(self.post_attention_layernorm(hidden_states)).chunk(2, dim=-1)
        return residual + self.down_proj(torch.nn.functional.silu(gate) * up)


def _autosymm_reduce(t):
    import autosymm

    return autosymm.all_reduce(t)


def _hf_layer(rank, world_size):
    from autosymm.integrations.fusion_pass import AllReduceRMSNormPass

    torch.manual_seed(rank)  # each rank its own shard
    layer = _LlamaStyleLayer(64, 128, _autosymm_reduce, _LlamaRMSNorm).to(torch.bfloat16)
    for norm in (layer.input_layernorm, layer.post_attention_layernorm):
        torch.nn.init.normal_(norm.weight, 1.0, 0.1, generator=torch.Generator().manual_seed(5))
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(12)).to(torch.bfloat16)
    fusion = AllReduceRMSNormPass()
    with torch.no_grad():
        want = layer(x)
        got, code = _run(_compile(layer, fusion), x)
    assert fusion.rewrites == 1 and FUSED in code
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)  # bf16: the fused op rounds once


def _titan_block(rank, world_size):
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from autosymm.integrations.fusion_pass import AllReduceRMSNormPass

    def reduce(t):
        return funcol.all_reduce(t, "sum", dist.group.WORLD)

    torch.manual_seed(10 + rank)
    block = _LlamaStyleLayer(64, 96, reduce, lambda h: torch.nn.RMSNorm(h, eps=1e-5))
    for norm in (block.input_layernorm, block.post_attention_layernorm):
        torch.nn.init.normal_(norm.weight, 1.0, 0.1, generator=torch.Generator().manual_seed(6))
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(13))
    fusion = AllReduceRMSNormPass()
    with torch.no_grad():
        want = block(x)
        got, code = _run(_compile(block, fusion), x)
    assert fusion.rewrites == 1 and FUSED in code
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _sum_read_elsewhere(rank, world_size):
    """The sum is returned besides feeding the add: the graph stays as it was."""
    from autosymm.integrations.fusion_pass import AllReduceRMSNormPass

    weight = torch.ones(16)

    def fn(y, residual):
        s = _autosymm_reduce(y @ torch.eye(16))
        h = residual + s
        return torch.nn.functional.rms_norm(h, (16,), weight, 1e-6), s

    fusion = AllReduceRMSNormPass()
    y, residual = torch.ones(4, 16) * (rank + 1), torch.zeros(4, 16)
    (out, s), code = _run(_compile(fn, fusion), y, residual)
    assert fusion.rewrites == 0 and FUSED not in code
    assert torch.equal(s, torch.full((4, 16), float(sum(range(1, world_size + 1)))))


def _e4m3_steps(got, want) -> int:
    """The largest distance of two float8_e4m3fn tensors in representable steps."""
    def ordinal(t):
        bits = t.view(torch.uint8).to(torch.int32)
        return torch.where(bits & 0x80 != 0, -(bits & 0x7F), bits & 0x7F)

    return int((ordinal(got) - ordinal(want)).abs().max())


def _no_residual_and_fp8(rank, world_size):
    """The norm of the sum itself (no add), and a static FP8 quant after the norm, with or without
    the add: each one op (quant="fp8", scale), the e4m3 values within one step of the unfused graph's."""
    from autosymm.integrations.fusion_pass import AllReduceRMSNormPass

    weight = (torch.rand(16, generator=torch.Generator().manual_seed(3)) + 0.5).bfloat16()
    scale = torch.tensor(0.02)

    def plain(y):
        return torch.nn.functional.rms_norm(_autosymm_reduce(y * 1.0), (16,), weight, 1e-6)

    def fp8(y, residual):
        h = residual + _autosymm_reduce(y * 1.0)
        return (torch.nn.functional.rms_norm(h, (16,), weight, 1e-6) / scale).clamp(-448, 448).to(
            torch.float8_e4m3fn), h

    def fp8_no_residual(y):
        s = _autosymm_reduce(y * 1.0)
        return (torch.nn.functional.rms_norm(s, (16,), weight, 1e-6) / scale).clamp(min=-448.0, max=448.0).to(
            torch.float8_e4m3fn)

    gen = torch.Generator().manual_seed(20 + rank)
    y, residual = torch.randn(2, 3, 16, generator=gen).bfloat16(), torch.ones(2, 3, 16).bfloat16()
    with torch.no_grad():
        for fn, args in ((plain, (y,)), (fp8, (y, residual)), (fp8_no_residual, (y,))):
            want = fn(*(a.clone() for a in args))
            fusion = AllReduceRMSNormPass()
            got, code = _run(_compile(fn, fusion), *(a.clone() for a in args))
            assert fusion.rewrites == 1 and FUSED in code, fn.__name__
            call = next(line for line in code.splitlines() if FUSED in line)
            assert ("'fp8'" in call) == (fn is not plain) and (", None, " in call) == (fn is not fp8), call
            got, want = (got if isinstance(got, tuple) else (got,)), (want if isinstance(want, tuple) else (want,))
            for g, w in zip(got, want):
                if g.dtype == torch.float8_e4m3fn:
                    assert _e4m3_steps(g, w) <= 1, fn.__name__
                else:
                    torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2)


def _no_residual_sum_read_elsewhere(rank, world_size):
    """The sum returned beside its norm: the op without a residual does not return it, so the graph stays."""
    from autosymm.integrations.fusion_pass import AllReduceRMSNormPass

    weight = torch.ones(16)

    def fn(y):
        s = _autosymm_reduce(y * 1.0)
        return torch.nn.functional.rms_norm(s, (16,), weight, 1e-6), s

    fusion = AllReduceRMSNormPass()
    (_, s), code = _run(_compile(fn, fusion), torch.ones(4, 16) * (rank + 1))
    assert fusion.rewrites == 0 and FUSED not in code
    assert torch.equal(s, torch.full((4, 16), float(sum(range(1, world_size + 1)))))


def _body(rank, world_size):
    torch.set_num_threads(1)
    for case in (_example_layer, _hf_layer, _titan_block, _sum_read_elsewhere, _no_residual_and_fp8,
                 _no_residual_sum_read_elsewhere):
        case(rank, world_size)
    return True


@pytest.mark.slow
def test_fusion_pass_on_two_gloo_ranks(tmp_path):
    env = {"all": {"AUTOSYMM_DB": str(tmp_path / "absent.sqlite")}}
    assert run_gloo(_body, 2, env=env, deadline_s=540) == {0: True, 1: True}


def test_install_adds_the_pass_once(monkeypatch):
    import torch._inductor.config as inductor_config

    from autosymm.integrations import fusion_pass

    def other(graph):
        return None

    monkeypatch.setattr(inductor_config, "post_grad_custom_post_pass", other)
    installed = fusion_pass.install()
    assert inductor_config.post_grad_custom_post_pass == [other, installed]
    assert fusion_pass.install() is installed and inductor_config.post_grad_custom_post_pass == [other, installed]
    monkeypatch.setattr(inductor_config, "post_grad_custom_post_pass", None)
    assert inductor_config.post_grad_custom_post_pass is None
    fresh = fusion_pass.install()
    assert inductor_config.post_grad_custom_post_pass is fresh and isinstance(fresh.uuid(), str)
