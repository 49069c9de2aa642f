"""Adapters for the interfaces serving and training stacks call (runtime side: no tuning imports).

* :class:`AutosymmCustomAllReduce` — the custom-all-reduce slot of vLLM and SGLang, built with
  their constructor arguments and CPU group (``should_custom_ar``, ``custom_all_reduce``,
  ``capture``, ``fused_allreduce_rmsnorm``, ``close``).
* :class:`AutosymmAll2AllManager` — MoE ``dispatch``/``combine`` over autosymm's dp->ep / ep->dp
  conversions; :class:`VllmAll2AllManager` and :class:`TitanTokenDispatcher` put it in vLLM's
  and torchtitan's shapes.
* ``autosymm.integrations.fusion_pass`` — the torch.compile pass that fuses all-reduce ->
  residual add -> RMSNorm (imported on demand: it loads inductor).
* ``autosymm.integrations.vllm_plugin`` / ``sglang_plugin`` — the stacks' plugin entry points.
"""

from .custom_all_reduce import AutosymmCustomAllReduce
from .moe_all2all import AutosymmAll2AllManager, DispatchHandle, Dispatched
from .moe_shapes import TitanTokenDispatcher, VllmAll2AllManager

__all__ = ["AutosymmAll2AllManager", "AutosymmCustomAllReduce", "DispatchHandle", "Dispatched",
           "TitanTokenDispatcher", "VllmAll2AllManager"]
