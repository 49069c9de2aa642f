"""autosymm in front of vLLM's FlashInfer replacement of all-reduce -> RMSNorm [-> quant] (vLLM 0.33.0).

Where vLLM's ``AllReduceFusionPass`` would replace a chain by FlashInfer's fused call, autosymm's
pass writes that same replacement with the same buffers (:func:`write`): ``auto_functionalized``
of ``torch.ops.autosymm.vllm_fused_allreduce_norm``, the schema and mutated arguments of vLLM's
``torch.ops.vllm.flashinfer_trtllm_fused_allreduce_norm`` plus the group's name. At run time the
op is vLLM's op on the same buffers (no copy vLLM's replacement does not make); where a tuned
autosymm row serves the call instead (the group adapter's ``serves_fused``), autosymm's fused op
runs and its outputs go where FlashInfer's would. vLLM's lines and the outputs' places: the
design notes.

Design notes: docs/INTEGRATIONS.md#integrations-vllm-flashinfer
"""

from __future__ import annotations

import operator
from collections import namedtuple
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor
from torch.fx import Graph, Node

from autosymm.collectives.all_reduce_rmsnorm import all_reduce_rmsnorm
from autosymm.epilogue import Epilogue

from .vllm_ops import group_coordinator
from .vllm_warmup import record_form

_AUTO_FUNCTIONALIZED = torch.ops.higher_order.auto_functionalized
#: The op's mutated arguments in schema order: auto_functionalized's items 1..5.
MUTATED = ("allreduce_in", "residual", "norm_out", "quant_out", "scale_out")
ITEM = {name: index + 1 for index, name in enumerate(MUTATED)}
#: vLLM's op's schema (allreduce_rms_fusion.py:274-320) plus the group's name.
SCHEMA = ("vllm_fused_allreduce_norm(Tensor(a!) allreduce_in, Tensor(b!) residual, Tensor rms_gamma, float rms_eps, "
          "int world_size, bool launch_with_pdl, bool fp32_acc, int max_token_num, int pattern_code, str group_name, "
          "Tensor(c!)? norm_out=None, Tensor(d!)? quant_out=None, Tensor(e!)? scale_out=None, "
          "Tensor? scale_factor=None, float weight_bias=0.0) -> ()")
#: One call's arguments, by the schema's names and defaults.
Call = namedtuple("Call", [arg.split("=")[0].split()[-1] for arg in SCHEMA[SCHEMA.index("(") + 1:SCHEMA.index(") ->")]
                           .split(", ")], defaults=(None, None, None, None, 0.0))
#: vLLM's op's arguments that are its call's parameters, not its buffers (a warm-up stack path
#: replays the call with them: autosymm.integrations.vllm_warmup).
PARAMS = ("world_size", "launch_with_pdl", "fp32_acc", "max_token_num", "pattern_code", "weight_bias")
_LIB = torch.library.Library("autosymm", "FRAGMENT")
_LIB.define(SCHEMA)


def vllm_fused_allreduce_norm(*args, **kwargs) -> None:
    """``torch.ops.autosymm.vllm_fused_allreduce_norm``: vLLM's ``flashinfer_trtllm_fused_allreduce_norm``
    over vLLM's group ``group_name`` (module docstring): FlashInfer's outputs in the buffers given,
    from autosymm's fused op where a tuned row serves the pattern's epilogue, else from vLLM's op
    with these arguments."""
    call = Call(*args, **kwargs)
    coordinator = group_coordinator(call.group_name)
    adapter = getattr(coordinator.device_communicator, "autosymm", None)
    quant = _quant_of(call.pattern_code)
    if quant is not False and adapter is not None:
        epilogue = Epilogue(residual=True, gemma=call.weight_bias == 1.0, quant=quant)
        if adapter.serves_fused(call.allreduce_in, epilogue, lambda: record_form(
                call.allreduce_in, epilogue, "flashinfer", {name: getattr(call, name) for name in PARAMS})):
            _autosymm(adapter, call, quant)
            return
    vllm_args = call._asdict()
    del vllm_args["group_name"]
    torch.ops.vllm.flashinfer_trtllm_fused_allreduce_norm.default(**vllm_args)


_LIB.impl("vllm_fused_allreduce_norm", vllm_fused_allreduce_norm, "CompositeExplicitAutograd")
torch.library.register_fake("autosymm::vllm_fused_allreduce_norm", lambda *args, **kwargs: None, lib=_LIB)


def _patterns():
    """FlashInfer's ``AllReduceFusionPattern`` as vLLM's fusion module holds it."""
    # vLLM is optional: imported only when vLLM runs
    from vllm.compilation.passes.fusion import allreduce_rms_fusion as fusion

    return fusion.flashinfer_comm.AllReduceFusionPattern


def _quant_of(pattern_code: int):
    """autosymm's quant mode of a FlashInfer pattern (None: unquantized), False for one it lacks."""
    codes = _patterns()
    return {codes.kARResidualRMSNorm: None, codes.kARResidualRMSNormFP8Quant: "fp8",
            codes.kARResidualRMSNormFP4Quant: "nvfp4"}.get(pattern_code, False)


