"""The pipeline a vLLM 0.33.0 user runs, with autosymm installed: a model block written with vLLM's
own layers, compiled through vLLM's own ``support_torch_compile`` and ``VllmBackend``, on 2 gloo ranks.

Each rank answers only the device probes vLLM asks (NVML's GPU count for its CUDA platform plugin,
``CudaPlatform.get_device_capability`` / ``device_count``, ``has_flashinfer``), then lets vLLM's
loader resolve the platform from the installed entry points (``vllm.platform_plugins`` ->
``autosymm.integrations.vllm_plugin:platform_plugin``; ``VLLM_PLUGINS=""`` leaves it out). The
tensors are CPU tensors, so vLLM registers its Python ops for the CPU dispatch key and its group
coordinators take the CPU device; CUDA graphs are off (``cudagraph_mode`` NONE), the CUDA-only
symm_mem and pynccl communicators too (vLLM's own switches); vLLM's embedding takes its non-CUDA
lookup. FlashInfer is the recorded stand-in of tests/stacks/stand_ins (stubs.STAND_INS), so
vLLM's own ``AllReduceFusionPass`` builds its workspace and patterns and registers its real
``flashinfer_trtllm_fused_allreduce_norm`` op.

The config is ``VllmConfig`` at its defaults (O2, VLLM_COMPILE, ``fuse_allreduce_rms`` on) with TP
2 and a model registered in-process, ``compute_hash()`` called on both ranks (vLLM's AOT compile
and ``VllmBackend`` key their caches by it). Two blocks cover vLLM's 8 all-reduce + norm patterns:
block "A" on sm90 (RMSNorm and GemmaRMSNorm with and without the residual add, static FP8 in
``QuantFP8``'s native form with and without it), block "B" with ``+quant_fp8`` on sm100 (static
FP8 through the custom op, NVFP4 through ``scaled_fp4_quant``, each with and without the add).
Each compiles with the plugin (AOT compile on, its artifact loaded back from disk, then AOT off)
and without it; the tests count autosymm's rewrites and vLLM's, and compare the outputs: where no
row decides (untuned, gloo), the block with the plugin calls vLLM's FlashInfer op exactly as
vLLM's own fusion does and its outputs are bit-equal to the plugin-off block's; with a tuned row
forced (tests/_adapter_decisions.py) autosymm's fused op runs instead, no FlashInfer call, its
outputs within the tolerance of autosymm's formula (fp32 sum rounded once, docs/EPILOGUE.md).
"""

from __future__ import annotations

import functools
import json
import os
import types
import zlib
from pathlib import Path

import pytest
import stubs
import torch
from _adapter_decisions import adapter_decisions
from _gloo import run_gloo

from autosymm.integrations import vllm_plugin

stubs.require_real_sources()

HIDDEN, INTER, VOCAB, TOKENS, EPS = 64, 128, 256, 5, 1e-6
IDS = [3, 77, 130, 200, 255]
_NVML = types.SimpleNamespace(nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlDeviceGetCount=lambda: 2)
#: block -> (the patterns autosymm's pass rewrites, the node's device capability, +quant_fp8)
BLOCKS = {
    "A": ({"rms": 1, "add_rms": 1, "add_gemma": 1, "gemma": 1, "add_rms_fp8": 1, "rms_fp8": 1}, (9, 0), False),
    "B": ({"rms_fp8": 1, "add_rms_fp8": 1, "rms_nvfp4": 1, "add_rms_nvfp4": 1}, (10, 0), True),
}


