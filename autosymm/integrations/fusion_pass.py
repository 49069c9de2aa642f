"""An inductor pass that fuses all-reduce -> residual add -> RMSNorm (-> FP8 quant) into ``autosymm::all_reduce_rmsnorm``.

For any model under ``torch.compile`` (inductor): ``h = residual + all_reduce(x); y = rms_norm(h) *
weight`` becomes one ``torch.ops.autosymm.all_reduce_rmsnorm(x, residual, weight, eps, group_name)``
(``residual`` then holds ``h``); without the add, the op with ``residual=None``; with a static FP8
quant of the norm's output, the op with ``quant="fp8", scale=scale``. It rewrites only where the
result is the same computation (one dtype, contiguous tensors, the norm over the last dimension,
the intermediates read by nothing else); outputs agree with the unfused graph within rounding.
Install for one compile, ``torch.compile(model, options={"post_grad_custom_post_pass":
AllReduceRMSNormPass()})``, or for every compile of the process, :func:`install`.

Design notes: docs/INTEGRATIONS.md#integrations-fusion-pass
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Optional

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.fx import Graph, Node

import autosymm.ops  # noqa: F401  (registers torch.ops.autosymm.*)

from .identity import code_identity

aten, prims = torch.ops.aten, torch.ops.prims
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass
class _Sum:
    """An all-reduce's summed result: the tensor reduced, the group, the nodes making the sum
    (the sum last)."""

    x: Node
    group_name: str
    nodes: list[Node]


@dataclass
class _Norm:
    """An RMSNorm of the residual: its output node, weight, eps and the nodes in between."""

    out: Node
    weight: Node
    eps: float
    nodes: list[Node]


@dataclass
class _Quant:
    """A static FP8 quant of the norm's output: the e4m3 node, the scale and the nodes in between."""

    out: Node
    scale: Node
    nodes: list[Node]


_CLAMPS = (aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default)
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _fp8_quant_of(y: Node) -> Optional[_Quant]:
    """``(y / scale).clamp(-448, 448).to(float8_e4m3fn)`` after ``y`` (module docstring), or None."""
    nodes, scale, bounds, node = [], None, set(), y
    while True:
        nxt = _only_user(node)
        if nxt is None:
            return None
        if _convert(nxt, torch.float8_e4m3fn):
            break
        if _call(nxt, prims.convert_element_type.default) and nxt.args[1] in _FLOATS:
            pass
        elif _call(nxt, aten.div.Tensor) and nxt.args[0] is node and scale is None and isinstance(nxt.args[1], Node):
            scale = nxt.args[1]
        elif _call(nxt, *_CLAMPS) and nxt.args[0] is node and scale is not None:
            args = list(nxt.args[1:]) + [nxt.kwargs.get(k) for k in ("min", "max") if k in nxt.kwargs]
            kinds = {aten.clamp_min.default: ("min",), aten.clamp_max.default: ("max",)}.get(nxt.target, ("min", "max"))
            for kind, value in zip(kinds, args):
                if value is not None:
                    bounds.add((kind, float(value)))
        else:
            return None
        nodes.append(nxt)
        node = nxt
    s = _val(scale)
    if s is None or s.dtype != torch.float32 or tuple(s.shape) not in ((), (1,)) or bounds != {("min", -448.0),
                                                                                             ("max", 448.0)}:
        return None
    return _Quant(nxt, scale, nodes + [nxt])


def _call(node, *targets) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def _val(node):
    return node.meta.get("val") if isinstance(node, Node) else None


def _only_user(node: Node) -> Optional[Node]:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _functionalized_sum(node: Node) -> Optional[_Sum]:
    """``getitem(auto_functionalized[_v2](autosymm.all_reduce_, ...), 1)``: the reduced tensor."""
    hops = torch.ops.higher_order
    af = node.args[0] if _call(node, operator.getitem) and node.args[1] == 1 else None
    if not _call(af, hops.auto_functionalized, getattr(hops, "auto_functionalized_v2", None)):
        return None
    kw = af.kwargs
    if af.args[0] is not torch.ops.autosymm.all_reduce_.default or kw.get("op") != "sum" or len(af.users) != 1:
        return None
    if "tensor" in kw:  # v1
        return _Sum(kw["tensor"], kw["group_name"], [af, node])
    index = kw.get("_tensor_base_index")
    if index is None or "_tensor_size" in kw:  # a view of a base: not the simple case
        return None
    return _Sum(kw["_all_bases"][index], kw["group_name"], [af, node])


def _sum_of(node) -> Optional[_Sum]:
    """The all-reduce whose summed result ``node`` is, or None."""
    if _call(node, torch.ops._c10d_functional.wait_tensor.default):
        ar = node.args[0]
        if (_call(ar, torch.ops._c10d_functional.all_reduce.default) and ar.args[1] == "sum"
                and len(ar.users) == 1):
            return _Sum(ar.args[0], ar.args[2], [ar, node])
        return None
    if _call(node, torch.ops.autosymm.all_reduce.default) and node.args[1] == "sum":
        return _Sum(node.args[0], node.args[2], [node])
    return _functionalized_sum(node) if isinstance(node, Node) else None


