"""Stand-ins of vLLM 0.33.0's ops that its compiled graphs hold around a TP layer's norm (vLLM
does not import without its GPU build): ``vllm::all_reduce(Tensor tensor, str group_name) ->
Tensor``, ``vllm_ir::fused_add_rms_norm(Tensor x, Tensor x_residual, Tensor? weight, float
epsilon, SymInt? variance_size=None) -> (Tensor, Tensor)`` and ``vllm_ir::rms_norm(Tensor x,
Tensor? weight, float epsilon, SymInt? variance_size=None) -> Tensor``, declared with vLLM's own
schemas, with the native formulas of ``vllm/ir/ops/layernorm.py`` (the all-reduce:
torch.distributed's on the default group). :func:`define_vllm_quant_stand_ins` adds vLLM's two
quant kernels its quantized fusion patterns name (:func:`chain` writes the steps)."""

from __future__ import annotations

import torch

EPS = 1e-6
_LIB = []  # the stand-in libraries, kept alive in the process that defined them
_QUANT_LIB = []  # the quant kernels' library (define_vllm_quant_stand_ins)
#: The stand-ins' calls, by name, in order (clear it before a step to see which ran).
CALLS: list[str] = []


def define_vllm_stand_ins() -> None:
    """vLLM's two ops, as vLLM 0.33.0 declares them (once per process)."""
    import torch.distributed as dist

    if _LIB:
        return
    vllm, ir = torch.library.Library("vllm", "FRAGMENT"), torch.library.Library("vllm_ir", "FRAGMENT")
    _LIB.extend((vllm, ir))
    vllm.define("all_reduce(Tensor tensor, str group_name) -> Tensor")
    ir.define("fused_add_rms_norm(Tensor x, Tensor x_residual, Tensor? weight, float epsilon, "
              "SymInt? variance_size=None) -> (Tensor, Tensor)")
    ir.define("rms_norm(Tensor x, Tensor? weight, float epsilon, SymInt? variance_size=None) -> Tensor")

    def all_reduce(tensor, group_name):
        CALLS.append("vllm.all_reduce")
        out = tensor.clone()
        dist.all_reduce(out)
        return out

    def fused_add_rms_norm(x, x_residual, weight, epsilon, variance_size=None):
        CALLS.append("vllm_ir.fused_add_rms_norm")
        s = x.float() + x_residual.float()
        return _rms_norm(s, weight, epsilon, variance_size).to(x.dtype), s.to(x.dtype)

    def rms_norm(x, weight, epsilon, variance_size=None):
        CALLS.append("vllm_ir.rms_norm")
        return _rms_norm(x.float(), weight, epsilon, variance_size).to(x.dtype)

    vllm.impl("all_reduce", all_reduce, "CompositeExplicitAutograd")
    ir.impl("rms_norm", rms_norm, "CompositeExplicitAutograd")
    torch.library.register_fake("vllm_ir::rms_norm", lambda x, w, e, v=None: torch.empty_like(x), lib=ir)
    ir.impl("fused_add_rms_norm", fused_add_rms_norm, "CompositeExplicitAutograd")
    torch.library.register_fake("vllm::all_reduce", lambda tensor, group_name: torch.empty_like(tensor), lib=vllm)
    torch.library.register_fake("vllm_ir::fused_add_rms_norm",
                                lambda x, r, w, e, v=None: (torch.empty_like(x), torch.empty_like(x)), lib=ir)


def _rms_norm(s, weight, epsilon, variance_size):
    """vLLM's native norm of the fp32 ``s``: normalized in fp32, cast to the weight's dtype, times it."""
    part = s if variance_size is None else s[..., :variance_size]
    normed = s * torch.rsqrt(part.pow(2).mean(-1, keepdim=True) + epsilon)
    return normed if weight is None else normed.to(weight.dtype) * weight


