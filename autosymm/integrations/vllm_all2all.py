"""autosymm's all-to-all manager for vLLM 0.33.0's expert-parallel MoE (checked against its sources).

vLLM picks its manager by name from ``parallel_config.all2all_backend``, a pydantic ``Literal``, so
autosymm serves under the default ``"allgather_reducescatter"``: the plugin's
``AutosymmCudaCommunicator`` calls :func:`install`, which replaces the ``AgRsAll2AllManager`` vLLM
just built by :class:`AutosymmAgRsAll2AllManager`, its subclass. autosymm's dp->ep / ep->dp
conversions (autosymm.integrations.moe_rows) serve the naive prepare/finalize's ``dispatch`` and
the ``combine`` / ``combine_into_output`` after it where every condition holds (expert parallelism
over this group with linear placement, the group's ranks, dtypes, room inside a capture, and a
tuned row deciding both conversions of the call for autosymm's Triton conversion), each the same
on every rank; everything else, untuned calls included, is vLLM's ``AgRsAll2AllManager``
unchanged (its all-gatherv and reduce-scatterv), exactly what vLLM runs without autosymm.

Design notes: docs/INTEGRATIONS.md#integrations-vllm-all2all
"""

from __future__ import annotations

import functools
import threading
from typing import Optional

import torch
import torch.distributed as dist

from autosymm.problem import MoEShape, Problem, dtype_name
from autosymm.spec import DP_TO_EP, EP_TO_DP

from . import serving
from autosymm.runtime.group import state_of
from .moe_rows import SUMMED_DTYPES, GatheredRows, row_view

MANAGER_QUALNAME = "autosymm.integrations.vllm_all2all.AutosymmAgRsAll2AllManager"


def install(comm) -> None:
    """Replace ``comm.all2all_manager`` by :class:`AutosymmAgRsAll2AllManager` where vLLM built its
    all-gather / reduce-scatter manager (``all2all_backend`` ``allgather_reducescatter``, vLLM's
    default, or ``naive``); other managers, and none, stay. Collective over the group's ranks, as
    vLLM's construction is."""
    # vLLM is optional: imported only when vLLM runs
    from vllm.distributed.device_communicators.all2all import AgRsAll2AllManager

    manager = getattr(comm, "all2all_manager", None)
    if type(manager) is not AgRsAll2AllManager:
        return
    comm.all2all_manager = _manager_class()(comm.cpu_group, manager.tcp_store_group,
                                             device_group=comm.device_group)


def moe_layout(vllm_config, world_size: int) -> tuple[Optional[int], str]:
    """(num_experts, '') of the MoE layers ``vllm_config`` registered when autosymm can place their
    experts on a group of ``world_size`` ranks, else (None, why not)."""
    compilation = getattr(vllm_config, "compilation_config", None)
    context = getattr(compilation, "static_forward_context", None) or {}
    names = getattr(compilation, "static_all_moe_layers", None) or []
    if not names:
        return None, "no MoE layer registered"
    configs = [getattr(context.get(name), "moe_config", None) for name in names]
    if any(config is None for config in configs):
        return None, "a registered MoE layer has no moe_config"
    layouts = {(c.num_experts, c.moe_parallel_config.use_ep, c.moe_parallel_config.ep_size) for c in configs}
    if len(layouts) > 1:
        return None, f"the MoE layers differ in (num_experts, use_ep, ep_size): {sorted(layouts)}"
    n_experts, use_ep, ep_size = layouts.pop()
    if not use_ep or ep_size != world_size:
        return None, f"experts are not expert-parallel over this group (use_ep={use_ep}, ep_size={ep_size}, " \
                     f"group of {world_size})"
    return int(n_experts), ""


