"""Workspace geometry: alignment, signal-pad layout, stage and buffer sizes, and the regions of
the symmetric workspace, in one place. Pure arithmetic on ints (no torch, no device).

Every rank lays out its workspace buffer identically, so a peer's region is the peer's base
address plus the same offset. Regions are reserved by name, in order, each on an
:data:`ALIGN`-byte boundary (:class:`Layout`); the standard layout (:func:`workspace_layout`) is::

    [ signal pads | all-reduce region | MoE region | all-reduce double buffer | fused stash | Lamport ]

Users of these numbers: ``autosymm.workspace.symm`` (the buffer and its regions), the backends (where a
call stages its data, what fits, which search-space points fit: each Triton algorithm record
names its stage size from here) and the tuner (how large a workspace a sweep needs). The backends' hot paths inline some of this
arithmetic; tests check the inlined forms against this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: Bytes: every region, every stage and every tensor handed out starts on this boundary.
ALIGN = 256
#: Most programs (thread blocks) one collective launch may use: one signal slot per (program, peer).
MAX_PROGRAMS = 256
#: Largest world size of a symmetric-memory group (one NVLink node).
MAX_WORLD_SIZE = 8

# -- signal pads -----------------------------------------------------------------------------
#: uint32 slots of one signal channel: [program][sender] (see autosymm.kernels.barrier).
SIGNAL_SLOTS_PER_RANK = MAX_PROGRAMS * MAX_WORLD_SIZE
#: One channel per kernel family, so collectives on two streams never share a slot.
SIGNAL_CHANNEL = {"all_reduce": 0, "moe": 1, "moe_end": 2, "host": 3}
N_SIGNAL_CHANNELS = len(SIGNAL_CHANNEL)
#: Byte offset of the error slots (one uint32 per channel) after the signal channels.
ERROR_SLOTS_OFFSET = N_SIGNAL_CHANNELS * SIGNAL_SLOTS_PER_RANK * 4
#: Split-row fused kernels (FusedConfig.row_split > 1, autosymm.kernels.fused_rmsnorm): per-row
#: scratch of this rank's own programs after the error slots, zeroed with the pads. An arrival
#: counter (uint32) per row, 0 between calls (each row's last program resets it), then the
#: row's partial sums of squares (fp32, [row][part]; written before they are read every call).
#: Most rows a split-row call may have (more: whole rows).
FUSED_SPLIT_MAX_ROWS = 256
#: Largest FusedConfig.row_split (programs sharing a row).
FUSED_SPLIT_MAX = 8
FUSED_COUNTS_OFFSET = (ERROR_SLOTS_OFFSET + N_SIGNAL_CHANNELS * 4 + 15) // 16 * 16
FUSED_PARTIALS_OFFSET = FUSED_COUNTS_OFFSET + 4 * FUSED_SPLIT_MAX_ROWS
SIGNAL_BYTES = FUSED_PARTIALS_OFFSET + 4 * FUSED_SPLIT_MAX_ROWS * FUSED_SPLIT_MAX
#: Self slots of the 'all_reduce' channel (program rows of a rank's own column, which no signal
#: reaches): the arrival counter and epoch of every double-buffered kernel (the pull and push
#: one-shot all-reduces, the fused one-shots: they share the epoch). autosymm.kernels.all_reduce
#: hard-codes the same rows (kernels import no host code).
ALL_REDUCE_ARRIVAL_SLOT = 0
ALL_REDUCE_EPOCH_SLOT = 1
#: Program slot of each MoE op's end barrier in the 'moe_end' channel.
MOE_SIGNAL_SLOT = {"dp_to_ep": 0, "ep_to_dp": 1}

# -- regions ---------------------------------------------------------------------------------
SIGNAL_REGION = "signal"
ALL_REDUCE_REGION = "all_reduce"
MOE_REGION = "moe"
#: The double-buffered one-shots' staging halves: a region of its own at fixed offsets, because a
#: half may still be read by a peer after this rank's kernel returned (until the next
#: double-buffered call's start barrier), so nothing else may write there.
DOUBLE_BUFFER_REGION = "all_reduce_double_buffer"
#: The split-row fused kernels' fp32 row sums ([rows, hidden], like x), written by each part's
#: program and read back by the row's last one: only this rank's own kernels touch it, and every
#: call writes what it reads, so it needs no initial value. Calls whose sums do not fit run
#: with whole rows.
FUSED_STASH_REGION = "fused_stash"
FUSED_STASH_BYTES = 2 << 20
#: The Lamport one-shot's receive buffers (autosymm.kernels.lamport_all_reduce): a header of this
#: rank's own words (rotation index, arrival counter; word 2 unused: every call re-arms what it
#: read), then 3 buffers of MAX_WORLD_SIZE - 1 slots of LAMPORT_SLOT_BYTES. Peers store into it at any time between their
#: calls, and a zero word is "not arrived", so nothing else may write there, it never moves, and
#: it is zeroed (armed) with the signal pads.
LAMPORT_REGION = "lamport"
LAMPORT_HEADER_BYTES = 256
LAMPORT_BUFFERS = 3
#: Largest input (bytes per rank) of a Lamport call, and the stride of its slots.
LAMPORT_SLOT_BYTES = 256 * 1024
LAMPORT_BYTES = LAMPORT_HEADER_BYTES + LAMPORT_BUFFERS * (MAX_WORLD_SIZE - 1) * LAMPORT_SLOT_BYTES
#: Bytes of each half of the double-buffer region.
DOUBLE_BUFFER_HALF_BYTES = 4 << 20
DEFAULT_ALL_REDUCE_BYTES = 256 * 1024**2
DEFAULT_MOE_BYTES = 256 * 1024**2
#: Slack added to the MoE region a sweep or a declared call needs (bytes).
MOE_REGION_SLACK = 1 << 20
#: Largest MoE region (bytes) an eager MoE call may grow the workspace to by default
#: (``autosymm.init(moe_max_bytes=...)`` sets a group's own; autosymm.runtime.moe_room).
DEFAULT_MOE_MAX_BYTES = 16 << 30


def align(value: int, alignment: int = ALIGN) -> int:
    """``value`` rounded up to a multiple of ``alignment``."""
    return (value + alignment - 1) // alignment * alignment


@dataclass(frozen=True)
class Region:
    offset: int  # bytes from the buffer's base, the same on every rank
    nbytes: int


@dataclass
class Layout:
    """Named regions of a workspace buffer, reserved in order on ALIGN boundaries."""

    regions: dict[str, Region] = field(default_factory=dict)
    total_bytes: int = 0

    def reserve(self, name: str, nbytes: int) -> Region:
        """Append region ``name`` of ``nbytes`` (rounded up to ALIGN); ValueError if taken."""
        if name in self.regions:
            raise ValueError(f"workspace region {name!r} is reserved already")
        if nbytes < 0:
            raise ValueError(f"workspace region {name!r}: nbytes={nbytes} must be >= 0")
        region = Region(self.total_bytes, align(nbytes))
        self.regions[name] = region
        self.total_bytes += region.nbytes
        return region


def workspace_layout(all_reduce_bytes: int, moe_bytes: int, double_buffer_half_bytes: int = 0) -> Layout:
    """The standard layout (module docstring); no double-buffer region when its half is 0 bytes
    (appended after the others, so they keep their offsets either way), then the fused stash
    and the Lamport receive buffers."""
    layout = Layout()
    layout.reserve(SIGNAL_REGION, SIGNAL_BYTES)
    layout.reserve(ALL_REDUCE_REGION, all_reduce_bytes)
    layout.reserve(MOE_REGION, moe_bytes)
    if double_buffer_half_bytes > 0:
        layout.reserve(DOUBLE_BUFFER_REGION, 2 * align(double_buffer_half_bytes))
    layout.reserve(FUSED_STASH_REGION, FUSED_STASH_BYTES)
    layout.reserve(LAMPORT_REGION, LAMPORT_BYTES)
    return layout


# -- all-reduce stages -----------------------------------------------------------------------

def push_slot_bytes(nbytes: int) -> int:
    """Bytes of one sender's slot in a push one-shot stage: ``nbytes`` rounded up to ALIGN."""
    return align(nbytes)