def layer(variance_size=None, reuse_sum=False):
    """A TP layer's tail as vLLM's graphs hold it: projection, vllm.all_reduce, the RMSNorm op."""

    def step(x, proj, residual, weight):
        summed = torch.ops.vllm.all_reduce(x @ proj, "tp:0")
        out, new_residual = torch.ops.vllm_ir.fused_add_rms_norm(summed, residual, weight, EPS, variance_size)
        return (out, new_residual, summed * 2) if reuse_sum else (out, new_residual)

    return step




def compile_options(fusion) -> dict:
    """inductor's options for a compile with the post-grad pass ``fusion``; the FX graph cache
    off, so that the pass runs (a cached graph of an earlier run would skip it)."""
    return {"post_grad_custom_post_pass": fusion, "fx_graph_cache": False}


def compiled(step, fusion, *args):
    """(outputs, inductor's generated code) of ``step`` compiled with ``fusion`` as the post-grad pass."""
    import torch._dynamo
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    fn = torch.compile(step, dynamic=False, options=compile_options(fusion))
    out, code = run_and_get_code(fn, *args)
    return out, "\n".join(code)


#: The fused call in inductor's generated code.
FUSED = "torch.ops.autosymm.vllm_all_reduce_rmsnorm.default("


def check_fused_step(args, rtol: float, atol: float) -> list[str]:
    """Compile :func:`layer` with a fresh VllmAllReduceRMSNormPass: one rewrite, the fused call in
    the generated code, the eager step's outputs; returns the stand-ins that ran inside it."""
    from autosymm.integrations.vllm_fusion import VllmAllReduceRMSNormPass

    want = layer()(*args)
    fusion = VllmAllReduceRMSNormPass()
    CALLS.clear()
    got, code = compiled(layer(), fusion, *args)
    assert code.count(FUSED) == 1 and fusion.rewrites == 1, code
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=rtol, atol=atol)
    return list(CALLS)


