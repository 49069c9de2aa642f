"""The collectives' front doors, one module per op: its public function and hot path, its checks,
its custom ops (and its replay, where it has one). Each builds on the runtime (autosymm.runtime)
and its op's spec (autosymm.spec); :data:`DOORS` is the entry list autosymm.ops registers the
custom ops of, in registry order.

How to add a collective: ARCHITECTURE.md ("A new collective").
"""

from __future__ import annotations

from . import all_gather, all_reduce, all_reduce_rmsnorm, moe, reduce_scatter

#: Every op's door, in the specs' registry order (autosymm.spec.ALL).
DOORS = (all_reduce.DOOR, moe.DP_TO_EP_DOOR, moe.EP_TO_DP_DOOR, all_reduce_rmsnorm.DOOR, reduce_scatter.DOOR,
         all_gather.DOOR)
