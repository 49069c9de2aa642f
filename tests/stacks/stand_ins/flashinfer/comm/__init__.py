"""``flashinfer.comm`` as vLLM 0.33.0 calls it (``compilation/passes/fusion/allreduce_rms_fusion.py:160-310``,
``distributed/device_communicators/flashinfer_all_reduce.py:76-130``), recorded.

``allreduce_fusion`` writes what vLLM's unfused ops compute for the call (its stated formulas, not
FlashInfer's kernel): the sum of ``input`` over the workspace's group (gloo, in ``input``'s dtype,
as vLLM's all-reduce), then ``vllm_ir.fused_add_rms_norm`` with the residual and ``gamma`` (Gemma:
``gamma.float() + weight_bias``), then the pattern's quant: static FP8 as ``QuantFP8.forward_native``
(``input_quant_fp8.py:216-221``), NVFP4 by autosymm.epilogue.nvfp4_quantize (the formula of vLLM's
``scaled_fp4_quant``). Outputs land where FlashInfer puts them: ``residual_out`` the sum plus the
residual, ``norm_out`` the norm, ``quant_out`` / ``scale_out`` the quantized values. Each call is
appended to :data:`CALLS`. The workspace has no multicast (``mc_ptr`` 0), so vLLM's ``auto``
backend falls back from ``mnnvl`` to ``trtllm``, as on a node without NVSwitch multicast.
"""

from __future__ import annotations

__stand_in__ = True

import torch
import torch.distributed as dist

#: One dict per allreduce_fusion call: pattern, tokens, which outputs were given, weight_bias.
CALLS: list[dict] = []


class AllReduceFusionPattern:
    """flashinfer/comm/trtllm_ar.py's codes."""

    kAllReduce = 0
    kARResidualRMSNorm = 1
    kARResidualRMSNormFP8Quant = 2
    kARResidualRMSNormFP4Quant = 3
    kARResidualRMSNormOutFP8Quant = 4
    kARResidualRMSNormOutFP4Quant = 5


class QuantizationSFLayout:
    SWIZZLED_128x4 = 0
    SWIZZLED_8x4 = 1
    LINEAR = 2


class Workspace:
    """What ``create_allreduce_fusion_workspace`` returns: its backend and process group."""

    def __init__(self, backend: str, group) -> None:
        self.backend, self.group, self.mc_ptr = backend, group, 0

    def destroy(self) -> None:
        pass


def create_allreduce_fusion_workspace(*, backend, world_size, rank, max_token_num, hidden_dim, dtype,
                                      comm_backend, group):
    return Workspace(backend, group)


def allreduce_fusion(*, input, workspace, pattern, launch_with_pdl, output, residual_out, norm_out, quant_out,
                     scale_out, residual_in, rms_gamma, rms_eps, scale_factor, layout_code, use_oneshot, fp32_acc,
                     weight_bias=0.0, trigger_completion_at_end=True):
    CALLS.append(dict(pattern=pattern, tokens=input.shape[0], norm_out=norm_out is not input,
                      quant=quant_out is not None, weight_bias=weight_bias, fp32_acc=fp32_acc,
                      residual_in_zero=not bool(residual_in.any())))
    summed = input.clone()
    dist.all_reduce(summed, group=workspace.group)
    gamma = rms_gamma.float() + weight_bias if weight_bias else rms_gamma
    norm, total = torch.ops.vllm_ir.fused_add_rms_norm.default(summed, residual_in, gamma, rms_eps, None)
    quantized = scales = None
    if pattern == AllReduceFusionPattern.kARResidualRMSNormFP8Quant:
        quantized = (norm.float() * scale_factor.float().reciprocal()).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    elif pattern == AllReduceFusionPattern.kARResidualRMSNormFP4Quant:
        from autosymm.epilogue import nvfp4_quantize

        quantized, scales = nvfp4_quantize(norm.float(), scale_factor)
    residual_out.copy_(total)
    norm_out.copy_(norm)
    if quantized is not None:
        quant_out.copy_(quantized)
    if scales is not None:
        scale_out.view(torch.uint8).copy_(scales.view(torch.uint8).view(scale_out.shape))
