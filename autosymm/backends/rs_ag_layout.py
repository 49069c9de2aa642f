"""Host-side layout of the reduce-scatter and all-gather kernels: segments and stages (their
configs: autosymm.configs.ReduceScatterConfig / AllGatherConfig).

Pure arithmetic on ints (no torch). A *segment* is one rank's part of the full tensor (the
reduce-scatter's input, the all-gather's output), in *units*: elements for reduce-scatter,
bytes for all-gather (autosymm.kernels.reduce_scatter / all_gather). ``vec`` units make 16
bytes. Staged kernels lay segments out in their stage at ``vec``-aligned starts (so peers'
accesses are 128-bit even where the user's segments are ragged); zero-copy ones use the user
tensor itself, whose starts are what they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from ..configs import MAX_BLOCK, as_int
from ..geometry import ALIGN, MAX_PROGRAMS, align

#: Largest number of units (elements or bytes) a call may have: the kernels index with int32,
#: and the last chunk's lane offsets reach up to one BLOCK past the end.
MAX_UNITS = 2**31 - 1 - MAX_BLOCK


@dataclass(frozen=True)
class Segments:
    """Where each rank's segment lies, in units: ``starts[s]`` in the user tensor (W + 1 entries,
    the last is the total), ``stage_starts[s]`` in the stage. ``even``: equal segments, the
    kernels then compute ``s * seg`` and ``s * stage_seg`` instead of reading the table."""

    starts: tuple[int, ...]
    stage_starts: tuple[int, ...]
    even: bool
    seg: int
    stage_seg: int
    seg_aligned: bool  # every start is a multiple of vec units (16 bytes)

    @property
    def counts(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.starts, self.starts[1:]))

    @property
    def total(self) -> int:
        return self.starts[-1]

    def table(self) -> list[int]:
        """The kernels' int32 table: starts (W + 1), then stage starts (W)."""
        return [*self.starts, *self.stage_starts]


def segments(counts: Sequence[int], vec: int, padded: bool) -> Segments:
    """The segments of per-rank ``counts`` (units); ``padded``: staged, each stage start rounded
    up to ``vec`` units, else the stage is the user tensor (zero-copy)."""
    counts = [as_int("count", c) for c in counts]
    if not counts or min(counts) < 0:
        raise ValueError(f"per-rank counts {counts} must be one non-negative count per rank")
    starts, stage_starts = [0], []
    stage = 0
    for count in counts:
        stage_starts.append(stage if padded else starts[-1])
        stage += align(count, vec)
        starts.append(starts[-1] + count)
    even = len(set(counts)) == 1
    seg = counts[0] if even else 0
    stage_seg = (align(seg, vec) if padded else seg) if even else 0
    return Segments(tuple(starts), tuple(stage_starts), even, seg, stage_seg, all(s % vec == 0 for s in starts))


def even_counts(total: int, world_size: int, what: str = "tensor") -> list[int]:
    """``world_size`` equal counts of a ``total``-unit tensor; ValueError naming it when it does
    not split evenly (torch.distributed's reduce_scatter_tensor / all_gather_into_tensor rule)."""
    if total % world_size:
        raise ValueError(f"a {what} of {total} units does not split into {world_size} equal shards")
    return [total // world_size] * world_size


def stage_units(layout: Segments, own_shard_only: bool) -> int:
    """Units a staged call's stage takes: every segment at its padded start (reduce-scatter,
    all-gather push), or the largest shard (all-gather pull: a rank stages its own only)."""
    if own_shard_only:
        return max(layout.counts)
    return layout.stage_starts[-1] + layout.counts[-1]


def push_slot_units(counts: Sequence[int], vec: int) -> int:
    """Units of one sender's slot in a push reduce-scatter stage: the largest segment rounded up
    to ``vec`` (the same on every rank); the stage holds world_size of them."""
    return align(max(counts), vec)


def stage_bytes(own_shard_only: bool, nbytes: int, world_size: int) -> int:
    """Bytes of the all-reduce region a staged call takes for a full tensor of ``nbytes`` split
    evenly (the reduce-scatter's input, the all-gather's output): every segment at a 16-byte
    aligned start (the push reduce-scatter: one slot per sender, the same bytes), or, with
    ``own_shard_only`` (the all-gather pull), this rank's own shard only. A per-rank split needs
    up to ``16 * world_size`` more, or its largest shard (pull: once, push: per sender)."""
    shard = -(-nbytes // world_size)
    if own_shard_only:
        return align(shard, ALIGN)
    return align(world_size * align(shard, 16), ALIGN)
