"""The collectives autosymm serves, one registered record each (:class:`Collective`, one module per
op): how a call becomes a Problem and its database key (bucket unit, shape), the public entry
(cache key, local checks, the launch signature of its custom op), its ``torch.ops.autosymm.*``
ops and fake implementations, its fallback backends, the dispatcher's lookup fallbacks and growth
model, and its default tuning points as data. The API, dispatcher, tuner, bench, CLI and the
custom-op registration (autosymm.ops) iterate :data:`ALL` (registry order) or ask :func:`get`.

How to add a collective (say a reduce-scatter): write ``collectives/reduce_scatter.py`` with a
subclass of :class:`Collective` giving ``check_problem``, ``problems`` (its tuning points),
``call_text`` / ``check_call`` (its entry's local checks, returning the Problem), ``custom_ops``
(impl + fake; entries take ``(output, input)``), and one instance: its name (the DB ``op``),
``bucket_unit='bytes'`` (of the full, unsharded tensor), its NCCL fallback backend (registered in
autosymm.backends) as ``fallback`` and ``fallback_order``, its :class:`TuningPoints`. Add the
instance to :data:`ALL` below; its public function builds a cache key led by the record, looks it
up in the group state's cache and on a miss calls :func:`prepare_call`; the tuning side adds ``tuning/ops/reduce_scatter.py`` (inputs, reference,
workspace needs) and one line in its registry (autosymm.tuning.ops).
"""

from __future__ import annotations

from .all_reduce import ALL_REDUCE
from .all_gather import ALL_GATHER
from .all_reduce_rmsnorm import ALL_REDUCE_RMSNORM
from .base import Collective, CustomOp, Lookups, PointRequest, TuningPoints, prepare_call, refuse_call
from .moe import DP_TO_EP, EP_TO_DP
from .reduce_scatter import REDUCE_SCATTER

#: Every registered collective, in registry order (the order of `--ops` choices, tables, sweeps).
ALL: tuple[Collective, ...] = (ALL_REDUCE, DP_TO_EP, EP_TO_DP, ALL_REDUCE_RMSNORM, REDUCE_SCATTER, ALL_GATHER)
_BY_NAME = {record.name: record for record in ALL}


def names() -> tuple[str, ...]:
    """Every registered op name, in registry order."""
    return tuple(_BY_NAME)


def get(name: str) -> Collective:
    """The record of op ``name``; ValueError naming the registered ops otherwise."""
    record = _BY_NAME.get(name)
    if record is None:
        raise ValueError(f"op={name!r} is not one of {names()}")
    return record


def default_tuned() -> tuple[str, ...]:
    """The ops `autosymm tune` tunes without ``--ops`` (registry order)."""
    return tuple(record.name for record in ALL if record.tuned_by_default)


__all__ = ["ALL", "ALL_GATHER", "ALL_REDUCE", "ALL_REDUCE_RMSNORM", "Collective", "CustomOp", "DP_TO_EP", "EP_TO_DP", "Lookups",
           "PointRequest", "REDUCE_SCATTER", "TuningPoints", "default_tuned", "get", "names", "prepare_call",
           "refuse_call"]
