"""Start one worker process per local GPU (or join a torchrun launch) and run a function on each.

``run_workers(fn, nproc, *args)`` calls ``fn(rank, world_size, *args)`` in every worker after
``init_process_group('nccl')`` with the worker's GPU selected, and returns rank 0's return value.
Under torchrun (RANK/WORLD_SIZE/LOCAL_RANK set) the current process is the worker. Workers
inherit the caller's environment unchanged: NCCL, torch and NVSHMEM run as the user runs them
(NVLS / multicast as the user's variables say; the node scripts, scripts/_node_env.sh, turn it
off explicitly). Tuned rows and bench output record that state (hardware.provenance's comm_env).
"""

from __future__ import annotations

import socket
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import autosymm.api

from .. import settings

def free_port() -> int:
    """An unused TCP port on 127.0.0.1 (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def under_torchrun() -> bool:
    return all(settings.raw(name) is not None for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def torchrun_world_size() -> int | None:
    """The world size of the torchrun launch this process is a worker of (None: not under torchrun)."""
    return int(settings.raw("WORLD_SIZE")) if under_torchrun() else None


def _init(rank: int, world_size: int, local_rank: int, cpu: bool = False) -> None:
    if cpu:  # gloo ranks on the CPU (the --cpu smoke paths)
        if not dist.is_initialized():
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        return
    torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group("nccl", rank=rank, world_size=world_size,
                                device_id=torch.device("cuda", local_rank))


def _spawned(rank: int, world_size: int, port: int, fn: Callable, args: tuple, results, cpu: bool = False) -> None:
    settings.export(dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                         WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank)))

    try:
        _init(rank, world_size, rank, cpu)
        value = fn(rank, world_size, *args)
        if rank == 0:
            results.put(("ok", value))
    except BaseException as exc:  # report to the parent, then fail this worker
        results.put(("error", f"rank {rank}: {exc!r}\n{traceback.format_exc()}"))
        raise
    finally:
        if dist.is_initialized():
            autosymm.api.reset()  # no group reference may outlive destroy_process_group
            dist.destroy_process_group()


def run_workers(fn: Callable, nproc: int | None, *args: Any, cpu: bool = False) -> Any:
    """Run ``fn(rank, world_size, *args)`` on ``nproc`` local GPUs; rank 0's result is returned.
    ``cpu``: on ``nproc`` CPU processes joined by gloo instead (smoke runs of the plumbing).

    ``fn`` must be importable (module level) since workers are spawned.
    """
    if under_torchrun():
        rank, world_size = int(settings.raw("RANK")), int(settings.raw("WORLD_SIZE"))
        _init(rank, world_size, int(settings.raw("LOCAL_RANK")), cpu)
        return fn(rank, world_size, *args)
    available = torch.cuda.device_count()
    nproc = nproc or available
    if cpu:
        if not nproc or nproc < 1:
            raise RuntimeError(f"{nproc} CPU worker(s) asked for; at least 1")
    elif nproc < 1 or nproc > available:
        raise RuntimeError(f"--nproc {nproc} asked for, {available} CUDA GPUs visible")

    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    try:
        mp.start_processes(_spawned, args=(nproc, free_port(), fn, args, results, cpu), nprocs=nproc, join=True,
                           start_method="spawn")
    except Exception as exc:
        errors = []
        while not results.empty():
            status, value = results.get()
            if status == "error":
                errors.append(value)
        raise RuntimeError("worker failed:\n" + "\n".join(errors or [str(exc)])) from None
    value = None
    while not results.empty():
        status, payload = results.get()
        if status == "ok":
            value = payload
    return value