def tensor_stage_bytes(nbytes: int, world_size: int) -> int:
    """Bytes of a stage holding the tensor itself (pull one-shot, two-shot, multimem)."""
    return nbytes


def push_stage_bytes(nbytes: int, world_size: int) -> int:
    """Bytes of a push stage for a tensor of ``nbytes``: one slot (:func:`push_slot_bytes`) per peer."""
    return (world_size - 1) * push_slot_bytes(nbytes)


def lamport_stage_bytes(nbytes: int, world_size: int) -> int:
    """Bytes of the all-reduce region a Lamport call stages in: none (peers write the Lamport region)."""
    return 0


def rows_and_out_stage_bytes(nbytes: int, world_size: int) -> int:
    """Bytes of the fused two-shot's stage for a tensor of ``nbytes``: x's rows, then the out rows."""
    return 2 * align(nbytes)


def stage_offset(capacity: int, nbytes: int) -> int:
    """Byte offset in an all-reduce region of ``capacity`` bytes where a non-zero-copy stage of
    ``nbytes`` sits: at the top, clear of ``Workspace.empty``'s tensors (allocated from the bottom)."""
    return capacity - align(nbytes)


def max_push_input_bytes(capacity: int, world_size: int) -> int:
    """Largest tensor (bytes) whose push stage (:func:`push_stage_bytes`) fits ``capacity`` bytes."""
    return capacity // max(1, world_size - 1) // ALIGN * ALIGN