def _c_op_schemas() -> dict[str, str]:
    """vLLM's ``torch.ops._C`` schemas as tests/stacks/stubs.py records them (checked there
    against the 0.33.0 wheel's extension)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("_stack_stubs", Path(__file__).parent / "stacks" / "stubs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.C_OPS


def create_fp4_output_tensors(m: int, n: int, device, is_sf_swizzled_layout: bool):
    """vLLM's allocation of ``scaled_fp4_quant``'s outputs (vllm/_custom_ops.py:37-87, swizzled):
    packed uint8 [m, n / 2], int32 [round_up(m, 128), round_up(n / 16, 4) / 4] block scales."""
    if not is_sf_swizzled_layout:
        raise ValueError("the stand-in allocates vLLM's swizzled layout only (is_sf_swizzled_layout=True)")
    rows, blocks = -(-m // 128) * 128, -(-(n // 16) // 4) * 4
    return (torch.empty((m, n // 2), dtype=torch.uint8, device=device),
            torch.empty((rows, blocks // 4), dtype=torch.int32, device=device))


def define_vllm_quant_stand_ins() -> None:
    """:func:`define_vllm_stand_ins`, and vLLM's static per-tensor FP8 and NVFP4 quant kernels
    ``_C::static_scaled_fp8_quant`` and ``_C::scaled_fp4_quant.out`` (vLLM's schemas), computed
    by autosymm's reference formula (autosymm.epilogue.quantize, which follows vLLM's kernels:
    FP8 bit for bit, NVFP4 but for vLLM's approximate reciprocals), and, where vLLM is absent, a
    module ``vllm._custom_ops`` holding only :func:`create_fp4_output_tensors` (the quant op's
    unfused fallback allocates through it). Once per process."""
    import importlib.util
    import sys
    import types

    from autosymm.epilogue import Epilogue, nvfp4_quantize, quantize

    define_vllm_stand_ins()
    if _QUANT_LIB:
        return
    schemas = _c_op_schemas()
    lib = torch.library.Library("_C", "FRAGMENT")
    _QUANT_LIB.append(lib)
    for name in ("static_scaled_fp8_quant", "scaled_fp4_quant.out"):
        lib.define(schemas[name])

    def static_scaled_fp8_quant(result, input, scale, group_shape=None):
        CALLS.append("_C.static_scaled_fp8_quant")
        if scale.numel() != 1 or list(group_shape or (-1, -1)) != [-1, -1]:
            raise ValueError(f"the stand-in quantizes per tensor only: scale {tuple(scale.shape)}, "
                             f"group_shape={group_shape}")
        result.copy_(quantize(input.float(), Epilogue(quant="fp8"), input.dtype, scale)[0])

    def scaled_fp4_quant_out(input, input_scale, is_sf_swizzled_layout, *, output, output_scale):
        CALLS.append("_C.scaled_fp4_quant.out")
        if not is_sf_swizzled_layout:
            raise ValueError("the stand-in writes vLLM's swizzled scale layout only")
        packed, scales = nvfp4_quantize(input.float(), input_scale)
        output.copy_(packed)
        output_scale.copy_(scales.view(torch.int32))

    lib.impl("static_scaled_fp8_quant", static_scaled_fp8_quant, "CompositeExplicitAutograd")
    lib.impl("scaled_fp4_quant.out", scaled_fp4_quant_out, "CompositeExplicitAutograd")
    torch.library.register_fake("_C::static_scaled_fp8_quant", lambda *args, **kwargs: None, lib=lib)
    torch.library.register_fake("_C::scaled_fp4_quant.out", lambda *args, **kwargs: None, lib=lib)
    if importlib.util.find_spec("vllm") is None:
        package, ops = types.ModuleType("vllm"), types.ModuleType("vllm._custom_ops")
        package.__path__, package._custom_ops = [], ops
        ops.create_fp4_output_tensors = create_fp4_output_tensors
        sys.modules.update({"vllm": package, "vllm._custom_ops": ops})


#: The quant forms :func:`chain` writes after the norm (autosymm.integrations.vllm_fusion_quant.FORMS).
QUANT_FORMS = (None, "fp8", "fp8_native", "nvfp4")


def chain(residual: bool, gemma: bool = False, quant=None):
    """``step(x, residual, weight, scale)`` as vLLM's graphs hold a layer's tail: ``vllm.all_reduce``,
    the norm (``fused_add_rms_norm``, or ``rms_norm`` without the residual; Gemma's weight
    ``weight.float() + 1.0``), then ``quant`` of its output (:data:`QUANT_FORMS`) as vLLM's linear
    layers call it: QuantFP8 static per tensor through ``ops.scaled_fp8_quant`` ("fp8") or its
    ``forward_native`` ("fp8_native"), NVFP4's ``ops.scaled_fp4_quant`` ("nvfp4", its scales
    viewed as e4m3). Without the residual the sum is read again (layer 0's residual). Returns
    (out[, scales], new residual or the sum doubled)."""
    if quant not in QUANT_FORMS:
        raise ValueError(f"quant={quant!r} is not one of {QUANT_FORMS}")
    fp8 = torch.float8_e4m3fn

    def quantize(y, scale):
        if quant == "fp8":
            out = torch.empty(y.shape, dtype=fp8, device=y.device)
            torch.ops._C.static_scaled_fp8_quant(out, y, scale, (-1, -1))
            return (out,)
        if quant == "fp8_native":
            return ((y.to(torch.float32) * scale.to(torch.float32).reciprocal()).clamp(-448.0, 448.0).to(fp8),)
        out, scales = create_fp4_output_tensors(y.shape[0], y.shape[1], y.device, True)
        torch.ops._C.scaled_fp4_quant.out(y, scale, True, output=out, output_scale=scales)
        return out, scales.view(fp8)

    def step(x, x_residual, weight, scale):
        summed = torch.ops.vllm.all_reduce(x, "tp:0")
        w = weight.float() + 1.0 if gemma else weight
        if residual:
            out, rest = torch.ops.vllm_ir.fused_add_rms_norm(summed, x_residual, w, EPS, None)
        else:
            out, rest = torch.ops.vllm_ir.rms_norm(summed, w, EPS, None), summed * 2
        return ((out,) if quant is None else quantize(out, scale)) + (rest,)

    return step
