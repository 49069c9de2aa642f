"""The checked mode (``AUTOSYMM_CHECK_CALLS=1``): every call on a group agrees on its fingerprint
(op, dtypes, shapes, reduce op, mode) with every rank before it runs, and a difference raises on
every rank naming what differed, like ``TORCH_DISTRIBUTED_DEBUG=DETAIL``. Without it, ranks agree
only on a call's first use (its cache key), and different later calls hang or mislead as with
``torch.distributed``. On, nothing is served from a cache before the check (:func:`check_call`,
through the group's agreement channel and its deadline); replays of a captured graph run no
Python and are not checked. Cost: this rank's checks and four store round trips a call (measured:
docs/BENCHMARKS.md#cpu-host-costs); off, nothing of this runs (a :class:`CheckedCache` makes the
lookups miss only when on).

Design notes: docs/DISPATCH.md#runtime-call-check
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from .agreement import AgreementError, Exchange, differences, failures
from ..routing import ExptAssignment

_TAG = "check"


class CallMismatchError(AgreementError):
    """The ranks of a group made different calls (checked mode); raised on every rank."""


def describe(value: Any) -> Any:
    """One argument as the ranks compare it: a tensor's dtype and shape ('float32[4, 512]'), an
    expert assignment's size, a plain value itself."""
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).replace('torch.', '')}{list(value.shape)}"
    if isinstance(value, ExptAssignment):
        return f"{value.n_expts_tot} experts on {value.n_expt_shard} shards, {list(value.n_expts_per_shard)} each"
    if isinstance(value, (tuple, list)) and all(isinstance(v, int) for v in value):
        return list(value)  # per-rank sizes
    return value if value is None or isinstance(value, (bool, int, float, str)) else type(value).__name__


def fingerprint(op: str, args: Sequence[Any], names: Sequence[str] = (), **params: Any) -> dict[str, Any]:
    """What the ranks compare: ``op``, every argument (:func:`describe`) by its name in ``names``
    (else 'arg<i>'), and ``params`` (mode, digests, ...), as JSON-able values."""
    found: dict[str, Any] = {"op": op}
    for i, value in enumerate(args):
        found[names[i] if i < len(names) else f"arg{i}"] = describe(value)
    found.update(params)
    return found


def check_call(channel: Exchange, call: dict[str, Any], error: Optional[BaseException] = None) -> None:
    """Agree on ``call`` (a :func:`fingerprint`) and on this rank's verdict (``error``: what its
    local checks of the call raised, or None) with every rank of ``channel``'s group. Then a rank
    whose checks failed raises its own error; every other rank raises CallMismatchError naming
    each field that differs ('x: rank 0 'float32[256]', rank 1 'float32[512]'') and each rank that
    failed; AgreementError when a peer makes no call within the deadline."""
    if channel.world_size == 1:
        if error is not None:
            raise error
        return
    tag = channel.round_tag(_TAG)
    report = {"call": call, "ok": error is None, "error": f"{type(error).__name__}: {error}" if error else ""}
    reports = channel.exchange(tag, report)
    # every peer published this round, so every peer read the previous one: drop this rank's
    previous = channel.rounds[_TAG] - 1
    if previous:
        channel.forget(f"{_TAG}.{previous}")
    if error is not None:
        raise error
    found = failures(reports) + differences(reports, "call")
    if found:
        raise CallMismatchError(f"autosymm (AUTOSYMM_CHECK_CALLS): call {channel.rounds[_TAG]} on this group "
                                f"differs across ranks or failed: {'; '.join(found)}")


class CheckedCache(dict):
    """A group's prepared calls in checked mode. The entry paths look their key up with ``get``,
    which always misses here, so every call takes ``prepare_call``, which checks it with every
    rank (:func:`checked_entry`) before it reads the entry itself; ``items`` and ``values``
    (``autosymm.stats``, the MoE region's re-preparing) see every entry as in a plain dict."""

    def get(self, key, default=None):
        return default


def checked_entry(state, door, key: tuple, args: tuple, mode: str):
    """Checked mode, every call: this rank's checks of it (``door.check_call``, local), then
    :func:`check_call` with every rank on ``door.fingerprint`` and that verdict; returns the
    prepared entry of ``key`` (None on its first use: the caller prepares it)."""
    error = None
    try:
        door.check_call(state, key, args, mode)
    except Exception as exc:  # agreed before it propagates
        error = exc
    check_call(state.channel, door.fingerprint(key, args, mode), error)
    return dict.get(state.cache, key)
