"""The tuner's rank communication: small float64 tensors on the control group (no pickling),
the identity without a process group; and calls under a timeout in a worker thread.
"""

from __future__ import annotations

import threading
import traceback
from typing import Any, Callable, Optional, Sequence

import torch

from .timing import comm_device, group_size


class RankComm:
    def __init__(self, group, device):
        import torch.distributed as dist

        self.dist = dist
        self.group = group
        self.world_size = group_size(group)
        self.active = self.world_size > 1
        self.rank = dist.get_rank(group) if self.active else 0
        self.device = comm_device(group, device) if self.active else torch.device("cpu")
        self.src = 0
        if self.active:
            try:
                self.src = dist.get_global_rank(group, 0) if group is not None else 0
            except (AttributeError, RuntimeError, ValueError):
                self.src = 0

    def broadcast_int(self, value: int) -> int:
        if not self.active:
            return int(value)
        t = torch.tensor([float(value)], dtype=torch.float64, device=self.device)
        self.dist.broadcast(t, src=self.src, group=self.group)
        return int(t.item())

    def max(self, values: list[float]) -> list[float]:
        if not self.active:
            return [float(v) for v in values]
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX, group=self.group)
        return t.tolist()

    def flags(self, mine: bool) -> list[float]:
        """A vector with a 1 at this rank's slot when ``mine`` is set (MAX-combined: who failed)."""
        vec = [0.0] * self.world_size
        vec[self.rank] = 1.0 if mine else 0.0
        return vec


def flagged_ranks(flags: Sequence[float]) -> list[int]:
    return [r for r, f in enumerate(flags) if f > 0]


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
            box["trace"] = traceback.format_exc(limit=8)

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
