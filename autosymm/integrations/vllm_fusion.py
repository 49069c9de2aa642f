"""vLLM's all-reduce -> RMSNorm [-> quant] chains as one fused call, ahead of vLLM's own fusion (vLLM 0.33.0).

:class:`VllmAllReduceRMSNormPass` takes each of the 8 patterns of vLLM's ``AllReduceFusionPass``
(``vllm.all_reduce`` then ``vllm_ir.fused_add_rms_norm`` or ``rms_norm``, the layer's or Gemma's
weight, possibly followed by static FP8 or NVFP4 quant: autosymm.integrations.vllm_fusion_quant).
Where vLLM's pass would fuse the chain now, it writes vLLM's own FlashInfer replacement with
autosymm's op in front (autosymm.integrations.vllm_flashinfer); elsewhere
``torch.ops.autosymm.vllm_all_reduce_rmsnorm`` (or ``..._quant``), whose fallback is vLLM's
unfused ops. :func:`install` (the plugin platform's ``check_and_update_config``) makes it
inductor's post-grad pre pass, before vLLM's pass manager, except where vLLM opts out of its own
fusion. It rewrites [tokens, hidden] tensors of one dtype, ``x`` contiguous, a weight given; with
the add, only where the norm alone reads the sum.

Design notes: docs/INTEGRATIONS.md#integrations-vllm-fusion
"""

from __future__ import annotations

import operator
from collections import Counter
from dataclasses import dataclass
from typing import Optional

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.fx import Graph, Node

from autosymm.epilogue import NVFP4_BLOCK

from . import vllm_fusion_quant as quant_fusion  # the quantized chains
from .identity import code_identity
from . import vllm_flashinfer  # registers the run-time ops (with autosymm.integrations.vllm_ops)
from .vllm_ops import _overload, _val

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_FLOAT_CASTS = (torch.ops.prims.convert_element_type.default, torch.ops.aten._to_copy.default)


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


@dataclass
class _Match:
    """One all-reduce -> norm pair: the nodes, the fused op's arguments, the norm's output node
    ``y`` (None where the graph reads the add's output only) and whether the graph reads the new
    residual (with the add)."""

    norm: Node
    summed: Node
    args: tuple  # (x, residual, raw weight, eps, group_name): the fused ops' first 5 arguments
    gemma: bool
    y: Optional[Node]
    residual_read: bool = True


class VllmAllReduceRMSNormPass(CustomGraphPass):
    """The pass (module docstring); ``rewrites`` counts the fusions made, ``patterns`` them by
    pattern ('add_rms', 'rms', 'add_gemma', 'gemma', 'add_rms_fp8', 'rms_fp8', 'add_rms_nvfp4',
    'rms_nvfp4')."""

    def __init__(self) -> None:
        self.rewrites = 0
        self.patterns: Counter = Counter()

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

    def uuid(self) -> str:
        """What vLLM and inductor key compiles by (autosymm.integrations.identity): this pass's
        modules and the run-time ops it inserts."""
        return code_identity(__name__, quant_fusion.__name__, "autosymm.integrations.vllm_ops")

    def __deepcopy__(self, memo) -> "VllmAllReduceRMSNormPass":
        # VllmBackend deep-copies the inductor config it compiles with (compilation/backends.py:893):
        # the pass stays the one that counts (it holds no per-compile state)
        return self

    def __reduce__(self):
        # a config pickled to vLLM's workers carries the worker's own process-wide pass
        return _process_pass, ()

    def _try(self, graph: Graph, norm: Node, sum_op, with_residual: bool, vllm_pass) -> None:
        match = _match(norm, sum_op, with_residual)
        if match is None:
            return
        x, residual, weight, eps, _ = match.args
        use = quant_fusion.quant_use(match.y) if match.y is not None and not match.gemma else None
        if use is not None:  # vLLM's quantized patterns take raw weights only: a Gemma norm fuses unquantized
            if not _quant_eligible(use, _val(x), graph, match.norm):
                return  # left to vLLM's pass, whose quantized pattern may take it
            max_tokens = _vllm_fused_max_tokens(vllm_pass, _val(x), _val(weight), eps, use.form)
            if residual is not None and not match.residual_read:
                # vLLM's quantized add patterns return the new residual; unread, only its pair
                # pattern without it matches (allreduce_rms_fusion.py:476-482 vs 726, 922)
                max_tokens = -abs(max_tokens)
            if max_tokens < 0:  # vLLM's pass fuses the pair and leaves the quant: so does this one
                use, max_tokens = None, -max_tokens
        else:
            max_tokens = _vllm_fused_max_tokens(vllm_pass, _val(x), _val(_norm_weight(match)), eps)
        if max_tokens > 0:
            new = _flashinfer_form(graph, match, use, vllm_pass)
        else:
            new = _functional(graph, match, use)
        _replace(graph, match, use, *new)
        key = "" if use is None else "_" + quant_fusion.FORMS[use.form]
        self.rewrites += 1
        self.patterns[("add_" if residual is not None else "") + ("gemma" if match.gemma else "rms") + key] += 1


