"""Run a test body on every local GPU, one process per GPU, with NCCL and symmetric memory.

``run_on_gpus(fn, *args)`` spawns ``world_size`` (default: all local GPUs) processes; each calls
``fn(rank, world_size, *args)`` after ``dist.init_process_group("nccl")`` with its device set.
A failure on any rank fails the test with that rank's traceback. NVLink multicast stays off.
"""

from __future__ import annotations

import os
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from autosymm.settings import MULTICAST_OFF_ENV
from autosymm.tuning.workers import free_port

#: The GPU tests keep NVLink multicast off on shared hosts (as scripts/run_gpu_tests.sh does).
SAFE_ENV = MULTICAST_OFF_ENV
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA GPUs")


def _worker(rank, world_size, port, fn, args, errors):
    os.environ.update(SAFE_ENV)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size,
                            device_id=torch.device("cuda", rank))
    try:
        fn(rank, world_size, *args)
    except BaseException:  # report every rank's failure to the parent
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        try:
            dist.barrier()
        except Exception:
            pass
        dist.destroy_process_group()


def run_on_gpus(fn, *args, world_size: int | None = None) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local GPUs (default: all)."""
    os.environ.update(SAFE_ENV)
    world_size = world_size or torch.cuda.device_count()
    if world_size > torch.cuda.device_count():
        pytest.skip(f"needs {world_size} GPUs, {torch.cuda.device_count()} present")
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    for attempt in range(3):  # a port free when picked can be taken before the store binds it
        try:
            mp.start_processes(_worker, args=(world_size, free_port(), fn, args, errors), nprocs=world_size,
                               join=True, start_method="spawn")
            break
        except mp.ProcessRaisedException as exc:
            if "EADDRINUSE" not in str(exc) or attempt == 2:
                raise
            while not errors.empty():  # the failed rendezvous ran no test code
                errors.get()
    if not errors.empty():
        rank, tb = errors.get()
        pytest.fail(f"rank {rank} failed:\n{tb}")