def _fake_node(capability: tuple[int, int]) -> None:
    """The device probes vLLM asks, answered as a node of 2 GPUs of ``capability``."""
    stubs.use_flashinfer_stand_in()
    import vllm.utils.import_utils

    vllm.utils.import_utils.import_pynvml = lambda: _NVML  # before anything resolves vLLM's platform
    from vllm.platforms.cuda import CudaPlatform
    from vllm.platforms.interface import DeviceCapability

    # the rank's tensors are CPU tensors: vLLM registers its Python ops (vllm.all_reduce, its FlashInfer
    # call) for the platform's dispatch key (utils/torch_utils.py:1028-1037), which it imports after this
    CudaPlatform.dispatch_key = "CPU"
    CudaPlatform.get_device_capability = classmethod(lambda cls, device_id=0: DeviceCapability(*capability))
    CudaPlatform.device_count = classmethod(lambda cls: 2)
    import vllm.utils.flashinfer

    vllm.utils.flashinfer.has_flashinfer = lambda: True


def _inductor_caches_on() -> None:
    """Inductor's FX graph and AOTAutograd caches on, as vLLM runs (it saves what they serialise).
    tests/conftest.py forces them off through the environment, which torch reads once when its
    config module loads (before the ranks fork), so the force itself is lifted here."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    for module, name in ((inductor_config, "fx_graph_cache"), (functorch_config, "enable_autograd_cache")):
        module._config[name].env_value_force = True


@functools.cache
def _classes():
    """(blocks by name, the architecture ModelConfig inspects), built after the probes are answered."""
    import torch.nn as nn
    from vllm._custom_ops import scaled_fp4_quant
    from vllm.compilation.decorators import support_torch_compile
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm
    from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    class Mlp(nn.Module):
        def __init__(self, prefix):
            super().__init__()
            self.up = ColumnParallelLinear(HIDDEN, INTER, bias=False, gather_output=False, prefix=f"{prefix}.up")
            self.down = RowParallelLinear(INTER, HIDDEN, bias=False, input_is_parallel=True, prefix=f"{prefix}.down")

        def forward(self, x):
            return self.down(self.up(x)[0])[0]  # RowParallelLinear's all-reduce

    class Block(nn.Module):
        norms = ()

        def __init__(self, *, vllm_config, prefix=""):
            super().__init__()
            self.embed = VocabParallelEmbedding(VOCAB, HIDDEN, prefix=f"{prefix}.embed")  # its all-reduce
            self.embed.use_fused_embedding = False  # vLLM's CUDA lookup kernel: the layer's other branch
            self.mlps = nn.ModuleList([Mlp(f"{prefix}.mlp{i}") for i in range(5)])
            self.norm = nn.ModuleList([norm(HIDDEN, eps=EPS) for norm in self.norms])
            self.quant = QuantFP8(True, GroupShape.PER_TENSOR)
            self.register_buffer("scale", torch.tensor([0.02], dtype=torch.float32))
            self.register_buffer("global_scale", torch.tensor([448.0 * 6.0 / 4.0], dtype=torch.float32))

        def fp8(self, x):
            """(QuantFP8 static per-tensor of x, its dequantized value: what the next layer reads)."""
            q, _ = self.quant(x, self.scale)
            return q, (q.float() * self.scale).to(x.dtype)

    @support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": 0})
    class BlockA(Block):
        """rms, add_rms, add_gemma, gemma, add_rms_fp8, rms_fp8 (QuantFP8's native form)."""

        norms = (RMSNorm, RMSNorm, GemmaRMSNorm, GemmaRMSNorm, RMSNorm, RMSNorm, RMSNorm)

        def forward(self, input_ids: torch.Tensor, positions: torch.Tensor):
            h = self.embed(input_ids)
            x = self.norm[0](h)  # rms; the sum is read again as the residual
            x, residual = self.norm[1](self.mlps[0](x), h)  # add_rms
            x, residual = self.norm[2](self.mlps[1](x), residual)  # add_gemma
            y = self.mlps[2](x)
            x = self.norm[3](y)  # gemma
            x, residual = self.norm[4](self.mlps[3](x), y)  # add_rms_fp8 (vLLM's needs the residual read)
            q1, x = self.fp8(x)
            y = self.mlps[4](x)
            q2, x = self.fp8(self.norm[5](y))  # rms_fp8
            out, residual = self.norm[6](x + y, residual)  # a norm without an all-reduce: vLLM's, left alone
            return out, residual, q1, q2

    @support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": 0})
    class BlockB(Block):
        """rms_fp8, add_rms_fp8 (the +quant_fp8 custom op), rms_nvfp4, add_rms_nvfp4."""

        norms = (RMSNorm, RMSNorm, RMSNorm, RMSNorm)

        def forward(self, input_ids: torch.Tensor, positions: torch.Tensor):
            h = self.embed(input_ids)
            q1, x = self.fp8(self.norm[0](h))  # rms_fp8
            x, residual = self.norm[1](self.mlps[0](x), h)  # add_rms_fp8
            q2, x = self.fp8(x)
            y = self.mlps[1](x)
            p1, s1 = scaled_fp4_quant(self.norm[2](y), self.global_scale)  # rms_nvfp4
            x, residual = self.norm[3](self.mlps[2](y), residual)  # add_rms_nvfp4
            p2, s2 = scaled_fp4_quant(x, self.global_scale)
            return residual, q1, q2, p1, s1, p2, s2

    class AutosymmBlockForCausalLM(nn.Module):
        """The architecture vLLM's ModelConfig inspects, registered in-process."""

        def __init__(self, *, vllm_config, prefix=""):
            super().__init__()

        def embed_input_ids(self, input_ids):
            return input_ids

        def compute_logits(self, hidden_states):
            return hidden_states

        def forward(self, input_ids, positions):
            return input_ids

    return {"A": BlockA, "B": BlockB}, AutosymmBlockForCausalLM


def _config(model_dir: Path, quant_fp8: bool):
    """vLLM's config at its defaults with TP 2 (the device: the CPU, where the tensors and vLLM's
    fusion patterns are; CUDA graphs off; ``+quant_fp8`` for block B)."""
    from vllm.config import CompilationConfig, CUDAGraphMode, DeviceConfig, ModelConfig, ParallelConfig, VllmConfig
    from vllm.model_executor.models.registry import ModelRegistry

    ModelRegistry.register_model("AutosymmBlockForCausalLM", _classes()[1])
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(dict(
        architectures=["AutosymmBlockForCausalLM"], model_type="llama", hidden_size=HIDDEN, intermediate_size=INTER,
        num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=1, vocab_size=VOCAB,
        max_position_embeddings=256, rms_norm_eps=EPS, torch_dtype="bfloat16")))
    model = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16")
    compilation = CompilationConfig(cudagraph_mode=CUDAGraphMode.NONE, custom_ops=["+quant_fp8"] if quant_fp8 else [])
    return VllmConfig(model_config=model, parallel_config=ParallelConfig(tensor_parallel_size=2),
                      compilation_config=compilation, device_config=DeviceConfig(device="cpu"))