class Served:
    """autosymm's side of the manager: the conversions per expert count, the pending call per thread."""

    def __init__(self, device_group, ranks: list[int], reason: str = "") -> None:
        self.device_group = device_group
        self.ranks = ranks
        self.reason = reason  #: why nothing is served on this group ('' where something may be)
        self.rows: dict[int, object] = {}  # n_experts -> GatheredRows
        self.pending = threading.local()  # DBO runs each micro-batch on its own thread
        self.layout: Optional[tuple[Optional[int], str]] = None
        self.why_not = ""  #: why the last dispatch was vLLM's ('' when autosymm served it)
        self.tuned: dict[tuple, bool] = {}  # a call's (experts, d, k, tokens, dtype, mode) -> tuned rows decide it

    def rows_for(self, n_experts: int):
        if n_experts not in self.rows:  # collective: every rank reaches the first call together
            self.rows[n_experts] = GatheredRows(n_experts, self.device_group)
        return self.rows[n_experts]

    def take(self):
        """The pending served dispatch of this thread (forgotten)."""
        call = getattr(self.pending, "call", None)
        self.pending.call = None
        return call


def _capturable(rows, hidden: torch.Tensor, k: int, n_tokens: int) -> bool:
    """Whether both conversions of this call run the Triton kernels on the workspace as it is."""
    # a backend loads on first use (autosymm.backends), not with this module
    from autosymm.backends.triton_moe import TRITON_MOE, fits

    state = state_of(rows.manager.group)
    shape = MoEShape(hidden.shape[1], rows.manager.n_experts, k)
    for op in ("dp_to_ep", "ep_to_dp"):
        problem = Problem.moe(op, shape, n_tokens, dtype_name(hidden.dtype), rows.world_size)
        if state.workspace is None or not fits(problem, state.caps.moe_bytes) or \
                state.decide(problem, "graph").backend != TRITON_MOE.name:
            return False
    return True


def tuned(served: Served, n_experts: int, rows: torch.Tensor, k: int, n_tokens: int, mode: str) -> bool:
    """Whether tuned rows decide both conversions of a call (``rows`` [tokens, d] as they travel,
    ``n_tokens`` per rank after padding) for something other than NCCL (autosymm.integrations.serving.
    serves), asked once per call shape. Collective the first time on the group (autosymm.explain)."""
    key = (n_experts, rows.shape[1], k, n_tokens, rows.dtype, mode)
    if key not in served.tuned:
        shape = MoEShape(rows.shape[1], n_experts, k)
        served.tuned[key] = all(
            serving.serves(serving.explained(served.device_group, spec, Problem.moe(
                spec.name, shape, n_tokens, dtype_name(rows.dtype), len(served.ranks)), mode), spec)
            for spec in (DP_TO_EP, EP_TO_DP))
    return served.tuned[key]


def why_not_dispatch(manager, dist_group, hidden_states, topk_ids, sizes) -> tuple[str, Optional[object]]:
    """('', GatheredRows) where autosymm serves this dispatch, else (why not, None); the same on every rank."""
    served = manager.autosymm
    if served.reason:
        return served.reason, None
    if list(dist_group.ranks) != served.ranks:
        return f"the call's group {dist_group.unique_name} is not the EP group's ranks", None
    if served.layout is None:
        from vllm.config import get_current_vllm_config_or_none  # vLLM is optional: imported only when vLLM runs

        served.layout = moe_layout(manager.vllm_config or get_current_vllm_config_or_none(), len(served.ranks))
    n_experts, why = served.layout
    if n_experts is None:
        return why, None
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 2 or topk_ids.dim() != 2 or \
            row_view(hidden_states.contiguous()) is None:
        return "hidden_states are not [tokens, d] rows autosymm moves", None
    rows, n_tokens = row_view(hidden_states.contiguous()), max(max(sizes), 1)
    capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    if capturing:
        if n_experts not in served.rows:  # setting up allocates and agrees: never inside a capture
            return "the first call on the group is inside a CUDA-graph capture", None
        if not _capturable(served.rows[n_experts], rows, topk_ids.shape[1], n_tokens):
            return "the Triton conversion cannot serve this call inside the capture", None
    if not tuned(served, n_experts, rows, topk_ids.shape[1], n_tokens, "graph" if capturing else "eager"):
        return "no tuned row decides this call for autosymm's conversion: vLLM's own collectives", None
    return "", served.rows_for(n_experts)


