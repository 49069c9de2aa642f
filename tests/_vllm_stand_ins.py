"""Stand-ins of vLLM 0.33.0's two ops that its compiled graphs hold around a TP layer's norm (vLLM
does not import without its GPU build): ``vllm::all_reduce(Tensor tensor, str group_name) ->
Tensor`` and ``vllm_ir::fused_add_rms_norm(Tensor x, Tensor x_residual, Tensor? weight, float
epsilon, SymInt? variance_size=None) -> (Tensor, Tensor)``, declared with vLLM's own schemas,
with the native formula of ``vllm/ir/ops/layernorm.py`` (the all-reduce: torch.distributed's on
the default group)."""

from __future__ import annotations

import torch

EPS = 1e-6
_LIB = []  # the stand-in library, kept alive in the process that defined it
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

    def all_reduce(tensor, group_name):
        CALLS.append("vllm.all_reduce")
        out = tensor.clone()
        dist.all_reduce(out)
        return out

    def fused_add_rms_norm(x, x_residual, weight, epsilon, variance_size=None):
        CALLS.append("vllm_ir.fused_add_rms_norm")
        s = x.float() + x_residual.float()
        part = s if variance_size is None else s[..., :variance_size]
        normed = s * torch.rsqrt(part.pow(2).mean(-1, keepdim=True) + epsilon)
        if weight is not None:
            normed = normed.to(weight.dtype) * weight
        return normed.to(x.dtype), s.to(x.dtype)

    vllm.impl("all_reduce", all_reduce, "CompositeExplicitAutograd")
    ir.impl("fused_add_rms_norm", fused_add_rms_norm, "CompositeExplicitAutograd")
    torch.library.register_fake("vllm::all_reduce", lambda tensor, group_name: torch.empty_like(tensor), lib=vllm)
    torch.library.register_fake("vllm_ir::fused_add_rms_norm",
                                lambda x, r, w, e, v=None: (torch.empty_like(x), torch.empty_like(x)), lib=ir)


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
