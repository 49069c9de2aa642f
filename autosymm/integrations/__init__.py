"""Adapters for the interfaces serving and training stacks call (runtime side: no tuning imports).

* :class:`AutosymmCustomAllReduce` — the custom-all-reduce slot of vLLM and SGLang, built with
  their constructor arguments and CPU group (``should_custom_ar``, ``custom_all_reduce``,
  ``capture``, ``fused_allreduce_rmsnorm``, ``close``).
* :class:`AutosymmAll2AllManager` — MoE ``dispatch``/``combine`` over autosymm's dp->ep / ep->dp
  conversions; :class:`TitanTokenDispatcher` puts it in torchtitan's shape, :class:`GatheredRows`
  in vLLM's gathered-rows layout (uneven token counts), which
  ``autosymm.integrations.vllm_all2all`` serves as a subclass of vLLM's own all-to-all manager.
* ``autosymm.integrations.fusion_pass`` — the torch.compile pass that fuses all-reduce ->
  residual add -> RMSNorm (imported on demand: it loads inductor).
* ``autosymm.integrations.vllm_plugin`` / ``sglang_plugin`` — the stacks' plugin entry points.
"""

from .custom_all_reduce import AutosymmCustomAllReduce
from .moe_all2all import AutosymmAll2AllManager, DispatchHandle, Dispatched
from .moe_rows import GatheredRows
from .moe_shapes import TitanTokenDispatcher

__all__ = ["AutosymmAll2AllManager", "AutosymmCustomAllReduce", "DispatchHandle", "Dispatched", "GatheredRows",
           "TitanTokenDispatcher"]