def _convert(node, dtype) -> bool:
    return _call(node, prims.convert_element_type.default) and node.args[1] == dtype


def _other(node: Node, one: Node):
    """The operand of a binary ``node`` that is not ``one`` (None unless ``one`` is an operand)."""
    a, b = node.args[:2]
    return b if a is one else a if b is one else None


def _norm_core(h: Node, ndim: int) -> Optional[tuple[Node, float, list[Node]]]:
    """From the residual ``h``: its fp32 form, pow 2, mean over the last dim, + eps, rsqrt, mul by
    the fp32 form. (the normalised fp32 node, eps, nodes) or None."""
    f32 = h if _val(h).dtype == torch.float32 else next((u for u in h.users if _convert(u, torch.float32)), None)
    if f32 is None:
        return None
    pow_ = next((u for u in f32.users if _call(u, aten.pow.Tensor_Scalar) and u.args == (f32, 2)), None)
    mean = _only_user(pow_) if pow_ is not None else None
    if not _call(mean, aten.mean.dim) or list(mean.args[1]) not in ([-1], [ndim - 1]) or not (
            mean.args[2:3] == (True,) or mean.kwargs.get("keepdim")):
        return None
    add = _only_user(mean)
    if not _call(add, aten.add.Tensor, aten.add.Scalar) or add.args[0] is not mean or not isinstance(
            add.args[1], (int, float)):
        return None
    rsqrt = _only_user(add)
    normed = _only_user(rsqrt) if _call(rsqrt, aten.rsqrt.default) else None
    if not _call(normed, aten.mul.Tensor) or _other(normed, rsqrt) is not f32:
        return None
    if f32 is not h and set(f32.users) != {pow_, normed}:
        return None
    inner = ([f32] if f32 is not h else []) + [pow_, mean, add, rsqrt, normed]
    return normed, float(add.args[1]), inner


def _weighted(normed: Node, dtype: torch.dtype) -> Optional[tuple[Node, Node, list[Node]]]:
    """The weight multiply after the normalised fp32 node, in either order of the cast:
    ``w * normed.to(dtype)`` (HF) or ``(normed * w).to(dtype)`` (F.rms_norm). (out, w, nodes)."""
    nxt = _only_user(normed)
    if _convert(nxt, dtype) and dtype != torch.float32:
        out = _only_user(nxt)
        if _call(out, aten.mul.Tensor) and _other(out, nxt) is not None:
            return out, _other(out, nxt), [nxt]
        return None
    if not _call(nxt, aten.mul.Tensor) or _other(nxt, normed) is None:
        return None
    if _val(nxt).dtype == dtype:
        return nxt, _other(nxt, normed), []
    out = _only_user(nxt)
    return (out, _other(nxt, normed), [nxt]) if _convert(out, dtype) else None


def _rms_norm_of(h: Node) -> Optional[_Norm]:
    """The RMSNorm that reads the residual ``h`` (see the module docstring), or None."""
    val = _val(h)
    core = _norm_core(h, val.dim())
    if core is None:
        return None
    normed, eps, inner = core
    tail = _weighted(normed, val.dtype)
    if tail is None:
        return None
    out, weight, more = tail
    w, o = _val(weight), _val(out)
    if (w is None or tuple(w.shape) != (val.shape[-1],) or w.dtype != val.dtype or o is None
            or o.dtype != val.dtype or o.shape != val.shape):
        return None
    return _Norm(out, weight, eps, inner + more + [out])


def _eligible(s: _Sum, add: Node, residual: Node) -> bool:
    x, r, h = _val(s.x), _val(residual), _val(add)
    if x is None or r is None or h is None or x.dtype not in _DTYPES or x.dim() < 2:
        return False
    return (x.shape == r.shape == h.shape and x.dtype == r.dtype == h.dtype and x.is_contiguous()
            and r.is_contiguous() and isinstance(x.shape[-1], int))


class AllReduceRMSNormPass(CustomGraphPass):
    """The post-grad pass (``torch._inductor.config.post_grad_custom_post_pass``); ``rewrites``
    counts the fusions made since construction."""

    def __init__(self) -> None:
        self.rewrites = 0

    def __call__(self, graph: Graph) -> None:
        for node in list(graph.nodes):
            if node.graph is graph and _call(node, aten.add.Tensor) and len(node.args) == 2 and not node.kwargs:
                self._try(graph, node)
        for node in list(graph.nodes):  # what is left: sums the norm reads without an add
            if node.graph is graph and not getattr(node, "_erased", False):
                self._try_no_residual(graph, node)

    def uuid(self) -> str:
        """What inductor keys compiles by (autosymm.integrations.identity): this pass and the op it
        inserts (its door and registration)."""
        return code_identity(__name__, "autosymm.collectives.all_reduce_rmsnorm", "autosymm.ops")

    def _try(self, graph: Graph, add: Node) -> None:
        for side in (0, 1):
            s = _sum_of(add.args[side])
            if s is None or len(add.args[side].users) != 1:
                continue
            residual = add.args[1 - side]
            norm = _rms_norm_of(add) if _eligible(s, add, residual) else None
            if norm is not None and _before(graph, norm.weight, add):
                quant = _fp8_quant_of(norm.out)
                if quant is None or _before(graph, quant.scale, add):
                    _rewrite(graph, s, add, residual, norm, quant)
                    self.rewrites += 1
                    return

    def _try_no_residual(self, graph: Graph, sum_node: Node) -> None:
        s = _sum_of(sum_node) if _call(sum_node, operator.getitem, torch.ops._c10d_functional.wait_tensor.default,
                                       torch.ops.autosymm.all_reduce.default) else None
        if s is None or not _eligible(s, sum_node, sum_node):
            return
        norm = _rms_norm_of(sum_node)
        if norm is None or not set(sum_node.users) <= set(norm.nodes) or not _before(graph, norm.weight, sum_node):
            return  # the sum read elsewhere: the op without a residual does not return it
        quant = _fp8_quant_of(norm.out)
        if quant is None or _before(graph, quant.scale, sum_node):
            _rewrite(graph, s, sum_node, None, norm, quant)
            self.rewrites += 1


