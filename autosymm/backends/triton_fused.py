"""Backends ``triton_fused_one_shot``, ``triton_fused_one_shot_push`` and ``triton_fused_two_shot``:
the fused all-reduce + residual add + RMSNorm kernels of autosymm.kernels.fused_rmsnorm over the
workspace's all-reduce region (stream-ordered with the all-reduces through its signal channel),
each a record of :data:`ALGORITHMS` with its search space (:func:`fused_space`) beside it.

A launcher ``launcher(x, residual, weight, eps, out=None, *, scale=None) -> out`` (or ``(out,
scales)``) serves contiguous [tokens, hidden] x and residual of the prepared dtype and hidden
size, any token count whose stage fits, with the problem's epilogue (autosymm.epilogue): the
residual updated in place, x left unchanged. Split rows (``row_split`` > 1) run whole rows for
calls beyond their scratch. Barrier failures are reported after the fact
(``Workspace.barrier_errors()``). Stages and scratch: the design notes.

Design notes: docs/BACKENDS.md#backends-triton-fused
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Callable, Optional

import torch

from ..spec import ALL_REDUCE_RMSNORM
from ..configs import FUSED_MAX_TILE_PER_THREAD, WARP_SIZE, FusedConfig, useful_counts
from ..epilogue import DEFAULT, NVFP4_BLOCK, Epilogue
from ..geometry import (ALL_REDUCE_REGION, DOUBLE_BUFFER_HALF_BYTES, FUSED_COUNTS_OFFSET, FUSED_PARTIALS_OFFSET,
                        FUSED_SPLIT_MAX, FUSED_SPLIT_MAX_ROWS, FUSED_STASH_REGION, LAMPORT_REGION, LAMPORT_SLOT_BYTES,
                        align, lamport_stage_bytes, push_stage_bytes, rows_and_out_stage_bytes, tensor_stage_bytes)
from ..kernels.fused_rmsnorm import _one_shot_all_reduce_rmsnorm, _two_shot_all_reduce_rmsnorm
from ..problem import Problem
from .base import Backend, BackendError, Capabilities, Needs, RunContext
from .launch import MAX_NUMEL, Algorithm, LeanLauncher, RegionLauncher, prepared_workspace, spin_constexpr, stage_limits
from .triton_lamport import lamport_header, lamport_limits

OP = ALL_REDUCE_RMSNORM.name

#: The fused algorithms by name (FusedConfig.algorithm), each a backend ``triton_fused_<name>``:
#: the one-shots (pull, push) stage as the all-reduce's and may split rows and double-buffer;
#: the two-shot by rows stages x's rows and the out rows. None is batch-invariant: the residual
#: is (the fp32 in-order sum, rounded once), but out's sum of squares is a tl.sum whose tree
#: follows the layout (BLOCK, warps, rows per program, the alignment it vectorises for) and the
#: split rows' parts, so its bits may change with the config.
ALGORITHMS: dict[str, Algorithm] = {a.name: a for a in (
    Algorithm("one_shot", _one_shot_all_reduce_rmsnorm, tensor_stage_bytes, {"PUSH": False}, double_buffer=True,
              double_buffer_space_bytes=DOUBLE_BUFFER_HALF_BYTES, row_split=True),
    Algorithm("one_shot_push", _one_shot_all_reduce_rmsnorm, push_stage_bytes, {"PUSH": True}, push=True,
              double_buffer=True, double_buffer_space_bytes=DOUBLE_BUFFER_HALF_BYTES, row_split=True),
    Algorithm("two_shot", _two_shot_all_reduce_rmsnorm, rows_and_out_stage_bytes, splits_by_rank=True),
    # no barrier: the Lamport exchange (peers store x into this rank's Lamport region, at most
    # LAMPORT_SLOT_BYTES a call; it shares the rotation with the Lamport all-reduce)
    Algorithm("lamport", _one_shot_all_reduce_rmsnorm, lamport_stage_bytes, {"PUSH": True, "LAMPORT": True},
              push=True, row_split=True, lamport=True),
)}


def largest_stage_bytes(nbytes: int, world_size: int) -> int:
    """Bytes of the all-reduce region the largest stage of any fused algorithm takes for ``nbytes``."""
    return max(a.stage_bytes(nbytes, world_size) for a in ALGORITHMS.values())


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


def epilogue_of(problem: Problem) -> Epilogue:
    """The epilogue a fused problem asks for (``problem.epilogue``; the default without one)."""
    return getattr(problem, "epilogue", None) or DEFAULT


class _FusedLauncher(RegionLauncher):
    """``launcher(x, residual, weight, eps, *, scale=None) -> out`` or ``(out, scales)``. Bound to
    one workspace, hidden size, epilogue and config."""

    eager_call = "new_output"  # autosymm.runtime.replay wraps eager calls in a FusedReplay

    def __init__(self, problem: Problem, config: FusedConfig, workspace, epilogue: Optional[Epilogue] = None) -> None:
        super().__init__(problem, config, workspace)
        self.hidden = problem.hidden
        self.epilogue = epilogue or epilogue_of(problem)
        self._rows_by_rank = self.record.splits_by_rank  # the two-shot: its stage holds the out rows too
        self._lamport = self.record.lamport
        if self._lamport:  # peers store into the Lamport region: the kernel's region_ptrs are its table
            region = workspace.regions[LAMPORT_REGION]
            self.region_ptrs = workspace.region_ptrs(LAMPORT_REGION)
            self._region_addr = int(self.region_ptrs.data_ptr())
            self._lamport_range = (int(workspace.buffer.data_ptr()) + region.offset,
                                   int(workspace.buffer.data_ptr()) + region.offset + region.nbytes)
        self.row_split, self.split_rows, self._scratch = config.row_split, 0, split_scratch(workspace)
        # the one-shot kernel's header_ptr: this rank's Lamport header (read by the Lamport variant only)
        self._scratch += (lamport_header(workspace) if LAMPORT_REGION in workspace.regions else self._scratch[0],)
        if not self.record.row_split:  # the two-shot kernel takes no split-row scratch
            self._scratch = ()
        elif config.row_split > 1 and FUSED_STASH_REGION in workspace.regions:
            stash_rows = workspace.capacity(FUSED_STASH_REGION) // (4 * self.hidden)
            self.split_rows = min(FUSED_SPLIT_MAX_ROWS, stash_rows)  # more rows: whole rows
        self._scratch_addrs = tuple(int(t.data_ptr()) for t in self._scratch)

    # -- hot path ---------------------------------------------------------------------------
    def __call__(self, x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float = 1e-6,
                 phase: int = 0, out=None, *, scale: Optional[torch.Tensor] = None):
        """residual += all-reduce(x) (with a residual); returns the epilogue's out (RMSNorm *
        weight, quantized or not), and ``(out, scales)`` where it has scales. ``out``: the tensor
        to write (an ``(out, scales)`` pair with scales), new ones when None. ``phase`` != 0 runs
        one phase of the two-shot kernel (tests: every phase writes the same tensors)."""
        epilogue = self.epilogue
        out, scales = out if isinstance(out, tuple) else (out, None)
        if out is None or (scales is None and epilogue.has_scales):
            new_out, new_scales = epilogue.empty_outputs(x.shape[0], self.hidden, self.dtype, self.device)
            out = new_out if out is None else out
            scales = new_scales if scales is None else scales
        self._check(x, residual, weight, out, scale, scales)
        plan = self._plan(x, residual, weight, (out, scale, scales), eps, phase)
        if plan is not None:
            key, ptrs, tail = plan
            direct = self._direct.get(key)
            if direct is not None:  # bound: int addresses, no per-pointer driver query
                direct(*ptrs, self._region_addr, self._signal_addr, *self._scratch_addrs, *tail)
            else:
                launch = self._variants.get(key) or self._variant(key)
                launch(x, x if residual is None else residual, weight, out, out if scale is None else scale,
                       out if scales is None else scales, self.region_ptrs, self.signal_ptrs, *self._scratch, *tail)
                if launch.direct is not None:
                    self._direct[key] = launch.direct
        return (out, scales) if epilogue.has_scales else out

    def bind(self, x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, out: torch.Tensor,
             eps: float = 1e-6, *, scale: Optional[torch.Tensor] = None,
             scales: Optional[torch.Tensor] = None) -> Optional[Callable[[], None]]:
        """``launch()``: this call's kernel launch writing ``out`` (and ``scales``), its arguments
        bound (int addresses), on the current stream, without any check; None when it launches
        nothing or its variant is not bound yet (call ``self(...)`` first). Valid for every call
        with tensors at these addresses, of these dtypes, shapes and devices, and this ``eps``,
        while ``workspace.empty_bytes`` is unchanged (autosymm.runtime.replay relies on it): the variant
        and the integer arguments are a function of those alone; the split-row counters return
        to 0 after every call, so a bound launch, or a CUDA graph of one, stays right."""
        self._check(x, residual, weight, out, scale, scales)
        plan = self._plan(x, residual, weight, (out, scale, scales), eps, 0)
        if plan is None:
            return None
        key, ptrs, tail = plan
        direct = self._direct.get(key)
        if direct is None:
            return None
        return partial(direct, *ptrs, self._region_addr, self._signal_addr, *self._scratch_addrs, *tail)

    def _check(self, x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, out: torch.Tensor,
               scale: Optional[torch.Tensor], scales: Optional[torch.Tensor]) -> None:
        dtype, device, epilogue = self.dtype, self.device, self.epilogue
        if not (x.dtype is dtype and weight.dtype is dtype and x.device == device and weight.device == device
                and x.is_contiguous() and weight.is_contiguous() and x.dim() == 2 and x.shape[1] == self.hidden
                and weight.shape[0] == self.hidden and weight.dim() == 1 and x.numel() <= MAX_NUMEL
                and ((residual is None) if not epilogue.residual else
                     (residual is not None and residual.dtype is dtype and residual.device == device
                      and residual.is_contiguous() and residual.shape == x.shape))
                and self._outputs_ok(x, out, scale, scales)):
            raise self._bad_input(x, residual, weight, out, scale, scales)

    def _outputs_ok(self, x: torch.Tensor, out: torch.Tensor, scale: Optional[torch.Tensor],
                    scales: Optional[torch.Tensor]) -> bool:
        """Whether out, scale and scales are what the epilogue writes and reads (on the device)."""
        epilogue, device, tokens = self.epilogue, self.device, x.shape[0]
        if not (out.dtype is epilogue.out_dtype(self.dtype) and tuple(out.shape) == epilogue.out_shape(tokens, self.hidden)
                and out.device == device and out.is_contiguous()):
            return False
        if epilogue.needs_scale and not (scale is not None and scale.dtype is torch.float32 and scale.numel() == 1
                                         and scale.device == device):
            return False
        if epilogue.has_scales:
            want = torch.float32 if epilogue.quant == "fp8_per_token" else torch.float8_e4m3fn
            return (scales is not None and scales.dtype is want and scales.device == device and scales.is_contiguous()
                    and tuple(scales.shape) == epilogue.scales_shape(tokens, self.hidden))
        return True

    def _plan(self, x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, outputs: tuple,
              eps: float, phase: int) -> Optional[tuple[tuple, tuple, tuple]]:
        """(variant key, the six pointer arguments' addresses, the kernel's arguments after the
        scratch) of a checked call with ``outputs`` = (out, scale, scales), or None without rows;
        BackendError when x or residual overlaps the stage. Unused pointer arguments (no residual,
        scale or scales) get x's or out's address."""
        out, scale, scales = outputs
        n_rows, nbytes, eps = x.shape[0], x.numel() * self.elem_bytes, float(eps)  # an int eps: another signature
        if n_rows == 0:
            return None
        stage, stage_end, sizes, double = self._stage(nbytes)
        out_addr = out.data_ptr()
        ptrs = (x.data_ptr(), x.data_ptr() if residual is None else residual.data_ptr(), weight.data_ptr(), out_addr,
                out_addr if scale is None else scale.data_ptr(), out_addr if scales is None else scales.data_ptr())
        if (ptrs[0] < stage_end and ptrs[0] + nbytes > stage) or (ptrs[1] < stage_end and ptrs[1] + nbytes > stage):
            raise BackendError(f"x or residual {tuple(x.shape)} overlaps the {self.algorithm} stage of the all-reduce "
                               "region, where peers write")
        split = self.row_split if n_rows <= self.split_rows else 1  # rows the split scratch holds
        key = (double, phase, split) + tuple(a % 16 == 0 for a in ptrs)
        return key, ptrs, (n_rows, eps, *sizes)

    run = __call__

    def _bad_input(self, x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, out: torch.Tensor,
                   scale: Optional[torch.Tensor], scales: Optional[torch.Tensor]) -> BackendError:
        """A BackendError naming every bad property of the tensors."""
        problems, epilogue = [], self.epilogue
        if epilogue.residual and residual is None:
            problems.append(f"residual is None, but the epilogue {epilogue.key or 'add_rms'} adds it")
        elif not epilogue.residual and residual is not None:
            problems.append(f"a residual was passed to the epilogue {epilogue.key}, which adds none")
        named = [("x", x), ("weight", weight)] + ([("residual", residual)] if residual is not None else [])
        for name, t in named:
            if t.dtype is not self.dtype:
                problems.append(f"{name} dtype {t.dtype} (prepared for {self.dtype})")
            if t.device != self.device:
                problems.append(f"{name} on {t.device} (the workspace is on {self.device})")
            if not t.is_contiguous():
                problems.append(f"{name} strides {tuple(t.stride())} (must be contiguous)")
        if x.dim() != 2 or x.shape[1] != self.hidden or (residual is not None and residual.shape != x.shape):
            problems.append(f"x {tuple(x.shape)} and residual {None if residual is None else tuple(residual.shape)} "
                            f"must both be [tokens, {self.hidden}]")
        if tuple(weight.shape) != (self.hidden,):
            problems.append(f"weight {tuple(weight.shape)} must be [{self.hidden}]")
        if x.numel() > MAX_NUMEL:
            problems.append(f"{x.numel()} elements exceed int32 indexing")
        if x.dim() == 2 and not self._outputs_ok(x, out, scale, scales):
            problems.append(self._outputs_wanted(x.shape[0], out, scale, scales))
        return BackendError(f"triton_fused_{self.algorithm} cannot serve all_reduce_rmsnorm: " + "; ".join(problems))

    def _outputs_wanted(self, tokens: int, out: torch.Tensor, scale: Optional[torch.Tensor],
                        scales: Optional[torch.Tensor]) -> str:
        """What the epilogue's out, scale and scales must be, and what they are."""
        epilogue = self.epilogue

        def desc(t):
            return "None" if t is None else f"{t.dtype} {tuple(t.shape)} on {t.device}"

        text = (f"epilogue {epilogue.key or 'add_rms'} writes out {epilogue.out_dtype(self.dtype)} "
                f"{epilogue.out_shape(tokens, self.hidden)} (got {desc(out)})")
        if epilogue.needs_scale:
            text += f", reads a float32 scale of one element (got {desc(scale)})"
        if epilogue.has_scales:
            text += f", writes scales {epilogue.scales_shape(tokens, self.hidden)} (got {desc(scales)})"
        return text + f", contiguous, on {self.device}"

    def _stage(self, nbytes: int) -> tuple[int, int, tuple, bool]:
        """(stage start and end addresses, the kernel's integer arguments after eps, double-buffered?)
        of an ``nbytes`` tensor (per call: ``Workspace.empty`` may have grown since the last)."""
        if self._lamport:  # the Lamport region: x within one slot, the kernel picks the buffer
            if nbytes > LAMPORT_SLOT_BYTES:
                raise BackendError(f"triton_fused_lamport serves at most {LAMPORT_SLOT_BYTES} bytes of x a call, "
                                   f"not {nbytes}")
            return (*self._lamport_range, (0, LAMPORT_SLOT_BYTES, 0), False)
        need = self.record.stage_bytes(nbytes, self.world_size)
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
        if self._rows_by_rank:
            return start, start + need, (offset, offset + slot), False
        return start, start + need, (offset, slot, 0), False

    # -- cold path --------------------------------------------------------------------------
    def _variant(self, key: tuple) -> LeanLauncher:
        """The launcher of one kernel specialisation (triton specialises on the pointers' alignment)."""
        double, phase, split = key[0], key[1], key[2]
        cfg = self.config
        constexprs = dict(RANK=self.rank, WORLD_SIZE=self.world_size, HIDDEN=self.hidden, BLOCK=cfg.block_size,
                          ROWS=cfg.rows_per_program, HAS_RESIDUAL=self.epilogue.residual, GEMMA=self.epilogue.gemma,
                          QUANT=self.epilogue.quant_code)
        if self.record.splits_by_rank:
            constexprs.update(PHASE=phase)
        elif phase:
            raise ValueError(f"the fused {self.algorithm} has no phases")
        else:
            spin = spin_constexpr(cfg, self.world_size, cfg.rows_per_program * cfg.block_size // split,
                                  cfg.num_warps * WARP_SIZE, self.elem_bytes)
            # LAMPORT: the record's flags may set it
            constexprs.update(SPLIT=split, DOUBLE_BUFFER=double, LAMPORT=False, SPIN=spin)
        launcher = LeanLauncher(self.record.kernel, (cfg.num_blocks,), {**constexprs, **self.record.flags},
                                num_warps=cfg.num_warps, num_stages=1)
        self._variants[key] = launcher
        return launcher