def _functional(graph: Graph, match: _Match, use) -> tuple[Node, Node, Optional[Node]]:
    """Where vLLM's pass would not fuse: ``autosymm.vllm_all_reduce_rmsnorm`` of the pair, or
    ``autosymm.vllm_all_reduce_rmsnorm_quant`` of the pair and its quant chain; (its items: the
    norm or quantized output, the sum, NVFP4's scales or None)."""
    norm, summed = match.norm, match.summed
    x = _val(match.args[0])
    sum_val = summed.meta.get("val") if match.args[1] is None else norm.meta["val"][1]
    with graph.inserting_before(norm):
        if use is None:
            fused = graph.call_function(torch.ops.autosymm.vllm_all_reduce_rmsnorm.default, match.args + (match.gemma,))
            fused.meta["val"] = (torch.empty_like(x), torch.empty_like(x))
            return _item(graph, fused, 0, fused.meta["val"][0]), _item(graph, fused, 1, sum_val), None
        fused = graph.call_function(torch.ops.autosymm.vllm_all_reduce_rmsnorm_quant.default,
                                    match.args + (use.form, use.scale))
        fused.meta["val"] = quant_fusion.fake_outputs(x, use.form)
        scales_out = use.outputs[1]
        scales = _item(graph, fused, 2, scales_out.meta.get("val")) if scales_out is not None else None
        return _item(graph, fused, 0, fused.meta["val"][0]), _item(graph, fused, 1, sum_val), scales


def _flashinfer_form(graph: Graph, match: _Match, use, vllm_pass) -> tuple[Node, Node, Optional[Node]]:
    """Where vLLM's pass would fuse: its FlashInfer replacement with autosymm's op in front
    (autosymm.integrations.vllm_flashinfer), on the same buffers."""
    # vLLM is optional: imported only when vLLM runs
    from vllm.compilation.passes.fusion import allreduce_rms_fusion as fusion

    codes = fusion.flashinfer_comm.AllReduceFusionPattern
    x, residual, weight, eps, group_name = match.args
    params = vllm_pass.allreduce_params.get_trtllm_fused_allreduce_kwargs()
    if use is None:
        site = vllm_flashinfer.Site(x, residual, weight, eps, group_name, params, codes.kARResidualRMSNorm,
                                    weight_bias=1.0 if match.gemma else 0.0)
    else:
        nvfp4 = quant_fusion.FORMS[use.form] == "nvfp4"
        packed, scales = use.buffers
        site = vllm_flashinfer.Site(
            x, residual, weight, eps, group_name, params,
            codes.kARResidualRMSNormFP4Quant if nvfp4 else codes.kARResidualRMSNormFP8Quant,
            scale=use.scale, quant_out=packed, scale_out=scales)
    return vllm_flashinfer.write(graph, match.norm, site)


def _replace(graph: Graph, match: _Match, use, out: Node, new_sum: Node, scales: Optional[Node]) -> None:
    """The graph reads ``out`` where it read the norm's output (or the quant chain's), ``new_sum``
    where it read the sum (or residual + sum), ``scales`` where it read NVFP4's scales; the
    replaced nodes no longer read go (a quant buffer the new call writes stays)."""
    norm, summed = match.norm, match.summed
    if use is not None:
        for old, new in zip(use.outputs, (out, scales)):
            if old is not None:
                old.replace_all_uses_with(new)
    items = tuple(u for u in norm.users if u.target is operator.getitem)
    if match.args[1] is not None:  # fused_add_rms_norm's items: 0 the norm, 1 residual + sum
        for item in items:
            if item.args[1] == 1 or use is None:
                item.replace_all_uses_with(new_sum if item.args[1] == 1 else out)
    else:
        if use is None:
            norm.replace_all_uses_with(out)
        summed.replace_all_uses_with(new_sum, delete_user_cb=lambda user: user is not norm)
    for node in (use.nodes if use is not None else ()) + items + (norm, summed):
        if not node.users and node.op == "call_function":
            graph.erase_node(node)
    for node in (out, new_sum, scales):
        if node is not None and not node.users and node.target is operator.getitem:
            graph.erase_node(node)


