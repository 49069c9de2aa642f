"""Backends ``torch_one_shot`` and ``torch_two_shot``: torch's own symmetric-memory all-reduce ops.

``torch.ops.symm_mem.one_shot_all_reduce_out`` and ``two_shot_all_reduce_`` need their input in
a symmetric-memory tensor rendezvoused with the group. Each launcher copies ``x`` into a staging
buffer (one ``symm_mem.empty`` per (group, device, dtype, capacity), created on first use by a
collective rendezvous: every rank must prepare together) and, for two-shot, copies the sum back.

What the ops accept (torch/csrc/distributed/c10d/symm_mem/CUDASymmetricMemoryOps.cu): bf16 and
fp32 only (AT_DISPATCH_FLOAT_AND_BFLOAT16, no fp16); input size a multiple of 4 bytes. We ask
more, to hold on every torch version since the ops appeared: 16-byte multiples for one-shot and
a whole number of 16-byte vectors per rank segment (``16 * world_size`` bytes) for two-shot.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ..problem import DTYPES, Problem
from .base import Backend, BackendError, Capabilities, Needs, RunContext, ops_available

SUPPORTED_DTYPES = ("bf16", "fp32")
MIN_STAGING_BYTES = 1 << 20

_STAGING: dict[tuple[str, str, torch.dtype, int], torch.Tensor] = {}
_LOCK = threading.Lock()


@dataclass(frozen=True)
class TorchAlgorithm:
    """One of torch's symmetric-memory all-reduce ops as a backend runs it: ``op`` (its name in
    ``torch.ops.symm_mem``) sums the staged tensor into x (``in_place`` False) or in the staging
    buffer itself, copied back after; ``splits_by_rank``: each rank reduces one segment."""

    name: str
    op: str
    in_place: bool
    splits_by_rank: bool

    def size_multiple(self, world_size: int) -> int:
        """Bytes the all-reduce size must be a multiple of: 16, or 16 per rank's segment."""
        return 16 * world_size if self.splits_by_rank else 16


ALGORITHMS = {a.name: a for a in (TorchAlgorithm("one_shot", "one_shot_all_reduce_out", False, False),
                                  TorchAlgorithm("two_shot", "two_shot_all_reduce_", True, True))}


def staging_buffer(group_name: str, device: torch.device, dtype: torch.dtype, capacity_bytes: int) -> torch.Tensor:
    """The 1-D symmetric staging tensor of (group, device, dtype, capacity), rendezvoused once."""
    key = (group_name, str(device), dtype, capacity_bytes)
    with _LOCK:
        buf = _STAGING.get(key)
        if buf is None:
            # symmetric memory: `import torch` skips it; only a workspace needs it
            import torch.distributed._symmetric_memory as symm_mem

            elem = torch.empty((), dtype=dtype).element_size()
            buf = symm_mem.empty((capacity_bytes // elem,), dtype=dtype, device=device)
            symm_mem.rendezvous(buf, group_name)
            _STAGING[key] = buf
        return buf


class _TorchLauncher:
    """``launcher(x) -> x`` through torch's op, staging ``x`` in ``buffer``."""

    def __init__(self, algorithm: str, group_name: str, buffer: torch.Tensor, world_size: int) -> None:
        record = ALGORITHMS[algorithm]
        self.algorithm = algorithm
        self.group_name = group_name
        self.buffer = buffer
        self.dtype = buffer.dtype
        self.device = buffer.device
        self.elem_bytes = buffer.element_size()
        self.multiple = record.size_multiple(world_size)
        self._in_place = record.in_place
        self._op = getattr(torch.ops.symm_mem, record.op)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype is not self.dtype or x.device != self.device or not x.is_contiguous():
            raise BackendError(
                f"torch_{self.algorithm} cannot reduce {tuple(x.shape)} {x.dtype} on {x.device} "
                f"(strides {tuple(x.stride())}): needs a contiguous {self.dtype} tensor on {self.device}")
        numel = x.numel()
        nbytes = numel * self.elem_bytes
        if nbytes > self.buffer.numel() * self.elem_bytes or nbytes % self.multiple:
            raise BackendError(
                f"torch_{self.algorithm} cannot reduce {tuple(x.shape)} {x.dtype} ({nbytes} bytes): the size "
                f"must be a multiple of {self.multiple} bytes and at most {self.buffer.numel() * self.elem_bytes}")
        if numel == 0:
            return x
        flat = x.view(-1)
        staged = self.buffer[:numel]
        staged.copy_(flat)
        if self._in_place:
            self._op(staged, "sum", self.group_name)
            flat.copy_(staged)
        else:
            self._op(staged, "sum", self.group_name, flat)
        return x


class TorchSymmAllReduce(Backend):
    """torch's ``one_shot`` or ``two_shot`` symmetric-memory all-reduce as a Backend."""

    needs = Needs(dtypes=SUPPORTED_DTYPES, intra_node=True, torch_symm_ops=True)

    def __init__(self, algorithm: str) -> None:
        self.algorithm, self.record = algorithm, ALGORITHMS[algorithm]
        self.name = f"torch_{algorithm}"

    def limits(self, problem: Problem, caps: Capabilities) -> Optional[str]:
        multiple = self.record.size_multiple(problem.world_size)
        if problem.nbytes % multiple:
            return f"{problem.nbytes} bytes is not a multiple of {multiple}"
        return None

    def prepare(self, problem: Problem, config: None, ctx: RunContext) -> _TorchLauncher:
        """Collective on first use per (group, device, dtype, capacity): every rank must call it."""
        if not ops_available():
            raise BackendError(f"{self.name}: torch.ops.symm_mem has no one-shot/two-shot all-reduce here")

        group = ctx.group if ctx.group is not None else dist.group.WORLD
        group_name = getattr(group, "group_name", None)
        if group_name is None:
            raise BackendError(f"{self.name} needs a process group with a group_name, got {group!r}")
        device = ctx.workspace.device if ctx.workspace is not None else torch.device("cuda", torch.cuda.current_device())
        capacity = max(MIN_STAGING_BYTES, 1 << max(0, problem.nbytes - 1).bit_length())
        buffer = staging_buffer(group_name, device, DTYPES[problem.dtype], capacity)
        return _TorchLauncher(self.algorithm, group_name, buffer, dist.get_world_size(group))


torch_one_shot = TorchSymmAllReduce("one_shot")
torch_two_shot = TorchSymmAllReduce("two_shot")
BACKENDS = (torch_one_shot, torch_two_shot)