FUSED_NUM_WARPS = (4, 8, 16, 32)
FUSED_ROWS_PER_PROGRAM = (1, 2, 4)
FUSED_NUM_BLOCKS = (1, 2, 4, 8, 16, 32, 64, 132)
#: Bytes of a row each thread holds, for the warps of the space (fewer: too few loads in flight
#: per thread to hide NVLink latency; more: registers spill).
FUSED_ROW_BYTES_PER_THREAD = (16, 64)
#: Grids per (warps, rows) point: the largest useful ones (a fused call is latency-bound where it
#: has few rows, and then one of them covers the rows; with many rows the widest grids win).
FUSED_GRIDS_PER_POINT = 3
#: Split rows (FusedConfig.row_split) of the one-shots' space: where rows x split programs
#: stay within one wave of 132 SMs (at 1-64 tokens a program per row leaves most SMs idle, and
#: one SM moves a whole row over NVLink), with warps holding 16-32 bytes of a part a thread.
FUSED_ROW_SPLITS = (2, 4, 8)
FUSED_SPLIT_MAX_PROGRAMS = 132
FUSED_SPLIT_BYTES_PER_THREAD = (16, 32)


def fused_block_size(hidden: int) -> int:
    """The BLOCK of a fused kernel for rows of ``hidden`` elements: a row group is held in
    registers, so the next power of two >= hidden (at least the 128 threads of 4 warps)."""
    return max(128, 1 << max(0, hidden - 1).bit_length())