def _parallel_state(rank: int, world_size: int, config) -> None:
    """vLLM's world and TP groups over gloo (vLLM's own initialisation), on the CPU device."""
    import vllm.platforms
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state

    platform = type(vllm.platforms.current_platform)
    real = platform.is_cuda_alike
    platform.is_cuda_alike = lambda self: False  # GroupCoordinator's device: the CPU, where the tensors are
    try:
        with set_current_vllm_config(config):
            parallel_state.init_distributed_environment(world_size, rank, "env://", rank, "gloo")
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size, backend="gloo")
    finally:
        platform.is_cuda_alike = real


def _weights(model, rank: int) -> None:
    """Seeded weights: the sharded ones per rank, the norms' the same on both ranks."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            sharded = hasattr(param, "output_dim") or hasattr(param, "input_dim")
            gen = torch.Generator().manual_seed(zlib.crc32(name.encode()) + (rank if sharded else 0))
            values = torch.randn(param.shape, generator=gen)
            param.copy_(values * 0.1 + 1.0 if name.startswith("norm.") else values * 0.3)


class _Counts:
    """vLLM's AllReduceFusionPass rewrites (observed: its own __call__ runs unchanged) and FlashInfer calls."""

    def __init__(self) -> None:
        from vllm.compilation.passes.fusion.allreduce_rms_fusion import AllReduceFusionPass

        self.vllm: list[int] = []
        real = AllReduceFusionPass.__call__

        def observed(pass_, graph):
            real(pass_, graph)
            self.vllm.append(pass_.matched_count)

        AllReduceFusionPass.__call__ = observed