def _item(graph: Graph, node: Node, index: int, val) -> Node:
    item = graph.call_function(operator.getitem, (node, index))
    item.meta["val"] = val
    return item


def _norm_weight(match: _Match):
    """The norm's own weight argument (Gemma's ``w.float() + 1.0``), for vLLM's size check."""
    return match.norm.args[2] if match.args[1] is not None else match.norm.args[1]


def _match(norm: Node, sum_op, with_residual: bool) -> Optional[_Match]:
    """The pair ending in ``norm`` where the pass rewrites it (module docstring), else None."""
    names = ("x", "x_residual", "weight", "epsilon", "variance_size") if with_residual else \
        ("x", "weight", "epsilon", "variance_size")
    norm_args = _args(norm, names, {"variance_size": None})
    if norm_args is None or norm_args["variance_size"] is not None:
        return None
    summed, weight = norm_args["x"], norm_args["weight"]
    residual = norm_args.get("x_residual")
    if not (isinstance(summed, Node) and summed.op == "call_function" and summed.target is sum_op
            and isinstance(weight, Node)):
        return None
    if with_residual and len(summed.users) != 1:
        return None
    sum_args = _args(summed, ("tensor", "group_name"), {})
    gemma_weight = _gemma_weight(weight)
    raw_weight = gemma_weight if gemma_weight is not None else weight
    x = _val(sum_args["tensor"]) if sum_args else None
    if x is None or not _eligible(x, _val(residual) if with_residual else x, _val(raw_weight)):
        return None
    if with_residual:
        outs = [u for u in norm.users if u.target is operator.getitem and u.args[1] == 0]
        if len(norm.users) != sum(u.target is operator.getitem for u in norm.users):
            return None  # the tuple itself is read: the plain rewrite's tuple stands in, a quant chain's would not
        y = outs[0] if len(outs) == 1 else None
        residual_read = any(u.args[1] == 1 and u.users for u in norm.users)
    else:
        y, residual_read = norm, True
    return _Match(norm, summed, (sum_args["tensor"], residual, raw_weight, float(norm_args["epsilon"]),
                                 sum_args["group_name"]), gemma_weight is not None, y, residual_read)


def _quant_eligible(use, x, graph: Graph, norm: Node) -> bool:
    """autosymm serves the chain: NVFP4 of bf16 / fp16 with hidden a multiple of 16, the scale
    defined before the norm (the fused call takes the norm's place)."""
    if quant_fusion.FORMS[use.form] == "nvfp4" and (x.dtype == torch.float32 or x.shape[1] % NVFP4_BLOCK):
        return False
    if use.scale.op in ("placeholder", "get_attr"):
        return True
    order = {node: i for i, node in enumerate(graph.nodes)}
    return order[use.scale] < order[norm]


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


def _vllm_fusion_pass():
    """vLLM's ``AllReduceFusionPass`` in the pass manager compiling now (vLLM's
    PostGradPassManager is inductor's post-grad post pass, compilation/backends.py:999), or None."""
    from torch._inductor import config as inductor_config  # torch._inductor: ~1 s of imports; only a compile needs it

    manager = inductor_config.post_grad_custom_post_pass
    for candidate in getattr(manager, "passes", ()):
        if type(candidate).__name__ == "AllReduceFusionPass":
            return candidate
    return None


