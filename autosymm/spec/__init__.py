"""The collectives autosymm serves, as declarative specs, one module per op (:class:`OpSpec`):
how a call becomes a Problem and its database key (bucket unit, shape kind), its fallback
backends, the dispatcher's lookups and growth model, and its default tuning points. The
dispatcher, database, backends, tuner, bench and CLI iterate :data:`ALL` (registry order) or ask
:func:`get`. This tuple is the entry list: it registers the specs with autosymm.problem (a
Problem finds its spec by name). Each op's front door is in autosymm.collectives.
"""

from __future__ import annotations

from ..problem import register_specs, spec_of
from .all_reduce import ALL_REDUCE
from .all_reduce_rmsnorm import ALL_REDUCE_RMSNORM
from .base import (BYTES, NO_SHAPE, TOKENS, BucketUnit, BytesKeyed, CallKey, Domain, Lookups, OpSpec, PointRequest, ShapeKind,
                   TokensKeyed, TuningPoints, call_key)
from .base import KEY_CAPTURING, KEY_DTYPE, KEY_EXTRA, KEY_SHAPE, KEY_SPEC, key_mode
from .moe import DP_TO_EP, EP_TO_DP
from .reduce_scatter import ALL_GATHER, REDUCE_SCATTER

#: Every registered collective, in registry order (the order of `--ops` choices, tables, sweeps).
ALL: tuple[OpSpec, ...] = (ALL_REDUCE, DP_TO_EP, EP_TO_DP, ALL_REDUCE_RMSNORM, REDUCE_SCATTER, ALL_GATHER)
register_specs(ALL)

get = spec_of  # the spec of an op name; ValueError naming the registered ops otherwise


def names() -> tuple[str, ...]:
    """Every registered op name, in registry order."""
    return tuple(spec.name for spec in ALL)


def default_tuned() -> tuple[str, ...]:
    """The ops `autosymm tune` tunes without ``--ops`` (registry order)."""
    return tuple(spec.name for spec in ALL if spec.tuned_by_default)


__all__ = ["ALL", "ALL_GATHER", "ALL_REDUCE", "ALL_REDUCE_RMSNORM", "BYTES", "BucketUnit", "BytesKeyed", "CallKey",
           "DP_TO_EP", "Domain", "EP_TO_DP", "Lookups", "NO_SHAPE", "OpSpec", "PointRequest", "REDUCE_SCATTER", "ShapeKind",
           "KEY_CAPTURING", "KEY_DTYPE", "KEY_EXTRA", "KEY_SHAPE",
           "KEY_SPEC", "TOKENS", "TokensKeyed", "TuningPoints", "call_key", "key_mode", "default_tuned", "get", "names"]
