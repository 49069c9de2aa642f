"""Cost per call of the checked mode (AUTOSYMM_CHECK_CALLS) on gloo ranks on the CPU: eager
``autosymm.all_reduce`` and ``all_reduce_rmsnorm`` calls with the mode on and off, and the
mechanism alone (``autosymm.runtime.call_check.check_call``), median of ``--repeats`` bursts of
``--calls`` back-to-back calls (every rank times the same bursts; rank 0 prints).

    PYTHONPATH=$PWD python3 scripts/bench_call_check.py [--world-size 2] [--calls 500]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.multiprocessing as mp


def _time(call, calls: int, repeats: int) -> float:
    """Median microseconds per call over ``repeats`` bursts (a barrier before each)."""
    import torch.distributed as dist

    for _ in range(20):
        call()
    bursts = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            call()
        bursts.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(bursts)


def _rank(rank: int, world_size: int, port: int, args, checked: bool, out) -> None:
    from autosymm import settings

    settings.export({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "AUTOSYMM_DB": "/nonexistent/none.sqlite",
                     "AUTOSYMM_CHECK_CALLS": "1" if checked else "0"})
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    import autosymm
    from autosymm.runtime.call_check import check_call, fingerprint

    x, residual, weight = torch.ones(args.numel), torch.ones(8, 512), torch.ones(512)
    fused_x = torch.ones(8, 512)
    row = {"all_reduce": _time(lambda: autosymm.all_reduce(x), args.calls, args.repeats),
           "all_reduce_rmsnorm": _time(lambda: autosymm.all_reduce_rmsnorm(fused_x, residual, weight),
                                       args.calls, args.repeats)}
    if checked:
        channel = autosymm.api.STATES[None].channel
        call = fingerprint("all_reduce", (x, "sum"), ("tensor", "reduce_op"), mode="eager")
        row["check_call alone"] = _time(lambda: check_call(channel, call), args.calls, args.repeats)
    if rank == 0:
        out.put(row)
    autosymm.api.reset()
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    from autosymm.tuning.workers import free_port

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--numel", type=int, default=1024, help="all-reduce elements (fp32)")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    rows = {}
    for checked in (False, True):
        out, port = ctx.Queue(), free_port()
        procs = [ctx.Process(target=_rank, args=(r, args.world_size, port, args, checked, out))
                 for r in range(args.world_size)]
        for proc in procs:
            proc.start()
        rows[checked] = out.get(timeout=600)
        for proc in procs:
            proc.join()
    print(f"{args.world_size} gloo ranks, {args.calls} calls x {args.repeats} bursts, us/call (median)")
    print(f"{'call':>20} {'off':>9} {'on':>9} {'cost':>9}")
    for name, on in rows[True].items():
        off = rows[False].get(name)
        print(f"{name:>20} {off if off is not None else float('nan'):9.1f} {on:9.1f} "
              f"{on - off if off is not None else on:9.1f}")


if __name__ == "__main__":
    main()
