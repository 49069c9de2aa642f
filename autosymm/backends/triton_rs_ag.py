"""Backends ``triton_reduce_scatter_pull`` / ``_push`` and ``triton_all_gather_push`` / ``_pull``:
the kernels of autosymm.kernels.reduce_scatter and autosymm.kernels.all_gather over the
workspace's all-reduce region (stream-ordered with every collective kernel of the group).

A launcher is ``launcher(output, input, counts=None) -> output``: torch.distributed's
``reduce_scatter_tensor`` / ``all_gather_into_tensor`` on flat data, equal segments in rank order
or ``counts[r]`` elements for rank r (the per-rank-size forms; the same list on every rank).
Reduce-scatter sums bf16 / fp16 / fp32 (fp32 in rank order: the Triton all-reduce's bits);
all-gather copies bytes of any dtype. ``Workspace.empty`` tensors are served zero-copy, others
staged; in place is fine. Failures are the all-reduce's (bounded waits, ``barrier_errors``,
``reset_signals`` on every rank).

Design notes: docs/BACKENDS.md#backends-triton-rs-ag
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable, Optional, Sequence

import torch

from ..configs import WARP_SIZE, useful_counts
from ..geometry import ALIGN, ALL_REDUCE_REGION, align
from ..problem import DTYPES, Problem
from .base import Backend, BackendError, Capabilities, Needs, RunContext
from .launch import LeanLauncher
from .rs_ag_layout import MAX_UNITS, Segments, even_counts, push_slot_units, segments, stage_bytes, stage_units
from ..configs import AllGatherConfig, ReduceScatterConfig
from .triton_all_reduce import prepared_workspace

#: BLOCK widths of the spaces: elements (reduce-scatter, as the all-reduce's), bytes (all-gather).
REDUCE_SCATTER_BLOCK_SIZES = (1024, 2048, 4096, 8192, 16384, 32768)
ALL_GATHER_BLOCK_SIZES = (2048, 4096, 8192, 16384, 32768, 65536)
NUM_WARPS = (4, 8, 16, 32)
NUM_BLOCKS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 132, 256)
#: Bounds tables (reduce_scatterv / all_gatherv) a launcher keeps on the device.
MAX_TABLES = 64


def _space(config_type, blocks, segment_units: int, unit_bytes: int, min_thread_bytes: int, algorithm: str) -> list:
    """Configs of BLOCK x warps x grid for segments of ``segment_units``: BLOCKs up to twice the
    segment (the smallest always), warps giving a thread >= ``min_thread_bytes`` (else only the
    fewest), grids up to the first that covers a segment's chunks. Never empty."""
    space = []
    for block in blocks:
        if block > 2 * max(segment_units, blocks[0]) and block != blocks[0]:
            continue
        chunks = max(1, -(-segment_units // block))
        for warps in NUM_WARPS:
            threads = warps * WARP_SIZE
            if threads > block or (block * unit_bytes // threads < min_thread_bytes and warps != NUM_WARPS[0]):
                continue
            space += [config_type(algorithm, block, grid, warps) for grid in useful_counts(NUM_BLOCKS, chunks)]
    return space


def reduce_scatter_space(algorithm: str, numel: int, world_size: int, elem_bytes: int) -> list[ReduceScatterConfig]:
    """Configs of a reduce-scatter of a ``numel``-element input (a program strides over every
    segment's chunks, so the chunk count is a segment's)."""
    return _space(ReduceScatterConfig, REDUCE_SCATTER_BLOCK_SIZES, -(-numel // world_size), elem_bytes, 8, algorithm)


def all_gather_space(algorithm: str, nbytes: int, world_size: int) -> list[AllGatherConfig]:
    """Configs of an all-gather of an ``nbytes`` output (BLOCK in bytes, a vector a thread at least)."""
    return _space(AllGatherConfig, ALL_GATHER_BLOCK_SIZES, -(-nbytes // world_size), 1, 16, algorithm)


@lru_cache(maxsize=1024)
def _layout(counts: tuple[int, ...], vec: int, padded: bool) -> Segments:
    return segments(counts, vec, padded)


class _SegmentLauncher:
    """What the reduce-scatter and all-gather launchers share: the workspace's addresses, the
    kernel variants (one LeanLauncher per specialisation), bounds tables and the stage placement."""

    #: 'reduce_scatter' | 'all_gather'; the all-gather's units are bytes
    op = ""
    #: whether the kernel has a ZERO_COPY constexpr (all but the push reduce-scatter's)
    zero_copy_kernel = True

    def __init__(self, kernel, config, workspace, dtype: Optional[torch.dtype]) -> None:
        self.kernel = kernel
        self.config = config
        self.workspace = workspace
        self.dtype = dtype
        self.rank, self.world_size, self.device = workspace.rank, workspace.world_size, workspace.device
        self.capacity = workspace.capacity(ALL_REDUCE_REGION)
        self.region_start = int(workspace.buffer.data_ptr()) + workspace.regions[ALL_REDUCE_REGION].offset
        self.region_end = self.region_start + self.capacity
        self.region_ptrs = workspace.region_ptrs(ALL_REDUCE_REGION)
        self.signal_ptrs = workspace.signal_ptrs(ALL_REDUCE_REGION)
        # The table argument of equal-segment calls, which the kernels never read: a view of the
        # workspace (no allocation, so a launcher prepared inside a CUDA-graph capture is fine).
        self._no_table = workspace.buffer[:4].view(torch.int32)
        self._tables: dict[Segments, torch.Tensor] = {}
        self._variants: dict[tuple, LeanLauncher] = {}
        self._direct: dict[tuple, Callable[..., None]] = {}
        self._addrs = (int(self.region_ptrs.data_ptr()), int(self.signal_ptrs.data_ptr()))

    def _launch(self, key: tuple, out: torch.Tensor, inp: torch.Tensor, layout: Segments, stage_offset: int,
                stride: int) -> None:
        """Launch variant ``key``; ``stride``: the kernel's third int (stage_seg, or the push's slot)."""
        table = self._table(layout)
        ints = (self.rank, layout.seg, stride, stage_offset)
        direct = self._direct.get(key)
        if direct is not None:  # bound: int addresses, no per-pointer driver query
            direct(out.data_ptr(), inp.data_ptr(), *self._addrs, table.data_ptr(), *ints)
            return
        launch = self._variants.get(key) or self._variant(key)
        launch(*self._views(out, inp), self.region_ptrs, self.signal_ptrs, table, *ints)
        if launch.direct is not None:
            self._direct[key] = launch.direct

    def _views(self, out: torch.Tensor, inp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return out, inp

    def _variant(self, key: tuple) -> LeanLauncher:
        zero_copy, aligned, seg_aligned, even = key[:4]
        constexprs = dict(WORLD_SIZE=self.world_size, BLOCK=self.config.block_size, ZERO_COPY=zero_copy,
                          ALIGNED=aligned, SEG_ALIGNED=seg_aligned, EVEN=even)
        if not self.zero_copy_kernel:
            del constexprs["ZERO_COPY"]  # the push reduce-scatter reads its input locally only
        launcher = LeanLauncher(self.kernel, (self.config.num_blocks,), constexprs, num_warps=self.config.num_warps,
                                num_stages=1)
        self._variants[key] = launcher
        return launcher

    def _table(self, layout: Segments) -> torch.Tensor:
        """The kernels' bounds table of ``layout`` (a dummy for equal segments), on the device.
        A new per-rank split costs one host-to-device copy (not inside a CUDA-graph capture:
        call the launcher with those counts once before capturing)."""
        if layout.even:
            return self._no_table
        table = self._tables.get(layout)
        if table is None:
            if len(self._tables) >= MAX_TABLES:
                self._tables.clear()
            table = self._tables[layout] = torch.tensor(layout.table(), dtype=torch.int32, device=self.device)
        return table

    def _counts(self, counts: Optional[Sequence[int]], total: int, what: str) -> tuple[int, ...]:
        """Per-rank counts (units): ``counts`` (checked) or an even split of ``total``."""
        if counts is None:
            try:
                return tuple(even_counts(total, self.world_size, what))
            except ValueError as exc:
                raise BackendError(f"{self.op}: {exc}; pass per-rank counts") from None
        counts = tuple(int(c) for c in counts)
        if len(counts) != self.world_size or min(counts) < 0 or sum(counts) != total:
            raise BackendError(f"{self.op}: per-rank counts {list(counts)} must be {self.world_size} non-negative "
                               f"counts summing to the {what}'s {total}")
        return counts

    def _check(self, output: torch.Tensor, input: torch.Tensor) -> None:
        problems = []
        for name, t in (("output", output), ("input", input)):
            if self.dtype is not None and t.dtype is not self.dtype:
                problems.append(f"{name} dtype {t.dtype} (prepared for {self.dtype})")
            if t.device != self.device:
                problems.append(f"{name} device {t.device} (the workspace is on {self.device})")
            if not t.is_contiguous():
                problems.append(f"{name} strides {tuple(t.stride())} (must be contiguous)")
        if output.dtype is not input.dtype:
            problems.append(f"output dtype {output.dtype} differs from input dtype {input.dtype}")
        if problems:
            raise BackendError(f"{self.op} of {tuple(input.shape)} -> {tuple(output.shape)}: " + "; ".join(problems))

    def _in_region(self, t: torch.Tensor, nbytes: int) -> Optional[int]:
        """Offset of ``t`` in the all-reduce region (zero-copy), None when outside; BackendError
        when it straddles the region's edge."""
        addr = t.data_ptr()
        if self.region_start <= addr and addr + nbytes <= self.region_end:
            return addr - self.region_start
        if addr < self.region_end and addr + nbytes > self.region_start:
            raise BackendError(f"{self.op}: tensor {tuple(t.shape)} straddles the edge of the all-reduce region: "
                               "it can be neither used in place nor staged")
        return None

    def _top_stage(self, need: int) -> int:
        """Offset of a ``need``-byte stage at the top of the region, clear of Workspace.empty's tensors."""
        offset = self.capacity - align(need, ALIGN)
        if offset < self.workspace.empty_bytes:
            raise BackendError(
                f"{self.op}: staging {need} bytes would overwrite the {self.workspace.empty_bytes} bytes handed out "
                f"by autosymm.empty in a {self.capacity}-byte region; raise AUTOSYMM_WORKSPACE_BYTES")
        return offset

    def _clear_of(self, stage: tuple[int, int], tensors: Sequence[tuple[str, torch.Tensor, int]]) -> None:
        """Every (name, tensor, bytes) lies outside the stage [start, end) (absolute addresses)."""
        for name, t, nbytes in tensors:
            if nbytes and t.data_ptr() < stage[1] and t.data_ptr() + nbytes > stage[0]:
                raise BackendError(f"{self.op}: the {name} {tuple(t.shape)} overlaps the stage in the all-reduce "
                                   "region, where peers read or write")

    def _check_in_place(self, whole: torch.Tensor, part: torch.Tensor, start: int, part_bytes: int,
                        whole_bytes: int) -> None:
        """``part`` (the shard or segment) may be ``whole``'s own segment, at byte ``start``, and
        must not overlap it otherwise."""
        a, b = whole.data_ptr(), part.data_ptr()
        if part_bytes and b < a + whole_bytes and b + part_bytes > a and b != a + start:
            raise BackendError(f"{self.op}: {tuple(part.shape)} overlaps {tuple(whole.shape)} other than as this "
                               f"rank's own segment (byte {start})")


class ReduceScatterLauncher(_SegmentLauncher):
    """``launcher(output, input, counts=None) -> output``: segment ``rank`` of the sum over the
    group of ``input`` (``counts``: per-rank elements, else equal segments)."""

    op = "reduce_scatter"

    def __init__(self, config: ReduceScatterConfig, workspace, dtype: torch.dtype) -> None:
        # Triton kernels load at the first launch: a CPU group imports none
        from ..kernels.reduce_scatter import _reduce_scatter, _reduce_scatter_push

        self.push = config.algorithm == "push"
        self.zero_copy_kernel = not self.push
        super().__init__(_reduce_scatter_push if self.push else _reduce_scatter, config, workspace, dtype)
        self.elem_bytes = dtype.itemsize
        self._vec = 16 // self.elem_bytes

    def __call__(self, output: torch.Tensor, input: torch.Tensor,
                 counts: Optional[Sequence[int]] = None) -> torch.Tensor:
        self._check(output, input)
        total, elem = input.numel(), self.elem_bytes
        counts = self._counts(counts, total, "input")
        if output.numel() != counts[self.rank]:
            raise BackendError(f"reduce_scatter: output {tuple(output.shape)} must hold rank {self.rank}'s "
                               f"{counts[self.rank]} elements of the {total}-element input")
        if total > MAX_UNITS:
            raise BackendError(f"reduce_scatter of {total} elements exceeds int32 indexing ({MAX_UNITS})")
        if total == 0:
            return output
        nbytes, out_bytes = total * elem, output.numel() * elem
        # zero-copy (pull only): the input is the stage, its segments' starts are the stage's
        offset = None if self.push else self._in_region(input, nbytes)
        zero_copy = offset is not None
        layout = _layout(counts, self._vec, not zero_copy)
        self._check_in_place(input, output, layout.starts[self.rank] * elem, out_bytes, nbytes)
        stride = layout.stage_seg
        if zero_copy:
            aligned = offset % 16 == 0 and layout.seg_aligned
        else:
            if self.push:  # one slot per sender
                stride = push_slot_units(counts, self._vec)
                need = self.world_size * stride * elem
            else:
                need = stage_units(layout, False) * elem
            offset = self._top_stage(need)
            self._clear_of((self.region_start + offset, self.region_end),
                           (("input", input, nbytes), ("output", output, out_bytes)))
            aligned = True  # 16-byte segment starts or slots, 256-byte aligned stage
        in_aligned = input.data_ptr() % 16 == 0
        key = (zero_copy, aligned, layout.seg_aligned and in_aligned, layout.even, output.data_ptr() % 16 == 0,
               in_aligned)
        self._launch(key, output, input, layout, offset, stride)
        return output


class AllGatherLauncher(_SegmentLauncher):
    """``launcher(output, input, counts=None) -> output``: every rank's ``input`` in rank order
    (``counts``: per-rank elements, else equal shards); bytes of any dtype."""

    op = "all_gather"

    def __init__(self, algorithm: str, config: AllGatherConfig, workspace) -> None:
        # Triton kernels load at the first launch: a CPU group imports none
        from ..kernels.all_gather import _all_gather_pull, _all_gather_push

        self.push = algorithm == "push"
        super().__init__(_all_gather_push if self.push else _all_gather_pull, config, workspace, None)

    def _views(self, out: torch.Tensor, inp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return out.reshape(-1).view(torch.uint8), inp.reshape(-1).view(torch.uint8)

    def __call__(self, output: torch.Tensor, input: torch.Tensor,
                 counts: Optional[Sequence[int]] = None) -> torch.Tensor:
        self._check(output, input)
        elem = input.element_size()
        counts = self._counts(counts, output.numel(), "output")
        if input.numel() != counts[self.rank]:
            raise BackendError(f"all_gather: input {tuple(input.shape)} must be rank {self.rank}'s "
                               f"{counts[self.rank]} elements of the {output.numel()}-element output")
        nbytes = output.numel() * elem
        if nbytes > MAX_UNITS:
            raise BackendError(f"all_gather of {nbytes} bytes exceeds int32 indexing ({MAX_UNITS})")
        if nbytes == 0:
            return output
        byte_counts = tuple(c * elem for c in counts)
        shard_bytes = byte_counts[self.rank]
        # zero-copy: the push writes into peers' outputs, the pull reads peers' inputs
        offset = self._in_region(output, nbytes) if self.push else self._in_region(input, shard_bytes)
        zero_copy = offset is not None
        layout = _layout(byte_counts, 16, self.push and not zero_copy)
        self._check_in_place(output, input, layout.starts[self.rank], shard_bytes, nbytes)
        if zero_copy:  # push: the output is the stage, shard s at its start; pull: the input is
            aligned = offset % 16 == 0 and (layout.seg_aligned or not self.push)
        else:
            offset = self._top_stage(stage_units(layout, not self.push))
            self._clear_of((self.region_start + offset, self.region_end),
                           (("input", input, shard_bytes), ("output", output, nbytes)))
            aligned = True
        out_aligned = output.data_ptr() % 16 == 0
        key = (zero_copy, aligned, layout.seg_aligned and out_aligned, layout.even, out_aligned,
               input.data_ptr() % 16 == 0)
        self._launch(key, output, input, layout, offset, layout.stage_seg)
        return output


def _stage_limits(need: int, units: int, caps: Capabilities) -> Optional[str]:
    if need > caps.all_reduce_bytes:
        return f"a {need}-byte stage exceeds the {caps.all_reduce_bytes}-byte all-reduce region"
    if units > MAX_UNITS:
        return f"{units} elements/bytes exceed int32 indexing"
    return None


class TritonReduceScatter(Backend):
    """The pull or push reduce-scatter (autosymm.kernels.reduce_scatter) as a Backend. A
    problem's ``nbytes`` is the full (unsharded) input's."""

    def __init__(self, algorithm: str) -> None:
        self.algorithm = algorithm
        self.name = f"triton_reduce_scatter_{algorithm}"
        self.batch_invariant = True  # the fp32 sum of ranks 0..W-1 in order, rounded once, per element
        self.needs = Needs(compiles_kernels=True, workspace_region=ALL_REDUCE_REGION,
                           intra_node=True)

    def limits(self, problem: Problem, caps: Capabilities) -> Optional[str]:
        return _stage_limits(stage_bytes(False, problem.nbytes, problem.world_size),
                             problem.numel, caps)

    def search_space(self, problem: Problem) -> list[ReduceScatterConfig]:
        return reduce_scatter_space(self.algorithm, problem.numel, problem.world_size, problem.elem_bytes)

    def prepare(self, problem: Problem, config: Optional[ReduceScatterConfig], ctx: RunContext) -> ReduceScatterLauncher:
        ws = prepared_workspace(self, problem, config, ReduceScatterConfig, ctx)
        return ReduceScatterLauncher(config, ws, DTYPES[problem.dtype])


class TritonAllGather(Backend):
    """The push or pull all-gather (autosymm.kernels.all_gather) as a Backend. A problem's
    ``nbytes`` is the full (gathered) output's."""

    def __init__(self, algorithm: str) -> None:
        self.algorithm = algorithm
        self.name = f"triton_all_gather_{algorithm}"
        self.batch_invariant = True  # rows are copied, never summed
        self.needs = Needs(dtypes=None, compiles_kernels=True,  # bytes of any dtype
                           workspace_region=ALL_REDUCE_REGION, intra_node=True)

    def limits(self, problem: Problem, caps: Capabilities) -> Optional[str]:
        return _stage_limits(stage_bytes(self.algorithm == "pull", problem.nbytes, problem.world_size),
                             problem.nbytes, caps)

    def search_space(self, problem: Problem) -> list[AllGatherConfig]:
        return all_gather_space(self.algorithm, problem.nbytes, problem.world_size)

    def prepare(self, problem: Problem, config: Optional[AllGatherConfig], ctx: RunContext) -> AllGatherLauncher:
        ws = prepared_workspace(self, problem, config, AllGatherConfig, ctx)
        return AllGatherLauncher(self.algorithm, config, ws)


triton_reduce_scatter_pull = TritonReduceScatter("pull")
triton_reduce_scatter_push = TritonReduceScatter("push")
triton_all_gather_push = TritonAllGather("push")
triton_all_gather_pull = TritonAllGather("pull")
BACKENDS = (triton_reduce_scatter_pull, triton_reduce_scatter_push, triton_all_gather_push, triton_all_gather_pull)
