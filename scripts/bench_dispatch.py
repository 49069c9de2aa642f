"""Host time of a cached dispatch decision: `autosymm.all_reduce(x)` minus the kernel launch.

Runs on the CPU: a one-rank gloo group, where the decision is the no-op, so what is timed is the
per-call work autosymm adds in front of any backend's launcher (cache key, dict lookup, mode
check, counters). On a GPU node the mode check also asks CUDA whether the stream is capturing;
run it there too (same command) to include that.

    PYTHONPATH=$PWD python3 scripts/bench_dispatch.py [--calls 200000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("gloo", rank=0, world_size=1)
    import autosymm

    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(8192, device=device).bfloat16()
    autosymm.all_reduce(x)  # first call: collectives, databases, decision
    assert autosymm.explain(x).backend == "noop"

    def per_call_ns(fn) -> float:
        samples = []
        for _ in range(args.repeats):
            start = time.perf_counter_ns()
            for _ in range(args.calls):
                fn(x)
            samples.append((time.perf_counter_ns() - start) / args.calls)
        return statistics.median(samples)

    baseline = per_call_ns(lambda t: t)  # the Python call itself
    cached = per_call_ns(autosymm.all_reduce)
    print(f"torch {torch.__version__}, {device}, {args.calls} calls x {args.repeats} repeats (median)")
    print(f"empty Python call:            {baseline / 1e3:.3f} us")
    print(f"autosymm.all_reduce (cached): {cached / 1e3:.3f} us")
    print(f"dispatch overhead:            {(cached - baseline) / 1e3:.3f} us per call")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
