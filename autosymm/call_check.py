"""The checked mode (``AUTOSYMM_CHECK_CALLS=1``): every call on a group agrees on its fingerprint
(op, dtypes, shapes, reduce op, mode) with every rank before it runs, and a difference raises on
every rank naming what differed, like ``TORCH_DISTRIBUTED_DEBUG=DETAIL``'s collective fingerprints.

Without it, autosymm agrees only on a call's first use per group (its cache key): two ranks that
later make different calls whose keys both are cached (another size, dtype or reduce op on one
rank) run mismatched collectives, which hang or return garbage, as ``torch.distributed`` does.
In checked mode nothing is served from a cache before the check: the entry path
(:func:`check_call`, through the group's agreement channel, so with its deadline
``AUTOSYMM_AGREE_TIMEOUT_S``) runs first on every call, the hot paths included; a rank that
never makes the call leaves its peers an AgreementError naming it. Calls inside a CUDA-graph
capture are checked when captured; replays run no Python, so they are not.

Cost: one store round trip to publish, one to wait, one to read every rank's fingerprint and
one to delete the previous one (the store stays small): README's Environment section gives the
measured cost per call.
"""

from __future__ import annotations

from typing import Any, Sequence

from .agreement import AgreementError, Exchange, differences

_TAG = "check"


class CallMismatchError(AgreementError):
    """The ranks of a group made different calls (checked mode); raised on every rank."""


def fingerprint(op: str, tensors: Sequence[Any], **params: Any) -> dict[str, Any]:
    """What the ranks compare: ``op``, every tensor's dtype and shape (None for an absent
    tensor), and ``params`` (reduce op, mode, ...), as JSON-able values."""
    found: dict[str, Any] = {"op": op}
    found["dtypes"] = [str(t.dtype).replace("torch.", "") if t is not None else None for t in tensors]
    found["shapes"] = [list(t.shape) if t is not None else None for t in tensors]
    found.update(params)
    return found


def check_call(channel: Exchange, op: str, tensors: Sequence[Any], **params: Any) -> None:
    """Agree on this call's :func:`fingerprint` with every rank of ``channel``'s group;
    CallMismatchError on every rank naming each field that differs ('shapes: rank 0 [[256]],
    rank 1 [[512]]'), AgreementError when a peer does not make a call within the deadline."""
    if channel.world_size == 1:
        return
    tag = channel.round_tag(_TAG)
    reports = channel.exchange(tag, {"call": fingerprint(op, tensors, **params)})
    # every peer published this round, so every peer read the previous one: drop this rank's
    previous = channel.rounds[_TAG] - 1
    if previous:
        channel.forget(f"{_TAG}.{previous}")
    found = differences(reports, "call")
    if found:
        raise CallMismatchError(f"autosymm (AUTOSYMM_CHECK_CALLS): call {channel.rounds[_TAG]} on this group "
                                f"differs across ranks: {'; '.join(found)}")