def fused_space(algorithm: str, n_tokens: int, hidden: int, world_size: int, elem_bytes: int) -> list[FusedConfig]:
    """Valid, non-redundant configs of the fused ``algorithm`` for [n_tokens, hidden] per rank.

    BLOCK is :func:`fused_block_size` (whole rows in registers); warps holding
    :data:`FUSED_ROW_BYTES_PER_THREAD` bytes of a row a thread (else 4); rows per program that fit
    :data:`FUSED_MAX_TILE_PER_THREAD` and the rows there are; the :data:`FUSED_GRIDS_PER_POINT`
    largest grids up to the first one covering the row groups (two-shot: of a rank's
    ``n_tokens / world_size`` rows). One-shots whose stage fits a double-buffer half get every
    config again with ``double_buffer=True``. Then the one-shots' split rows where the rows are
    few (:func:`_split_space`), double-buffered only where the stage fits: such calls are
    latency-bound, and the end barrier is what double buffering removes. Never empty.
    """
    block_size = fused_block_size(hidden)
    record = ALGORITHMS[algorithm]
    rows = record.share(n_tokens, world_size)
    low, high = FUSED_ROW_BYTES_PER_THREAD
    warps = [w for w in FUSED_NUM_WARPS if low <= block_size * elem_bytes // (w * WARP_SIZE) <= high
             and w * WARP_SIZE <= block_size] or [FUSED_NUM_WARPS[0]]
    space: list[FusedConfig] = []
    for num_warps in warps:
        for rows_per_program in FUSED_ROWS_PER_PROGRAM:
            if rows_per_program > 1 and (rows_per_program * block_size > FUSED_MAX_TILE_PER_THREAD * num_warps * WARP_SIZE
                                         or rows_per_program >= 2 * rows):
                continue  # spills, or only masked rows
            groups = -(-rows // rows_per_program)
            for num_blocks in useful_counts(FUSED_NUM_BLOCKS, groups)[-FUSED_GRIDS_PER_POINT:]:
                space.append(FusedConfig(algorithm, block_size, num_warps, num_blocks, rows_per_program))
    stage = record.stage_bytes(n_tokens * hidden * elem_bytes, world_size)
    double = record.double_buffer and stage <= record.double_buffer_space_bytes
    if double:
        space += [dataclasses.replace(config, double_buffer=True) for config in space]
    if record.row_split:  # latency-bound: double-buffered only, where it fits
        space += [dataclasses.replace(c, double_buffer=double) for c in _split_space(algorithm, rows, hidden, elem_bytes)]
    # No spin=True configs: on 1x H200 (2026-12-03, docs/BENCHMARKS.md) the fused Lamport's spin
    # gave up its waits in the static-FP8 case at 1 x 8192, g1 w16; FusedConfig.spin stays for the bench.
    return space


def _split_space(algorithm: str, rows: int, hidden: int, elem_bytes: int) -> list[FusedConfig]:
    """The split-row configs of a one-shot for ``rows`` rows of ``hidden`` (FusedConfig.row_split):
    :data:`FUSED_ROW_SPLITS` with at most :data:`FUSED_SPLIT_MAX_PROGRAMS` programs, warps holding
    :data:`FUSED_SPLIT_BYTES_PER_THREAD` bytes of a part, one program per (row, part)."""
    block_size = fused_block_size(hidden)
    low, high = FUSED_SPLIT_BYTES_PER_THREAD
    space = []
    for split in FUSED_ROW_SPLITS:
        chunk = block_size // split
        parts = -(-hidden // chunk)  # parts holding columns < hidden
        if rows > FUSED_SPLIT_MAX_ROWS or rows * split > FUSED_SPLIT_MAX_PROGRAMS or parts < 2:
            continue
        for num_warps in FUSED_NUM_WARPS:
            if low <= chunk * elem_bytes // (num_warps * WARP_SIZE) <= high and num_warps * WARP_SIZE <= chunk:
                space.append(FusedConfig(algorithm, block_size, num_warps, rows * parts, 1, row_split=split))
    return space


class TritonFused(Backend):
    """One fused algorithm (a record of :data:`ALGORITHMS`) as a Backend."""

    def __init__(self, record: Algorithm) -> None:
        self.record, self.algorithm = record, record.name
        self.name = f"triton_fused_{record.name}"
        self.batch_invariant = record.batch_invariant
        self.needs = Needs(compiles_kernels=True, workspace_region=ALL_REDUCE_REGION, intra_node=True)

    def limits(self, problem: Problem, caps: Capabilities) -> Optional[str]:
        if self.record.lamport and (reason := lamport_limits(problem)):
            return reason
        return stage_limits(self.record.stage_bytes(problem.nbytes, problem.world_size), problem, caps)

    def search_space(self, problem: Problem) -> list[FusedConfig]:
        return fused_space(self.algorithm, problem.n_tokens_local, problem.hidden, problem.world_size,
                           problem.elem_bytes)

    def prepare(self, problem: Problem, config: Optional[FusedConfig], ctx: RunContext) -> _FusedLauncher:
        """A launcher for ``problem`` with ``config`` on ``ctx.workspace``."""
        ws = prepared_workspace(self, problem, config, FusedConfig, ctx)
        if self.record.lamport and LAMPORT_REGION not in ws.regions:
            raise BackendError(f"{self.name} needs the workspace's {LAMPORT_REGION!r} region; this one has none")
        if problem.op != OP:
            raise BackendError(f"{self.name} serves {OP}, not {problem.op}")
        if config.block_size < problem.hidden:
            raise BackendError(f"{self.name}: block_size={config.block_size} must be >= hidden={problem.hidden} "
                               "(a row is held in registers)")
        if epilogue_of(problem).quant == "nvfp4" and problem.hidden % NVFP4_BLOCK:
            raise BackendError(f"{self.name}: nvfp4 packs blocks of {NVFP4_BLOCK}: hidden={problem.hidden} is not "
                               "a multiple")
        return _FusedLauncher(problem, config, ws)


triton_fused_one_shot = TritonFused(ALGORITHMS["one_shot"])
triton_fused_one_shot_push = TritonFused(ALGORITHMS["one_shot_push"])
triton_fused_two_shot = TritonFused(ALGORITHMS["two_shot"])
triton_fused_lamport = TritonFused(ALGORITHMS["lamport"])
BACKENDS = (triton_fused_one_shot, triton_fused_one_shot_push, triton_fused_two_shot, triton_fused_lamport)