def segment_vecs(numel: int, world_size: int, elem_bytes: int) -> int:
    """Two-shot segment length in 16-byte units: ceil(numel / world_size) rounded up to 16 bytes."""
    return -(-numel // (world_size * (16 // elem_bytes)))  # = ceil(ceil(numel / world_size) / vec)


# -- MoE buffers -----------------------------------------------------------------------------

def moe_buffer(op: str, moe_bytes: int, world_size: int) -> tuple[int, int]:
    """(offset, bytes) of ``op``'s destination buffer inside a MoE region of ``moe_bytes``: ep->dp
    owns the first 1/(world_size + 1), dp->ep the rest (disjoint, so the two ops' peers never
    write a buffer the other op's owner still reads)."""
    ep_to_dp_bytes = moe_bytes // (world_size + 1) // ALIGN * ALIGN
    if op == "ep_to_dp":
        return 0, ep_to_dp_bytes
    return ep_to_dp_bytes, moe_bytes - ep_to_dp_bytes


def dst_rows(op: str, n_tokens_local: int, n_expts_act: int, world_size: int) -> int:
    """Rows of ``op``'s destination buffer (dp->ep: every global pair; ep->dp: local pairs)."""
    return n_tokens_local * n_expts_act * (world_size if op == "dp_to_ep" else 1)


def grid_rows(op: str, n_tokens_local: int, n_expts_act: int, world_size: int) -> int:
    """Pair rows the kernel's programs walk over: local pairs (dp->ep), all sorted rows (ep->dp)."""
    return n_tokens_local * n_expts_act * (world_size if op == "ep_to_dp" else 1)


def moe_region_bytes(n_tokens_local: int, n_expts_act: int, row_bytes: int, world_size: int) -> int:
    """MoE region (bytes) in which both conversions of ``n_tokens_local`` tokens per rank fit,
    with :data:`MOE_REGION_SLACK`: the two destination buffers side by side."""
    rows = (dst_rows("dp_to_ep", n_tokens_local, n_expts_act, world_size)
            + dst_rows("ep_to_dp", n_tokens_local, n_expts_act, world_size))
    return rows * row_bytes + MOE_REGION_SLACK


def grown_moe_bytes(current: int, need: int, limit: int) -> int:
    """MoE region (bytes) to grow a region of ``current`` bytes to when a call needs ``need``:
    at least ``need``, at least double (so a growing token count regrows rarely), at most
    ``limit`` (which the caller has checked serves the call)."""
    return align(min(limit, max(need, 2 * current)))
