"""Run a test body in several CPU processes joined by a gloo process group.

The rank processes are forks of one fork server per pytest process that has imported torch,
triton, inductor and autosymm once (a spawned process pays 2-4 s of CPU to import them; the suite
starts hundreds of ranks). The fork server starts in the environment this module was imported in
(at collection, before any test changed it), so what those modules read at import comes from it.
Each rank takes the environment its caller had when it started, as a spawned one would, before
the body runs; the test module, loaded while the target is unpickled, sees the fork server's.
"""

from __future__ import annotations

import functools
import itertools
import os
import socket
import traceback

import _interpreter
import pytest
import torch.multiprocessing as mp

from autosymm.tuning.workers import free_port as any_free_port  # also loads autosymm's ops, as bodies expect

#: inductor's modules (about 3 s of CPU to import, in each rank that compiles) and this module,
#: with autosymm (0.2 s in every rank).
_PRELOAD = ["torch", "torch.distributed", "triton", "torch._dynamo", "torch._inductor.compile_fx", "_gloo",
            "_fork_server_ready"]
_SESSION_ENVIRON = dict(os.environ)
_TESTS = os.path.dirname(os.path.abspath(__file__))
#: Under pytest-xdist each worker takes its ports from its own range, below Linux's ephemeral
#: ports (32768-60999), so no worker's rendezvous port is handed to another's bind(0) meanwhile.
_PORTS_PER_WORKER = 1000
_next_port = itertools.count()


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for MASTER_PORT, from this xdist worker's own range."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw"):
        return any_free_port()
    base = 12000 + int(worker[2:]) * _PORTS_PER_WORKER
    for _ in range(_PORTS_PER_WORKER):
        port = base + next(_next_port) % _PORTS_PER_WORKER
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {base}..{base + _PORTS_PER_WORKER - 1} for xdist worker {worker}")


def context():
    """The multiprocessing context of the rank processes: the preloading fork server."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    _start_fork_server()
    return ctx


@functools.cache
def _start_fork_server() -> None:
    """Start the fork server once per pytest process, in the session's environment with tests/ on
    its path (it ignores the caller's sys.path, and skips a preload it cannot import silently)."""
    from multiprocessing import forkserver

    current = dict(os.environ)
    _take_environment({**_SESSION_ENVIRON,
                       "PYTHONPATH": os.pathsep.join(filter(None, [_TESTS, _SESSION_ENVIRON.get("PYTHONPATH")]))})
    try:
        forkserver.ensure_running()
    finally:
        _take_environment(current)


def _take_environment(environ: dict) -> None:
    os.environ.clear()
    os.environ.update(environ)


def in_environment(environ: dict, target, *args):
    """``target(*args)`` in a rank process after taking the starting process's ``environ``."""
    _take_environment(environ)
    if environ.get("TRITON_INTERPRET") == "1":
        _interpreter.install()
    return target(*args)


def start(ctx, target, args) -> "mp.Process":
    """A started daemon process of ``ctx`` running ``target(*args)`` in this process's environment."""
    proc = ctx.Process(target=in_environment, args=(dict(os.environ), target, *args), daemon=True)
    proc.start()
    return proc


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

    ctx = context()
    results = ctx.Queue()
    port = free_port()
    procs = [start(ctx, _worker, (rank, world_size, port, env or {}, body, args, results)) for rank in range(world_size)]
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

    ctx = context()
    out = ctx.Queue()
    port = free_port()
    procs = [start(ctx, target, (r, world_size, port, out)) for r in range(world_size)]
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
