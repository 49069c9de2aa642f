"""The run-time op the vLLM pass (autosymm.integrations.vllm_fusion) writes where vLLM's own pass
would not fuse a chain (no FlashInfer, a compile range beyond its table):
``torch.ops.autosymm.vllm_all_reduce_rmsnorm``, functional like the unfused ops it replaces (its
quantized sibling is autosymm.integrations.vllm_fusion_quant's; where vLLM would fuse,
autosymm.integrations.vllm_flashinfer's op), and what the ops share: vLLM's live group by name and
the graph helpers."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.fx import Node

from autosymm.collectives.all_reduce_rmsnorm import all_reduce_rmsnorm
from autosymm.epilogue import Epilogue

from .vllm_warmup import record_form


def group_coordinator(name: str):
    """vLLM's live ``GroupCoordinator`` called ``name`` (its ``unique_name``, e.g. 'tp:0')."""
    from vllm.distributed.parallel_state import _groups  # vLLM is optional: imported only when vLLM runs

    ref = _groups.get(name)
    coordinator = ref() if ref is not None else None
    if coordinator is None:
        raise RuntimeError(f"autosymm.vllm_all_reduce_rmsnorm: vLLM has no live group {name!r}")
    return coordinator


@torch.library.custom_op("autosymm::vllm_all_reduce_rmsnorm", mutates_args=())
def vllm_all_reduce_rmsnorm(x: Tensor, residual: Optional[Tensor], weight: Tensor, eps: float, group_name: str,
                            gemma: bool = False) -> tuple[Tensor, Tensor]:
    """``(rmsnorm(s) * w, s)`` with ``s = residual + sum(x)`` (``sum(x)`` where ``residual`` is
    None) over vLLM's group ``group_name``, ``w = weight`` or Gemma's ``1 + weight`` (fp32), as new
    tensors. autosymm's fused op where a tuned row serves it (the group adapter's ``serves_fused``);
    else vLLM's all-reduce and norm ops, whose new tensors it returns as they are."""
    coordinator = group_coordinator(group_name)
    adapter = getattr(coordinator.device_communicator, "autosymm", None)
    # asked about the epilogue the call runs (the residual is always given: a zero one without)
    epilogue = Epilogue(residual=True, gemma=gemma)
    if adapter is not None and adapter.serves_fused(x, epilogue, lambda: record_form(x, epilogue, "unfused")):
        summed = residual.clone() if residual is not None else torch.zeros_like(x)
        out = all_reduce_rmsnorm(x.clone(), summed, weight, eps, group=adapter.group, gemma=gemma)
        return out, summed
    summed = coordinator.all_reduce(x)
    norm_weight = weight.float() + 1.0 if gemma else weight
    if residual is None:
        return torch.ops.vllm_ir.rms_norm.default(summed, norm_weight, eps, None), summed
    out, new_residual = torch.ops.vllm_ir.fused_add_rms_norm.default(summed, residual, norm_weight, eps, None)
    return out, new_residual


@vllm_all_reduce_rmsnorm.register_fake
def _fake(x: Tensor, residual: Optional[Tensor], weight: Tensor, eps: float, group_name: str,
          gemma: bool = False) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x), torch.empty_like(x)


def _overload(namespace: str, name: str):
    """``torch.ops.<namespace>.<name>.default``, or None before vLLM (or a stand-in) defined it."""
    try:
        return getattr(getattr(torch.ops, namespace), name).default
    except (AttributeError, RuntimeError):
        return None


def _val(node):
    return node.meta.get("val") if isinstance(node, Node) else None
