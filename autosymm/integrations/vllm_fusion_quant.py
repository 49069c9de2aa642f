"""vLLM's all-reduce -> RMSNorm -> quant chains as one fused call (vLLM 0.33.0): the 4 quantized
patterns of vLLM's ``AllReduceFusionPass``, RMSNorm with and without the residual add followed by
static per-tensor FP8 (e4m3) quant in either of vLLM's two forms (``"fp8"``: its
``_C.static_scaled_fp8_quant``; ``"fp8_native"``: ``QuantFP8.forward_native``'s torch ops) or by
NVFP4 quant (``"nvfp4"``: ``_C.scaled_fp4_quant.out``, swizzled scales), ``s`` one float32 value.
:func:`quant_use` finds the chain after a norm's output; autosymm.integrations.vllm_fusion's pass
replaces it by vLLM's FlashInfer replacement with autosymm's op in front where vLLM's pass would
fuse it, else by ``torch.ops.autosymm.vllm_all_reduce_rmsnorm_quant``, the run-time op here. The
graphs matched, with vLLM's file:line: the design notes.

Design notes: docs/INTEGRATIONS.md#integrations-vllm-fusion-quant
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor
from torch.fx import Node

from autosymm.collectives.all_reduce_rmsnorm import all_reduce_rmsnorm
from autosymm.epilogue import FP8_E4M3_MAX, NVFP4_BLOCK, Epilogue

from . import vllm_ops as base

#: The quant forms (module docstring) and autosymm's quant mode serving each.
FORMS = {"fp8": "fp8", "fp8_native": "fp8", "nvfp4": "nvfp4"}
_FP8 = torch.float8_e4m3fn
_AUTO_FUNCTIONALIZED = torch.ops.higher_order.auto_functionalized
_CONVERT = torch.ops.prims.convert_element_type.default
_NOOP_VIEWS = (torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default)


def _round_up(value, multiple: int):
    return (value + multiple - 1) // multiple * multiple


def _nvfp4_shapes(tokens, hidden: int) -> tuple[tuple, tuple]:
    """(packed uint8 output, int32 swizzled block scales) shapes of vLLM's ``scaled_fp4_quant``
    for [tokens, hidden] (_custom_ops.py:37-87: 128-row tiles of 4 e4m3 scales per int32)."""
    return (tokens, hidden // 2), (_round_up(tokens, 128), _round_up(hidden // NVFP4_BLOCK, 4) // 4)


@torch.library.custom_op("autosymm::vllm_all_reduce_rmsnorm_quant", mutates_args=())
def vllm_all_reduce_rmsnorm_quant(x: Tensor, residual: Optional[Tensor], weight: Tensor, eps: float, group_name: str,
                                  quant: str, scale: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(quant(rmsnorm(s) * weight), s, scales)`` with ``s = residual + sum(x)`` (``sum(x)`` where
    ``residual`` is None) over vLLM's group ``group_name``, as new tensors. ``quant``: a form of
    :data:`FORMS`; "fp8*": e4m3 ``[tokens, hidden]`` with ``scale`` the static per-tensor scale,
    ``scales`` an empty float32 [0]; "nvfp4": packed uint8 ``[tokens, hidden / 2]`` with ``scale``
    the global scale, ``scales`` vLLM's int32 swizzled block scales. autosymm's fused op where a
    tuned row serves this epilogue; else vLLM's all-reduce, norm and the graph's quant op."""
    coordinator = base.group_coordinator(group_name)
    adapter = getattr(coordinator.device_communicator, "autosymm", None)
    mode = FORMS[quant]
    if adapter is not None and adapter.serves_fused(x, epilogue=Epilogue(residual=True, quant=mode)):
        summed = residual.clone() if residual is not None else torch.zeros_like(x)
        got = all_reduce_rmsnorm(x, summed, weight, eps, group=adapter.group, quant=mode,
                                 scale=scale.reshape(()))  # x unchanged on every epilogue path
        if mode == "fp8":
            return got, summed, _no_scales(x)
        packed, block_scales = got
        return packed, summed, block_scales.view(torch.int32)
    summed = coordinator.all_reduce(x)
    if residual is None:
        out = torch.ops.vllm_ir.rms_norm.default(summed, weight, eps, None)
    else:
        out, summed = torch.ops.vllm_ir.fused_add_rms_norm.default(summed, residual, weight, eps, None)
    quantized, scales = quantize(out, quant, scale)
    return quantized, summed, scales


