"""vLLM's all-reduce -> fused add + RMSNorm as one fused call (checked against vLLM 0.33.0's graphs).

In vLLM's compiled graphs a tensor-parallel layer's projection output reaches
``torch.ops.vllm.all_reduce(x, group_name)`` and then the next RMSNorm layer's
``torch.ops.vllm_ir.fused_add_rms_norm(sum, residual, weight, eps, None)`` -> ``(out, residual +
sum)`` (vLLM's pre-grad pass turns the layer's ``maybe_inplace`` overload into this one;
``vllm/model_executor/layers/layernorm.py:93``, ``compilation/passes/ir/inplace_functionalization.py``).
:class:`VllmAllReduceRMSNormPass`, a post-grad pass, replaces the pair with
``torch.ops.autosymm.vllm_all_reduce_rmsnorm(x, residual, weight, eps, group_name)``, which at
run time asks the group's autosymm adapter (autosymm.integrations.vllm_plugin puts one on every
``tp`` communicator): autosymm's fused op where its decision for the call is not NCCL, else
vLLM's own two calls, unchanged (``GroupCoordinator.all_reduce``: vLLM's custom all-reduce,
FlashInfer, ... then ``vllm_ir.fused_add_rms_norm``).

It rewrites only the simple case: [tokens, hidden] tensors of one dtype (bf16, fp16, fp32) for
``x``, ``residual`` and ``weight``, ``x`` contiguous, a weight given, no ``variance_size``, and
the sum read by the norm alone. vLLM's own ``fuse_allreduce_rms`` pass (FlashInfer's fused op)
runs first where it is enabled; what it fused, this pass never sees.

Install (vLLM resolves the name as ``autosymm.<attribute>``)::

    vllm serve ... --compilation-config '{"inductor_passes":
        {"post_grad_custom_post_pass": "autosymm.vllm_fusion_pass"}}'

vLLM adds the pass to its PostGradPassManager after its own passes and before its IR lowering
(``vllm/compilation/backends.py:983``, ``vllm/config/compilation.py:946``).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch.fx import Graph, Node

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def group_coordinator(name: str):
    """vLLM's live ``GroupCoordinator`` called ``name`` (its ``unique_name``, e.g. 'tp:0')."""
    from vllm.distributed.parallel_state import _groups

    ref = _groups.get(name)
    coordinator = ref() if ref is not None else None
    if coordinator is None:
        raise RuntimeError(f"autosymm.vllm_all_reduce_rmsnorm: vLLM has no live group {name!r}")
    return coordinator


@torch.library.custom_op("autosymm::vllm_all_reduce_rmsnorm", mutates_args=())
def vllm_all_reduce_rmsnorm(x: Tensor, residual: Tensor, weight: Tensor, eps: float,
                            group_name: str) -> tuple[Tensor, Tensor]:
    """``(rmsnorm(residual + sum(x)) * weight, residual + sum(x))`` over vLLM's group
    ``group_name``, as new tensors (``x`` and ``residual`` unchanged): autosymm's fused op where
    the group's adapter serves it (its backends leave ``x`` as it is), else vLLM's all-reduce and
    ``vllm_ir.fused_add_rms_norm``."""
    coordinator = group_coordinator(group_name)
    adapter = getattr(coordinator.device_communicator, "autosymm", None)
    if adapter is not None and adapter.serves_fused(x):
        return adapter.all_reduce_rmsnorm(x, residual, weight, eps)
    out, new_residual = torch.ops.vllm_ir.fused_add_rms_norm.default(coordinator.all_reduce(x), residual, weight,
                                                                     eps, None)
    return out, new_residual


@vllm_all_reduce_rmsnorm.register_fake
def _fake(x: Tensor, residual: Tensor, weight: Tensor, eps: float, group_name: str) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x), torch.empty_like(residual)


def _overload(namespace: str, name: str):
    """``torch.ops.<namespace>.<name>.default``, or None before vLLM (or a stand-in) defined it."""
    try:
        return getattr(getattr(torch.ops, namespace), name).default
    except (AttributeError, RuntimeError):
        return None


def _val(node):
    return node.meta.get("val") if isinstance(node, Node) else None


def _args(node: Node, names: tuple[str, ...], defaults: dict) -> Optional[dict]:
    """``node``'s arguments by ``names`` (positional or keyword, else ``defaults``), or None when
    one is missing."""
    out = dict(zip(names, node.args))
    for name in names[len(node.args):]:
        if name in node.kwargs:
            out[name] = node.kwargs[name]
        elif name in defaults:
            out[name] = defaults[name]
        else:
            return None
    return out


class VllmAllReduceRMSNormPass(CustomGraphPass):
    """The post-grad pass (module docstring); ``rewrites`` counts the fusions made."""

    def __init__(self) -> None:
        self.rewrites = 0

    def __call__(self, graph: Graph) -> None:
        norm_op, sum_op = _overload("vllm_ir", "fused_add_rms_norm"), _overload("vllm", "all_reduce")
        if norm_op is None or sum_op is None:
            return
        for node in list(graph.nodes):
            if node.op == "call_function" and node.target is norm_op:
                self._try(graph, node, sum_op)

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,))

    def _try(self, graph: Graph, norm: Node, sum_op) -> None:
        norm_args = _args(norm, ("x", "x_residual", "weight", "epsilon", "variance_size"), {"variance_size": None})
        if norm_args is None or norm_args["variance_size"] is not None:
            return
        summed, residual, weight = norm_args["x"], norm_args["x_residual"], norm_args["weight"]
        if not (isinstance(summed, Node) and summed.op == "call_function" and summed.target is sum_op
                and len(summed.users) == 1 and isinstance(weight, Node)):
            return
        sum_args = _args(summed, ("tensor", "group_name"), {})
        if sum_args is None or not _eligible(_val(sum_args["tensor"]), _val(residual), _val(weight)):
            return
        with graph.inserting_before(norm):
            fused = graph.call_function(torch.ops.autosymm.vllm_all_reduce_rmsnorm.default,
                                        (sum_args["tensor"], residual, weight, float(norm_args["epsilon"]),
                                         sum_args["group_name"]))
        fused.meta["val"] = tuple(torch.empty_like(v) for v in norm.meta["val"])
        norm.replace_all_uses_with(fused)  # its users take items 0 (out) and 1 (the new residual) alike
        graph.erase_node(norm)
        graph.erase_node(summed)
        self.rewrites += 1


def _eligible(x, residual, weight) -> bool:
    if x is None or residual is None or weight is None or x.dtype not in _DTYPES or x.dim() != 2:
        return False
    return (x.shape == residual.shape and x.dtype == residual.dtype == weight.dtype and x.is_contiguous()
            and tuple(weight.shape) == (x.shape[1],) and isinstance(x.shape[1], int))


#: The pass ``autosymm.vllm_fusion_pass`` runs (one per process, so its count covers every compile).
PASS = VllmAllReduceRMSNormPass()
