"""The one list of what tests/stacks does not take from the real vLLM 0.33.0 / SGLang 0.5.23 sources.

:data:`STUBS`: compiled extensions that cannot load on a CPU (built for CUDA and another torch),
each made an empty importable module by name, with the reason. :data:`STAND_INS`: modules that
cannot import here at all and that a test replaces with a recorded fake (where and why).
Everything else the tests import is the real code, unpacked by scripts/test_real_stacks.sh into
``$AUTOSYMM_STACKS_CACHE/src`` (default ``~/.cache/autosymm-stacks``), with the pure-Python
packages it needs in ``$AUTOSYMM_STACKS_CACHE/deps``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from pathlib import Path

#: module name -> why it is an empty stub here.
STUBS: dict[str, str] = {
    "vllm._C_stable_libtorch": "vLLM's CUDA kernels (a CUDA .so for torch 2.14); vllm/platforms/cuda.py:23 "
                               "imports it unconditionally; declares C_OPS' schemas",
    "vllm._moe_C_stable_libtorch": "vLLM's CUDA MoE kernels (.so); imported by the CUDA platform's "
                                   "import_kernels",
    "vllm.vllm_flash_attn._vllm_fa2_C": "vLLM's FlashAttention-2 kernels (.so); on a CUDA platform "
                                        "v1/attention/backends/fa_utils.py:22 imports vllm_flash_attn, which "
                                        "needs one of its two extensions (vllm_flash_attn/__init__.py:33), and "
                                        "vLLM's linear layers reach it through their imports",
}

#: The ``torch.ops._C`` operators vLLM's Python names at import time (pattern tables, matchers),
#: which ``vllm._C_stable_libtorch`` registers: declared here with the schemas of vLLM's
#: csrc/torch_bindings.cpp as the 0.33.0 wheel's ``vllm/_C_stable_libtorch.abi3.so`` carries them
#: (test_stubs.py compares), a no-op fake (they write their ``Tensor!`` outputs; except
#: :data:`VLLM_FAKES`) and a CPU kernel that refuses. NVFP4's ``scaled_fp4_quant`` is declared, as
#: on the CUDA wheel (vLLM probes it with ``hasattr``: allreduce_rms_fusion.py:99), and so are the
#: per-group FP8 kernels (probed the same way, rms_quant_fusion.py:163, :201; RMSNormQuantFusionPass
#: asserts them with ``+quant_fp8`` on sm100, :818).
C_OPS: dict[str, str] = {
    "rms_norm": "rms_norm(Tensor! result, Tensor input, Tensor? weight, float epsilon) -> ()",
    "fused_add_rms_norm": "fused_add_rms_norm(Tensor! input, Tensor! residual, Tensor? weight, float epsilon) -> ()",
    "rms_norm_static_fp8_quant": "rms_norm_static_fp8_quant(Tensor! result, Tensor input, Tensor weight, "
                                 "Tensor scale, float epsilon) -> ()",
    "fused_add_rms_norm_static_fp8_quant": "fused_add_rms_norm_static_fp8_quant(Tensor! result, Tensor input, "
                                           "Tensor! residual, Tensor weight, Tensor scale, float epsilon) -> ()",
    "rms_norm_dynamic_per_token_quant": "rms_norm_dynamic_per_token_quant(Tensor! result, Tensor input, "
                                        "Tensor weight, Tensor! scale, float epsilon, Tensor? scale_ub, "
                                        "Tensor!? residual) -> ()",
    "static_scaled_fp8_quant": "static_scaled_fp8_quant(Tensor! result, Tensor input, Tensor scale, "
                               "int[]? group_shape=None) -> ()",
    "scaled_fp4_quant": "scaled_fp4_quant(Tensor input, Tensor input_scale, bool is_sf_swizzled_layout) "
                        "-> (Tensor, Tensor)",
    "scaled_fp4_quant.out": "scaled_fp4_quant.out(Tensor input, Tensor input_scale, bool is_sf_swizzled_layout, "
                            "*, Tensor(a!) output, Tensor(b!) output_scale) -> ()",
    "per_token_group_fp8_quant": "per_token_group_fp8_quant(Tensor input, Tensor! output_q, Tensor! output_s, "
                                 "int group_size, float eps, float fp8_min, float fp8_max, bool scale_ue8m0, "
                                 "bool dummy_is_scale_transposed, bool dummy_is_tma_aligned) -> ()",
    "rms_norm_per_block_quant": "rms_norm_per_block_quant(Tensor! result, Tensor input, Tensor weight, Tensor! scale, "
                                "float epsilon, Tensor? scale_ub, Tensor!? residual, int group_size, "
                                "bool is_scale_transposed) -> ()",
    "dynamic_scaled_fp8_quant": "dynamic_scaled_fp8_quant(Tensor! result, Tensor input, Tensor! scale) -> ()",
    "dynamic_per_token_scaled_fp8_quant": "dynamic_per_token_scaled_fp8_quant(Tensor! result, Tensor input, "
                                          "Tensor! scale, Tensor? scale_ub) -> ()",
    "silu_and_mul": "silu_and_mul(Tensor! result, Tensor input) -> ()",
    "silu_and_mul_quant": "silu_and_mul_quant(Tensor! result, Tensor input, Tensor scale) -> ()",
    # named unguarded on a CUDA platform (compilation/passes/fusion/act_quant_fusion.py:42-44)
    "silu_and_mul_per_block_quant": "silu_and_mul_per_block_quant(Tensor! out, Tensor input, Tensor! scales, "
                                    "int group_size, Tensor? scale_ub=None, bool is_scale_transposed=False) -> ()",
    "rotary_embedding": "rotary_embedding(Tensor positions, Tensor! query, Tensor!? key, int head_size, "
                        "Tensor cos_sin_cache, bool is_neox, int rope_dim_offset=0, bool inverse=False) -> ()",
    "fused_qk_norm_rope": "fused_qk_norm_rope(Tensor! qkv, int num_heads_q, int num_heads_k, int num_heads_v, "
                          "int head_dim, float eps, Tensor q_weight, Tensor k_weight, Tensor cos_sin_cache, "
                          "bool is_neox, Tensor position_ids, int forced_token_heads_per_warp=-1) -> ()",
}
#: The ``torch.ops._C`` queries vLLM's Python asks at import on a CUDA platform (which kernels the
#: build has: ``model_executor/layers/quantization/utils/w8a8_utils.py:41``, ``_custom_ops.py:750-781``),
#: declared with the wheel's schemas (test_stubs.py compares) and answered False: no CUTLASS kernel
#: exists here, so vLLM's layers take their other paths, as on a build without them.
C_QUERIES: dict[str, str] = {
    "cutlass_scaled_mm_supports_fp8": "cutlass_scaled_mm_supports_fp8(int cuda_device_capability) -> bool",
    "cutlass_scaled_mm_supports_block_fp8": "cutlass_scaled_mm_supports_block_fp8(int cuda_device_capability) -> bool",
    "cutlass_scaled_mm_supports_fp4": "cutlass_scaled_mm_supports_fp4(int cuda_device_capability) -> bool",
}
_C_LIB: list = []  # the torch.library holding C_OPS, alive for the process

#: module / op / class name -> the recorded fake that stands in for it, and why the real one cannot serve.
STAND_INS: dict[str, str] = {
    "flashinfer": (
        "tests/stacks/stand_ins/flashinfer (test_vllm_compile.py): FlashInfer needs CUDA. Put on sys.path by the "
        "ranks that compile through vLLM (use_flashinfer_stand_in), so vLLM's own fusion module registers its "
        "real flashinfer_trtllm_fused_allreduce_norm op (compilation/passes/fusion/allreduce_rms_fusion.py:"
        "100-320) and its AllReduceFusionPass builds its real workspace and patterns"),
    "flashinfer.comm": (
        "the stand-in's allreduce_fusion records each call and writes what vLLM's unfused ops compute for it "
        "(its all-reduce, vllm_ir.fused_add_rms_norm, QuantFP8's static FP8, autosymm.epilogue.nvfp4_quantize "
        "for NVFP4); its workspaces have no multicast, so vLLM's 'auto' backend takes 'trtllm'"),
}
STAND_IN_DIR = Path(__file__).resolve().parent / "stand_ins"


def cache_dir() -> Path:
    """Where scripts/test_real_stacks.sh keeps the wheels, ``src/`` and ``deps/``."""
    return Path(os.environ.get("AUTOSYMM_STACKS_CACHE", Path.home() / ".cache" / "autosymm-stacks"))


def missing_reason() -> str | None:
    """Why the real sources cannot be used here, or None when they can."""
    src = cache_dir() / "src"
    for name in ("vllm", "sglang"):
        if not (src / name / "__init__.py").is_file():
            return (f"the real {name} sources are not under {src}: run bash scripts/test_real_stacks.sh "
                    "(it fetches and unpacks the wheels)")
    if not (cache_dir() / "deps").is_dir():
        return f"{cache_dir() / 'deps'} is missing: run bash scripts/test_real_stacks.sh"
    return None


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves every name in :data:`STUBS` as an empty module (``__stub_reason__`` says why)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname in STUBS:
            return importlib.machinery.ModuleSpec(fullname, self, origin="autosymm-stub")
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        module.__stub_reason__ = STUBS[module.__name__]
        if module.__name__ == "vllm._C_stable_libtorch":
            _declare_c_ops()


#: C_OPS whose fake vLLM's own Python registers (vllm/_custom_ops.py:90-100), so none is added here.
VLLM_FAKES = frozenset({"scaled_fp4_quant"})


def _declare_c_ops() -> None:
    """Declare :data:`C_OPS` in ``torch.ops._C`` (what the real extension's import registers)."""
    import torch

    if _C_LIB:
        return
    lib = torch.library.Library("_C", "FRAGMENT")
    _C_LIB.append(lib)
    for name, schema in C_OPS.items():
        lib.define(schema)
        lib.impl(name, _refuse(name), "CPU")
        if name not in VLLM_FAKES:
            torch.library.register_fake(f"_C::{name}", lambda *args, **kwargs: None, lib=lib)
    for name, schema in C_QUERIES.items():
        lib.define(schema)
        lib.impl(name, lambda *args: False, "CompositeExplicitAutograd")


def _refuse(name: str):
    def kernel(*args, **kwargs):
        raise NotImplementedError(f"torch.ops._C.{name} is vLLM's CUDA kernel, stubbed on this CPU (tests/stacks/stubs.py)")
    return kernel


def install() -> None:
    """Make the :data:`STUBS` importable (idempotent; before vLLM or SGLang imports)."""
    if not any(isinstance(finder, _StubFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _StubFinder())


def use_real_sources() -> None:
    """Put the unpacked sources and their packages first on ``sys.path`` and install the stubs
    (spawned ranks inherit ``sys.path``; they call this again for the stubs)."""
    for path in (cache_dir() / "deps", cache_dir() / "src"):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
    install()


def use_flashinfer_stand_in() -> None:
    """Make the ``flashinfer`` stand-in (:data:`STAND_INS`) importable, before vLLM looks for it."""
    if str(STAND_IN_DIR) not in sys.path:
        sys.path.insert(0, str(STAND_IN_DIR))


def require_real_sources() -> None:
    """Skip the calling test module, saying why, where the real sources are absent; else use them."""
    import pytest

    reason = missing_reason()
    if reason is not None:
        pytest.skip(reason, allow_module_level=True)
    use_real_sources()
