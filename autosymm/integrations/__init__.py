"""Adapters for the interfaces serving and training stacks call (runtime side: no tuning imports).

* :class:`AutosymmCustomAllReduce` — the custom-all-reduce slot (``should_custom_ar``,
  ``custom_all_reduce``, ``capture``, ``close``) of vLLM/SGLang-style stacks.
* :class:`AutosymmAll2AllManager` — MoE ``dispatch``/``combine`` over autosymm's dp->ep / ep->dp
  conversions.
"""

from .custom_all_reduce import AutosymmCustomAllReduce
from .moe_all2all import AutosymmAll2AllManager, DispatchHandle, Dispatched

__all__ = ["AutosymmAll2AllManager", "AutosymmCustomAllReduce", "DispatchHandle", "Dispatched"]
