"""Backends ``triton_fused_one_shot``, ``triton_fused_one_shot_push`` and ``triton_fused_two_shot``:
the fused all-reduce + residual add + RMSNorm kernels of autosymm.kernels.fused_rmsnorm over the
symmetric workspace's all-reduce region (and its signal channel: calls are stream-ordered with
the all-reduces, as theirs are with each other).

A launcher ``launcher(x, residual, weight, eps) -> out`` serves contiguous x and residual of
[tokens, hidden] (the prepared dtype and hidden size, any token count whose stage fits) and a
contiguous weight [hidden] of the same dtype; ``out`` is a new tensor, residual is updated in
place, x is left unchanged. Stages: at the top of the region (clear of ``Workspace.empty``'s
tensors), as the all-reduce kernels' — the tensor itself (pull one-shot), one slot per peer
(push), x's rows and the out rows (two-shot: twice the tensor) — or, for a one-shot config with
``double_buffer`` whose stage fits, in a half of the double-buffer region. Barrier failures are
reported after the fact, as for the all-reduce backends (``Workspace.barrier_errors()``).

Split rows (a one-shot config's ``row_split`` > 1) use this rank's scratch (:func:`split_scratch`:
per-row counters and partial sums in the signal region, the fp32 stash region): a call with more
rows than it holds (``FUSED_SPLIT_MAX_ROWS``, or a stash of ``rows x hidden`` fp32) runs the same
config with whole rows instead, so a launcher serves any token count whose stage fits.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..configs import FusedConfig, fused_block_size, fused_space
from ..geometry import (ALL_REDUCE_REGION, DOUBLE_BUFFER_REGION, FUSED_COUNTS_OFFSET, FUSED_PARTIALS_OFFSET,
                        FUSED_SPLIT_MAX, FUSED_SPLIT_MAX_ROWS, FUSED_STASH_REGION, align, stage_bytes)
from ..kernels.fused_rmsnorm import _one_shot_all_reduce_rmsnorm, _two_shot_all_reduce_rmsnorm
from ..problem import DTYPES, Problem
from .base import Backend, BackendError, Capabilities, Needs, RunContext
from .launch import LeanLauncher
from .triton_all_reduce import MAX_NUMEL, prepared_workspace, stage_limits

OP = "all_reduce_rmsnorm"


def fused_stage_bytes(algorithm: str, nbytes: int, world_size: int) -> int:
    """Bytes of the all-reduce region a fused call of an ``nbytes`` tensor stages in: the
    all-reduce's stage, or x's rows plus the out rows (two-shot)."""
    if algorithm == "two_shot":
        return 2 * align(nbytes)
    return stage_bytes(algorithm, nbytes, world_size)


def split_scratch(workspace) -> tuple:
    """(per-row arrival counters int32, partial sums fp32, stash fp32) of ``workspace``'s rank:
    views of its buffer (autosymm.geometry), so nothing is allocated (not even inside a CUDA-graph
    capture). Without a stash region the partials stand in (split rows are then never used)."""
    buf = workspace.buffer
    counts = buf[FUSED_COUNTS_OFFSET:FUSED_COUNTS_OFFSET + 4 * FUSED_SPLIT_MAX_ROWS].view(torch.int32)
    partials = buf[FUSED_PARTIALS_OFFSET:][:4 * FUSED_SPLIT_MAX_ROWS * FUSED_SPLIT_MAX].view(torch.float32)
    stash = partials
    if FUSED_STASH_REGION in workspace.regions:
        region = workspace.regions[FUSED_STASH_REGION]
        stash = buf[region.offset:region.offset + region.nbytes].view(torch.float32)
    return counts, partials, stash


class _FusedLauncher:
    """``launcher(x, residual, weight, eps) -> out``. Bound to one workspace, hidden size and config."""

    def __init__(self, problem: Problem, config: FusedConfig, workspace) -> None:
        self.algorithm, self.config, self.workspace = config.algorithm, config, workspace
        self.dtype, self.hidden = DTYPES[problem.dtype], problem.hidden
        self.elem_bytes = problem.elem_bytes
        self.device, self.rank, self.world_size = workspace.device, workspace.rank, workspace.world_size
        self.capacity = workspace.capacity(ALL_REDUCE_REGION)
        self.region_start = int(workspace.buffer.data_ptr()) + workspace.regions[ALL_REDUCE_REGION].offset
        self.region_ptrs = workspace.region_ptrs(ALL_REDUCE_REGION)
        self.signal_ptrs = workspace.signal_ptrs(ALL_REDUCE_REGION)
        self.half_bytes = workspace.double_buffer_half_bytes if config.double_buffer else 0
        self.double_offset = 0
        if self.half_bytes:
            self.double_offset = workspace.regions[DOUBLE_BUFFER_REGION].offset - workspace.regions[ALL_REDUCE_REGION].offset
        self._variants: dict[tuple, LeanLauncher] = {}
        self._direct: dict[tuple, Callable[..., None]] = {}
        self._region_addr = int(self.region_ptrs.data_ptr())  # the workspace keeps these tensors alive
        self._signal_addr = int(self.signal_ptrs.data_ptr())
        self.row_split, self.split_rows, self._scratch = config.row_split, 0, split_scratch(workspace)
        if self.algorithm == "two_shot":
            self._scratch = ()
        elif config.row_split > 1 and FUSED_STASH_REGION in workspace.regions:
            stash_rows = workspace.capacity(FUSED_STASH_REGION) // (4 * self.hidden)
            self.split_rows = min(FUSED_SPLIT_MAX_ROWS, stash_rows)  # more rows: whole rows
        self._scratch_addrs = tuple(int(t.data_ptr()) for t in self._scratch)

    # -- hot path ---------------------------------------------------------------------------
    def __call__(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                 phase: int = 0, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """residual += all-reduce(x); returns RMSNorm(residual) * weight. ``phase`` != 0 runs one
        phase of the two-shot kernel into ``out`` (tests: every phase writes the same tensor)."""
        dtype, device = self.dtype, self.device
        if not (x.dtype is dtype and residual.dtype is dtype and weight.dtype is dtype and x.device == device
                and residual.device == device and weight.device == device and x.is_contiguous()
                and residual.is_contiguous() and weight.is_contiguous() and x.dim() == 2
                and x.shape[1] == self.hidden and residual.shape == x.shape and weight.shape[0] == self.hidden
                and weight.dim() == 1 and x.numel() <= MAX_NUMEL):
            raise self._bad_input(x, residual, weight)
        n_rows, nbytes, eps = x.shape[0], x.numel() * self.elem_bytes, float(eps)  # an int eps: another signature
        out = torch.empty_like(x) if out is None else out
        if n_rows == 0:
            return out
        stage, stage_end, sizes, double = self._stage(nbytes)
        ptrs = (x.data_ptr(), residual.data_ptr(), weight.data_ptr(), out.data_ptr())
        if (ptrs[0] < stage_end and ptrs[0] + nbytes > stage) or (ptrs[1] < stage_end and ptrs[1] + nbytes > stage):
            raise BackendError(f"x or residual {tuple(x.shape)} overlaps the {self.algorithm} stage of the all-reduce "
                               "region, where peers write")
        split = self.row_split if n_rows <= self.split_rows else 1  # rows the split scratch holds
        key = (double, phase, split) + tuple(a % 16 == 0 for a in ptrs)
        direct = self._direct.get(key)
        if direct is not None:  # bound: int addresses, no per-pointer driver query
            direct(*ptrs, self._region_addr, self._signal_addr, *self._scratch_addrs, n_rows, eps, *sizes)
            return out
        launch = self._variants.get(key) or self._variant(key)
        launch(x, residual, weight, out, self.region_ptrs, self.signal_ptrs, *self._scratch, n_rows, eps, *sizes)
        if launch.direct is not None:
            self._direct[key] = launch.direct
        return out

    run = __call__

    def _bad_input(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> BackendError:
        """A BackendError naming every bad property of the tensors."""
        problems = []
        for name, t in (("x", x), ("residual", residual), ("weight", weight)):
            if t.dtype is not self.dtype:
                problems.append(f"{name} dtype {t.dtype} (prepared for {self.dtype})")
            if t.device != self.device:
                problems.append(f"{name} on {t.device} (the workspace is on {self.device})")
            if not t.is_contiguous():
                problems.append(f"{name} strides {tuple(t.stride())} (must be contiguous)")
        if x.dim() != 2 or x.shape[1] != self.hidden or residual.shape != x.shape:
            problems.append(f"x {tuple(x.shape)} and residual {tuple(residual.shape)} must both be "
                            f"[tokens, {self.hidden}]")
        if tuple(weight.shape) != (self.hidden,):
            problems.append(f"weight {tuple(weight.shape)} must be [{self.hidden}]")
        if x.numel() > MAX_NUMEL:
            problems.append(f"{x.numel()} elements exceed int32 indexing")
        return BackendError(f"triton_fused_{self.algorithm} cannot serve all_reduce_rmsnorm: " + "; ".join(problems))

    def _stage(self, nbytes: int) -> tuple[int, int, tuple, bool]:
        """(stage start and end addresses, the kernel's integer arguments after eps, double-buffered?)
        of an ``nbytes`` tensor (per call: ``Workspace.empty`` may have grown since the last)."""
        need = fused_stage_bytes(self.algorithm, nbytes, self.world_size)
        slot = align(nbytes)
        if need <= self.half_bytes:
            start = self.region_start + self.double_offset
            return start, start + 2 * self.half_bytes, (self.double_offset, slot, self.half_bytes), True
        offset = self.capacity - need
        if offset < self.workspace.empty_bytes:
            raise BackendError(
                f"a {self.algorithm} stage of {need} bytes does not fit the {self.capacity}-byte all-reduce region "
                f"beside the {self.workspace.empty_bytes} bytes handed out by autosymm.empty; "
                "raise AUTOSYMM_WORKSPACE_BYTES")
        start = self.region_start + offset
        if self.algorithm == "two_shot":
            return start, start + need, (offset, offset + slot), False
        return start, start + need, (offset, slot, 0), False

    # -- cold path --------------------------------------------------------------------------
    def _variant(self, key: tuple) -> LeanLauncher:
        """The launcher of one kernel specialisation (triton specialises on the pointers' alignment)."""
        double, phase, split = key[0], key[1], key[2]
        cfg = self.config
        constexprs = dict(RANK=self.rank, WORLD_SIZE=self.world_size, HIDDEN=self.hidden, BLOCK=cfg.block_size,
                          ROWS=cfg.rows_per_program)
        if self.algorithm == "two_shot":
            kernel = _two_shot_all_reduce_rmsnorm
            constexprs.update(PHASE=phase)
        else:
            if phase:
                raise ValueError(f"the fused {self.algorithm} has no phases")
            kernel = _one_shot_all_reduce_rmsnorm
            constexprs.update(SPLIT=split, PUSH=self.algorithm == "one_shot_push", DOUBLE_BUFFER=double)
        launcher = LeanLauncher(kernel, (cfg.num_blocks,), constexprs, num_warps=cfg.num_warps, num_stages=1)
        self._variants[key] = launcher
        return launcher


class TritonFused(Backend):
    """One fused algorithm (autosymm.configs.FUSED_ALGORITHMS) as a Backend."""

    def __init__(self, algorithm: str) -> None:
        self.algorithm = algorithm
        self.name = f"triton_fused_{algorithm}"
        self.needs = Needs(ops=(OP,), compiles_kernels=True, workspace_region=ALL_REDUCE_REGION, intra_node=True)

    def limits(self, problem: Problem, caps: Capabilities) -> Optional[str]:
        return stage_limits(fused_stage_bytes(self.algorithm, problem.nbytes, problem.world_size), problem, caps)

    def search_space(self, problem: Problem) -> list[FusedConfig]:
        return fused_space(self.algorithm, problem.n_tokens_local, problem.hidden, problem.world_size,
                           problem.elem_bytes)

    def fallback_config(self, problem: Problem) -> Optional[FusedConfig]:
        """An untuned config (dispatch falls back to NCCL, see autosymm.backends.FALLBACK_ORDER;
        for callers of the backend itself): whole rows in registers, one row per program."""
        if problem.op != OP:
            return None
        block = fused_block_size(problem.hidden)
        warps = max(4, min(32, block * problem.elem_bytes // (16 * 32)))  # 16 bytes a thread
        return FusedConfig(self.algorithm, block, warps, min(132, problem.n_tokens_local), 1)

    def prepare(self, problem: Problem, config: Optional[FusedConfig], ctx: RunContext) -> _FusedLauncher:
        """A launcher for ``problem`` with ``config`` on ``ctx.workspace``."""
        ws = prepared_workspace(self, problem, config, FusedConfig, ctx)
        if problem.op != OP:
            raise BackendError(f"{self.name} serves {OP}, not {problem.op}")
        if config.block_size < problem.hidden:
            raise BackendError(f"{self.name}: block_size={config.block_size} must be >= hidden={problem.hidden} "
                               "(a row is held in registers)")
        return _FusedLauncher(problem, config, ws)


triton_fused_one_shot = TritonFused("one_shot")
triton_fused_one_shot_push = TritonFused("one_shot_push")
triton_fused_two_shot = TritonFused("two_shot")
BACKENDS = (triton_fused_one_shot, triton_fused_one_shot_push, triton_fused_two_shot)
