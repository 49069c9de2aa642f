"""Fault injection on the GPU node: each scenario runs on fresh processes (one per GPU, NCCL) and
must end, on every rank, with a clear error or the same safe fallback within its deadline.

    source scripts/_node_env.sh; python3 scripts/gpu_faults.py [--out FILE.md]

Scenarios: a peer killed before a Triton all-reduce (the survivor's barrier gives up: bounded
polls, counted by barrier_errors), settings that differ per rank (every rank on NCCL, one
warning), a dtype that differs per rank (AgreementError everywhere), a first call inside a CUDA
graph capture (a clear error on every rank), a peer that never makes its call (the
agreement deadline), and all-reduces issued on two streams of one group at once (two-batch
overlap: both must stay right, serialised or in separate slots, or raise a clear error; the row
says which). After each, the user DB must pass SQLite's integrity check. On one GPU only the
scenarios that mean something for a one-rank group run (the two-stream one: it runs and is right).
"""

from __future__ import annotations

import argparse
import os
import queue
import sqlite3
import sys
import tempfile
import time
import traceback

import torch
import torch.multiprocessing as mp

DEADLINE_S = 120.0


def _init(rank: int, world_size: int, port: int):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size, device_id=torch.device("cuda", rank))
    import autosymm

    return dist, autosymm


def _killed_peer(rank, world_size, dist, autosymm):
    x = torch.ones(1 << 16, device="cuda", dtype=torch.bfloat16)
    autosymm.all_reduce(x)  # prepared and agreed on every rank
    torch.cuda.synchronize()
    if rank == 1:
        return "exits without a word, as a crashed peer"
    time.sleep(2)
    start = time.monotonic()
    backend = autosymm.explain(x).backend
    autosymm.all_reduce(x)
    errors = autosymm.barrier_errors()
    return f"{backend}: survivor's call ended after {time.monotonic() - start:.1f} s, barrier_errors={errors}"


def _settings_differ(rank, world_size, dist, autosymm):
    x = torch.full((4096,), float(rank + 1), device="cuda", dtype=torch.bfloat16)
    autosymm.all_reduce(x)
    ok = torch.equal(x, torch.full_like(x, float(sum(range(1, world_size + 1)))))
    decision = autosymm.explain(x)
    return f"{decision.backend}, sum {'right' if ok else 'WRONG'}: {decision.reason[:120]}"


def _dtype_differs(rank, world_size, dist, autosymm):
    autosymm.init()
    x = torch.ones(4096, device="cuda", dtype=torch.bfloat16 if rank == 0 else torch.float16)
    try:
        autosymm.all_reduce(x)
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc)[:100]}"
    return "no error (BAD)"


def _first_call_in_capture(rank, world_size, dist, autosymm):
    x = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            autosymm.all_reduce(x)
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc)[:100]}"
    return "no error (BAD)"


def _peer_skips_call(rank, world_size, dist, autosymm):
    from datetime import timedelta

    autosymm.init()
    autosymm.api.STATES[None].channel.timeout = timedelta(seconds=5)
    if rank == 1:
        return "skipped the call"
    start = time.monotonic()
    try:
        autosymm.all_reduce(torch.ones(999, device="cuda"))
    except Exception as exc:
        return f"{type(exc).__name__} after {time.monotonic() - start:.1f} s: {str(exc)[:80]}"
    return "no error (BAD)"


