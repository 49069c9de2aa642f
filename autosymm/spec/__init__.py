"""The collectives autosymm serves, as declarative specs, one module per op (:class:`OpSpec`): the
one record of an op, naming its door, backends, config types, tuning module and bench beside how a
call becomes a Problem and its database key (bucket unit, shape kind), its fallbacks, the
dispatcher's lookups and growth model, and its default tuning points.

The op registry: :data:`ALL` are the shipped ops, each registered at import by :func:`register`
(one line per op); another op registers itself with one call. Every other registry is derived
from the registered specs (:func:`registered`, registry order): the doors
(autosymm.collectives.doors), the backends (autosymm.backends), the tuning modules
(autosymm.tuning.ops), the benches (autosymm.bench.report.benches) and the config types
(autosymm.configs.config_types). The dispatcher, database, tuner, bench and CLI iterate
:func:`registered` or ask :func:`get`.
"""

from __future__ import annotations

from ..configs import AnyConfig
from ..problem import register_specs, registered_specs, spec_of
from .all_reduce import ALL_REDUCE
from .all_reduce_rmsnorm import ALL_REDUCE_RMSNORM
from .base import (STACK_BACKENDS, BytesKeyed, CallKey, Domain, Lookups, OpSpec, PointRequest, TokensKeyed,
                   TuningPoints, call_key, with_extra_sizes)
from .base import KEY_CAPTURING, KEY_DTYPE, KEY_EXTRA, KEY_SHAPE, KEY_SPEC, key_mode
from .kinds import BYTES, TOKENS, BucketUnit, Option, OptionError, ShapeKind, Values
from .moe import DP_TO_EP, EP_TO_DP
from .reduce_scatter import ALL_GATHER, REDUCE_SCATTER

#: The backend every op shares (autosymm.backends.local): a call with nothing to exchange. No op lists it.
NOOP = "noop"


def register(record: OpSpec) -> OpSpec:
    """Add ``record`` to the op registry (again: nothing changes) and return it. ValueError where it
    clashes with a registered op (another record of its name, a backend name listed with another
    entry, an option flag of another record) or names what it cannot (a config type that is no
    AnyConfig, the reserved backend 'noop')."""
    if not isinstance(record, OpSpec):
        raise ValueError(f"register: {record!r} is not an autosymm.spec.OpSpec")
    known = {spec.name: spec for spec in registered_specs()}
    if known.get(record.name, record) is not record:
        raise ValueError(f"register: op {record.name!r} is already registered (another record)")
    odd = [cls for cls in record.config_types if not (isinstance(cls, type) and issubclass(cls, AnyConfig))]
    if odd:
        raise ValueError(f"register: {record.name}'s config types {odd} are not autosymm.configs.AnyConfig classes")
    if NOOP in record.backends:
        raise ValueError(f"register: {record.name} lists the backend name {NOOP!r}, reserved for calls with "
                         "nothing to exchange")
    for other in known.values():
        clash = [name for name, entry in record.backends.items() if other.backends.get(name, entry) != entry]
        if clash:
            raise ValueError(f"register: {record.name} lists backend(s) {clash} with other entries than "
                             f"{other.name} does ({[other.backends[name] for name in clash]})")
        for mine, theirs in ((record.call_options, other.call_options), (record.sweep_options, other.sweep_options)):
            flags = {option.flag: option for option in theirs}
            clash = [option.flag for option in mine if flags.get(option.flag, option) is not option]
            if clash:
                raise ValueError(f"register: {record.name}'s option(s) {clash} are not {other.name}'s, whose "
                                 "flags they take (ops sharing a flag share its Option record)")
    register_specs((record,))
    return record


def registered() -> tuple[OpSpec, ...]:
    """Every registered op's spec, in registry order (the order of `--ops` choices, tables, sweeps)."""
    return registered_specs()


#: The ops autosymm ships, in registry order: one registry line each.
ALL: tuple[OpSpec, ...] = (ALL_REDUCE, DP_TO_EP, EP_TO_DP, ALL_REDUCE_RMSNORM, REDUCE_SCATTER, ALL_GATHER)
for _record in ALL:
    register(_record)

get = spec_of  # the spec of an op name; ValueError naming the registered ops otherwise


def names() -> tuple[str, ...]:
    """Every registered op name, in registry order."""
    return tuple(spec.name for spec in registered())


def default_tuned() -> tuple[str, ...]:
    """The ops `autosymm tune` tunes without ``--ops`` (registry order)."""
    return tuple(spec.name for spec in registered() if spec.tuned_by_default)


__all__ = ["STACK_BACKENDS", "STACK_BACKENDS", "ALL", "ALL_GATHER", "ALL_REDUCE", "ALL_REDUCE_RMSNORM", "BYTES", "BucketUnit", "BytesKeyed", "CallKey",
           "DP_TO_EP", "Domain", "EP_TO_DP", "Lookups", "NOOP", "OpSpec", "Option", "OptionError", "PointRequest",
           "REDUCE_SCATTER", "ShapeKind", "KEY_CAPTURING", "KEY_DTYPE", "KEY_EXTRA", "KEY_SHAPE", "KEY_SPEC", "TOKENS",
           "TokensKeyed", "TuningPoints", "Values", "call_key", "key_mode", "default_tuned", "get", "names", "register",
           "registered", "with_extra_sizes"]
