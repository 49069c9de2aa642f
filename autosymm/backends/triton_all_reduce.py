"""Backends ``triton_one_shot``, ``triton_one_shot_push``, ``triton_two_shot`` and
``triton_multimem``: the Triton all-reduce kernels of autosymm.kernels.all_reduce (and
autosymm.kernels.push_all_reduce) over the symmetric workspace. The family's ``lamport`` record
is served by its own backend, autosymm.backends.triton_lamport. Each is a record of
:data:`ALGORITHMS` (autosymm.backends.launch.Algorithm: kernel, stage, splits by rank, double
buffering, multicast) with its search space (:func:`all_reduce_space`) beside it.

Invariants: a tensor from ``Workspace.empty`` is reduced in place (zero-copy: every rank passes a
tensor at the same offset); any other is staged at the *top* of the all-reduce region, or in a
double-buffer half. All calls of one workspace must be stream-ordered. Failures are reported after
the fact, never on the hot path: the barrier waits are bounded, ``Workspace.barrier_errors()`` is
then non-zero, and every rank must call ``Workspace.reset_signals()`` before the next kernel.

Design notes: docs/BACKENDS.md#backends-triton-all-reduce
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Callable, Optional

import torch

from ..configs import WARP_SIZE, AllReduceConfig, useful_counts
from ..geometry import (ALIGN, ALL_REDUCE_REGION, DOUBLE_BUFFER_HALF_BYTES, lamport_stage_bytes, max_push_input_bytes,
                        push_stage_bytes, tensor_stage_bytes)
from ..kernels.all_reduce import _one_shot_all_reduce, _two_shot_all_reduce
from ..kernels.lamport_all_reduce import _lamport_all_reduce
from ..kernels.push_all_reduce import _push_one_shot_all_reduce
from ..problem import Problem
from .base import Backend, BackendError, Capabilities, Needs, RunContext
from .launch import MAX_NUMEL, Algorithm, LeanLauncher, RegionLauncher, prepared_workspace, stage_limits, with_spin

#: Largest all-reduce (bytes) for which the pull one-shot's space offers ``double_buffer``: beyond
#: it a call reads megabytes over NVLink and the end barrier (about a microsecond) is noise.
PULL_DOUBLE_BUFFER_MAX_BYTES = 1 << 20

#: The all-reduce algorithms by name (AllReduceConfig.algorithm), each a backend ``triton_<name>``.
ALGORITHMS: dict[str, Algorithm] = {a.name: a for a in (
    Algorithm("one_shot", _one_shot_all_reduce, tensor_stage_bytes, double_buffer=True,
              double_buffer_space_bytes=PULL_DOUBLE_BUFFER_MAX_BYTES, batch_invariant=True),
    # the stage takes world_size - 1 slots of the tensor, one per peer: a double-buffer half while they fit
    Algorithm("one_shot_push", _push_one_shot_all_reduce, push_stage_bytes, push=True, double_buffer=True,
              double_buffer_space_bytes=DOUBLE_BUFFER_HALF_BYTES, batch_invariant=True),
    Algorithm("two_shot", _two_shot_all_reduce, tensor_stage_bytes, {"MULTIMEM": False}, splits_by_rank=True,
              batch_invariant=True),
    # one v4 multimem operation a thread: 16 bytes a thread at least. Not batch-invariant: the
    # switch's ld_reduce adds the ranks in an order PTX does not specify.
    Algorithm("multimem", _two_shot_all_reduce, tensor_stage_bytes, {"MULTIMEM": True}, splits_by_rank=True,
              multicast=True, min_thread_bytes=16),
    # peers push into the Lamport region, not the all-reduce region: backend triton_lamport
    # (autosymm.backends.triton_lamport: its own launcher and size cap)
    Algorithm("lamport", _lamport_all_reduce, lamport_stage_bytes, batch_invariant=True, lamport=True),
)}


class _AllReduceLauncher(RegionLauncher):
    """``launcher(x) -> x``: x summed in place over the group. Bound to one workspace and config."""

    def __init__(self, problem: Problem, config: AllReduceConfig, workspace) -> None:
        super().__init__(problem, config, workspace)
        record = self.record
        # Tensor.get_device() of a tensor on the workspace's device (-1: CPU): an int, no torch.device
        self._device_index = self.device.index if self.device.type == "cuda" else -1
        self._push = record.push
        # push: one slot of the rounded-up tensor per peer must fit the region
        fits = max_push_input_bytes(self.capacity, self.world_size) if record.push else self.capacity
        self.max_bytes = min(fits, MAX_NUMEL * self.elem_bytes)
        self.region_end = self.region_start + self.capacity
        if self.half_bytes:
            self.double_start = self.region_start + self.double_offset
            self.double_end = self.double_start + 2 * self.half_bytes
        self.mc_base = 0
        if record.multicast:
            self.mc_base = workspace.multicast_ptr + workspace.regions[ALL_REDUCE_REGION].offset
        self._two_shot = record.splits_by_rank
        self._vec = 16 // self.elem_bytes  # elements per 16 bytes
        self._seg_div = self.world_size * self._vec  # elements per 16 bytes of every rank
        # variant key: (zero_copy, aligned, x_aligned, phase, double_buffer, tail): tail = the
        # one-shots' TAIL, elements numel is a multiple of (16 bytes' worth, or 1)

    # -- hot path ---------------------------------------------------------------------------
    def __call__(self, x: torch.Tensor, phase: int = 0) -> torch.Tensor:
        """Reduce ``x`` in place. ``phase`` != 0 runs one phase of the two-shot kernels (tests)."""
        plan = self._plan(x, phase)
        if plan is None:
            return x  # nothing to exchange
        key, addr, sizes = plan
        direct = self._direct.get(key)
        if direct is not None:  # bound: int addresses, no per-pointer driver query
            direct(addr, self._region_addr, self._signal_addr, *sizes)
            return x
        launch = self._variants.get(key) or self._variant(*key)
        launch(x, self.region_ptrs, self.signal_ptrs, *sizes)
        if launch.direct is not None:
            self._direct[key] = launch.direct
        return x

    run = __call__

    def bind(self, x: torch.Tensor) -> Optional[Callable[[], None]]:
        """``launch()``: this call's kernel launch with its arguments bound, on the current stream,
        without any check; None when the call launches nothing or its variant is not bound yet
        (call ``self(x)`` first). Valid for every tensor at ``x``'s address with x's dtype,
        numel and device while ``workspace.empty_bytes`` is unchanged: the variant and the
        integer arguments are a function of those alone (autosymm.runtime.replay relies on it). The
        kernels keep their per-call state (the double-buffer epoch) on the device, so a bound
        launch, or a CUDA graph of one, stays right call after call."""
        plan = self._plan(x, 0)
        if plan is None:
            return None
        key, addr, sizes = plan
        direct = self._direct.get(key)
        if direct is None:
            return None
        return partial(direct, addr, self._region_addr, self._signal_addr, *sizes)

    def _plan(self, x: torch.Tensor, phase: int) -> Optional[tuple[tuple, int, tuple]]:
        """(variant key, x's address, integer arguments) of a call, or None when there is
        nothing to launch; raises BackendError for a tensor this launcher cannot reduce."""
        if x.dtype is not self.dtype or x.get_device() != self._device_index or not x.is_contiguous():
            raise self._bad_input(x)
        numel = x.numel()
        nbytes = numel * self.elem_bytes
        if nbytes > self.max_bytes:
            raise BackendError(
                f"all_reduce of {tuple(x.shape)} {x.dtype} needs {nbytes} bytes; at most {self.max_bytes} fit "
                f"(the workspace's all-reduce region and int32 indexing; raise AUTOSYMM_WORKSPACE_BYTES)")
        if numel == 0 or self.world_size == 1:
            return None  # the sum over one rank is x itself
        addr = x.data_ptr()
        x_aligned = addr % 16 == 0
        tail = self._vec if numel % self._vec == 0 and not self._two_shot else 1
        if self._push:
            key, sizes = self._push_args(x, addr, numel, nbytes, x_aligned)
            return (*key, tail), addr, sizes
        if self.region_start <= addr and addr + nbytes <= self.region_end:  # zero-copy
            key = (True, x_aligned, x_aligned, phase, False, tail)
            offset = addr - self.region_start
        else:
            if addr < self.region_end and addr + nbytes > self.region_start:
                raise BackendError(f"tensor {tuple(x.shape)} straddles the edge of the all-reduce region: "
                                   "it can be neither reduced in place nor staged")
            if nbytes <= self.half_bytes:  # double-buffered: staged at the bottom of half epoch & 1
                if addr < self.double_end and addr + nbytes > self.double_start:
                    raise BackendError(f"tensor {tuple(x.shape)} lies in the all-reduce double buffer, where "
                                       "it would be staged onto itself")
                key = (False, True, x_aligned, phase, True, tail)
                offset = self.double_offset
            else:
                key = (False, True, x_aligned, phase, False, tail)
                offset = self.capacity - (nbytes + ALIGN - 1) // ALIGN * ALIGN
                if offset < self.workspace.empty_bytes:  # staging from the top must not reach empty()'s tensors
                    raise BackendError(
                        f"staging {nbytes} bytes would overwrite the {self.workspace.empty_bytes} bytes handed out "
                        f"by autosymm.empty in a {self.capacity}-byte region; raise AUTOSYMM_WORKSPACE_BYTES")
        if not self._two_shot:  # the pull one-shot (push returned above)
            return key, addr, (numel, offset, self.half_bytes)
        # segment length in 16-byte units: segment_vecs(numel, world_size, elem_bytes)
        return key, addr, (numel, offset, (numel + self._seg_div - 1) // self._seg_div, self.mc_base)


    def _push_args(self, x: torch.Tensor, addr: int, numel: int, nbytes: int, x_aligned: bool) -> tuple:
        """(variant key, integer arguments) of a push one-shot call. x is read only locally, so
        any tensor (in the region or not) is served without a copy; the stage is WORLD_SIZE - 1
        slots in a double-buffer half when they fit, else at the top of the all-reduce region,
        clear of x and of autosymm.empty's tensors."""
        slot_bytes = (nbytes + ALIGN - 1) // ALIGN * ALIGN  # push_slot_bytes(nbytes)
        need = (self.world_size - 1) * slot_bytes
        if need <= self.half_bytes:
            offset, double = self.double_offset, True
            stage_start, stage_end = self.double_start, self.double_end
        else:
            offset, double = self.capacity - need, False
            stage_start, stage_end = self.region_start + offset, self.region_end
            if offset < self.workspace.empty_bytes:
                raise BackendError(
                    f"a push stage of {need} bytes would overwrite the {self.workspace.empty_bytes} bytes handed out "
                    f"by autosymm.empty in a {self.capacity}-byte region; raise AUTOSYMM_WORKSPACE_BYTES")
        if addr < stage_end and addr + nbytes > stage_start:
            raise BackendError(f"tensor {tuple(x.shape)} overlaps the push stage of the all-reduce region, "
                               "where peers write their copies")
        return (False, True, x_aligned, 0, double), (numel, offset, slot_bytes, self.half_bytes)

    # -- cold path --------------------------------------------------------------------------
    def _variant(self, zero_copy: bool, aligned: bool, x_aligned: bool, phase: int, double: bool,
                 tail: int) -> LeanLauncher:
        """The launcher of one kernel specialisation (triton also specialises on x's alignment)."""
        record = self.record
        if record.multicast and not aligned:
            raise BackendError(f"triton_{self.algorithm} needs a 16-byte aligned tensor; this zero-copy tensor "
                               "(inside the all-reduce region) is not: allocate it with Workspace.empty")
        constexprs = dict(RANK=self.rank, WORLD_SIZE=self.world_size, BLOCK=self.config.block_size, ALIGNED=aligned)
        if not record.push:  # a push kernel never reads x from a peer: zero-copy is nothing to it
            constexprs.update(ZERO_COPY=zero_copy)
        if record.splits_by_rank:
            constexprs.update(PHASE=phase)
        elif phase:
            raise ValueError(f"{self.algorithm} has no phases")
        else:
            constexprs.update(DOUBLE_BUFFER=double, TAIL=tail)
        launcher = LeanLauncher(record.kernel, (self.config.num_blocks,), {**constexprs, **record.flags},
                                num_warps=self.config.num_warps, num_stages=1)
        self._variants[(zero_copy, aligned, x_aligned, phase, double, tail)] = launcher
        return launcher

    def _bad_input(self, x: torch.Tensor) -> BackendError:
        problems = []
        if x.dtype is not self.dtype:
            problems.append(f"dtype {x.dtype} (prepared for {self.dtype})")
        if x.device != self.device:
            problems.append(f"device {x.device} (the workspace is on {self.device})")
        if not x.is_contiguous():
            problems.append(f"strides {tuple(x.stride())} (must be contiguous)")
        return BackendError(f"triton_{self.algorithm} cannot reduce tensor {tuple(x.shape)}: " + "; ".join(problems))


# On 2x H200 the default tune picked the largest BLOCK, grid and warps of the earlier space
# (16384, 132, 32) for the push one-shot at every size from 8 MiB: the space now reaches past
# them (two programs per SM, 64 KiB of bf16 per program and chunk).
ALL_REDUCE_BLOCK_SIZES = (1024, 2048, 4096, 8192, 16384, 32768)
ALL_REDUCE_NUM_WARPS = (4, 8, 16, 32)
ALL_REDUCE_NUM_BLOCKS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 132, 256)