def _vllm_fused_max_tokens(vllm_pass, x, weight, eps: float, form: Optional[str] = None) -> int:
    """vLLM's ``max_token_num`` where its pass fuses this call now (enabled, this compile range
    applicable, a pattern of its epsilons and model dtype, vLLM's dtype check), else 0
    (compilation/passes/fusion/allreduce_rms_fusion.py:1069-1132). With a quant chain ``form``
    (vllm_fusion_quant.FORMS): negative where vLLM's pass has no quantized pattern for it and fuses
    the norm alone (1051-1090: no quant workspace; NVFP4 below sm100; the FP8 pattern of the other
    QuantFP8 form, matcher_utils.py:384)."""
    if vllm_pass is None or getattr(vllm_pass, "disabled", True) or eps not in (1e-5, 1e-6):
        return 0
    from vllm.compilation.passes.pass_manager import get_pass_context  # vLLM is optional: imported only when vLLM runs

    if not vllm_pass.is_applicable_for_range(get_pass_context().compile_range):
        return 0
    if x.dtype != vllm_pass.model_dtype:
        return 0
    max_tokens = int(vllm_pass.max_token_num)
    if form is None:
        return max_tokens
    return max_tokens if _vllm_has_quant_pattern(vllm_pass, form) else -max_tokens


def _vllm_has_quant_pattern(vllm_pass, form: str) -> bool:
    """Whether vLLM's enabled pass registered its quantized pattern of ``form`` (allreduce_rms_fusion.py:1051-1090)."""
    if not getattr(vllm_pass, "supports_quant_fusion", False):
        return False
    if form == "nvfp4":
        from vllm.platforms import current_platform  # vLLM is optional: imported only when vLLM runs

        return bool(current_platform.has_device_capability(100))
    # vLLM is optional: imported only when vLLM runs
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8

    return (form == "fp8") == bool(QuantFP8.enabled())  # MatcherQuantFP8's form is QuantFP8's


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
    compiles (``CompilationMode.VLLM_COMPILE``) with TP > 1, unless vLLM turned its own all-reduce
    fusion off as an opt-out (:func:`opted_out`); True when it is there. vLLM's own
    ``fuse_allreduce_rms`` stays as vLLM set it: its pass keeps the FlashInfer workspace and its
    replacement's parameters, which the FlashInfer form autosymm writes uses."""
    from vllm.config import CompilationMode  # vLLM is optional: imported only when vLLM runs

    compilation = vllm_config.compilation_config
    if (vllm_config.parallel_config.tensor_parallel_size <= 1 or compilation.mode != CompilationMode.VLLM_COMPILE
            or opted_out(vllm_config)):
        return False
    current = compilation.inductor_compile_config.get(PRE_PASS_KEY)
    passes = list(current) if isinstance(current, (list, tuple)) else [] if current is None else [current]
    if not any(isinstance(p, VllmAllReduceRMSNormPass) for p in passes):
        passes.insert(0, PASS)
    compilation.inductor_compile_config[PRE_PASS_KEY] = passes[0] if len(passes) == 1 else passes
    return True


def opted_out(vllm_config) -> str:
    """Why vLLM turned its all-reduce + RMSNorm fusion off as an opt-out, so autosymm's pass stays
    out too ('' where it did not): ``VLLM_BATCH_INVARIANT=1`` (config/vllm.py:184-186, the fused
    path is not batch-invariant), an optimization level below O2 (:260, :281), or
    ``fuse_allreduce_rms=False`` where vLLM's own check would turn it on (the user's choice). Off
    for want of FlashInfer or of sm90/sm100 (:193-202) is no opt-out: the pass serves there, its
    fallback vLLM's unfused ops."""
    import vllm.envs as envs  # vLLM is optional: imported only when vLLM runs
    # vLLM is optional: imported only when vLLM runs
    from vllm.config.vllm import OptimizationLevel, enable_allreduce_rms_fusion

    if envs.VLLM_BATCH_INVARIANT:
        return "VLLM_BATCH_INVARIANT=1"
    if vllm_config.compilation_config.pass_config.fuse_allreduce_rms:
        return ""
    if vllm_config.optimization_level < OptimizationLevel.O2:
        return f"optimization level {vllm_config.optimization_level.name}"
    return "fuse_allreduce_rms=False" if enable_allreduce_rms_fusion(vllm_config) else ""


#: The pass the plugin installs (one per process, so its count covers every compile).
PASS = VllmAllReduceRMSNormPass()


def _process_pass() -> VllmAllReduceRMSNormPass:
    """:data:`PASS` (what an unpickled pass becomes)."""
    return PASS
