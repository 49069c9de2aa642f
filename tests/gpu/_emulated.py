"""Ranks emulated on ONE GPU: every rank's kernels launched concurrently from one process.

Each rank gets a stream of its own and a workspace whose peer buffers are the other ranks'
buffers on the same device (``autosymm.workspace.symm.simulated_workspaces(device="cuda")``), so the
signal-pad barriers, peer loads and peer stores run on real hardware exactly as on W GPUs
(correctness only: the "peers" are local HBM, nothing about NVLink speed is learnt).

:func:`run_ranks` drives a case given as ``launch(rank, round)``, which enqueues one rank's
work of one round on the current stream (copies in and out included). Three steps:

1. **compile** every rank's kernels in threads (``autosymm.backends.launch.compile_only``: no
   launch). The rank is a constexpr of autosymm's kernels, so each rank is a kernel of its own.
2. **load**: every rank's launches of round 0, one rank after another on one stream, with every
   barrier slot ``[program][peer]`` pre-set to a large count and every Lamport receive buffer
   pre-filled with non-sentinel words, so no wait ever spins. This loads
   each kernel's module (a module load waits for the kernels running on the device: a rank
   that spins while a peer's module loads would wait for ever) and binds the lean launches,
   and it runs torch's own copy kernels once. Then the pads are zeroed (Workspace.reset_signals:
   simulated workspaces have no group, it just zeroes).
3. **run**: ``rounds`` rounds, each rank on its own stream, launched round-robin; joined with a
   deadline, then every rank's barrier error slots must be 0 and its pads balanced.

A new kernel family needs only a ``launch`` and a check (see tests/gpu/test_emulated_ranks_gpu.py).
Grids must be small enough that every rank's programs are resident at once (a program's
barrier waits for the same program of every peer): world_size x num_blocks well under the SMs.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional, Sequence

import torch

from autosymm.geometry import MAX_PROGRAMS, MAX_WORLD_SIZE, SIGNAL_CHANNEL, SIGNAL_SLOTS_PER_RANK
from autosymm.workspace.symm import Workspace, simulated_workspaces

#: Pre-set count of every barrier slot during the load step (more than any case's waits).
PRESET = 1 << 20
DEADLINE_S = 120.0
WORLD_SIZES = (2, 4, 8)

Launch = Callable[[int, int], None]


def workspaces(world_size: int, *, all_reduce_bytes: int = 4 << 20, moe_bytes: int = 4 << 20,
               double_buffer_bytes: int = 1 << 20) -> list[Workspace]:
    """``world_size`` workspaces over buffers of the current CUDA device (one per rank)."""
    return simulated_workspaces(world_size, all_reduce_bytes=all_reduce_bytes, moe_bytes=moe_bytes,
                                double_buffer_bytes=double_buffer_bytes, device="cuda")


def pads(ws: Workspace, channel: str) -> torch.Tensor:
    """int32 [MAX_PROGRAMS, MAX_WORLD_SIZE] view of ``ws``'s slots of one signal channel."""
    start = SIGNAL_CHANNEL[channel] * SIGNAL_SLOTS_PER_RANK
    words = ws.buffer[:4 * (start + SIGNAL_SLOTS_PER_RANK)].view(torch.int32)[start:]
    return words.view(MAX_PROGRAMS, MAX_WORLD_SIZE)


def _peer_columns(ws: Workspace) -> list[int]:
    return [p for p in range(ws.world_size) if p != ws.rank]


def presatisfy(wss: Sequence[Workspace]) -> None:
    """Every slot [program][peer] of every channel holds PRESET signals (self slots untouched), and
    every Lamport receive buffer holds non-sentinel words (a Lamport wait finds its data at once)."""
    from autosymm.geometry import LAMPORT_HEADER_BYTES, LAMPORT_REGION

    for ws in wss:
        for channel in SIGNAL_CHANNEL:
            pads(ws, channel)[:, _peer_columns(ws)] = PRESET
        region = ws.regions.get(LAMPORT_REGION)
        if region is not None:
            ws.buffer[region.offset + LAMPORT_HEADER_BYTES:region.offset + region.nbytes].fill_(0x55)


