"""Rank agreement with a deadline: the ranks of a group exchange small JSON reports through the
default c10d store (host memory, no device work, so it also runs during a CUDA-graph capture).

Every rank publishes a report, even "I failed, here is why", and waits for the others' until
``AUTOSYMM_AGREE_TIMEOUT_S``; a peer that never reports, or a dead store host (rank 0), turns into
an :class:`AgreementError` naming it on every rank that waits. Keys are
``autosymm/<group name>/<generation>/<tag>/<rank>``: every rank makes the same exchanges in the
same order, and a new group state (after ``autosymm.reset()``) takes a new generation. Each key is
written once, first writer wins (compare-and-set): its rank's report, or the verdict of a peer that
gave up waiting, so either every rank goes on or every rank that gets there raises, the late one
too.

Design notes: docs/DISPATCH.md#runtime-agreement
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any, Optional, Sequence

import torch.distributed as dist

from .. import settings
from ..dist_compat import group_name

_GENERATIONS: dict[str, int] = {}


class AgreementError(RuntimeError):
    """The ranks of a group did not all report in time, or reported a failure or a mismatch."""


def timeout_s() -> float:
    """Seconds a rank waits for its peers' reports (AUTOSYMM_AGREE_TIMEOUT_S, default 300); a bad
    value gives the default here, and its error to the group's first agreement (settings.check)."""
    return settings.get_or_default("AUTOSYMM_AGREE_TIMEOUT_S")[0]


class Exchange:
    """The agreement channel of one group state: ``exchange(tag, report)`` -> every rank's report;
    ``all_ok(tag, ok)``: did every rank succeed (autosymm's one rank-consensus mechanism: the
    runtime, the tuner's protocol and bench all agree through it). ``wait_s``: the deadline
    (default :func:`timeout_s`)."""

    def __init__(self, group, rank: int, world_size: int, store=None, wait_s: Optional[float] = None) -> None:
        self.rank, self.world_size = rank, world_size
        self.timeout = timedelta(seconds=timeout_s() if wait_s is None else wait_s)
        self.rounds: dict[str, int] = {}
        self.prefix, self.store = "", store
        if world_size > 1:  # one rank exchanges nothing
            name = group_name(group)
            generation = _GENERATIONS[name] = _GENERATIONS.get(name, 0) + 1
            self.prefix = f"autosymm/{name}/{generation}/"
            if store is None:
                self.store = dist.distributed_c10d._get_default_store()

    def exchange(self, tag: str, report: dict[str, Any]) -> list[dict[str, Any]]:
        """Publish this rank's ``report`` under ``tag``; return all ranks' reports in rank order.
        AgreementError naming the ranks that did not report within the deadline (on the rank that
        waited, and on a late rank that reports after a peer gave up: both raise, as the module
        docstring says), or naming rank 0 when the store itself is gone (its host process died
        or is unreachable)."""
        if self.world_size == 1:
            return [report]
        keys = [f"{self.prefix}{tag}/{rank}" for rank in range(self.world_size)]
        mine = json.dumps(report, sort_keys=True, default=str)
        try:
            # first writer wins: a peer that gave up has put its verdict under this rank's key
            held = self.store.compare_set(keys[self.rank], "", mine)
            if held != mine.encode():
                raise AgreementError(f"autosymm: this rank (rank {self.rank}) reached '{tag}' after "
                                     f"{_gave_up_text(json.loads(held))}: every rank raises") from None
            self._wait(tag, keys)
            reports = [json.loads(value) for value in self.store.multi_get(keys)]
        except dist.DistNetworkError as exc:
            raise AgreementError(
                f"autosymm: lost the c10d store{_store_address(self.store)} at '{tag}': it lives in the process "
                f"of global rank 0 (the store host), which exited, crashed or became unreachable "
                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'no detail'})") from None
        late = [rank for rank, found in enumerate(reports) if _GAVE_UP in found]
        if late:  # every key is filled, some by a peer that gave up: no rank goes on
            raise AgreementError(f"autosymm: rank(s) {late} of the group did not reach '{tag}' in time: "
                                 f"{_gave_up_text(reports[late[0]])}")
        return reports

    def forget(self, tag: str) -> None:
        """Delete this rank's key of ``tag`` (a tag every peer has read: the store stays small
        when a channel exchanges on every call)."""
        if self.world_size > 1:
            self.store.delete_key(f"{self.prefix}{tag}/{self.rank}")

    def _wait(self, tag: str, keys: list[str]) -> None:
        """Wait for every key; past the deadline, fill each missing one with this rank's verdict
        (the store's compare-and-set: a peer's own report, if it came first, stays), so that a
        late peer raises too instead of going on alone into a collective nobody joins."""
        try:
            self.store.wait(keys, self.timeout)
            return
        except dist.DistNetworkError:
            raise
        except RuntimeError:  # DistStoreError (a RuntimeError): some peer has not reported yet
            pass
        waited_s = self.timeout.total_seconds()
        verdict = json.dumps({_GAVE_UP: {"rank": self.rank, "waited_s": waited_s}})
        missing = [rank for rank, key in enumerate(keys)
                   if _GAVE_UP in json.loads(self.store.compare_set(key, "", verdict))]
        if missing:
            raise AgreementError(
                f"autosymm: rank(s) {missing} of the group did not reach '{tag}' within {waited_s:g} s "
                f"(AUTOSYMM_AGREE_TIMEOUT_S): a peer failed, exited or made a different call") from None

    def all_ok(self, tag: str, ok: bool, error: str = "") -> list[str]:
        """Publish whether this rank succeeded at the next round of ``tag`` (call it as often as
        needed, in the same order on every rank); returns 'rank r: error' for every rank that did
        not, empty when all did. AgreementError when a peer never reports (as exchange)."""
        return failures(self.exchange(self.round_tag(tag), {"ok": bool(ok), "error": error}))

    def round_tag(self, tag: str) -> str:
        """``tag`` numbered by how often this channel used it ('agree.1', 'agree.2', ...): the
        same on every rank, since every rank makes the same exchanges in the same order."""
        self.rounds[tag] = self.rounds.get(tag, 0) + 1
        return f"{tag}.{self.rounds[tag]}"