class _Served:
    """Within: autosymm's fused calls in the FlashInfer form (vllm_flashinfer._autosymm) recorded,
    their inputs and the buffers they wrote; :meth:`check` runs vLLM's op (the FlashInfer stand-in,
    collective: every rank checks its calls in order) on the same inputs and compares."""

    def __enter__(self):
        from autosymm.integrations import vllm_flashinfer

        self.module, self.real, self.calls = vllm_flashinfer, vllm_flashinfer._autosymm, []

        def recorded(adapter, call, quant):
            before = dict(x=call.allreduce_in.clone(), residual=call.residual.clone())
            self.real(adapter, call, quant)
            wrote = dict(x=call.allreduce_in, residual=call.residual, norm_out=call.norm_out,
                         quant_out=call.quant_out, scale_out=call.scale_out)
            self.calls.append((before, {k: v.clone() for k, v in wrote.items() if v is not None}, call.rms_gamma,
                               call.rms_eps, quant, call.weight_bias == 1.0, call.scale_factor))

        self.module._autosymm = recorded
        return self

    def __exit__(self, *exc):
        self.module._autosymm = self.real

    def check(self) -> list:
        """Per call: (quant, max ulps off of each bf16 output, the share of quantized bytes equal)."""
        from vllm.compilation.passes.fusion import allreduce_rms_fusion as fusion

        codes = fusion.flashinfer_comm.AllReduceFusionPattern
        pattern = {None: codes.kARResidualRMSNorm, "fp8": codes.kARResidualRMSNormFP8Quant,
                   "nvfp4": codes.kARResidualRMSNormFP4Quant}
        report = []
        for before, wrote, weight, eps, quant, gemma, scale in self.calls:
            want = {k: torch.empty_like(v) for k, v in wrote.items()}
            want["x"], want["residual"] = before["x"].clone(), before["residual"].clone()
            torch.ops.vllm.flashinfer_trtllm_fused_allreduce_norm.default(
                allreduce_in=want["x"], residual=want["residual"], rms_gamma=weight, rms_eps=eps, world_size=2,
                launch_with_pdl=True, fp32_acc=True, max_token_num=TOKENS, pattern_code=pattern[quant],
                norm_out=want.get("norm_out"), quant_out=want.get("quant_out"), scale_out=want.get("scale_out"),
                scale_factor=scale, weight_bias=1.0 if gemma else 0.0)
            # where the graph reads FlashInfer's outputs (vllm_flashinfer's module docstring)
            readable = (["quant_out", "scale_out"] if quant else ["x" if "norm_out" not in wrote else "norm_out"]) + \
                ["residual" if "norm_out" not in wrote else "x"]
            readable = [k for k in readable if k in wrote]
            ulps = {k: _ulps(wrote[k], want[k]) for k in readable if wrote[k].dtype == torch.bfloat16}
            same = {k: float((wrote[k].view(torch.uint8) == want[k].view(torch.uint8)).float().mean())
                    for k in readable if wrote[k].dtype != torch.bfloat16}
            report.append((quant, ulps, same))
        return report