@functools.cache
def _manager_class():
    # vLLM is optional: imported only when vLLM runs
    from vllm.distributed.device_communicators.all2all import AgRsAll2AllManager

    class AutosymmAgRsAll2AllManager(AgRsAll2AllManager):
        """vLLM's all-gather / reduce-scatter manager with autosymm's conversions serving
        ``dispatch`` and its combine where they apply (module docstring). ``device_group``: the
        group's device group (vLLM's ``CudaCommunicator.device_group``)."""

        def __init__(self, cpu_group, tcp_store_group=None, *, device_group=None):
            super().__init__(cpu_group, tcp_store_group)
            from vllm.config import get_current_vllm_config_or_none  # vLLM is optional: imported only when vLLM runs

            self.vllm_config = get_current_vllm_config_or_none()
            stateless = tcp_store_group is not None or device_group is None
            reason = ("a stateless group (elastic EP)" if stateless else
                      "the group spans nodes" if self.internode else "")
            ranks = [] if stateless else dist.get_process_group_ranks(cpu_group)
            self.autosymm = Served(device_group, ranks, reason)

        def dispatch(self, hidden_states, topk_weights, topk_ids, is_sequence_parallel=False, extra_tensors=None):
            self.autosymm.take()
            dist_group = self._get_comm_group(is_sequence_parallel)
            sizes = self._get_sizes(hidden_states.shape[0], dist_group)
            self.autosymm.why_not, rows = why_not_dispatch(self, dist_group, hidden_states, topk_ids, sizes)
            if rows is None:
                return super().dispatch(hidden_states, topk_weights, topk_ids, is_sequence_parallel, extra_tensors)
            hidden, ids, call = rows.dispatch(hidden_states, topk_ids, sizes)
            others = dist_group.all_gatherv([topk_weights, *(extra_tensors or [])], dim=0, sizes=list(sizes))
            self.autosymm.pending.call = (dist_group, rows, call)
            if extra_tensors is None:
                return hidden, others[0], ids
            return hidden, others[0], ids, others[1:]

        def dispatch_router_logits(self, hidden_states, router_logits, is_sequence_parallel=False,
                                   extra_tensors=None):
            self.autosymm.take()
            return super().dispatch_router_logits(hidden_states, router_logits, is_sequence_parallel, extra_tensors)

        def _served_combine(self, hidden_states, is_sequence_parallel):
            """autosymm's combine of the pending served dispatch, or None (vLLM's then runs)."""
            pending = self.autosymm.take()
            if pending is None:
                return None
            dist_group, rows, call = pending
            if (self._get_comm_group(is_sequence_parallel) is not dist_group or hidden_states.dim() != 2
                    or hidden_states.shape[0] != call.rows.numel() or hidden_states.dtype not in SUMMED_DTYPES):
                return None
            return rows.combine(hidden_states, call)

        def combine(self, hidden_states, is_sequence_parallel=False):
            out = self._served_combine(hidden_states, is_sequence_parallel)
            return super().combine(hidden_states, is_sequence_parallel) if out is None else out

        def combine_into_output(self, hidden_states, output, is_sequence_parallel=False):
            out = self._served_combine(hidden_states, is_sequence_parallel)
            if out is None:
                return super().combine_into_output(hidden_states, output, is_sequence_parallel)
            output.copy_(out)
            return output

        def destroy(self):
            """Stop serving (later calls are vLLM's) and release autosymm's conversions."""
            for rows in self.autosymm.rows.values():
                rows.destroy()
            self.autosymm = Served(None, [], "destroyed")
            super().destroy()

    AutosymmAgRsAll2AllManager.__module__ = __name__
    AutosymmAgRsAll2AllManager.__qualname__ = "AutosymmAgRsAll2AllManager"  # pickles by reference
    return AutosymmAgRsAll2AllManager


def __getattr__(name: str):
    """:class:`AutosymmAgRsAll2AllManager`, built (importing vLLM) on first access."""
    if name == "AutosymmAgRsAll2AllManager":
        return _manager_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
