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

import operator
from typing import Optional

import torch
from torch import Tensor
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch.fx import Graph, Node

import autosymm

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_QUANT_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8, torch.int8)
_FLOAT_CASTS = (torch.ops.prims.convert_element_type.default, torch.ops.aten._to_copy.default)


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
    if adapter is not None and adapter.serves_fused(x):
        summed = residual.clone() if residual is not None else torch.zeros_like(x)
        out = autosymm.all_reduce_rmsnorm(x.clone(), summed, weight, eps, group=adapter.group, gemma=gemma)
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
    """The pass (module docstring); ``rewrites`` counts the fusions made."""

    def __init__(self) -> None:
        self.rewrites = 0

    def __call__(self, graph: Graph) -> None:
        sum_op = _overload("vllm", "all_reduce")
        norms = {_overload("vllm_ir", "fused_add_rms_norm"): True, _overload("vllm_ir", "rms_norm"): False}
        norms.pop(None, None)
        if sum_op is None or not norms:
            return
        vllm_pass = _vllm_fusion_pass()
        for node in list(graph.nodes):
            if node.op == "call_function" and node.target in norms:
                self._try(graph, node, sum_op, norms[node.target], vllm_pass)

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,))

    def _try(self, graph: Graph, norm: Node, sum_op, with_residual: bool, vllm_pass) -> None:
        names = ("x", "x_residual", "weight", "epsilon", "variance_size") if with_residual else \
            ("x", "weight", "epsilon", "variance_size")
        norm_args = _args(norm, names, {"variance_size": None})
        if norm_args is None or norm_args["variance_size"] is not None or _feeds_quant(norm):
            return  # quantized epilogues stay with vLLM's own pass
        summed, weight = norm_args["x"], norm_args["weight"]
        residual = norm_args.get("x_residual")
        if not (isinstance(summed, Node) and summed.op == "call_function" and summed.target is sum_op
                and isinstance(weight, Node)):
            return
        if with_residual and len(summed.users) != 1:
            return
        sum_args = _args(summed, ("tensor", "group_name"), {})
        gemma_weight = _gemma_weight(weight)
        raw_weight = gemma_weight if gemma_weight is not None else weight
        x = _val(sum_args["tensor"]) if sum_args else None
        if x is None or not _eligible(x, _val(residual) if with_residual else x, _val(raw_weight)):
            return
        eps = float(norm_args["epsilon"])
        max_tokens = _vllm_fused_max_tokens(vllm_pass, x, _val(weight), eps)
        with graph.inserting_before(norm):
            fused = graph.call_function(torch.ops.autosymm.vllm_all_reduce_rmsnorm.default,
                                        (sum_args["tensor"], residual, raw_weight, eps, sum_args["group_name"],
                                         gemma_weight is not None, max_tokens))
            fused.meta["val"] = (torch.empty_like(x), torch.empty_like(x))
            if with_residual:
                norm.replace_all_uses_with(fused)  # users take items 0 (out) and 1 (the new residual) alike
            else:
                out = graph.call_function(operator.getitem, (fused, 0))
                out.meta["val"] = norm.meta.get("val")
                total = graph.call_function(operator.getitem, (fused, 1))
                total.meta["val"] = summed.meta.get("val")
                norm.replace_all_uses_with(out)
                summed.replace_all_uses_with(total)
        graph.erase_node(norm)
        graph.erase_node(summed)
        self.rewrites += 1


def _gemma_weight(weight: Node) -> Optional[Node]:
    """The raw weight ``w`` where ``weight`` is vLLM's Gemma ``w.float() + 1.0``
    (model_executor/layers/layernorm.py:171), else None."""
    if not (weight.op == "call_function" and weight.target in (torch.ops.aten.add.Tensor, torch.ops.aten.add.Scalar)
            and len(weight.args) == 2 and weight.args[1] in (1, 1.0) and not weight.kwargs):
        return None
    base = weight.args[0]
    if not isinstance(base, Node) or _val(weight) is None or _val(weight).dtype != torch.float32:
        return None
    if base.op == "call_function" and base.target in _FLOAT_CASTS and len(base.users) == 1:
        source = base.args[0]
        return source if isinstance(source, Node) else None
    return base if _val(base) is not None and _val(base).dtype == torch.float32 else None