def compile_all(launch: Launch, world_size: int) -> None:
    """Compile every rank's kernels of ``launch`` in threads; nothing reaches the GPU but copies."""
    from autosymm.backends.launch import compile_only

    def one(rank: int) -> None:
        with compile_only():
            launch(rank, 0)

    with ThreadPoolExecutor(max_workers=min(16, world_size)) as pool:
        list(pool.map(one, range(world_size)))
    torch.cuda.synchronize()


def load_all(wss: Sequence[Workspace], launch: Launch) -> None:
    """Run round 0 of every rank one after another with every barrier pre-satisfied, then zero the pads."""
    presatisfy(wss)
    for rank in range(len(wss)):
        launch(rank, 0)
    torch.cuda.synchronize()
    for ws in wss:
        ws.reset_signals()
    torch.cuda.synchronize()


def _join(streams: Sequence[torch.cuda.Stream], deadline_s: float) -> None:
    events = []
    for stream in streams:
        event = torch.cuda.Event()
        event.record(stream)
        events.append(event)
    start = time.monotonic()
    while not all(e.query() for e in events):
        if time.monotonic() - start > deadline_s:
            stuck = [r for r, e in enumerate(events) if not e.query()]
            raise AssertionError(f"emulated ranks {stuck} did not finish within {deadline_s:.0f} s "
                                 "(a barrier spins: a missing signal, or programs not co-resident)")
        time.sleep(0.001)
    torch.cuda.synchronize()


def check_pads(wss: Sequence[Workspace]) -> None:
    """No wait gave up, and every signal sent was consumed (peer slots of every channel zero)."""
    for ws in wss:
        errors = ws.barrier_error_counts()
        assert not any(errors.values()), f"rank {ws.rank}: barrier waits gave up: {errors}"
        for channel in SIGNAL_CHANNEL:
            left = pads(ws, channel)[:, _peer_columns(ws)]
            assert int(left.count_nonzero()) == 0, (
                f"rank {ws.rank} channel {channel!r}: unconsumed signals in programs "
                f"{torch.nonzero(left.sum(1)).flatten().tolist()[:8]}")


def run_ranks(wss: Sequence[Workspace], launch: Launch, rounds: int = 3, *, reset: Optional[Callable[[], object]] = None,
              deadline_s: float = DEADLINE_S) -> None:
    """Compile, load, then run ``rounds`` rounds of every rank concurrently (one stream per rank).
    ``reset()`` runs after the load step (which ran round 0 once): outputs the run must write
    again go back to their poison there."""
    world_size = len(wss)
    compile_all(launch, world_size)
    load_all(wss, launch)
    if reset is not None:
        reset()
    streams = [torch.cuda.Stream() for _ in range(world_size)]
    for stream in streams:
        stream.wait_stream(torch.cuda.current_stream())
    for round_ in range(rounds):
        for rank in range(world_size):
            with torch.cuda.stream(streams[rank]):
                launch(rank, round_)
    _join(streams, deadline_s)
    check_pads(wss)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a tensor (so -0.0, NaN and rounding compare exactly)."""
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    same = bits(got) == bits(want.to(got.device))
    if not bool(same.all()):
        bad = torch.nonzero(~same.reshape(-1)).flatten()
        first = int(bad[0])
        raise AssertionError(f"{what}: {bad.numel()} of {same.numel()} elements differ, first at {first}: "
                             f"{got.reshape(-1)[first].item()} != {want.reshape(-1)[first].item()}")


def fp32_sum(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The kernels' sum: fp32, ranks 0..W-1 in order, rounded once to the inputs' dtype."""
    acc = torch.zeros(tensors[0].shape, dtype=torch.float32, device=tensors[0].device)
    for t in tensors:
        acc = acc + t.float()
    return acc.to(tensors[0].dtype)


def random(shape, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (scale * torch.randn(shape, generator=gen, device="cuda")).to(dtype)


__all__ = ["WORLD_SIZES", "assert_bits", "bits", "check_pads", "fp32_sum", "load_all", "random", "run_ranks",
           "workspaces"]