@vllm_all_reduce_rmsnorm_quant.register_fake
def _fake(x: Tensor, residual: Optional[Tensor], weight: Tensor, eps: float, group_name: str, quant: str,
          scale: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return fake_outputs(x, quant)


def fake_outputs(x: Tensor, quant: str) -> tuple[Tensor, Tensor, Tensor]:
    """New tensors of the op's outputs' shapes and dtypes for ``x`` (a fake tensor in a trace)."""
    if quant not in FORMS:
        raise ValueError(f"autosymm.vllm_all_reduce_rmsnorm_quant: quant={quant!r} is not one of {tuple(FORMS)}")
    if FORMS[quant] == "fp8":
        return torch.empty_like(x, dtype=_FP8), torch.empty_like(x), _no_scales(x)
    packed, scales = _nvfp4_shapes(x.shape[0], x.shape[1])
    return x.new_empty(packed, dtype=torch.uint8), torch.empty_like(x), x.new_empty(scales, dtype=torch.int32)


def _no_scales(x: Tensor) -> Tensor:
    return x.new_empty((0,), dtype=torch.float32)


def quantize(y: Tensor, quant: str, scale: Tensor) -> tuple[Tensor, Tensor]:
    """(quantized ``y``, scales) by the graph's own quant ``quant`` (module docstring), as vLLM's
    unfused chain runs it."""
    if quant == "fp8":
        out = torch.empty(y.shape, dtype=_FP8, device=y.device)
        torch.ops._C.static_scaled_fp8_quant.default(out, y, scale, [-1, -1])
        return out, _no_scales(y)
    if quant == "fp8_native":
        product = y.to(torch.float32) * scale.reciprocal()
        return product.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(_FP8), _no_scales(y)
    from vllm._custom_ops import create_fp4_output_tensors  # vLLM is optional: imported only when vLLM runs

    out, scales = create_fp4_output_tensors(y.shape[0], y.shape[1], y.device, True)
    torch.ops._C.scaled_fp4_quant.out(y, scale, True, output=out, output_scale=scales)
    return out, scales


@dataclass(frozen=True)
class QuantUse:
    """A quant chain reading a norm's output: its form, scale node, the nodes whose values the
    fused op's items 0 and 2 replace (``outputs``; None where the graph reads none), every node of
    the chain, users first (``nodes``), and NVFP4's output buffers (``buffers``: packed, int32
    scales; vLLM's FlashInfer replacement writes into them, allreduce_rms_fusion.py:827-842)."""

    form: str
    scale: Node
    outputs: tuple[Optional[Node], Optional[Node]]
    nodes: tuple[Node, ...]
    buffers: tuple[Optional[Node], Optional[Node]] = (None, None)


def quant_use(y: Node) -> Optional[QuantUse]:
    """The quant chain of vLLM's quantized patterns that alone reads norm output ``y`` (through
    no-op views), each node of it but the last read by the next alone, or None. (vLLM's pattern
    matcher requires as much of a pattern's inner nodes; where another node reads one, vLLM's
    pass fuses the norm unquantized.)"""
    if len(y.users) != 1:
        return None
    (user,) = y.users
    if user.target in _NOOP_VIEWS and _same_shape(user, y):
        use = quant_use(user)
        return None if use is None else QuantUse(use.form, use.scale, use.outputs, use.nodes + (user,), use.buffers)
    return _af_quant(user, y) or _native_fp8(user, y)


def _af_quant(node: Node, y: Node) -> Optional[QuantUse]:
    """``auto_functionalized`` of ``_C.static_scaled_fp8_quant`` (per tensor) or of
    ``_C.scaled_fp4_quant.out`` (swizzled) with input ``y``."""
    if node.target is not _AUTO_FUNCTIONALIZED or not node.args:
        return None
    op, kwargs = node.args[0], node.kwargs
    fp8_op, fp4_op = base._overload("_C", "static_scaled_fp8_quant"), _fp4_out()
    if op is fp8_op and op is not None:
        if kwargs.get("input") is not y or list(kwargs.get("group_shape") or ()) != [-1, -1] \
                or _dtype(kwargs.get("result")) != _FP8:
            return None
        form, scale, items, buffers = "fp8", kwargs.get("scale"), (1, None), ("result",)
    elif op is fp4_op and op is not None:
        if kwargs.get("input") is not y or kwargs.get("is_sf_swizzled_layout") is not True:
            return None
        form, scale, items, buffers = "nvfp4", kwargs.get("input_scale"), (1, 2), ("output", "output_scale")
    else:
        return None
    getitems = {user.args[1]: user for user in node.users if user.target is operator.getitem}
    if len(getitems) != len(node.users) or any(i not in items for i in getitems) or not _one_value(scale):
        return None  # a consumer of the node other than its items (or an item vLLM's pattern does not return)
    outputs = tuple(getitems.get(i) if i is not None else None for i in items)
    written = tuple(kwargs[b] for b in buffers if isinstance(kwargs.get(b), Node))
    kept = (kwargs.get("output"), kwargs.get("output_scale")) if form == "nvfp4" else (None, None)
    return QuantUse(form, scale, outputs, tuple(getitems.values()) + (node,) + written, kept)


def _native_fp8(node: Node, y: Node) -> Optional[QuantUse]:
    """``QuantFP8.forward_native``'s chain from ``y``: [f32 cast], ``* reciprocal(scale)``,
    ``clamp_min(-448)`` and ``clamp_max(448)`` (or one ``clamp``), e4m3 cast."""
    chain = []
    if node.target is _CONVERT and node.args[1] == torch.float32 and node.args[0] is y:
        chain.append(node)
        node = _only_user(node)
    elif _dtype(y) != torch.float32:
        return None
    source = chain[-1] if chain else y
    if node is None or node.target is not torch.ops.aten.mul.Tensor or source not in node.args:
        return None
    other = node.args[1] if node.args[0] is source else node.args[0]
    if not (isinstance(other, Node) and other.target is torch.ops.aten.reciprocal.default
            and _one_value(other.args[0])):
        return None
    chain.append(node)
    node = _clamped(_only_user(node), chain)
    if node is None or node.target is not _CONVERT or node.args[1] != _FP8:
        return None
    chain.append(node)
    return QuantUse("fp8_native", other.args[0], (node, None), tuple(reversed(chain)) + (other,))


def _clamped(node: Optional[Node], chain: list) -> Optional[Node]:
    """After appending the clamp node(s) to ``chain``: the node that reads the clamp to ±448."""
    if node is None:
        return None
    if node.target is torch.ops.aten.clamp.default and tuple(node.args[1:]) == (-FP8_E4M3_MAX, FP8_E4M3_MAX):
        chain.append(node)
        return _only_user(node)
    if node.target is torch.ops.aten.clamp_min.default and node.args[1] == -FP8_E4M3_MAX:
        chain.append(node)
        node = _only_user(node)
        if node is not None and node.target is torch.ops.aten.clamp_max.default and node.args[1] == FP8_E4M3_MAX:
            chain.append(node)
            return _only_user(node)
    return None


def _only_user(node: Node) -> Optional[Node]:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _fp4_out():
    try:
        return torch.ops._C.scaled_fp4_quant.out
    except (AttributeError, RuntimeError):
        return None  # a build without NVFP4 (vLLM probes it the same way, allreduce_rms_fusion.py:99)


def _dtype(node) -> Optional[torch.dtype]:
    val = base._val(node)
    return val.dtype if isinstance(val, Tensor) else None


def _one_value(node) -> bool:
    """A float32 node of one element (a static scale)."""
    val = base._val(node)
    return isinstance(val, Tensor) and val.dtype == torch.float32 and val.numel() == 1


def _same_shape(view: Node, source: Node) -> bool:
    a, b = base._val(view), base._val(source)
    return isinstance(a, Tensor) and isinstance(b, Tensor) and tuple(a.shape) == tuple(b.shape)
