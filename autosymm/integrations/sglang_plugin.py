"""SGLang plugin: autosymm first in the custom-all-reduce slot and the fused all-reduce + RMSNorm,
and warm-up tuning at SGLang's CUDA-graph set-up (checked against SGLang 0.5.23).

Installing autosymm declares the ``sglang.srt.plugins`` entry point ``autosymm`` -> :func:`register`,
which SGLang's ``load_plugins()`` runs in every process. Three AROUND hooks: :data:`CA_DISPATCH`
(``dispatch_custom_allreduce``) builds SGLang's own custom all-reduce with autosymm first in its
slot calls (of a generated subclass of its class, so ``isinstance`` checks and SGLang's V2 fusions
hold), or autosymm's standalone slot where SGLang's is disabled or failed; :data:`FUSED`
(``flashinfer_allreduce_residual_rmsnorm``) runs autosymm's fused op where the group's slot holds
an autosymm adapter and a tuned row decides the call, else FlashInfer's; :data:`WARMUP`
(``ModelRunner.init_cuda_graphs``) runs SGLang's warm-up inside ``autosymm.autotune`` with
``AUTOSYMM_STACK_AUTOTUNE``'s budget. ``SGLANG_PLUGINS`` selects plugins; nothing here imports
SGLang until :func:`register` runs.

Design notes: docs/INTEGRATIONS.md#integrations-sglang-plugin
"""

from __future__ import annotations

import functools
import logging
from typing import Optional

import torch
import torch.distributed as dist

from autosymm.backends.stack import StackPath
from autosymm.runtime.group import state_of

from .custom_all_reduce import wrap
from .serving import AutosymmServing, stack_warmup

log = logging.getLogger("autosymm")

CA_DISPATCH = "sglang.srt.distributed.device_communicators.custom_all_reduce.dispatch_custom_allreduce"
FUSED = "sglang.srt.layers.flashinfer_comm_fusion.flashinfer_allreduce_residual_rmsnorm"


#: SGLang's model runner's CUDA-graph set-up: its warm-up runs and capture at every batch size
#: (srt/model_executor/model_runner.py:1170), which warm-up tuning wraps.
WARMUP = "sglang.srt.model_executor.model_runner.ModelRunner.init_cuda_graphs"


def register() -> None:
    """The ``sglang.srt.plugins`` entry point: register the three hooks (see the module docstring)."""
    # SGLang is optional: imported only when SGLang runs
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(CA_DISPATCH, dispatch_custom_allreduce, HookType.AROUND)
    HookRegistry.register(FUSED, fused_allreduce_residual_rmsnorm, HookType.AROUND)
    HookRegistry.register(WARMUP, tuned_warmup, HookType.AROUND)


def tuned_warmup(original, *args, **kwargs):
    """AROUND SGLang's CUDA-graph set-up: inside ``autosymm.autotune`` with
    ``AUTOSYMM_STACK_AUTOTUNE``'s budget (off: none), so the keys its warm-up calls are tuned."""
    with stack_warmup():
        return original(*args, **kwargs)


def stack_path(slot) -> StackPath:
    """SGLang's own all-reduce on ``slot``'s group without autosymm: its custom all-reduce where it
    takes the call, else the group's NCCL sum (SGLang's pynccl / torch fallback)."""
    serving = slot.autosymm

    def all_reduce(problem):
        def launcher(x: torch.Tensor) -> torch.Tensor:
            with serving.bypassed():
                own = slot.custom_all_reduce(x) if slot.should_custom_ar(x) else None
            if own is None:
                dist.all_reduce(x, group=serving.group)
                return x
            return x.copy_(own)
        return launcher

    return StackPath("sglang", {"all_reduce": all_reduce},
                     why_not=lambda problem, mode: "SGLang's custom all-reduce captures only inside SGLang's own "
                                                   "graph capture" if mode == "graph" else None)


def dispatch_custom_allreduce(original, *args, **kwargs):
    """AROUND ``dispatch_custom_allreduce``: the factory ``(group=..., device=...) -> adapter``
    wrapping the class SGLang would have built."""
    return functools.partial(build, original(*args, **kwargs))


def build(stack_class, group, device):
    """The slot over SGLang's ``stack_class(group=group, device=device)``
    (:func:`~autosymm.integrations.custom_all_reduce.wrap`: that object itself, its class a
    subclass of ``stack_class``, where it is enabled, so SGLang's ``isinstance(ca_comm,
    CustomAllReduceV2)`` paths stay on); where it cannot be built (SGLang then warns and goes
    without), autosymm's standalone slot. Under SGLang's deterministic inference autosymm reads
    only batch-invariant tuned rows (its deterministic setting). Collective."""
    try:
        inner = stack_class(group=group, device=device)
    except Exception as exc:  # what SGLang's own construction does with it: warn, go on without
        log.warning("autosymm: SGLang's custom all-reduce %s failed (%s); autosymm serves alone",
                    getattr(stack_class, "__name__", stack_class), exc)
        inner = None
    slot = wrap(inner, group=group, device=device, deterministic=_deterministic())
    state_of(slot.autosymm.group).attach_stack(stack_path(slot))  # SGLang's own path: the default to beat
    return slot


def _deterministic() -> Optional[bool]:
    """True under SGLang's deterministic inference (``SGLANG_ENABLE_DETERMINISTIC_INFERENCE``, read
    through SGLang's ``envs``), else None (autosymm's own default)."""
    from sglang.srt.environ import envs  # SGLang is optional: imported only when SGLang runs

    return True if envs.SGLANG_ENABLE_DETERMINISTIC_INFERENCE.get() else None


def serve_fused(slot, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                eps: float) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """``(norm_out, residual_out)`` from autosymm where ``slot`` carries autosymm (``.autosymm``, in
    place or standalone), is not disabled and a tuned row decides the fused call, else None."""
    serving = getattr(slot, "autosymm", None)
    if (isinstance(serving, AutosymmServing) and not getattr(slot, "disabled", True)
            and residual.shape == x.shape and serving.serves_fused(x)):
        return serving.all_reduce_rmsnorm(x, residual, weight, eps)
    return None


def fused_allreduce_residual_rmsnorm(original, input_tensor, residual, weight, eps=1e-6, **options):
    """AROUND FlashInfer's fused call: autosymm's where it serves (see the module docstring)."""
    # SGLang is optional: imported only when SGLang runs
    from sglang.srt.layers.flashinfer_comm_fusion import resolve_fusion_group

    _, _, coordinator = resolve_fusion_group(use_attn_tp_group=options.get("use_attn_tp_group", True))
    served = serve_fused(getattr(coordinator, "ca_comm", None), input_tensor, residual, weight, eps)
    return served if served is not None else original(input_tensor, residual, weight, eps, **options)
