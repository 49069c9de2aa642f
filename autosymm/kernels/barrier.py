"""Signal-pad barriers between the same program of every rank (Triton, device side only).

Slot ``[program][sender]`` of a rank's signal channel (autosymm.workspace.symm) counts the signals
that program ``program`` of rank ``sender`` sent it and that it has not consumed. A barrier: CTA
barrier; one ``red.add.release.sys`` on slot ``[program][RANK]`` of every peer; acquire-poll our
slot of each peer until non-zero, then subtract one; CTA barrier. Every barrier consumes exactly
what it was sent (the pads are back to zero after each kernel: a CUDA graph replays with no host
reset); all ranks must launch the same grid. Waits are bounded (:data:`MAX_POLLS`): a wait that
gives up adds one to the rank's error slot (``signal_ptrs[WORLD_SIZE]``) and performs no acquire,
so the host must treat every call since the last clean ``Workspace.barrier_errors()`` as failed
and call ``Workspace.reset_signals()`` on every rank before the next collective kernel.

Design notes: docs/KERNELS.md#kernels-barrier
"""

import triton
import triton.language as tl

# the poll limits are settings; this module names them for the kernels' readers (and tests)
from ..settings import RUNTIME_MAX_POLLS, TUNING_MAX_POLLS, get_or_default  # noqa: F401

#: Slots per program in a signal channel (autosymm.geometry.MAX_WORLD_SIZE).
SLOTS_PER_PROGRAM: tl.constexpr = tl.constexpr(8)


#: AUTOSYMM_BARRIER_MAX_POLLS as this module was imported (autosymm.settings; default
#: RUNTIME_MAX_POLLS, the tuner's TUNING_MAX_POLLS). A bad value gives the default here; the first
#: call's rank agreement reports it (settings.check: every rank then takes NCCL), so a typo on one
#: rank never makes ranks compile different kernels silently.
_POLLS = get_or_default("AUTOSYMM_BARRIER_MAX_POLLS")[0]

#: Polls of an empty slot before a wait gives up (read when kernels are compiled; set
#: AUTOSYMM_BARRIER_MAX_POLLS before importing autosymm to change it). One poll is a CTA barrier
#: plus an ``ld.acquire.sys`` of a local L2-resident word and a shared-memory broadcast: about
#: 0.3-1 us on an H100/H200 (an estimate, not yet measured), so the run-time default gives up
#: after roughly 5-18 minutes and the tuner's after roughly 5-17 s, far below the tuner's
#: measurement timeout (autosymm.tuning.sweep), so a spinning kernel ends by itself there.
#: Tests under the interpreter patch this module attribute to a handful of polls.
MAX_POLLS: tl.constexpr = tl.constexpr(_POLLS)
#: A pessimistic cost of one poll (us), for host-side timeouts that must outlast a spinning wait.
POLL_US_MAX = 2.0


def max_wait_s() -> float:
    """Pessimistic seconds one wait may spin before it gives up (MAX_POLLS * POLL_US_MAX)."""
    return int(getattr(MAX_POLLS, "value", MAX_POLLS)) * POLL_US_MAX * 1e-6


@triton.jit
def signal_peers(signal_ptrs, program, RANK: tl.constexpr, WORLD_SIZE: tl.constexpr):
    """Add one to slot [program][RANK] of every peer's channel (release, system scope)."""
    for peer in tl.static_range(WORLD_SIZE):
        if peer != RANK:
            pad = tl.load(signal_ptrs + peer).to(tl.pointer_type(tl.int32))
            tl.atomic_add(pad + program * SLOTS_PER_PROGRAM + RANK, 1, sem="release", scope="sys")


@triton.jit
def wait_peers(signal_ptrs, program, RANK: tl.constexpr, WORLD_SIZE: tl.constexpr):
    """Consume one signal from every peer's program ``program`` (acquire, system scope), or give
    up after MAX_POLLS empty polls and count the failure in this rank's error slot (see above)."""
    pad = tl.load(signal_ptrs + RANK).to(tl.pointer_type(tl.int32))
    for peer in tl.static_range(WORLD_SIZE):
        if peer != RANK:
            slot = pad + program * SLOTS_PER_PROGRAM + peer
            pending = tl.atomic_add(slot, 0, sem="acquire", scope="sys")
            if pending == 0:  # slow path only: the signal is not there yet
                errors = tl.load(signal_ptrs + WORLD_SIZE).to(tl.pointer_type(tl.int32))
                # A channel that already timed out is stale until the host resets it: fail fast.
                failed = tl.atomic_add(errors, 0, sem="relaxed", scope="gpu")
                polls = tl.where(failed == 0, 0, MAX_POLLS)
                while (pending == 0) & (polls < MAX_POLLS):
                    pending = tl.atomic_add(slot, 0, sem="acquire", scope="sys")
                    polls += 1
                if pending == 0:  # gave up: no acquire happened, leave the slot alone
                    tl.atomic_add(errors, 1, sem="relaxed", scope="gpu")
            if pending != 0:
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
