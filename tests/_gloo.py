"""Run a test body in several CPU processes joined by a gloo process group."""

from __future__ import annotations

import os
import traceback

import pytest
import torch.multiprocessing as mp

from autosymm.tuning.workers import free_port


def _worker(rank, world_size, port, env, body, args, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **env.get(rank, env.get("all", {})))
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        results.put((rank, "ok", body(rank, world_size, *args)))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        _teardown(dist)


def _teardown(dist) -> None:
    """Drop autosymm's references to the group, leave together, then destroy the group (a
    group destroyed under a peer's feet, or outliving its destroy, aborts at exit)."""
    import sys

    if "autosymm.api" in sys.modules:
        sys.modules["autosymm.api"].reset()
    try:
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_gloo(body, world_size: int, *args, env: dict | None = None, deadline_s: float = 120.0) -> dict:
    """``body(rank, world_size, *args)`` on ``world_size`` gloo processes; {rank: return value}.

    ``env``: {"all": {...}} and/or {rank: {...}} environment variables set before the group is
    made. A failure on any rank fails the test with that rank's traceback; a rank that has not
    reported within ``deadline_s`` seconds fails it as a hang (its processes are killed).
    """
    import queue as queue_module
    import time

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(rank, world_size, port, env or {}, body, args, results), daemon=True)
             for rank in range(world_size)]
    for proc in procs:
        proc.start()
    out, errors, end = {}, {}, time.monotonic() + deadline_s
    try:
        while len(out) + len(errors) < world_size:
            try:
                rank, status, value = results.get(timeout=max(0.1, end - time.monotonic()))
            except queue_module.Empty:
                pytest.fail(f"hang: only ranks {sorted(out) + sorted(errors)} reported within {deadline_s} s")
            (errors if status == "error" else out)[rank] = value
    finally:
        for proc in procs:
            proc.join(timeout=20)
            if proc.is_alive():
                proc.kill()
    for rank, value in sorted(errors.items()):
        pytest.fail(f"rank {rank}:\n{value}")
    return out


def run_with_deadline(target, world_size: int, deadline_s: float = 90.0) -> dict:
    """Start ``target(rank, world_size, port, queue)`` in ``world_size`` processes and collect the
    ``(rank, report, error)`` each puts on the queue; a rank silent past ``deadline_s`` seconds
    fails the test as a deadlock (the protocol tests assert that nothing hangs)."""
    import queue as queue_module
    import time

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world_size, port, out), daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    reports, end = {}, time.monotonic() + deadline_s
    try:
        while len(reports) < world_size:
            try:
                rank, report, error = out.get(timeout=max(0.1, end - time.monotonic()))
            except queue_module.Empty:
                pytest.fail(f"deadlock: only ranks {sorted(reports)} reported within {deadline_s} s")
            if error:
                pytest.fail(f"rank {rank} failed:\n{error}")
            reports[rank] = report
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return reports
