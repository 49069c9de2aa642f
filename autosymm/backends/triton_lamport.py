"""Backend ``triton_lamport``: the Lamport one-shot all-reduce of autosymm.kernels.lamport_all_reduce
for small tensors (at most :data:`autosymm.geometry.LAMPORT_SLOT_BYTES` per rank), without a
barrier. Its record is ``ALGORITHMS["lamport"]`` of autosymm.backends.triton_all_reduce (the
all-reduce family's config and search space); it stages nothing: peers store into this rank's
Lamport region, so any tensor outside it is served without a copy.

Invariants: the rotation index lives on the device (a bound launch or a CUDA graph of one stays
right call after call); all Lamport calls of a workspace are stream-ordered and run in the same
sequence on every rank. A wait that gives up is counted in the 'all_reduce' error slot: every rank
must then call ``Workspace.reset_signals()``, which also re-arms the receive buffers.

Design notes: docs/BACKENDS.md#backends-triton-lamport
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Optional

import torch

from ..configs import AllReduceConfig
from ..geometry import LAMPORT_HEADER_BYTES, LAMPORT_REGION, LAMPORT_SLOT_BYTES
from ..problem import Problem
from .base import BackendError, Capabilities, RunContext
from .launch import LeanLauncher, RegionLauncher, prepared_workspace
from .triton_all_reduce import ALGORITHMS, TritonAllReduce


def lamport_header(workspace) -> torch.Tensor:
    """int32 view of this rank's Lamport header (autosymm.geometry.LAMPORT_HEADER_BYTES: the rotation
    index, the arrival counter): the Lamport kernels' ``header_ptr``. A view, nothing allocated."""
    region = workspace.regions[LAMPORT_REGION]
    return workspace.buffer[region.offset:region.offset + LAMPORT_HEADER_BYTES].view(torch.int32)


def lamport_limits(problem: Problem) -> Optional[str]:
    """Why the Lamport one-shot cannot serve ``problem`` (its size), or None."""
    if problem.nbytes > LAMPORT_SLOT_BYTES:
        return f"{problem.nbytes} bytes exceed the Lamport one-shot's {LAMPORT_SLOT_BYTES}-byte slots"
    return None


class _LamportLauncher(RegionLauncher):
    """``launcher(x) -> x``: x summed in place over the group by the Lamport one-shot."""

    def __init__(self, problem: Problem, config: AllReduceConfig, workspace) -> None:
        super().__init__(problem, config, workspace)
        region = workspace.regions[LAMPORT_REGION]
        self.lamport_start = int(workspace.buffer.data_ptr()) + region.offset
        self.lamport_end = self.lamport_start + region.nbytes
        self.region_ptrs = workspace.region_ptrs(LAMPORT_REGION)  # the kernel's region: the receive buffers
        self._region_addr = int(self.region_ptrs.data_ptr())
        # this rank's header (the rotation index), an argument so the kernel reads it in one load
        self.header = lamport_header(workspace)
        self._header_addr = int(self.header.data_ptr())
        self._device_index = self.device.index if self.device.type == "cuda" else -1
        self._vec = 16 // self.elem_bytes
        # variant key: (x_aligned, tail, phase)

    def __call__(self, x: torch.Tensor, phase: int = 0) -> torch.Tensor:
        """Reduce ``x`` in place. ``phase`` 1 runs only the pushes, 2 the rest (tests)."""
        plan = self._plan(x, phase)
        if plan is None:
            return x
        key, addr, numel = plan
        direct = self._direct.get(key)
        if direct is not None:
            direct(addr, self._region_addr, self._signal_addr, self._header_addr, numel, LAMPORT_SLOT_BYTES)
            return x
        launch = self._variants.get(key) or self._variant(*key)
        launch(x, self.region_ptrs, self.signal_ptrs, self.header, numel, LAMPORT_SLOT_BYTES)
        if launch.direct is not None:
            self._direct[key] = launch.direct
        return x

    run = __call__

    def bind(self, x: torch.Tensor) -> Optional[Callable[[], None]]:
        """``launch()``: this call's bound kernel launch (see _AllReduceLauncher.bind); None when
        it launches nothing or its variant is not bound yet."""
        plan = self._plan(x, 0)
        direct = None if plan is None else self._direct.get(plan[0])
        if direct is None:
            return None
        return partial(direct, plan[1], self._region_addr, self._signal_addr, self._header_addr, plan[2],
                       LAMPORT_SLOT_BYTES)

    def _plan(self, x: torch.Tensor, phase: int) -> Optional[tuple[tuple, int, int]]:
        """(variant key, x's address, numel) of a call, or None when there is nothing to launch."""
        if x.dtype is not self.dtype or x.get_device() != self._device_index or not x.is_contiguous():
            raise BackendError(f"triton_lamport cannot reduce tensor {tuple(x.shape)} {x.dtype} on {x.device}: "
                               f"it is prepared for contiguous {self.dtype} on {self.device}")
        numel = x.numel()
        nbytes = numel * self.elem_bytes
        if nbytes > LAMPORT_SLOT_BYTES:
            raise BackendError(f"all_reduce of {tuple(x.shape)} {x.dtype} needs {nbytes} bytes; the Lamport "
                               f"one-shot serves at most {LAMPORT_SLOT_BYTES}")
        if numel == 0 or self.world_size == 1:
            return None  # the sum over one rank is x itself
        addr = x.data_ptr()
        if addr < self.lamport_end and addr + nbytes > self.lamport_start:
            raise BackendError(f"tensor {tuple(x.shape)} lies in the Lamport receive buffers, where peers write")
        tail = self._vec if numel % self._vec == 0 else 1
        return (addr % 16 == 0, tail, phase), addr, numel

    def _variant(self, x_aligned: bool, tail: int, phase: int) -> LeanLauncher:
        constexprs = dict(RANK=self.rank, WORLD_SIZE=self.world_size, BLOCK=self.config.block_size, TAIL=tail,
                          PHASE=phase)
        launcher = LeanLauncher(self.record.kernel, (self.config.num_blocks,), constexprs,
                                num_warps=self.config.num_warps, num_stages=1)
        self._variants[(x_aligned, tail, phase)] = launcher
        return launcher


class TritonLamport(TritonAllReduce):
    """The Lamport one-shot as a Backend: the all-reduce family's eligibility (dtype, world size
    <= 8, a workspace) plus its size cap."""

    def limits(self, problem: Problem, caps: Capabilities) -> Optional[str]:
        return lamport_limits(problem) or super().limits(problem, caps)

    def prepare(self, problem: Problem, config: Optional[AllReduceConfig], ctx: RunContext) -> _LamportLauncher:
        """A launcher ``launcher(x) -> x`` for ``problem`` with ``config`` on ``ctx.workspace``."""
        ws = prepared_workspace(self, problem, config, AllReduceConfig, ctx)
        if LAMPORT_REGION not in ws.regions:
            raise BackendError(f"{self.name} needs the workspace's {LAMPORT_REGION!r} region; this one has none")
        reason = lamport_limits(problem)
        if reason is not None:
            raise BackendError(f"{self.name} cannot serve {problem.describe()}: {reason}")
        return _LamportLauncher(problem, config, ws)


triton_lamport = TritonLamport(ALGORITHMS["lamport"])
