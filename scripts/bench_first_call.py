"""The first autosymm call on a group of gloo ranks (CPU): its time, the autosymm modules it
imports and the database rows the group read, on rank 0.

    python3 scripts/bench_first_call.py [--ranks 2] [--repeats 5] [--json]

Each repeat starts fresh processes (spawned: nothing preloaded) and times, on rank 0, the first
``autosymm.all_reduce`` of a group (its set-up: settings, fingerprint, the databases, the rank
agreement, the decision), then three more first calls of other keys (a max, a fused call, an
empty tensor). The shipped databases are read as a process of this machine reads them: only its
own hardware's rows. Run it with ``PYTHONPATH=<another checkout>`` to time that one; times are
this machine's (2 CPU cores here: read them as ratios between two checkouts, alternated).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world_size: int, port: int, out) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    import autosymm
    from autosymm.runtime.group import state_of

    before = {m for m in sys.modules if m.startswith("autosymm")}
    start = time.perf_counter()
    autosymm.all_reduce(torch.ones(1024))
    first_s = time.perf_counter() - start
    start = time.perf_counter()
    autosymm.all_reduce(torch.ones(1000, dtype=torch.int32), op="max")
    autosymm.all_reduce_rmsnorm(torch.ones(4, 64), torch.ones(4, 64), torch.ones(64))
    autosymm.all_reduce(torch.ones(0))
    more_s = time.perf_counter() - start
    state = state_of(None)
    if rank == 0:
        out.put({"first_ms": first_s * 1e3, "three_more_ms": more_s * 1e3, "hardware": state.hardware,
                 "rows_read": sum(len(source.db.rows(hardware=state.hardware)) for source in state.sources),
                 "imported": sorted(m for m in sys.modules if m.startswith("autosymm") and m not in before),
                 "kernels_loaded": sorted(m for m in sys.modules if m.startswith("autosymm.kernels"))})
    dist.barrier()
    dist.destroy_process_group()


def run_once(world_size: int) -> dict:
    """One fresh group of ``world_size`` spawned gloo ranks; rank 0's report."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, world_size, port, out)) for r in range(world_size)]
    for proc in procs:
        proc.start()
    try:
        return out.get(timeout=300)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print the reports as JSON")
    args = parser.parse_args()
    reports = [run_once(args.ranks) for _ in range(args.repeats)]
    if args.json:
        print(json.dumps(reports))
        return
    first = [r["first_ms"] for r in reports]
    print(f"{args.ranks} gloo ranks, {args.repeats} fresh groups: first call median {statistics.median(first):.1f} ms "
          f"(min {min(first):.1f}, max {max(first):.1f}); three more first calls median "
          f"{statistics.median(r['three_more_ms'] for r in reports):.1f} ms")
    last = reports[-1]
    print(f"hardware {last['hardware']}: {last['rows_read']} rows read; kernel modules loaded: "
          f"{', '.join(last['kernels_loaded']) or 'none'}")
    print(f"autosymm modules the calls imported: {', '.join(last['imported']) or 'none'}")


if __name__ == "__main__":
    main()
