"""Backends ``triton_one_shot``, ``triton_one_shot_push``, ``triton_two_shot`` and
``triton_multimem``: the Triton all-reduce kernels of autosymm.kernels.all_reduce over the
symmetric workspace.

A launcher works on any contiguous tensor of the prepared dtype that fits the workspace's
all-reduce region. A tensor from ``Workspace.empty`` (inside the region) is reduced in place
there (zero-copy); any other tensor is staged by the kernel's fused copy-in at the *top* of the
region (``Workspace.empty`` allocates from the bottom), so live zero-copy tensors are not
overwritten unless the region is nearly full. Zero-copy must be symmetric: every rank passes a
tensor at the same offset, as the SPMD use of ``Workspace.empty`` guarantees.

Double buffering (``AllReduceConfig.double_buffer``, one-shot): a staged tensor that fits one
half of the workspace's double-buffer region (``Workspace.double_buffer_half_bytes``, a region
of its own, see autosymm.symm) is staged at the bottom of half ``epoch & 1`` by a kernel without
an end barrier (autosymm.kernels.all_reduce). A larger tensor, a zero-copy one, or a workspace
without that region takes the single-buffer kernel (with its end barrier) exactly as a config
without double buffering does, so the size limits are those of the single-buffer path. All
calls of one workspace must be stream-ordered (one stream, or streams joined by events), as the
signal-pad barriers already require.

Push one-shot (``triton_one_shot_push``): peers write into this rank's stage and ``x`` is only
read locally, so any tensor is served without a copy-in; the stage takes ``world_size - 1``
slots of the tensor's size (rounded up to 256 bytes): in a double-buffer half when they fit and
the config asks for it, else at the top of the all-reduce region.

Failures are reported after the fact, never on the hot path: the kernels' barrier waits are
bounded (autosymm.kernels.barrier), so a peer that never launches its kernel (it raised, or runs
another decision) makes this rank's kernel finish with a garbage sum instead of hanging the GPU.
``Workspace.barrier_errors()`` (it synchronizes the device) is then non-zero, and every rank must
call ``Workspace.reset_signals()`` before the next collective kernel.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Optional

import torch

from ..configs import AllReduceConfig, all_reduce_space
from ..kernels.all_reduce import _one_shot_all_reduce, _two_shot_all_reduce
from ..kernels.push_all_reduce import _push_one_shot_all_reduce
from ..problem import DTYPES, Problem
from ..geometry import (ALIGN, ALL_REDUCE_REGION, DOUBLE_BUFFER_REGION, max_stage_input_bytes, stage_bytes)
from .base import Backend, BackendError, Capabilities, Needs, RunContext
from .launch import LeanLauncher

CHANNEL = ALL_REDUCE_REGION
MAX_NUMEL = 2**31 - 1  # kernels index with int32


class _AllReduceLauncher:
    """``launcher(x) -> x``: x summed in place over the group. Bound to one workspace and config."""

    def __init__(self, algorithm: str, problem: Problem, config: AllReduceConfig, workspace) -> None:
        self.algorithm = algorithm
        self.workspace = workspace
        self.dtype = DTYPES[problem.dtype]
        self.elem_bytes = problem.elem_bytes
        self.device = workspace.device
        # Tensor.get_device() of a tensor on the workspace's device (-1: CPU): an int, no torch.device
        self._device_index = self.device.index if self.device.type == "cuda" else -1
        self.world_size = workspace.world_size
        self.rank = workspace.rank
        self.capacity = workspace.capacity(CHANNEL)
        self._push = algorithm == "one_shot_push"
        # push: one slot of the rounded-up tensor per peer must fit the region
        self.max_bytes = min(max_stage_input_bytes(algorithm, self.capacity, self.world_size),
                             MAX_NUMEL * self.elem_bytes)
        self.region_start = int(workspace.buffer.data_ptr()) + workspace.regions[CHANNEL].offset
        self.region_end = self.region_start + self.capacity
        self.region_ptrs = workspace.region_ptrs(CHANNEL)
        self.signal_ptrs = workspace.signal_ptrs(CHANNEL)
        # Double buffer: halves at this offset from the region base (same buffer, same offsets on
        # every rank) and half_bytes apart; only one-shot configs that ask for it use them.
        self.half_bytes = workspace.double_buffer_half_bytes if config.double_buffer else 0
        self.double_offset = 0
        if self.half_bytes:
            self.double_offset = workspace.regions[DOUBLE_BUFFER_REGION].offset - workspace.regions[CHANNEL].offset
            self.double_start = self.region_start + self.double_offset
            self.double_end = self.double_start + 2 * self.half_bytes
        self.mc_base = 0
        if algorithm == "multimem":
            self.mc_base = workspace.multicast_ptr + workspace.regions[CHANNEL].offset
        self.config = config
        self._one_shot = algorithm == "one_shot"
        self._two_shot = not (self._one_shot or self._push)
        self._vec = 16 // self.elem_bytes  # elements per 16 bytes
        self._seg_div = self.world_size * self._vec  # elements per 16 bytes of every rank
        # key: (zero_copy, aligned, x_aligned, phase, double_buffer, tail): tail = the one-shots'
        # TAIL, elements numel is a multiple of (16 bytes' worth, or 1)
        self._variants: dict[tuple[bool, bool, bool, int, bool, int], LeanLauncher] = {}
        self._direct: dict[tuple[bool, bool, bool, int, bool, int], Callable[..., None]] = {}
        self._region_addr = int(self.region_ptrs.data_ptr())  # the workspace keeps these tensors alive
        self._signal_addr = int(self.signal_ptrs.data_ptr())

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
        integer arguments are a function of those alone (autosymm.replay relies on it). The
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
        if self._one_shot:
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
        if self.algorithm == "multimem" and not aligned:
            raise BackendError("triton_multimem needs a 16-byte aligned tensor; this zero-copy tensor "
                               "(inside the all-reduce region) is not: allocate it with Workspace.empty")
        constexprs = dict(RANK=self.rank, WORLD_SIZE=self.world_size, BLOCK=self.config.block_size,
                          ZERO_COPY=zero_copy, ALIGNED=aligned)
        if self.algorithm == "one_shot":
            if phase:
                raise ValueError("one-shot has no phases")
            kernel = _one_shot_all_reduce
            constexprs.update(DOUBLE_BUFFER=double, TAIL=tail)
        elif self._push:
            if phase:
                raise ValueError("push one-shot has no phases")
            kernel = _push_one_shot_all_reduce
            del constexprs["ZERO_COPY"]
            constexprs.update(DOUBLE_BUFFER=double, TAIL=tail)
        else:
            kernel = _two_shot_all_reduce
            constexprs.update(MULTIMEM=self.algorithm == "multimem", PHASE=phase)
        launcher = LeanLauncher(kernel, (self.config.num_blocks,), constexprs, num_warps=self.config.num_warps,
                                num_stages=1)
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


def stage_limits(need: int, problem: Problem, caps: Capabilities) -> Optional[str]:
    """Why a Triton kernel staging ``need`` bytes in the all-reduce region cannot serve
    ``problem`` (the region too small, or more elements than int32 indexing reaches), or None."""
    if need > caps.all_reduce_bytes:
        return f"a {need}-byte stage exceeds the {caps.all_reduce_bytes}-byte all-reduce region"
    if problem.numel > MAX_NUMEL:
        return f"{problem.numel} elements exceed int32 indexing"
    return None


def prepared_workspace(backend: Backend, problem: Problem, config: Any, config_type: type, ctx: RunContext):
    """``ctx.workspace`` once a Triton backend's ``prepare`` arguments fit: a workspace of the
    problem's world size and a ``config_type`` config of the backend's algorithm (BackendError)."""
    ws = ctx.workspace
    if ws is None:
        raise BackendError(f"{backend.name} needs a symmetric workspace (ctx.workspace is None)")
    if not isinstance(config, config_type) or config.algorithm != backend.algorithm:
        raise BackendError(f"{backend.name} needs {config_type.__name__}(algorithm={backend.algorithm!r}, ...), "
                           f"got {config!r}")
    if ws.world_size != problem.world_size:
        raise BackendError(f"{problem.describe()} does not match the workspace's world size {ws.world_size}")
    return ws


class TritonAllReduce(Backend):
    """One Triton all-reduce algorithm (autosymm.configs.ALL_REDUCE_ALGORITHMS) as a Backend."""

    def __init__(self, algorithm: str) -> None:
        self.algorithm = algorithm
        self.name = f"triton_{algorithm}"
        multimem = algorithm == "multimem"
        self.needs = Needs(ops=("all_reduce",), compiles_kernels=True, workspace_region=ALL_REDUCE_REGION,
                           intra_node=True, multicast=multimem, min_compute_capability=(9, 0) if multimem else (0, 0))

    def limits(self, problem: Problem, caps: Capabilities) -> Optional[str]:
        return stage_limits(stage_bytes(self.algorithm, problem.nbytes, problem.world_size), problem, caps)

    def search_space(self, problem: Problem) -> list[AllReduceConfig]:
        return all_reduce_space(self.algorithm, problem.numel, problem.world_size, problem.elem_bytes)

    def prepare(self, problem: Problem, config: Optional[AllReduceConfig], ctx: RunContext) -> _AllReduceLauncher:
        """A launcher ``launcher(x) -> x`` for ``problem`` with ``config`` on ``ctx.workspace``."""
        ws = prepared_workspace(self, problem, config, AllReduceConfig, ctx)
        if self.algorithm == "multimem" and not ws.has_multicast:
            raise BackendError(f"{self.name} needs multicast; the workspace has none")
        return _AllReduceLauncher(self.algorithm, problem, config, ws)


triton_one_shot = TritonAllReduce("one_shot")
triton_one_shot_push = TritonAllReduce("one_shot_push")
triton_two_shot = TritonAllReduce("two_shot")
triton_multimem = TritonAllReduce("multimem")
BACKENDS = (triton_one_shot, triton_one_shot_push, triton_two_shot, triton_multimem)