def _ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest |got - want| of a row, in bf16 ulps at the row's RMS (the scale both formulas round
    at: a sum cancelling to a small value keeps the rounding error of its larger terms)."""
    rms = want.float().pow(2).mean(-1, keepdim=True).sqrt().clamp_min(torch.finfo(torch.bfloat16).tiny)
    _, exponent = torch.frexp(rms)
    ulp = torch.ldexp(torch.ones_like(rms), exponent - 8)
    return float(((got.float() - want.float()).abs() / ulp).max())


_COPIES = (torch.ops.aten.copy_.default, torch.ops.aten.clone.default, torch.ops.aten._to_copy.default)


def _copies_per_call(adapter) -> dict:
    """The copies (aten copy_ / clone / _to_copy) each untuned call of autosymm's run-time ops makes
    outside the stack's own ops (a dispatch mode sees a custom op as one call, not its insides), and
    whether vLLM's FlashInfer op got the caller's own buffers."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from vllm.compilation.passes.fusion import allreduce_rms_fusion as fusion

    import flashinfer.comm
    from autosymm.integrations import vllm_flashinfer, vllm_ops

    class Count(TorchDispatchMode):
        copies = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.copies += func in _COPIES
            return func(*args, **(kwargs or {}))

    seen = []
    real = flashinfer.comm.allreduce_fusion
    flashinfer.comm.allreduce_fusion = lambda **kw: seen.append((kw["input"], kw["residual_in"], kw["norm_out"])) or \
        real(**kw)
    gen = torch.Generator().manual_seed(5)
    x, residual, weight = (torch.randn(TOKENS, HIDDEN, generator=gen).bfloat16() for _ in range(3))
    params = dict(world_size=2, launch_with_pdl=True, fp32_acc=True, max_token_num=64,
                  pattern_code=fusion.flashinfer_comm.AllReduceFusionPattern.kARResidualRMSNorm, group_name="tp:0")
    out = {}
    try:
        for form in ("residual", "no_residual"):
            buffers = dict(allreduce_in=x.clone(), residual=residual.clone() if form == "residual" else
                           torch.zeros_like(x), norm_out=None if form == "residual" else torch.empty_like(x))
            with Count() as count:
                vllm_flashinfer.vllm_fused_allreduce_norm(rms_gamma=weight, rms_eps=EPS, **params, **buffers)
            given = seen.pop()
            same = [a is b or a.data_ptr() == b.data_ptr() for a, b in zip(given, buffers.values()) if b is not None]
            out[f"flashinfer {form}"] = (count.copies, all(same))
        for with_residual in (True, False):
            with Count() as count:
                vllm_ops.vllm_all_reduce_rmsnorm._init_fn(x, residual if with_residual else None, weight, EPS, "tp:0")
            out[f"unfused {'residual' if with_residual else 'no_residual'}"] = (count.copies, True)
    finally:
        flashinfer.comm.allreduce_fusion = real
    return out


def _forward(model, config) -> list:
    """The block's outputs as (dtype, shape, bytes): plain data back through the result queue."""
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    with torch.no_grad(), set_current_vllm_config(config), set_forward_context(None, config):
        got = model(torch.tensor(IDS[:TOKENS]), torch.arange(TOKENS))
    return [(t.dtype, tuple(t.shape), t.contiguous().view(torch.uint8).numpy().tobytes()) for t in got]


def _tensor(packed) -> torch.Tensor:
    dtype, shape, raw = packed
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).view(shape)


