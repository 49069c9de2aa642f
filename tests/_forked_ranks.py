"""Ranks as forked processes under the Triton interpreter, running at the same time.

The sequential simulations (tests/_all_reduce_sim.py, tests/_lamport_sim.py) run one rank's launch
to completion before the next, so a kernel whose program waits for a peer's data with no phase
to split at (the fused Lamport one-shot) cannot run there. Here every rank is a process forked
from the test, its workspace buffers and tensors in shared memory at the same addresses in every
process (``fork`` keeps the mappings), so the interpreter's loads, stores and atomics reach the
peers as on GPUs, and ranks may run calls ahead of each other as on GPUs.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from typing import Callable, Sequence

import torch

from autosymm.workspace.symm import Workspace, simulated_workspaces


def shared_workspaces(world_size: int, **sizes) -> list[Workspace]:
    """Simulated workspaces whose buffers live in shared memory (made before any fork)."""
    layout_ws = simulated_workspaces(world_size, **sizes)
    buffers = [ws.buffer.share_memory_() for ws in layout_ws]
    return [Workspace(rank, buffers, layout_ws[0].layout) for rank in range(world_size)]


def shared(t: torch.Tensor) -> torch.Tensor:
    """``t`` in shared memory: what a rank process writes there, the test reads."""
    return t.share_memory_()


def run_forked(world_size: int, body: Callable[[int], None], timeout_s: float = 600.0) -> None:
    """``body(rank)`` in one forked process per rank, all at once; AssertionError naming the rank
    whose body raised or that did not end in time."""
    ctx = mp.get_context("fork")
    errors = ctx.Queue()

    def main(rank: int) -> None:
        torch.set_num_threads(1)
        try:
            body(rank)
        except BaseException:
            errors.put(f"rank {rank}:\n{traceback.format_exc()}")
            os._exit(1)
        os._exit(0)

    procs = [ctx.Process(target=main, args=(rank,)) for rank in range(world_size)]
    for p in procs:
        p.start()
    failed: Sequence[str] = []
    for rank, p in enumerate(procs):
        p.join(timeout=timeout_s)
        if p.exitcode is None:
            for q in procs:
                q.kill()
            raise AssertionError(f"rank {rank} did not finish within {timeout_s:.0f} s")
    failed = [errors.get() for p in procs if p.exitcode != 0]
    assert not failed, "\n".join(failed)
