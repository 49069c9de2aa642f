"""Host time of a cached dispatch decision: `autosymm.all_reduce(x)` minus the kernel launch.

A one-rank group (gloo on the CPU, NCCL on a GPU), where the decision is the no-op, so what is
timed is the per-call work autosymm adds in front of any backend's launcher (cache key, dict
lookup, mode check, counters). On a GPU the mode check also asks CUDA whether the stream is
capturing; there the script also times that query alone and the host side of one Triton kernel
launch through LeanLauncher (an empty one-program kernel), the two other parts of an eager call.
It also times the drop-in forms (``op=dist.ReduceOp.SUM``, ``op="sum"``) and the same call
through the op dispatcher (``torch.ops.autosymm.all_reduce_``, what a compiled graph runs), which
eager calls skip. Per call: the minimum over repeats of this thread's CPU time (robust on a
loaded machine, where wall-clock medians vary by 2x).

    PYTHONPATH=$PWD python3 scripts/bench_dispatch.py [--calls 200000]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=21)
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    import autosymm

    x = torch.randn(8192, device=device).bfloat16()
    autosymm.all_reduce(x)  # first call: collectives, databases, decision
    assert autosymm.explain(x).backend == "noop"

    def per_call_ns(fn) -> float:
        samples = []
        for _ in range(args.repeats):
            start = time.thread_time_ns()
            for _ in range(args.calls):
                fn(x)
            samples.append((time.thread_time_ns() - start) / args.calls)
        return min(samples)

    baseline = per_call_ns(lambda t: t)  # the Python call itself
    cached = per_call_ns(autosymm.all_reduce)
    print(f"torch {torch.__version__}, {device}, {args.calls} calls x {args.repeats} repeats (min thread CPU time)")
    print(f"empty Python call:            {baseline / 1e3:.3f} us")
    print(f"autosymm.all_reduce (cached): {cached / 1e3:.3f} us")
    print(f"dispatch overhead:            {(cached - baseline) / 1e3:.3f} us per call")
    op_sum, name_sum = dist.ReduceOp.SUM, "sum"
    print(f"  op=dist.ReduceOp.SUM:       {per_call_ns(lambda t: autosymm.all_reduce(t, op_sum)) / 1e3:.3f} us")
    print(f"  op='sum':                   {per_call_ns(lambda t: autosymm.all_reduce(t, name_sum)) / 1e3:.3f} us")
    group_name, op = autosymm.dist_compat.group_name(), torch.ops.autosymm.all_reduce_
    print(f"torch.ops.autosymm.all_reduce_: {per_call_ns(lambda t: op(t, name_sum, group_name)) / 1e3:.3f} us "
          f"(the op dispatcher, as a compiled graph calls it)")
    if device == "cuda":
        capturing = per_call_ns(lambda t: torch.cuda.is_current_stream_capturing())
        print(f"is_current_stream_capturing:  {(capturing - baseline) / 1e3:.3f} us per call")
        launch = _empty_launch()
        launches = per_call_ns(lambda t: launch())
        torch.cuda.synchronize()
        print(f"empty Triton kernel launch:   {(launches - baseline) / 1e3:.3f} us per call (host, LeanLauncher.direct)")
    dist.destroy_process_group()


def _empty_launch():
    """A bound launch of autosymm's one-program barrier kernel over one rank (it does nothing)."""
    from autosymm.backends.launch import LeanLauncher
    from autosymm.kernels.barrier import _barrier_kernel

    pads = torch.zeros(2, dtype=torch.int64, device="cuda")
    launcher = LeanLauncher(_barrier_kernel, (1,), dict(RANK=0, WORLD_SIZE=1), num_warps=1)
    launcher(pads)  # compiles and binds
    direct = launcher.direct or launcher
    address = pads.data_ptr()
    return lambda: direct(address)


if __name__ == "__main__":
    main()