def _feeds_quant(norm: Node, depth: int = 4) -> bool:
    """True when the norm's output reaches an FP8 / FP4 value within ``depth`` nodes (the quantized
    patterns of vLLM's pass: static FP8 and NVFP4, with or without the add)."""
    frontier = [norm]
    for _ in range(depth):
        frontier = [user for node in frontier for user in node.users]
        for node in frontier:
            val = _val(node)
            vals = val if isinstance(val, (tuple, list)) else (val,)
            if any(isinstance(v, Tensor) and v.dtype in _QUANT_DTYPES for v in vals) or "quant" in str(node.target):
                return True
    return False


def _vllm_fusion_pass():
    """vLLM's ``AllReduceFusionPass`` in the pass manager compiling now (vLLM's
    PostGradPassManager is inductor's post-grad post pass, compilation/backends.py:1000), or None."""
    from torch._inductor import config as inductor_config

    manager = inductor_config.post_grad_custom_post_pass
    for candidate in getattr(manager, "passes", ()):
        if type(candidate).__name__ == "AllReduceFusionPass":
            return candidate
    return None


def _vllm_fused_max_tokens(vllm_pass, x, weight, eps: float) -> int:
    """vLLM's ``max_token_num`` where its pass fuses this call now (enabled, this compile range
    applicable, a pattern of its epsilons and model dtype, vLLM's dtype check), else 0
    (compilation/passes/fusion/allreduce_rms_fusion.py:1069-1132)."""
    if vllm_pass is None or getattr(vllm_pass, "disabled", True) or eps not in (1e-5, 1e-6):
        return 0
    from vllm.compilation.passes.pass_manager import get_pass_context

    if not vllm_pass.is_applicable_for_range(get_pass_context().compile_range):
        return 0
    if x.dtype != vllm_pass.model_dtype:
        return 0
    return int(vllm_pass.max_token_num)


def _eligible(x, residual, weight) -> bool:
    """[tokens, hidden] tensors of one dtype, ``x`` contiguous, the weight [hidden]."""
    if x is None or residual is None or weight is None or x.dtype not in _DTYPES or x.dim() != 2:
        return False
    return (x.shape == residual.shape and x.dtype == residual.dtype == weight.dtype and x.is_contiguous()
            and tuple(weight.shape) == (x.shape[1],) and isinstance(x.shape[1], int))


#: The inductor hook the plugin fills: it runs before vLLM's PostGradPassManager (inductor's
#: post-grad post pass), so before vLLM's AllReduceFusionPass (torch/_inductor/fx_passes/post_grad.py).
PRE_PASS_KEY = "post_grad_custom_pre_pass"


def install(vllm_config) -> bool:
    """Put :data:`PASS` in ``vllm_config``'s inductor config as the post-grad pre pass where vLLM
    compiles (``CompilationMode.VLLM_COMPILE``) with TP > 1; True when it is there. vLLM's own
    ``fuse_allreduce_rms`` stays as vLLM set it: its pass then finds only what autosymm left (the
    quantized patterns) and keeps the FlashInfer workspace autosymm's run-time fallback calls."""
    from vllm.config import CompilationMode

    compilation = vllm_config.compilation_config
    if vllm_config.parallel_config.tensor_parallel_size <= 1 or compilation.mode != CompilationMode.VLLM_COMPILE:
        return False
    current = compilation.inductor_compile_config.get(PRE_PASS_KEY)
    passes = list(current) if isinstance(current, (list, tuple)) else [] if current is None else [current]
    if not any(isinstance(p, VllmAllReduceRMSNormPass) for p in passes):
        passes.insert(0, PASS)
    compilation.inductor_compile_config[PRE_PASS_KEY] = passes[0] if len(passes) == 1 else passes
    return True


#: The pass ``autosymm.vllm_fusion_pass`` runs (one per process, so its count covers every compile).
PASS = VllmAllReduceRMSNormPass()