def _compile_and_run(rank, world_size, tmp: str, block: str, plugin: bool) -> dict:
    """One rank: the block compiled and run (see the module docstring); what the test compares."""
    _inductor_caches_on()
    _, capability, quant_fp8 = BLOCKS[block]
    _fake_node(capability)
    import flashinfer.comm
    import torch._dynamo
    import vllm.platforms
    from vllm.compilation.counter import compilation_counter
    from vllm.config import set_current_vllm_config
    from vllm.distributed import get_tp_group
    from vllm.utils.torch_utils import set_default_torch_dtype

    from autosymm.integrations import vllm_fusion

    counts = _Counts()
    config = _config(Path(tmp) / f"model-{block}", quant_fp8)
    out = dict(platform=type(vllm.platforms.current_platform).__name__, hashes=[config.compute_hash()],
               worker=config.parallel_config.worker_cls)
    _parallel_state(rank, world_size, config)
    adapter = getattr(get_tp_group().device_communicator, "autosymm", None)

    def build():
        torch._dynamo.reset()
        with set_current_vllm_config(config), set_default_torch_dtype(torch.bfloat16):
            model = _classes()[0][block](vllm_config=config)
        _weights(model, rank)
        return model

    served = _Served()

    def run(name, model, decisions=None):
        flashinfer.comm.CALLS.clear()
        before = vllm_fusion.PASS.rewrites
        if decisions is None:
            got = _forward(model, config)
        else:
            with decisions:
                got = _forward(model, config)
        out[name] = dict(got=got, calls=list(flashinfer.comm.CALLS), rewrites=vllm_fusion.PASS.rewrites - before,
                         patterns=dict(vllm_fusion.PASS.patterns), vllm=list(counts.vllm))
        vllm_fusion.PASS.patterns.clear()
        counts.vllm.clear()
        return model

    os.environ["VLLM_USE_AOT_COMPILE"] = "1"  # vLLM's default on torch >= 2.10
    model = run("aot", build())
    if plugin:
        with served:
            run("autosymm", model, adapter_decisions(backend="triton_fused_one_shot"))
        out["served"] = served.check()
        out["copies"] = _copies_per_call(adapter)
        saved = compilation_counter.num_aot_artifacts_saved
        loaded = run("aot_loaded", build())  # the artifact vLLM saved (pickled), loaded back (unpickled)
        out["saved_and_loaded"] = (saved, loaded.was_aot_compile_fn_loaded_from_disk)
        # VllmBackend alone: a fresh config and caches (a compiled artifact loaded back computes
        # other values on this CPU emulation, with or without the plugin: see aot_loaded)
        os.environ.update(VLLM_USE_AOT_COMPILE="0", TORCHINDUCTOR_CACHE_DIR=str(Path(tmp) / f"inductor-{rank}"),
                          VLLM_CACHE_ROOT=str(Path(tmp) / f"vllm-no-aot-{rank}"))
        config = _config(Path(tmp) / f"model-{block}", quant_fp8)
        run("no_aot", build())
        out["hashes"].append(config.compute_hash())
    return out


def _run_block(tmp_path, block: str, plugin: bool) -> dict:
    env = {"AUTOSYMM_DB": str(tmp_path / "none.sqlite"), "VLLM_DISABLE_PYNCCL": "1",
           "VLLM_ALLREDUCE_USE_SYMM_MEM": "0", "VLLM_CACHE_ROOT": str(tmp_path / f"vllm-{plugin}"),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / f"inductor-{plugin}")}
    if not plugin:
        env["VLLM_PLUGINS"] = ""  # vLLM's allow-list without autosymm
    return run_gloo(_compile_and_run, 2, str(tmp_path), block, plugin, env={"all": env}, deadline_s=560)


@pytest.fixture(scope="module", params=sorted(BLOCKS))
def runs(request, tmp_path_factory):
    """(block, (plugin on, plugin off)): one compile-and-run of each per block, shared by the tests."""
    tmp_path = tmp_path_factory.mktemp(f"block{request.param}")
    return request.param, (_run_block(tmp_path, request.param, True), _run_block(tmp_path, request.param, False))


def test_vllm_compiles_with_autosymm_and_its_config_hash_is_a_stable_str(runs):
    """The crash of issue #38: vLLM's compute_hash() (JSON) of a config holding autosymm's pass, on
    the AOT path and VllmBackend's; the same on both ranks and before and after compiling."""
    block, (on, off) = runs
    for rank in (0, 1):
        # vLLM's own CUDA platform class is NvmlCudaPlatform where NVML answers (platforms/cuda.py)
        assert on[rank]["platform"] == "AutosymmCudaPlatform" and off[rank]["platform"] == "NvmlCudaPlatform"
        # vLLM's own worker, as vLLM chose it, becomes autosymm's (its warm-up runs inside warm-up tuning)
        assert (on[rank]["worker"], off[rank]["worker"]) == (vllm_plugin.WORKER_QUALNAME, vllm_plugin.VLLM_WORKER)
        assert all(isinstance(h, str) and h for h in on[rank]["hashes"] + off[rank]["hashes"])
    assert len({h for rank in (0, 1) for h in on[rank]["hashes"]}) == 1
    assert off[0]["hashes"] == off[1]["hashes"] != on[0]["hashes"][:1]  # the pass is part of the hash
    assert on[0]["saved_and_loaded"] == on[1]["saved_and_loaded"] == (1, True)  # vLLM pickled and unpickled it


