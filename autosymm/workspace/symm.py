"""The symmetric-memory workspace: one buffer per (process group, device), rendezvoused once.

Layout of every rank's buffer (offsets identical on all ranks; autosymm.geometry)::

    [ signal pads | all-reduce region | MoE region | all-reduce double buffer | fused stash ]

Signal pads: one channel per kernel family, zeroed at creation, and one error slot per channel
(barrier waits that gave up). After a timeout :meth:`Workspace.reset_signals` (collective) is
mandatory before the next collective kernel. The self slots hold per-rank device state (arrival
counters; the double-buffer epoch, NOT zero between calls and equal on every rank). The double
buffer and the Lamport receive buffers (a zero word: not arrived) are written by nothing else.
Multicast is never created here: ``multicast_ptr`` is what torch's handle reports.

Design notes: docs/REPLAY.md#workspace-symm
"""

from __future__ import annotations

import threading
from math import prod
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ..geometry import (ALIGN, ALL_REDUCE_EPOCH_SLOT, ALL_REDUCE_REGION, LAMPORT_REGION, DOUBLE_BUFFER_HALF_BYTES,
                        DOUBLE_BUFFER_REGION, ERROR_SLOTS_OFFSET, MAX_PROGRAMS, MOE_REGION, Layout, MAX_WORLD_SIZE,
                        N_SIGNAL_CHANNELS, Region, SIGNAL_BYTES, SIGNAL_CHANNEL, SIGNAL_SLOTS_PER_RANK,
                        MOE_SIGNAL_SLOT, align, moe_buffer, workspace_layout)
from ..dist_compat import group_name
from ..settings import default_region_bytes, multicast_disabled_by_env

#: Called (no arguments) whenever a workspace's staging limits change (``empty_bytes``): the
#: replay plans made under the old limits are forgotten (autosymm.runtime.replay registers
#: ``forget_all`` here; the workspace sits below the runtime and imports none of it).
STAGING_LISTENERS: list[Callable[[], None]] = []


def staging_changed() -> None:
    for listener in STAGING_LISTENERS:
        listener()


