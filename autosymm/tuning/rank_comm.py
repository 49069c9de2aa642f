"""The tuner's rank communication: who failed through autosymm.runtime.agreement (the one consensus
mechanism), rank 0's word and the MAX of timings as small float64 tensors on the control group
(no pickling), the identity without a process group; and calls under a timeout in a worker thread.

What the ranks agree on comes back with names (:class:`Agreement`), never as slices of the
exchanged vector.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ..runtime.agreement import Exchange
from .timing import Timing, comm_device, group_size


@dataclass(frozen=True)
class Agreement:
    """Which ranks reported a failure and which timed out, the same on every rank."""

    failed_ranks: tuple[int, ...] = ()
    timed_out_ranks: tuple[int, ...] = ()

    @property
    def failed(self) -> bool:
        return bool(self.failed_ranks)

    @property
    def timed_out(self) -> bool:
        return bool(self.timed_out_ranks)

    @property
    def raised_ranks(self) -> tuple[int, ...]:
        """The ranks that failed without timing out (often why a peer timed out)."""
        return tuple(r for r in self.failed_ranks if r not in self.timed_out_ranks)


class RankComm:
    """Rank 0's word and MAX over ``group`` (None: the default group), on the group's device for
    host collectives (CPU for gloo); without a process group every call is local. ``wait_s``: how
    long an agreement waits for a peer (None: the process group's timeout)."""

    def __init__(self, group, wait_s: Optional[float] = None):
        self.dist = dist
        self.group = group
        self.world_size = group_size(group)
        self.active = self.world_size > 1
        self.rank = dist.get_rank(group) if self.active else 0
        self.device = comm_device(group) if self.active else torch.device("cpu")
        self.src, self.channel = 0, None
        if self.active:
            # the tuner's agreements (autosymm.runtime.agreement): a peer may still be preparing a
            # candidate (up to its prepare timeout), so they wait as long as the process group would
            self.channel = Exchange(group, self.rank, self.world_size,
                                    wait_s=dist.default_pg_timeout.total_seconds() if wait_s is None else wait_s)
            try:
                self.src = dist.get_global_rank(group, 0) if group is not None else 0
            except (AttributeError, RuntimeError, ValueError):
                self.src = 0

    def broadcast_int(self, value: int) -> int:
        """Rank 0's ``value`` on every rank."""
        if not self.active:
            return int(value)
        t = torch.tensor([float(value)], dtype=torch.float64, device=self.device)
        self.dist.broadcast(t, src=self.src, group=self.group)
        return int(t.item())

    def max(self, values: list[float]) -> list[float]:
        """Element-wise MAX of ``values`` over the ranks."""
        if not self.active:
            return [float(v) for v in values]
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX, group=self.group)
        return t.tolist()

    def agree(self, failed: bool, timed_out: bool = False) -> Agreement:
        """Who failed and who timed out, from this rank's two flags (an exchange through
        autosymm.runtime.agreement, with the process group's deadline)."""
        report = {"failed": bool(failed), "timed_out": bool(timed_out)}
        reports = self.channel.exchange(self.channel.round_tag("agree"), report) if self.active else [report]
        return Agreement(tuple(r for r, seen in enumerate(reports) if seen["failed"]),
                         tuple(r for r, seen in enumerate(reports) if seen["timed_out"]))

    def combine_measurement(self, timing: Timing, status: str) -> tuple[Timing, Agreement]:
        """One MAX of (median, p10, p90, samples) and the failure flags of this rank's ``status``
        ('ok' | 'error' | 'timeout'): the slowest rank's timing (us) when every rank's status
        was 'ok', else ``Timing.failed()``; NaN counts as +inf."""
        ok = status == "ok"
        numbers = [timing.median_us, timing.p10_us, timing.p90_us, float(timing.samples)]
        numbers = [math.inf if (math.isnan(v) or not ok) else v for v in numbers]
        combined = self.max(numbers + self._flags(not ok) + self._flags(status == "timeout"))
        agreement = self._agreement(combined[4:])
        if agreement.failed:
            return Timing.failed(), agreement
        median, p10, p90, samples = combined[:4]
        return Timing(median, p10, p90, int(samples)), agreement

    def _flags(self, mine: bool) -> list[float]:
        """A vector with a 1 at this rank's slot when ``mine`` is set (MAX-combined: who)."""
        vec = [0.0] * self.world_size
        vec[self.rank] = 1.0 if mine else 0.0
        return vec

    def _agreement(self, flags: Sequence[float]) -> Agreement:
        """The Agreement of MAX-combined (failed, timed out) flag vectors, in that order."""
        n = self.world_size
        return Agreement(tuple(r for r in range(n) if flags[r] > 0), tuple(r for r in range(n) if flags[n + r] > 0))


def current_cuda_device() -> Optional[int]:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.current_device()
    return None


def call_with_timeout(fn: Callable, arg: Any, timeout_s: Optional[float]):
    """(status, value, detail, thread): status 'ok' | 'error' | 'timeout'. The call runs in a
    daemon thread (on this thread's CUDA device) so a stuck one can be left behind."""
    box: dict[str, Any] = {}
    device = current_cuda_device()

    def target() -> None:
        try:
            if device is not None:
                torch.cuda.set_device(device)
            box["value"] = fn(arg)
        except BaseException as exc:  # reported, never raised through the search
            box["error"] = f"{type(exc).__name__}: {exc}"

    if timeout_s is None:
        target()
        thread = None
    else:
        thread = threading.Thread(target=target, name="autosymm-tune", daemon=True)
        thread.start()
        thread.join(timeout_s)
        if thread.is_alive():
            return "timeout", None, f"no result after {timeout_s:g} s", thread
    if "error" in box:
        return "error", None, box["error"], thread
    return "ok", box.get("value"), None, thread


def device_healthy(timeout_s: float) -> bool:
    """Does a device synchronize finish in time? (True without CUDA.)"""
    if current_cuda_device() is None:
        return True
    status, _, _, _ = call_with_timeout(lambda _: torch.cuda.synchronize(), None, timeout_s)
    return status == "ok"
