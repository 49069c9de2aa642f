"""Split planning of the NCCL MoE path on one GPU: the split kernel (nccl_all_to_all.DeviceSplits,
one program or two passes) beside the torch planning it replaced, per call, both ops.

``us/call``: wall time of back-to-back calls (each ends in the host copy of the split sizes, so a
call's time is its launches' host time plus the GPU work before that copy), median of
``--repeats`` bursts; ``GPU ops``: kernels and copies per call (torch.profiler). Use it to place
ONE_PROGRAM_MAX_ITEMS: the item count where ``two passes`` starts beating ``one program``.

    source scripts/_node_env.sh && python3 scripts/bench_moe_splits.py [--world-size 2]
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python3 scripts/bench_moe_splits.py --device cpu --tokens 8   # smoke run
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Optional

import torch

SHAPES = ((160, 6), (256, 8))  # experts, top-k


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2, help="simulated group (rank 0 plans)")
    parser.add_argument("--tokens", default="16,64,128,256,512,1024,3000", help="tokens per rank")
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type != "cuda":
        print(f"on {device}: nothing to measure (the interpreter runs the kernels); each path runs once, no times")
    print(f"{'experts/k':>9} {'tok':>5} {'items':>7} {'op':>8} | {'torch us':>8} {'ops':>4} | "
          f"{'one program':>11} {'ops':>4} | {'two passes':>10} {'ops':>4} | chosen")
    for n_expts, k in SHAPES:
        for n_tokens in (int(t) for t in args.tokens.split(",")):
            for op in ("dp_to_ep", "ep_to_dp"):
                _row(op, args.world_size, n_tokens, n_expts, k, device, args.calls, args.repeats)


def _row(op, world_size, n_tokens, n_expts, k, device, calls, repeats) -> None:
    import autosymm.backends.nccl_all_to_all as nccl
    from autosymm.routing import make_expt_assignment, make_expt_dict_random, random_expt_indx, route

    assignment = make_expt_assignment(world_size, n_expts, make_expt_dict_random(world_size, n_expts, seed=1), device)
    expt_indx = random_expt_indx(world_size * n_tokens, n_expts, k, seed=2, device=device)
    gate, topk = route(expt_indx)
    indx = gate if op == "dp_to_ep" else topk
    plan = nccl.dp_to_ep_splits if op == "dp_to_ep" else nccl.ep_to_dp_splits
    tables: dict = {}
    cells = [_time(lambda: plan(nccl.owner_table(assignment, world_size, tables), expt_indx, indx, n_tokens, 0,
                                world_size), device, calls, repeats)]
    limit = nccl.ONE_PROGRAM_MAX_ITEMS
    try:
        for forced in (1 << 62, 0):  # every call in one program; every call in two passes
            nccl.ONE_PROGRAM_MAX_ITEMS = forced
            kernel = nccl.DeviceSplits(op, 0, world_size)
            cells.append(_time(lambda: kernel(assignment.expt_owner, expt_indx, indx), device, calls, repeats))
    finally:
        nccl.ONE_PROGRAM_MAX_ITEMS = limit
    chosen = "one program" if expt_indx.numel() <= limit else "two passes"
    print(f"{n_expts:>5}/{k:<3} {n_tokens:>5} {expt_indx.numel():>7} {op:>8} | "
          + " | ".join(f"{'-' if us is None else f'{us:.1f}':>{w}} {ops:>4}" for (us, ops), w in zip(cells, (8, 11, 10)))
          + f" | {chosen}",
          flush=True)


def _time(call, device, calls, repeats) -> tuple[Optional[float], int]:
    """(median us per call over bursts of back-to-back calls, GPU ops per call); off a GPU the
    call runs once and is not timed (None, -1)."""
    if device.type != "cuda":
        call()
        return None, -1
    for _ in range(5):
        call()
    bursts = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        bursts.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(bursts), _gpu_ops(call, device)


def _gpu_ops(call, device) -> int:
    if device.type != "cuda":
        return -1
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize(device)
    return sum(1 for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA)


if __name__ == "__main__":
    main()