def _autosymm(adapter, call: Call, quant: Optional[str]) -> None:
    """autosymm's fused op, its outputs where FlashInfer puts them (module docstring). ``residual``
    becomes residual + sum (with ``norm_out``, vLLM's zero residual: the sum)."""
    x, residual = call.allreduce_in, call.residual
    got = all_reduce_rmsnorm(x, residual, call.rms_gamma, call.rms_eps, group=adapter.group,
                             gemma=call.weight_bias == 1.0, quant=quant,
                             scale=None if quant is None else call.scale_factor.reshape(()))
    if quant is None:
        (x if call.norm_out is None else call.norm_out).copy_(got)
    elif quant == "fp8":
        call.quant_out.copy_(got)
    else:
        packed, block_scales = got
        call.quant_out.copy_(packed)
        call.scale_out.copy_(block_scales.view(call.scale_out.dtype).view(call.scale_out.shape))
    if call.norm_out is not None:  # FlashInfer's form without a residual leaves the sum in allreduce_in
        x.copy_(residual)


@dataclass
class Site:
    """One chain vLLM's pass would replace: its nodes (``residual`` None: no add) and vLLM's
    replacement's parameters (``params``: its FlashInferFusedAllReduceParams kwargs; ``scale``,
    ``quant_out``, ``scale_out``: the quant's scale and buffers, None where it allocates them or
    has none)."""

    x: Node
    residual: Optional[Node]
    weight: Node
    eps: float
    group_name: str
    params: dict
    pattern_code: int
    weight_bias: float = 0.0
    scale: Optional[Node] = None
    quant_out: Optional[Node] = None
    scale_out: Optional[Node] = None


def write(graph: Graph, before: Node, site: Site) -> tuple[Node, Node, Optional[Node]]:
    """vLLM's replacement (module docstring) of ``site`` with this op, inserted before ``before``:
    returns (the node holding the norm, or the quantized values; the node holding residual + sum,
    or the sum; NVFP4's int32 scales, else None). vLLM's FP8 replacement allocates its e4m3 buffer;
    NVFP4's scale buffer is its int32 node viewed as e4m3, as vLLM's replacement does."""
    x, residual, scale = site.x, site.residual, site.scale
    val = x.meta["val"]
    with graph.inserting_before(before):
        kwargs = dict(allreduce_in=x, residual=residual, rms_gamma=site.weight, rms_eps=site.eps,
                      pattern_code=site.pattern_code, group_name=site.group_name, norm_out=None,
                      quant_out=site.quant_out, scale_out=None, scale_factor=scale, weight_bias=site.weight_bias,
                      **site.params)
        if residual is None:  # vLLM's form without a residual: a zero residual and a norm buffer
            kwargs["residual"] = _call(graph, torch.ops.aten.full.default, (_sizes(graph, x), 0),
                                       torch.zeros_like(val), dtype=val.dtype, layout=torch.strided,
                                       device=val.device, pin_memory=False)  # zeros_like, decomposed
            kwargs["norm_out"] = _call(graph, torch.ops.aten.empty_like.default, (x,), torch.empty_like(val))
        if scale is not None and site.quant_out is None:
            e4m3 = torch.float8_e4m3fn
            kwargs["quant_out"] = _call(graph, torch.ops.aten.empty_like.default, (x,),
                                        torch.empty_like(val, dtype=e4m3), dtype=e4m3)
        if site.scale_out is not None:
            kwargs["scale_out"] = _call(graph, torch.ops.aten.view.dtype, (site.scale_out, torch.float8_e4m3fn),
                                        site.scale_out.meta["val"].view(torch.float8_e4m3fn))
        fused = graph.call_function(_AUTO_FUNCTIONALIZED, (torch.ops.autosymm.vllm_fused_allreduce_norm.default,),
                                    kwargs)
        fused.meta["val"] = (None, *(_val(kwargs[name]) for name in MUTATED))
        items = {name: _item(graph, fused, ITEM[name]) for name in MUTATED if kwargs[name] is not None}
    if scale is not None:
        out = items["quant_out"]
    else:
        out = items["allreduce_in" if residual is not None else "norm_out"]
    scales = None
    if site.scale_out is not None:  # back to vLLM's int32 scales (allreduce_rms_fusion.py:51-56, 851-855)
        with graph.inserting_after(items["scale_out"]):
            scales = _call(graph, torch.ops.aten.view.dtype, (items["scale_out"], torch.int32),
                           site.scale_out.meta["val"])
    return out, items["residual" if residual is not None else "allreduce_in"], scales


def _sizes(graph: Graph, x: Node) -> list:
    """``x``'s sizes for a constructor: ints, and ``sym_size`` nodes for symbolic ones."""
    sizes = []
    for dim, size in enumerate(x.meta["val"].shape):
        sizes.append(size if isinstance(size, int) else _call(graph, torch.ops.aten.sym_size.int, (x, dim), size))
    return sizes


def _call(graph: Graph, target, args: tuple, val, **kwargs) -> Node:
    node = graph.call_function(target, args, kwargs)
    node.meta["val"] = val
    return node


def _item(graph: Graph, node: Node, index: int) -> Node:
    item = graph.call_function(operator.getitem, (node, index))
    item.meta["val"] = node.meta["val"][index]
    return item


def _val(node):
    return node.meta.get("val") if isinstance(node, Node) else None
