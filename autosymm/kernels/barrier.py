"""Signal-pad barriers between the same program of every rank (Triton, device side only).

Slot ``[program][sender]`` of a rank's signal channel (autosymm.workspace.symm) counts the signals
that program ``program`` of rank ``sender`` sent it and that it has not consumed. A barrier: CTA
barrier; one ``red.add.release.sys`` on slot ``[program][RANK]`` of every peer (one vector
instruction, one fence); acquire-poll our slot of every peer (one vector poll) until none is
empty, then subtract one from each; CTA barrier. Every barrier consumes exactly what it was sent
(the pads are back to zero after each kernel: a CUDA graph replays with no host reset); all ranks
must launch the same grid. Waits are bounded (:data:`MAX_POLLS`): a wait that gives up adds one to
the rank's error slot (``signal_ptrs[WORLD_SIZE]``) and performs no acquire, so the host must treat
every call since the last clean ``Workspace.barrier_errors()`` as failed and call
``Workspace.reset_signals()`` on every rank before the next collective kernel. Also here:
``count_in`` / ``publish``, a per-call word advanced once every program has read it.

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
def _peers(RANK: tl.constexpr, WORLD_SIZE: tl.constexpr):
    """(lanes 0..SLOTS_PER_PROGRAM-1, which of them are peers): every peer handled by one vector
    instruction, not one instruction (and one fence, one round trip) per peer."""
    lanes = tl.arange(0, SLOTS_PER_PROGRAM)
    return lanes, (lanes < WORLD_SIZE) & (lanes != RANK)


@triton.jit
def signal_peers(signal_ptrs, program, RANK: tl.constexpr, WORLD_SIZE: tl.constexpr):
    """Add one to slot [program][RANK] of every peer's channel (release, system scope).

    One vector ``red.release.sys`` over the peers: its fence (``MEMBAR.SYS``, which waits until
    this CTA's earlier stores are performed) is paid once per barrier, not once per peer; a second
    per-peer fence would also wait for the previous peer's signal to land. (World size 2: the one
    peer's scalar red, the same instruction with one lane.)"""
    if WORLD_SIZE == 2:
        pad = tl.load(signal_ptrs + (1 - RANK)).to(tl.pointer_type(tl.int32))
        tl.atomic_add(pad + program * SLOTS_PER_PROGRAM + RANK, 1, sem="release", scope="sys")
    else:
        lanes, is_peer = _peers(RANK, WORLD_SIZE)
        pads = tl.load(signal_ptrs + lanes, mask=is_peer, other=0).to(tl.pointer_type(tl.int32))
        tl.atomic_add(pads + program * SLOTS_PER_PROGRAM + RANK, 1, mask=is_peer, sem="release", scope="sys")


@triton.jit
def _missing(pending, is_peer):
    return tl.sum(((pending == 0) & is_peer).to(tl.int32), axis=0)


@triton.jit
def _poll(slots, is_peer, SCALAR: tl.constexpr):
    """(what the slots hold, how many of the peers' are empty): one acquire poll (system scope)."""
    if SCALAR:  # one peer: the acquire add of 0 becomes an ld.acquire
        pending = tl.atomic_add(slots, 0, sem="acquire", scope="sys")
        missing = (pending == 0).to(tl.int32)
    else:
        pending = tl.atomic_add(slots, 0, mask=is_peer, sem="acquire", scope="sys")
        missing = _missing(pending, is_peer)
    return pending, missing


@triton.jit
def wait_peers(signal_ptrs, program, RANK: tl.constexpr, WORLD_SIZE: tl.constexpr):
    """Consume one signal from every peer's program ``program`` (acquire, system scope), or give
    up after MAX_POLLS polls that found one missing and count the failure in this rank's error
    slot (see above). Every peer's slot is polled by one vector ``atom.acquire.sys`` (all in
    flight together; world size 2: the one peer's scalar poll); the slots that hold a signal are
    then decremented by one ``red``."""
    SCALAR: tl.constexpr = WORLD_SIZE == 2
    pad = tl.load(signal_ptrs + RANK).to(tl.pointer_type(tl.int32))
    if SCALAR:
        is_peer = True
        slots = pad + program * SLOTS_PER_PROGRAM + (1 - RANK)
    else:
        lanes, is_peer = _peers(RANK, WORLD_SIZE)
        slots = pad + program * SLOTS_PER_PROGRAM + lanes
    pending, missing = _poll(slots, is_peer, SCALAR)
    if missing > 0:  # slow path only: a signal is not there yet
        errors = tl.load(signal_ptrs + WORLD_SIZE).to(tl.pointer_type(tl.int32))
        # A channel that already timed out is stale until the host resets it: fail fast. The
        # check's load is in flight with the first re-poll (no round trip of its own).
        failed = tl.load(errors, cache_modifier=".cv")  # a hint: fetched again, not served from L1
        pending, missing = _poll(slots, is_peer, SCALAR)
        polls = tl.where(failed == 0, 1, MAX_POLLS)
        while (missing > 0) & (polls < MAX_POLLS):
            pending, missing = _poll(slots, is_peer, SCALAR)
            polls += 1
        if missing > 0:  # gave up: the slots still empty saw no acquire; leave them alone
            tl.atomic_add(errors, 1, sem="relaxed", scope="gpu")
    if SCALAR:
        if pending != 0:
            tl.atomic_add(slots, -1, sem="relaxed", scope="sys")
    else:
        tl.atomic_add(slots, -1, mask=is_peer & (pending != 0), sem="relaxed", scope="sys")


@triton.jit
def barrier(signal_ptrs, program, RANK: tl.constexpr, WORLD_SIZE: tl.constexpr):
    """Full barrier between program ``program`` of every rank (see the module docstring)."""
    if WORLD_SIZE > 1:
        tl.debug_barrier()
        signal_peers(signal_ptrs, program, RANK, WORLD_SIZE)
        wait_peers(signal_ptrs, program, RANK, WORLD_SIZE)
        tl.debug_barrier()


# --------------------------------------------------------------------------------------------
# Per-call device state advanced by the grid (the double-buffer epoch, the Lamport rotation)
# --------------------------------------------------------------------------------------------

@triton.jit
def count_in(counter, pid, n_programs):
    """Every program but the grid's last adds one to ``counter`` (``red.release.gpu``, nothing
    returned): call it after this program's loads of the word :func:`publish` overwrites, and
    early (the fence then has no stores to wait for, and nothing waits for the red)."""
    if pid < n_programs - 1:
        tl.atomic_add(counter, 1, sem="release", scope="gpu")


@triton.jit
def publish(counter, word, value, pid, n_programs, signal_ptrs, WORLD_SIZE: tl.constexpr):
    """The grid's last program waits (acquire, gpu scope) until the other ``n_programs - 1`` have
    counted in on ``counter`` (:func:`count_in`), then zeroes it and stores ``value`` in ``word``.

    Every program reads ``word`` before its release count, which the last program's acquire
    synchronizes with, so no program of this call sees ``value``; the next kernel on the stream
    does. The counter is 0 between calls, whatever the grid (a CUDA graph replays with no host
    reset). The wait is on programs of this grid only, which count in before they wait for
    anything: it ends once they are scheduled (the interpreter runs programs in order, the last
    one last, so it never waits there). Bounded all the same: a give-up is counted in this rank's
    error slot (the host then resets the pads, the counter and the word with them); the value is
    still stored, so the ranks that ran the call stay in step. Put it where the last program waits
    anyway (after a barrier's signal, before its wait; after the Lamport pushes), not at the end."""
    if pid == n_programs - 1:
        if n_programs > 1:
            arrived = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")
            polls = 0
            while (arrived < n_programs - 1) & (polls < MAX_POLLS):
                arrived = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")
                polls += 1
            if arrived < n_programs - 1:
                errors = tl.load(signal_ptrs + WORLD_SIZE).to(tl.pointer_type(tl.int32))
                tl.atomic_add(errors, 1, sem="relaxed", scope="gpu")
            tl.store(counter, 0)  # no other program touches it again in this call
        tl.store(word, value)


@triton.jit
def barrier_and_publish(signal_ptrs, program, counter, word, value, n_programs, RANK: tl.constexpr,
                        WORLD_SIZE: tl.constexpr):
    """:func:`barrier`, with :func:`publish` between its signal and its wait: the last program's
    wait for its grid overlaps the signals' round trip."""
    if WORLD_SIZE > 1:
        tl.debug_barrier()
        signal_peers(signal_ptrs, program, RANK, WORLD_SIZE)
    publish(counter, word, value, program, n_programs, signal_ptrs, WORLD_SIZE)
    if WORLD_SIZE > 1:
        wait_peers(signal_ptrs, program, RANK, WORLD_SIZE)
        tl.debug_barrier()


@triton.jit
def _barrier_kernel(signal_ptrs, RANK: tl.constexpr, WORLD_SIZE: tl.constexpr):
    """One-program kernel: a stream-ordered barrier of the group (after a kernel's peer writes)."""
    barrier(signal_ptrs, 0, RANK, WORLD_SIZE)