def all_reduce_space(algorithm: str, numel: int, world_size: int, elem_bytes: int) -> list[AllReduceConfig]:
    """Valid, non-redundant configs of ``algorithm`` for an all-reduce of ``numel`` elements.

    Redundant points are dropped: more programs than there are BLOCK-wide chunks to do, and
    BLOCK widths far beyond the data (they only mask). Two-shot and multimem split the data in
    ``world_size`` segments, so their chunk count is per segment. Never empty.

    A double-buffer capable algorithm whose stage is at most its record's
    ``double_buffer_space_bytes`` (pull one-shot: :data:`PULL_DOUBLE_BUFFER_MAX_BYTES`; push
    one-shot: its slots fit a :data:`autosymm.geometry.DOUBLE_BUFFER_HALF_BYTES` half) also gets
    every config again with ``double_buffer=True`` (appended, so the first configs stay the
    single-buffer ones): there
    the call is latency-bound and its end barrier (a system-scope round trip over NVLink, about
    1-1.5 us of 5-6 us at 4-64 KiB on H200) is worth removing; beyond it the copy and the reads
    dominate, a half of the double-buffer region would not hold the tensor, and the space stays
    as it was (it is largest there: most grids are useful).
    """
    record = ALGORITHMS[algorithm]
    per_program = record.share(numel, world_size)  # Lamport at world size 2: also spin (with_spin)
    space: list[AllReduceConfig] = []
    for block_size in ALL_REDUCE_BLOCK_SIZES:
        # a BLOCK more than twice the data is only masking; keep the smallest such BLOCK.
        if block_size > 2 * max(per_program, ALL_REDUCE_BLOCK_SIZES[0]) and block_size != ALL_REDUCE_BLOCK_SIZES[0]:
            continue
        chunks = max(1, -(-per_program // block_size))
        for num_warps in ALL_REDUCE_NUM_WARPS:
            if num_warps * WARP_SIZE > block_size:
                continue
            # fewer than 8 bytes a thread means narrow loads (multimem: 16, one v4 operation a
            # thread, else threads repeat it): keep only the widest-per-thread warps.
            if (block_size * elem_bytes // (num_warps * WARP_SIZE) < record.min_thread_bytes
                    and num_warps != ALL_REDUCE_NUM_WARPS[0]):
                continue
            for num_blocks in useful_counts(ALL_REDUCE_NUM_BLOCKS, chunks):
                space.append(AllReduceConfig(algorithm, block_size, num_blocks, num_warps))
    if record.double_buffer and record.stage_bytes(numel * elem_bytes, world_size) <= record.double_buffer_space_bytes:
        space += [dataclasses.replace(config, double_buffer=True) for config in space]
    return with_spin(space, record, world_size)



def largest_stage_bytes(nbytes: int, world_size: int) -> int:
    """Bytes of the all-reduce region the largest stage of any algorithm takes for ``nbytes``."""
    return max(a.stage_bytes(nbytes, world_size) for a in ALGORITHMS.values())


class TritonAllReduce(Backend):
    """One Triton all-reduce algorithm (a record of :data:`ALGORITHMS`) as a Backend."""

    def __init__(self, record: Algorithm) -> None:
        self.record, self.algorithm = record, record.name
        self.name = f"triton_{record.name}"
        self.batch_invariant = record.batch_invariant
        # multimem instructions need sm_90
        self.needs = Needs(compiles_kernels=True, workspace_region=ALL_REDUCE_REGION,
                           intra_node=True, multicast=record.multicast,
                           min_compute_capability=(9, 0) if record.multicast else (0, 0))

    def limits(self, problem: Problem, caps: Capabilities) -> Optional[str]:
        return stage_limits(self.record.stage_bytes(problem.nbytes, problem.world_size), problem, caps)

    def search_space(self, problem: Problem) -> list[AllReduceConfig]:
        return all_reduce_space(self.algorithm, problem.numel, problem.world_size, problem.elem_bytes)

    def prepare(self, problem: Problem, config: Optional[AllReduceConfig], ctx: RunContext) -> _AllReduceLauncher:
        """A launcher ``launcher(x) -> x`` for ``problem`` with ``config`` on ``ctx.workspace``."""
        ws = prepared_workspace(self, problem, config, AllReduceConfig, ctx)
        if self.record.multicast and not ws.has_multicast:
            raise BackendError(f"{self.name} needs multicast; the workspace has none")
        return _AllReduceLauncher(problem, config, ws)


triton_one_shot = TritonAllReduce(ALGORITHMS["one_shot"])
triton_one_shot_push = TritonAllReduce(ALGORITHMS["one_shot_push"])
triton_two_shot = TritonAllReduce(ALGORITHMS["two_shot"])
triton_multimem = TritonAllReduce(ALGORITHMS["multimem"])
BACKENDS = (triton_one_shot, triton_one_shot_push, triton_two_shot, triton_multimem)