def _two_streams(rank, world_size, dist, autosymm):
    """Two streams of one group, each reducing its own tensor, launched back to back with no host
    sync between them (as vLLM's DBO and SGLang's TBO overlap two micro-batches)."""
    autosymm.init()
    numel, rounds = 1 << 16, 20
    a, b = (torch.empty(numel, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    autosymm.all_reduce(a)  # prepared and agreed (eager, default stream) before the overlap
    autosymm.all_reduce(b)
    streams = (torch.cuda.Stream(), torch.cuda.Stream())
    right = 0
    try:
        for i in range(rounds):
            a.fill_(rank + 1 + i)
            b.fill_(2 * (rank + 1) + i)
            for stream, t in zip(streams, (a, b)):
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    autosymm.all_reduce(t)
            for stream in streams:
                torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()
            total = world_size * (world_size + 1) // 2
            right += int(bool((a == total + world_size * i).all()) and bool((b == 2 * total + world_size * i).all()))
    except Exception as exc:
        return f"{type(exc).__name__} after {right} right rounds: {str(exc)[:100]}"
    backend = autosymm.explain(a).backend
    verdict = "right" if right == rounds else "WRONG (BAD)"
    return f"{backend}: {right}/{rounds} rounds {verdict}, barrier_errors={autosymm.barrier_errors()}"


SCENARIOS = {
    "peer killed before a Triton all-reduce": (_killed_peer, {"all": {"AUTOSYMM_BARRIER_MAX_POLLS": str(1 << 22)}}),
    "AUTOSYMM_DISABLE on rank 1 only": (_settings_differ, {1: {"AUTOSYMM_DISABLE": "1"}}),
    "AUTOSYMM_WORKSPACE_BYTES on rank 1 only": (_settings_differ, {1: {"AUTOSYMM_WORKSPACE_BYTES": "256MiB"}}),
    "AUTOSYMM_BARRIER_MAX_POLLS=abc on rank 0": (_settings_differ, {0: {"AUTOSYMM_BARRIER_MAX_POLLS": "abc"}}),
    "dtype differs per rank": (_dtype_differs, {}),
    "first call inside a CUDA-graph capture": (_first_call_in_capture, {}),
    "peer never makes its call": (_peer_skips_call, {}),
    "all-reduces on two streams of one group at once": (_two_streams,
                                                        {"all": {"AUTOSYMM_BARRIER_MAX_POLLS": str(1 << 22)}}),
}
#: Scenarios that mean something for a one-rank group (the rest need a peer).
ONE_RANK = ("all-reduces on two streams of one group at once",)


def _worker(rank, world_size, port, name, env, db_path, out):
    os.environ.update(env.get("all", {}), **env.get(rank, {}), AUTOSYMM_DB=db_path)
    body = SCENARIOS[name][0]
    try:
        dist, autosymm = _init(rank, world_size, port)
        out.put((rank, body(rank, world_size, dist, autosymm)))
    except BaseException:
        out.put((rank, "raised: " + traceback.format_exc(limit=2).strip().splitlines()[-1]))
    out.close()
    out.join_thread()  # the report is flushed to the pipe before the hard exit below
    os._exit(0)  # no teardown: a scenario may leave a peer gone


def run_scenario(name: str, world_size: int) -> tuple[dict, float, str]:
    from autosymm.tuning.workers import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    db_path = os.path.join(tempfile.mkdtemp(), "user.sqlite")
    _seed_db(db_path)
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, name, SCENARIOS[name][1], db_path, out))
             for r in range(world_size)]
    start = time.monotonic()
    for p in procs:
        p.start()
    reports: dict = {}
    while len(reports) < world_size and time.monotonic() - start < DEADLINE_S:
        try:
            rank, text = out.get(timeout=1.0)
            reports[rank] = text
        except queue.Empty:
            if all(not p.is_alive() for p in procs) and out.empty():
                break
    elapsed = time.monotonic() - start
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    return reports, elapsed, _integrity(db_path)


def _seed_db(path: str) -> None:
    from autosymm.db.store import TuningDB

    TuningDB(path)  # an empty, valid user DB: the scenarios must leave it intact


def _integrity(path: str) -> str:
    with sqlite3.connect(path) as conn:
        return conn.execute("PRAGMA integrity_check").fetchone()[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="also write the table (markdown) here")
    parser.add_argument("--only", default="", help="run only the scenarios whose name contains this text")
    args = parser.parse_args()
    world_size = torch.cuda.device_count()
    if world_size < 1:
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    names = [n for n in (SCENARIOS if world_size > 1 else ONE_RANK) if args.only in n]
    lines = [f"# GPU fault scenarios ({world_size}x {torch.cuda.get_device_name(0)}, torch {torch.__version__})", "",
             "| scenario | seconds | DB | per rank |", "|---|---|---|---|"]
    for name in names:
        reports, elapsed, integrity = run_scenario(name, world_size)
        ranks = "<br>".join(f"rank {r}: {reports.get(r, 'NO REPORT (hang or crash)')}" for r in range(world_size))
        lines.append(f"| {name} | {elapsed:.1f} | {integrity} | {ranks} |")
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