#: The field of a verdict a rank that gave up waiting leaves under a late peer's key.
_GAVE_UP = "autosymm_gave_up"


def _gave_up_text(verdict: dict[str, Any]) -> str:
    """What a verdict left under a late rank's key says."""
    found = verdict.get(_GAVE_UP) or {}
    return (f"rank {found.get('rank')} gave up waiting for it after {found.get('waited_s', 0):g} s "
            f"(AUTOSYMM_AGREE_TIMEOUT_S)")


def _store_address(store) -> str:
    """' (host:port)' of the TCP store under ``store`` (PrefixStores unwrapped), or ''."""
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    host, port = getattr(store, "host", None), getattr(store, "port", None)
    return f" ({host}:{port})" if host is not None and port is not None else ""


def failures(reports: Sequence[dict[str, Any]]) -> list[str]:
    """'rank r: error' for every report with ok False."""
    return [f"rank {rank}: {report.get('error') or 'failed'}" for rank, report in enumerate(reports)
            if not report.get("ok", False)]


def differences(reports: Sequence[dict[str, Any]], field: str = "settings") -> list[str]:
    """'name: rank 0 a, rank 1 b' for every entry of ``report[field]`` that differs across ranks."""
    names = sorted({name for report in reports for name in (report.get(field) or {})})
    out = []
    for name in names:
        values = [(report.get(field) or {}).get(name) for report in reports]
        if len({json.dumps(v, sort_keys=True) for v in values}) > 1:
            out.append(f"{name}: " + ", ".join(f"rank {rank} {value!r}" for rank, value in enumerate(values)))
    return out


def problems(reports: Sequence[dict[str, Any]], field: str = "settings") -> Optional[str]:
    """One line naming every failure and every difference, or None when all ranks agree."""
    found = failures(reports) + differences(reports, field)
    return "; ".join(found) if found else None