def _before(graph: Graph, node, anchor: Node) -> bool:
    """True when ``node`` (a weight) is defined before ``anchor`` in the graph's order."""
    if not isinstance(node, Node):
        return False
    for n in graph.nodes:
        if n is node:
            return True
        if n is anchor:
            return False
    return False


def _rewrite(graph: Graph, s: _Sum, add: Node, residual: Optional[Node], norm: _Norm,
             quant: Optional[_Quant]) -> None:
    """Insert the fused op before ``add`` (without a residual: before the sum ``add``); its
    outputs take the places of the norm's output (or the quant's) and of the residual sum; the
    replaced nodes go."""
    shape = _val(add).shape
    hidden = int(shape[-1])
    with graph.inserting_before(add):
        x2 = _flat(graph, s.x, hidden)
        bases = [x2] if residual is None else [x2, _flat(graph, residual, hidden)]
        kwargs = {"weight": norm.weight, "eps": norm.eps, "group_name": s.group_name, "_x_base_index": 0,
                  "_residual_base_index": None if residual is None else 1, "_all_bases": bases}
        if quant is not None:
            kwargs.update(gemma=False, quant="fp8", scale=quant.scale)
        fused = graph.call_function(torch.ops.higher_order.auto_functionalized_v2,
                                    (torch.ops.autosymm.all_reduce_rmsnorm.default,), kwargs)
        xv = _val(x2)
        out_val = torch.empty_like(xv, dtype=torch.float8_e4m3fn) if quant is not None else torch.empty_like(xv)
        fused.meta["val"] = (out_val, *(torch.empty_like(_val(b)) for b in bases))
        out = _unflat(graph, _item(graph, fused, 0), s.x, shape)
        if residual is not None:
            new_residual = _unflat(graph, _item(graph, fused, 2), s.x, shape)
    (quant.out if quant is not None else norm.out).replace_all_uses_with(out)
    if residual is not None:
        add.replace_all_uses_with(new_residual)
    for node in reversed(norm.nodes + (quant.nodes if quant is not None else [])):
        graph.erase_node(node)
    if residual is not None:
        graph.erase_node(add)
    for node in reversed(s.nodes):
        graph.erase_node(node)


def _item(graph: Graph, node: Node, index: int) -> Node:
    item = graph.call_function(operator.getitem, (node, index))
    item.meta["val"] = node.meta["val"][index]
    return item


def _flat(graph: Graph, node: Node, hidden: int) -> Node:
    """``node`` as [tokens, hidden] (itself when 2-D)."""
    val = _val(node)
    if val.dim() == 2:
        return node
    flat = graph.call_function(aten.view.default, (node, [-1, hidden]))
    flat.meta["val"] = val.view(-1, hidden)
    return flat


def _unflat(graph: Graph, node: Node, like: Node, shape) -> Node:
    """``node`` [tokens, hidden] back to ``shape`` (``like``'s), symbolic sizes read off ``like``."""
    if len(shape) == 2:
        return node
    sizes = []
    for dim, size in enumerate(shape):
        if isinstance(size, int):
            sizes.append(size)
            continue
        sym = graph.call_function(aten.sym_size.int, (like, dim))
        sym.meta["val"] = size
        sizes.append(sym)
    view = graph.call_function(aten.view.default, (node, sizes))
    view.meta["val"] = _val(node).view(shape)
    return view


def install() -> AllReduceRMSNormPass:
    """Add the pass to ``torch._inductor.config.post_grad_custom_post_pass`` for every later
    compile of this process (beside a pass already there); returns the installed pass."""
    import torch._inductor.config as inductor_config  # torch._inductor: ~1 s of imports; only a compile needs it

    current = inductor_config.post_grad_custom_post_pass
    passes = list(current) if isinstance(current, (list, tuple)) else [] if current is None else [current]
    for existing in passes:
        if isinstance(existing, AllReduceRMSNormPass):
            return existing
    fusion = AllReduceRMSNormPass()
    inductor_config.post_grad_custom_post_pass = fusion if not passes else [*passes, fusion]
    return fusion
