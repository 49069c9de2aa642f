"""The run-time ops the vLLM pass (autosymm.integrations.vllm_fusion) writes into vLLM's graphs:
``torch.ops.autosymm.vllm_all_reduce_rmsnorm`` (the unquantized chains; the quantized op is
autosymm.integrations.vllm_fusion_quant's) and what both ops share: vLLM's live group by name,
FlashInfer's fused call as vLLM's pass writes it, and the graph helpers."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.fx import Node

from autosymm.collectives.all_reduce_rmsnorm import all_reduce_rmsnorm
from autosymm.epilogue import Epilogue


def group_coordinator(name: str):
    """vLLM's live ``GroupCoordinator`` called ``name`` (its ``unique_name``, e.g. 'tp:0')."""
    from vllm.distributed.parallel_state import _groups

    ref = _groups.get(name)
    coordinator = ref() if ref is not None else None
    if coordinator is None:
        raise RuntimeError(f"autosymm.vllm_all_reduce_rmsnorm: vLLM has no live group {name!r}")
    return coordinator


@torch.library.custom_op("autosymm::vllm_all_reduce_rmsnorm", mutates_args=())
def vllm_all_reduce_rmsnorm(x: Tensor, residual: Optional[Tensor], weight: Tensor, eps: float, group_name: str,
                            gemma: bool = False, flashinfer_max_tokens: int = 0) -> tuple[Tensor, Tensor]:
    """``(rmsnorm(s) * w, s)`` with ``s = residual + sum(x)`` (``sum(x)`` where ``residual`` is
    None) over vLLM's group ``group_name``, ``w = weight`` or Gemma's ``1 + weight`` (fp32), as new
    tensors. autosymm's fused op where the group's adapter serves it; else what vLLM's default runs:
    FlashInfer's fused call through vLLM's own op where vLLM's pass would have fused this call
    (``x.shape[0] <= flashinfer_max_tokens``, 0: it would not), else vLLM's all-reduce and norm."""
    coordinator = group_coordinator(group_name)
    adapter = getattr(coordinator.device_communicator, "autosymm", None)
    # asked about the epilogue the call runs (the residual is always given: a zero one without)
    if adapter is not None and adapter.serves_fused(x, epilogue=Epilogue(residual=True, gemma=gemma)):
        summed = residual.clone() if residual is not None else torch.zeros_like(x)
        out = all_reduce_rmsnorm(x.clone(), summed, weight, eps, group=adapter.group, gemma=gemma)
        return out, summed
    if 0 < x.shape[0] <= flashinfer_max_tokens:
        return flashinfer_fused(x, residual, weight, eps, coordinator.world_size, gemma, flashinfer_max_tokens)
    summed = coordinator.all_reduce(x)
    norm_weight = weight.float() + 1.0 if gemma else weight
    if residual is None:
        return torch.ops.vllm_ir.rms_norm.default(summed, norm_weight, eps, None), summed
    out, new_residual = torch.ops.vllm_ir.fused_add_rms_norm.default(summed, residual, norm_weight, eps, None)
    return out, new_residual


@vllm_all_reduce_rmsnorm.register_fake
def _fake(x: Tensor, residual: Optional[Tensor], weight: Tensor, eps: float, group_name: str, gemma: bool = False,
          flashinfer_max_tokens: int = 0) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x), torch.empty_like(x)


def flashinfer_fused(x: Tensor, residual: Optional[Tensor], weight: Tensor, eps: float, world_size: int,
                     gemma: bool, max_token_num: int) -> tuple[Tensor, Tensor]:
    """vLLM's FlashInfer replacement of the pair, called as vLLM's pass writes it
    (compilation/passes/fusion/allreduce_rms_fusion.py:379-400 without a residual, 445-462 with
    one; Gemma: ``weight_bias=1.0``, 515-535): ``torch.ops.vllm.flashinfer_trtllm_fused_allreduce_norm``
    on copies, with vLLM's ``FlashInferFusedAllReduceParams``. Returns ``(out, residual + sum)``."""
    from vllm.compilation.passes.fusion import allreduce_rms_fusion as fusion

    params = fusion.FlashInferFusedAllReduceParams(world_size=world_size, max_token_num=max_token_num)
    allreduce_in = x.clone()
    summed = residual.clone() if residual is not None else torch.zeros_like(x)
    norm_out = None if residual is not None else torch.empty_like(x)
    torch.ops.vllm.flashinfer_trtllm_fused_allreduce_norm.default(
        allreduce_in=allreduce_in, residual=summed, norm_out=norm_out, quant_out=None, scale_out=None,
        rms_gamma=weight, rms_eps=eps, pattern_code=fusion.flashinfer_comm.AllReduceFusionPattern.kARResidualRMSNorm,
        weight_bias=1.0 if gemma else 0.0, **params.get_trtllm_fused_allreduce_kwargs())
    if residual is not None:
        return allreduce_in, summed  # FlashInfer writes the norm into allreduce_in, the sum into residual
    return norm_out, allreduce_in  # with norm_out given, the sum goes to allreduce_in


def _overload(namespace: str, name: str):
    """``torch.ops.<namespace>.<name>.default``, or None before vLLM (or a stand-in) defined it."""
    try:
        return getattr(getattr(torch.ops, namespace), name).default
    except (AttributeError, RuntimeError):
        return None


def _val(node):
    return node.meta.get("val") if isinstance(node, Node) else None
