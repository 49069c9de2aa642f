"""Signal-pad barriers between the same program of every rank (Triton, device side only).

Slot ``[program][sender]`` of a rank's signal channel (autosymm.symm) counts the signals that
program ``program`` of rank ``sender`` sent it and that it has not consumed. A barrier is:

1. ``tl.debug_barrier()``: every thread of the program has issued its prior memory operations;
2. signal: one ``red.add.release.sys`` on slot ``[program][RANK]`` of every peer. Release at
   system scope after the CTA barrier makes every write of this program (local or to a peer)
   visible to whoever acquires the signal;
3. wait: for each peer, poll our slot ``[program][peer]`` with acquire loads until it is
   non-zero, then subtract one. Only this rank ever decrements its slots and only the one
   sender increments a slot, so a count never goes negative; counting (not a 0/1 flag) lets a
   sender run one barrier ahead without a signal being lost;
4. ``tl.debug_barrier()``: no thread reads peer data before the acquire above.

Every barrier consumes exactly what it was sent, so the pads are back to zero after each
kernel: the same launch replays under a CUDA graph with no host reset. All ranks must launch the
same grid (the tuner and the dispatcher guarantee it: a decision is the same on every rank).
"""

import triton
import triton.language as tl

#: Slots per program in a signal channel (autosymm.configs.MAX_WORLD_SIZE).
SLOTS_PER_PROGRAM: tl.constexpr = tl.constexpr(8)


@triton.jit
def signal_peers(signal_ptrs, program, RANK: tl.constexpr, WORLD_SIZE: tl.constexpr):
    """Add one to slot [program][RANK] of every peer's channel (release, system scope)."""
    for peer in tl.static_range(WORLD_SIZE):
        if peer != RANK:
            pad = tl.load(signal_ptrs + peer).to(tl.pointer_type(tl.int32))
            tl.atomic_add(pad + program * SLOTS_PER_PROGRAM + RANK, 1, sem="release", scope="sys")


@triton.jit
def wait_peers(signal_ptrs, program, RANK: tl.constexpr, WORLD_SIZE: tl.constexpr):
    """Consume one signal from every peer's program ``program`` (acquire, system scope)."""
    pad = tl.load(signal_ptrs + RANK).to(tl.pointer_type(tl.int32))
    for peer in tl.static_range(WORLD_SIZE):
        if peer != RANK:
            slot = pad + program * SLOTS_PER_PROGRAM + peer
            pending = tl.atomic_add(slot, 0, sem="acquire", scope="sys")
            while pending == 0:
                pending = tl.atomic_add(slot, 0, sem="acquire", scope="sys")
            tl.atomic_add(slot, -1, sem="relaxed", scope="sys")


@triton.jit
def barrier(signal_ptrs, program, RANK: tl.constexpr, WORLD_SIZE: tl.constexpr):
    """Full barrier between program ``program`` of every rank (see the module docstring)."""
    if WORLD_SIZE > 1:
        tl.debug_barrier()
        signal_peers(signal_ptrs, program, RANK, WORLD_SIZE)
        wait_peers(signal_ptrs, program, RANK, WORLD_SIZE)
        tl.debug_barrier()


@triton.jit
def _barrier_kernel(signal_ptrs, RANK: tl.constexpr, WORLD_SIZE: tl.constexpr):
    """One-program kernel: a stream-ordered barrier of the group (after a kernel's peer writes)."""
    barrier(signal_ptrs, 0, RANK, WORLD_SIZE)