def test_autosymms_pass_takes_every_pattern_before_vllms(runs):
    block, (on, off) = runs
    patterns = BLOCKS[block][0]
    n = sum(patterns.values())
    for rank in (0, 1):
        for phase in ("aot", "no_aot"):  # each compile: autosymm's pass first, vLLM's finds nothing left
            assert on[rank][phase]["patterns"] == patterns and on[rank][phase]["rewrites"] == n, phase
            assert on[rank][phase]["vllm"] == [0], phase
        assert on[rank]["aot_loaded"]["rewrites"] == 0  # loaded, not compiled
        assert off[rank]["aot"]["rewrites"] == 0 and off[rank]["aot"]["vllm"] == [n]  # without it: vLLM's pass


def test_untuned_calls_run_vllms_flashinfer_call_bit_equal_to_vllms_own_fusion(runs):
    """Where no row decides, autosymm's op calls vLLM's FlashInfer op with the arguments vLLM's own
    replacement passes (the stand-in records them), so every output equals the plugin-off block's."""
    block, (on, off) = runs
    n = sum(BLOCKS[block][0].values())
    for rank in (0, 1):
        want = off[rank]["aot"]
        assert len(want["calls"]) == n
        for phase in ("aot", "no_aot"):
            got = on[rank][phase]
            assert got["calls"] == want["calls"], phase
            assert got["got"] == want["got"], phase  # every output, byte for byte
        # the loaded artifact calls vLLM's op through autosymm's alike (its values: vLLM's own
        # loaded artifact, with or without the plugin, computes others on this CPU emulation)
        assert on[rank]["aot_loaded"]["calls"] == want["calls"]


def test_a_tuned_row_runs_autosymms_fused_op_within_its_tolerance(runs):
    """A tuned row (forced): autosymm's fused op serves every pattern, no FlashInfer call. Each
    call's outputs, against vLLM's op (its formulas) on the same inputs: the norm and the sum within
    4 bf16 ulps at the row's RMS (autosymm rounds the fp32 sum once; vLLM rounds the ranks' bf16 sum,
    whose terms can be a few times the row's RMS, and then the add: docs/INTEGRATIONS.md), the
    quantized bytes (FP8 values, NVFP4 codes and block scales) equal but where that rounding moves
    one across a quantization boundary."""
    block, (on, off) = runs
    patterns = BLOCKS[block][0]
    for rank in (0, 1):
        got, want = on[rank]["autosymm"], off[rank]["aot"]
        assert got["calls"] == [] and len(on[rank]["served"]) == sum(patterns.values())
        for g, w in zip(got["got"], want["got"], strict=True):
            assert g[:2] == w[:2] and not _tensor(g).view(torch.uint8).equal(_tensor(w).view(torch.uint8)[:0])
        for quant, ulps, same in on[rank]["served"]:
            assert ulps and max(ulps.values()) <= 4.0, (quant, ulps)
            assert all(share >= 0.9 for share in same.values()), (quant, same)


def test_untuned_calls_copy_nothing_the_stack_does_not(runs):
    """Per untuned call, on CPU: autosymm's FlashInfer-form op hands vLLM's op the caller's own buffers
    (the graph's, as vLLM's replacement does) and copies nothing; the unfused form returns vLLM's
    ops' new tensors as they are."""
    block, (on, _) = runs
    for rank in (0, 1):
        assert on[rank]["copies"] == {"flashinfer residual": (0, True), "flashinfer no_residual": (0, True),
                                      "unfused residual": (0, True), "unfused no_residual": (0, True)}