class Workspace:
    """A rank's view of the symmetric workspace of its group.

    Attributes used by the backends (all on ``device``):
      ``rank``, ``world_size``;
      ``signal_ptrs(family)``: int64 tensor [world_size + 1], each rank's signal channel address,
      then this rank's error slot of that channel (entry ``world_size``, read by the kernels'
      bounded waits);
      ``region_ptrs(name)``: int64 tensor [world_size], each rank's region address;
      ``multicast_ptr``: multicast address of the buffer base, 0 when there is none;
      ``double_buffer_half_bytes``: bytes of each half of the all-reduce double buffer (0: none).
    """

    def __init__(self, rank: int, peer_buffers: Sequence[torch.Tensor], layout: Layout, *, multicast_ptr: int = 0,
                 group=None, handle=None) -> None:
        """``peer_buffers[r]``: rank r's workspace buffer as this rank addresses it (uint8; entry
        ``rank`` is this rank's own), each laid out by ``layout``."""
        world_size = len(peer_buffers)
        if not 1 <= world_size <= MAX_WORLD_SIZE:
            raise ValueError(f"world_size={world_size} must be in 1..{MAX_WORLD_SIZE}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in 0..{world_size - 1}")
        self.rank = rank
        self.world_size = world_size
        self.buffer = peer_buffers[rank]
        self.device = self.buffer.device
        self.group = group
        self.handle = handle
        self.peer_buffers = tuple(peer_buffers)
        self.multicast_ptr = int(multicast_ptr or 0)
        self.layout = layout
        self.regions = layout.regions
        if self.buffer.numel() < layout.total_bytes:
            raise ValueError(f"workspace buffer has {self.buffer.numel()} bytes, layout needs {layout.total_bytes}")
        self._ptr_cache: dict[tuple[str, int], torch.Tensor] = {}
        #: bytes of the all-reduce region handed out by empty() (a bump allocator from offset 0 up);
        #: a plain attribute: eager replays read it on every call
        self.empty_bytes = 0
        #: regions moved to allocations of their own (move_region): name -> (peer buffers, Region)
        self._moved: dict[str, tuple[tuple[torch.Tensor, ...], Region]] = {}
        self._keep_alive: list = []  # allocations a region moved away from, and their handles
        # Made now, not per call: a host-to-device copy is not allowed inside CUDA-graph capture.
        # Kernels take these plus byte offsets as scalars.
        for region_name in self.regions:
            self.region_ptrs(region_name)
        self._moe_buffer_ptrs()
        for family in SIGNAL_CHANNEL:
            self.signal_ptrs(family)

    # -- addresses -----------------------------------------------------------------------
    def _where(self, name: str) -> tuple[Sequence[torch.Tensor], Region]:
        """(every rank's buffer holding region ``name``, the region's place in it)."""
        moved = self._moved.get(name)
        return moved if moved is not None else (self.peer_buffers, self.regions[name])

    def region_ptrs(self, name: str, offset: int = 0) -> torch.Tensor:
        """int64 tensor [world_size]: each rank's address of ``region`` + ``offset`` bytes."""
        buffers, region = self._where(name)
        key = ("at", int(buffers[self.rank].data_ptr()) + region.offset + offset)  # one per address
        cached = self._ptr_cache.get(key)
        if cached is None:
            addrs = [int(b.data_ptr()) + region.offset + offset for b in buffers]
            cached = self._ptr_cache[key] = torch.tensor(addrs, dtype=torch.int64, device=self.device)
        return cached

    def _moe_buffer_ptrs(self) -> None:
        """Make the address tables of both MoE ops' buffers now (a launcher prepared inside a
        CUDA-graph capture cannot copy them to the device)."""
        if MOE_REGION in self.regions:
            for op in ("dp_to_ep", "ep_to_dp"):
                self.region_ptrs(MOE_REGION, moe_buffer(op, self.capacity(MOE_REGION), self.world_size)[0])
                self.signal_ptrs("moe_end", MOE_SIGNAL_SLOT[op])

    def move_region(self, name: str, peer_buffers: Sequence[torch.Tensor], keep: Sequence = ()) -> None:
        """Region ``name`` lives from now on at offset 0 of ``peer_buffers`` (rank r's uint8 buffer
        as this rank addresses it). The old allocation stays alive, with ``keep`` (handles):
        tensors and CUDA graphs made before may address it; launchers must be prepared again."""
        if len(peer_buffers) != self.world_size:
            raise ValueError(f"move_region({name!r}): {len(peer_buffers)} buffers for world size {self.world_size}")
        nbytes = min(b.numel() for b in peer_buffers) // ALIGN * ALIGN
        self._keep_alive.append(self._moved.get(name))
        self._keep_alive.extend(keep)
        self._moved[name] = (tuple(peer_buffers), Region(0, nbytes))
        self.region_ptrs(name)
        self._moe_buffer_ptrs()

    def signal_ptrs(self, family: str, program: int = 0) -> torch.Tensor:
        """int64 tensor [world_size + 1]: each rank's signal channel of ``family`` (uint32 slots),
        shifted by ``program`` programs (so the kernel's program 0 is the channel's ``program``),
        then this rank's error slot of the channel (never shifted).

        Made once per (family, program) on the host and cached. The tables launchers use are
        made when the workspace is (program 0 of every family, and the MoE ops' programs of
        'moe_end'), so a launcher prepared inside a CUDA-graph capture allocates nothing: a
        tensor made during a capture would belong to the graph's memory pool."""
        key = ("signal:" + family, program)
        table = self._ptr_cache.get(key)
        if table is None:
            if not 0 <= program < MAX_PROGRAMS:
                raise ValueError(f"program={program} must be in 0..{MAX_PROGRAMS - 1}")
            channel = SIGNAL_CHANNEL[family]
            shift = channel * SIGNAL_SLOTS_PER_RANK * 4 + program * MAX_WORLD_SIZE * 4
            addrs = [int(b.data_ptr()) + shift for b in self.peer_buffers]
            addrs.append(int(self.buffer.data_ptr()) + ERROR_SLOTS_OFFSET + 4 * channel)
            table = self._ptr_cache[key] = torch.tensor(addrs, dtype=torch.int64, device=self.device)
        return table

    def capacity(self, name: str) -> int:
        """Bytes of region ``name``."""
        return self._where(name)[1].nbytes

    @property
    def double_buffer_half_bytes(self) -> int:
        """Bytes of each half of the double-buffer region (0: there is none)."""
        region = self.regions.get(DOUBLE_BUFFER_REGION)
        return region.nbytes // 2 if region is not None else 0

    def double_buffer_epoch(self) -> int:
        """This rank's double-buffer epoch (double-buffered one-shot calls since the last reset).
        Synchronizes the device first; for tests and diagnostics, not the hot path."""
        self._synchronize()
        word = (SIGNAL_CHANNEL["all_reduce"] * SIGNAL_SLOTS_PER_RANK + ALL_REDUCE_EPOCH_SLOT * MAX_WORLD_SIZE
                + self.rank)
        return int(self.buffer[:SIGNAL_BYTES].view(torch.int32)[word])

    @property
    def has_multicast(self) -> bool:
        return self.multicast_ptr != 0 and not multicast_disabled_by_env()

    # -- tensors -------------------------------------------------------------------------
    def peer_view(self, rank: int, name: str, shape: Sequence[int], dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
        """A tensor of ``shape``/``dtype`` in ``rank``'s region ``name`` at ``offset`` bytes."""
        buffers, region = self._where(name)
        elem = torch.empty((), dtype=dtype).element_size()
        nbytes = prod(shape) * elem
        if offset % ALIGN or offset < 0 or offset + nbytes > region.nbytes:
            raise ValueError(
                f"{tuple(shape)} {dtype} at offset {offset} does not fit region {name!r} of "
                f"{region.nbytes} bytes (or offset is not {ALIGN}-byte aligned)"
            )
        start = region.offset + offset
        return buffers[rank][start:start + nbytes].view(dtype).view(tuple(shape))

    def local_view(self, name: str, shape: Sequence[int], dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
        return self.peer_view(self.rank, name, shape, dtype, offset)

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A tensor living in the all-reduce region, so all_reduce of it needs no copy.

        Allocation is a bump pointer: every rank must call this in the same order with the same
        shapes (the usual SPMD pattern), so the tensor sits at the same offset everywhere.
        :meth:`reset_empty` frees all of them at once.
        """
        elem = torch.empty((), dtype=dtype).element_size()
        nbytes = align(prod(shape) * elem)
        region = self.regions[ALL_REDUCE_REGION]
        if self.empty_bytes + nbytes > region.nbytes:
            raise ValueError(
                f"autosymm.empty({tuple(shape)}, {dtype}) needs {nbytes} bytes; the all-reduce region "
                f"has {region.nbytes - self.empty_bytes} of {region.nbytes} left "
                f"(raise AUTOSYMM_WORKSPACE_BYTES)"
            )
        tensor = self.local_view("all_reduce", shape, dtype, self.empty_bytes)
        self.empty_bytes += nbytes
        staging_changed()  # plans made under the old staging limits
        return tensor

    def reset_empty(self) -> None:
        self.empty_bytes = 0
        staging_changed()

    def offset_in_region(self, tensor: torch.Tensor, name: str = "all_reduce") -> Optional[int]:
        """Byte offset of ``tensor`` inside this rank's region ``name``, or None if outside."""
        buffers, region = self._where(name)
        start = int(buffers[self.rank].data_ptr()) + region.offset
        addr = int(tensor.data_ptr())
        end = addr + tensor.numel() * tensor.element_size()
        if start <= addr and end <= start + region.nbytes and tensor.device == self.device:
            return addr - start
        return None

    # -- barrier health (not on the hot path) --------------------------------------------
    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def barrier_error_counts(self) -> dict[str, int]:
        """{signal channel: waits on it that gave up (a peer never signalled)} of this rank.
        Synchronizes the device first (every kernel launched so far has finished)."""
        self._synchronize()
        start = ERROR_SLOTS_OFFSET
        counts = self.buffer[start:start + 4 * N_SIGNAL_CHANNELS].view(torch.int32).tolist()
        return {family: int(counts[channel]) for family, channel in SIGNAL_CHANNEL.items()}

    def barrier_errors(self) -> int:
        """Barrier waits of this rank's kernels that gave up since the last reset (0: healthy).

        Non-zero means some collective kernel ran without its peers (a peer failed, or launched
        fewer or different kernels): every result since the last clean check is suspect, and
        :meth:`reset_signals` must run on every rank before the next collective kernel.
        Synchronizes the device: call it after the fact, not on the hot path."""
        return sum(self.barrier_error_counts().values())

    def reset_signals(self, group=None) -> None:
        """Zero this rank's signal pads and error slots; a collective over the group.

        Every rank must call it together (``group``: the host group to line up on, default the
        workspace's; a CPU gloo group keeps it off the GPU). Order: device sync (this rank's
        kernels are done: bounded waits guarantee they end), host barrier (so no rank's kernel
        is still running and could signal into pads after they are zeroed), zero, device sync,
        host barrier (every rank's pads are zero before any rank signals again). Both barriers
        are joined even when a local step fails, so no peer is left waiting; the first local
        error is raised afterwards. On simulated workspaces (no group) it just zeroes."""
        group = group if group is not None else self.group
        errors: list[BaseException] = []

        def local(step) -> None:
            if errors:
                return
            try:
                step()
            except Exception as exc:  # joined barriers first, raised below
                errors.append(exc)

        local(self._synchronize)
        self._host_barrier(group)
        local(self._zero_control)
        local(self._synchronize)
        self._host_barrier(group)
        if errors:
            raise errors[0]

    def _zero_control(self) -> None:
        """Zero the signal pads and arm the Lamport receive buffers (this rank's buffer)."""
        self.buffer[:SIGNAL_BYTES].zero_()
        lamport = self.regions.get(LAMPORT_REGION)
        if lamport is not None:
            self.buffer[lamport.offset:lamport.offset + lamport.nbytes].zero_()

    @staticmethod
    def _host_barrier(group) -> None:
        if group is None:
            return

        if dist.is_available() and dist.is_initialized():
            dist.barrier(group=group)

    def device_barrier(self) -> None:
        """A stream-ordered barrier of the group on the device (the 'host' signal channel): work
        queued after it on this rank's current stream starts only once every rank's stream has
        reached it. Bounded like every autosymm barrier (see :meth:`barrier_errors`)."""
        if self.world_size == 1:
            return
        # Triton kernels load at the first launch: a CPU group imports none
        from ..kernels.barrier import _barrier_kernel

        _barrier_kernel[(1,)](self.signal_ptrs("host"), RANK=self.rank, WORLD_SIZE=self.world_size, num_warps=1)


# ------------------------------------------------------------------------------------------
# Creation
# ------------------------------------------------------------------------------------------

_WORKSPACES: dict[tuple[str, str], Workspace] = {}
_LOCK = threading.Lock()
_MOE_RESERVED: dict[str, int] = {}  # group name -> MoE bytes its workspace is made with, at least


def reserve_moe_bytes(group, nbytes: int) -> None:
    """Make ``group``'s workspace, when it is created, with a MoE region of at least ``nbytes``
    (every rank must reserve the same; autosymm.init(moe=...) agrees on it first)."""
    name = group_name(group)
    _MOE_RESERVED[name] = max(_MOE_RESERVED.get(name, 0), int(nbytes))


def get_workspace(group=None, device: Optional[torch.device] = None, *, all_reduce_bytes: Optional[int] = None,
                  moe_bytes: Optional[int] = None) -> Workspace:
    """The workspace of (group, device), created by a collective rendezvous on first use.

    Every rank of ``group`` must make the first call together; its MoE region is at least what
    :func:`reserve_moe_bytes` reserved. Later calls return the cached workspace; asking for more
    bytes than it has raises (only autosymm.runtime.moe_room grows the MoE region, collectively).
    Besides the requested regions it holds the all-reduce double buffer (2 x
    :data:`DOUBLE_BUFFER_HALF_BYTES`) and the Lamport receive buffers
    (autosymm.geometry.LAMPORT_BYTES), not counted in AUTOSYMM_WORKSPACE_BYTES.
    """
    group = group if group is not None else dist.group.WORLD
    device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    default_ar, default_moe = default_region_bytes()
    all_reduce_bytes = default_ar if all_reduce_bytes is None else all_reduce_bytes
    moe_bytes = default_moe if moe_bytes is None else moe_bytes
    key = (group_name(group), str(device))
    with _LOCK:
        ws = _WORKSPACES.get(key)
        if ws is not None:
            if ws.capacity("all_reduce") < all_reduce_bytes or ws.capacity("moe") < moe_bytes:
                raise ValueError(
                    f"workspace of group {key[0]} on {device} has {ws.capacity('all_reduce')} all-reduce and "
                    f"{ws.capacity('moe')} MoE bytes; {all_reduce_bytes} and {moe_bytes} were asked for. "
                    f"Create it with the larger sizes first (autosymm.init) or set AUTOSYMM_WORKSPACE_BYTES."
                )
            return ws
        ws = _rendezvous(group, device, all_reduce_bytes, max(moe_bytes, _MOE_RESERVED.get(key[0], 0)))
        _WORKSPACES[key] = ws
        return ws


def _rendezvous(group, device: torch.device, all_reduce_bytes: int, moe_bytes: int,
                double_buffer_bytes: int = DOUBLE_BUFFER_HALF_BYTES) -> Workspace:
    # symmetric memory: `import torch` skips it; only a workspace needs it
    import torch.distributed._symmetric_memory as symm_mem

    if device.type != "cuda":
        raise ValueError(f"symmetric memory needs a CUDA device, got {device}")
    layout = workspace_layout(all_reduce_bytes, moe_bytes, double_buffer_bytes)
    buffer = symm_mem.empty((layout.total_bytes,), dtype=torch.uint8, device=device)
    buffer[:SIGNAL_BYTES].zero_()  # signal pads start at zero: no signal pending
    lamport = layout.regions[LAMPORT_REGION]
    buffer[lamport.offset:lamport.offset + lamport.nbytes].zero_()  # Lamport buffers armed
    torch.cuda.synchronize(device)
    peers, handle, base_offset = peer_buffers(buffer, group)
    multicast = int(getattr(handle, "multicast_ptr", 0) or 0)
    if multicast:
        multicast += base_offset
    if multicast_disabled_by_env():
        multicast = 0
    ws = Workspace(handle.rank, peers, layout, multicast_ptr=multicast, group=group, handle=handle)
    dist.barrier(group=group)  # every rank's signal pads are zero before anyone signals
    return ws


def peer_buffers(buffer: torch.Tensor, group) -> tuple[list[torch.Tensor], object, int]:
    """Rendezvous (collective) of this rank's symmetric uint8 ``buffer``: (every rank's buffer as
    this rank addresses it, the handle, the buffer's byte offset in its symmetric allocation)."""
    # symmetric memory: `import torch` skips it; only a workspace needs it
    import torch.distributed._symmetric_memory as symm_mem

    handle = symm_mem.rendezvous(buffer, group=group_name(group))
    rank, total = handle.rank, buffer.numel()
    # The tensor may start inside a larger symmetric allocation: address peers by the same offset.
    base_offset = int(buffer.data_ptr()) - int(handle.buffer_ptrs[rank])
    peers = [buffer if peer == rank else handle.get_buffer(peer, (total + base_offset,), torch.uint8)[base_offset:]
             for peer in range(handle.world_size)]
    return peers, handle, base_offset


def simulated_workspaces(world_size: int, *, all_reduce_bytes: int = 1 << 20, moe_bytes: int = 1 << 20,
                         double_buffer_bytes: int = DOUBLE_BUFFER_HALF_BYTES, device: str = "cpu") -> list[Workspace]:
    """``world_size`` workspaces over plain tensors of one process: ranks simulated for tests.

    Under TRITON_INTERPRET=1 the kernels read and write the peers' buffers exactly as on GPUs.
    """
    layout = workspace_layout(all_reduce_bytes, moe_bytes, double_buffer_bytes)
    buffers = [torch.zeros(layout.total_bytes, dtype=torch.uint8, device=device) for _ in range(world_size)]
    return [Workspace(rank, buffers, layout) for rank in range(world_size)]

