"""Host cost of an eager call, next to the cheapest launches the node allows, in one run.

On GPUs (one process per GPU, default 2; NVLink multicast off as scripts/_node_env.sh sets it):

* host us/call: bursts of ``--calls`` back-to-back calls without a sync, best and median of
  ``--repeats`` bursts, MAX over ranks, for autosymm's eager all-reduce (a plain tensor at one
  address; an ``autosymm.empty`` buffer; replay off, i.e. memoised bound launches; no wrapper,
  i.e. the launcher's checked direct path), the launch floor (a 1-program Triton kernel through
  ``kernel[grid]``, through ``LeanLauncher.direct``, replayed as a one-kernel CUDA graph, and
  ``x.add_(1)``), torch's two-shot on a symmetric buffer (no copy) and NCCL;
* device latency per call (CUDA events around a burst) of the same eager loops at ``--sizes``
  (default 4 KiB, 64 KiB, 1, 4 and 8 MiB, bf16), MAX over ranks;
* ``floor gap``: autosymm's host us/call minus the cheapest floor row (issue #13: <= 1 us);
* both eager launch styles (``eager_launch=replay``: a one-kernel graph replay, ``=direct``: a
  bound launch) of the all-reduce at ``--sizes`` and of the fused all-reduce + RMSNorm at
  ``--fused-tokens`` x 8192 (bf16), beside the row's own pick and the unwrapped launcher: the
  device column says which style leaves less time per call where the kernel bounds the loop.

With ``--cpu-stub`` (any machine, no GPU): Python ns per call of the all-reduce and fused
launchers with a stub launch (what the host path adds to the launch itself), through the
launcher's checked path, a memoised bound launch and a (stub) graph replay, and
autosymm.all_reduce's and autosymm.all_reduce_rmsnorm's dispatch in front.

    source scripts/_node_env.sh && python3 scripts/bench_dispatch.py [--world-size 2]
    PYTHONPATH=$PWD python3 scripts/bench_dispatch.py --cpu-stub
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import triton
import triton.language as tl

#: Default all-reduce sizes (bytes, bf16). At the larger ones the device column compares a loop of
#: one-kernel graph replays ("autosymm") with one of bound direct launches ("replay off").
SIZES = "4096,65536,1048576,4194304,8388608"
HOST_BYTES = 4 << 10
#: Token counts (x FUSED_HIDDEN, bf16) of the fused op's eager loops.
FUSED_TOKENS = "1,128,2048"
FUSED_HIDDEN = 8192


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=400, help="calls per burst")
    parser.add_argument("--repeats", type=int, default=15, help="bursts per row")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--sizes", default=SIZES, help="all-reduce sizes in bytes, comma-separated (bf16)")
    parser.add_argument("--fused-tokens", default=FUSED_TOKENS, help="fused op token counts (x 8192 bf16)")
    parser.add_argument("--cpu-stub", action="store_true", help="Python overhead with stub launches (no GPU)")
    args = parser.parse_args()
    if args.cpu_stub or not torch.cuda.is_available():
        _stub_report(max(args.calls, 20_000), args.repeats)
        return
    import torch.multiprocessing as mp

    from autosymm.settings import MULTICAST_OFF_ENV
    from autosymm.tuning.workers import free_port

    os.environ.update(MULTICAST_OFF_ENV)  # a shared host: multicast stays off
    world_size = min(args.world_size, torch.cuda.device_count())
    mp.start_processes(_rank, args=(world_size, free_port(), args), nprocs=world_size, start_method="spawn")


def _rank(rank: int, world_size: int, port: int, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size, device_id=torch.device("cuda", rank))
    try:
        rows = _measure(rank, world_size, args)
        gathered = [None] * world_size
        dist.all_gather_object(gathered, rows)
        if rank == 0:
            _print(gathered, world_size, args)
    finally:
        dist.destroy_process_group()


def _timer(args):
    """fn -> (host us/call best, median, device us/call median) over bursts, ranks in step."""
    import torch.distributed as dist

    def measure(fn) -> tuple[float, float, float]:
        for _ in range(20):
            fn()
        host, device = [], []
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(args.repeats):
            torch.cuda.synchronize()
            dist.barrier()
            start.record()
            t0 = time.perf_counter()
            for _ in range(args.calls):
                fn()
            host.append((time.perf_counter() - t0) / args.calls * 1e6)
            end.record()
            end.synchronize()
            device.append(start.elapsed_time(end) * 1e3 / args.calls)
        return min(host), statistics.median(host), statistics.median(device)

    return measure


def _measure(rank: int, world_size: int, args) -> dict[str, tuple[float, float, float]]:
    import autosymm

    autosymm.init()
    measure = _timer(args)
    rows = {f"floor {name}": measure(fn) for name, fn in _floor_launches().items()}
    rows.update(_host_pieces(args.calls, args.repeats))
    for nbytes in (int(size) for size in args.sizes.split(",")):
        numel = nbytes // 2
        label = f"{nbytes >> 10} KiB"
        for name, fn in _all_reduce_loops(numel).items():
            rows[f"{name} @ {label}"] = measure(fn)
    for n_tokens in (int(t) for t in args.fused_tokens.split(",")):
        for name, fn in _fused_loops(n_tokens).items():
            rows[f"{name} @ {n_tokens} x {FUSED_HIDDEN}"] = measure(fn)
    return rows


@triton.jit
def _one_program(x_ptr, STEP: tl.constexpr):
    tl.store(x_ptr, tl.load(x_ptr) + STEP)


def _floor_launches() -> dict:
    """Launches of a 1-program Triton kernel four ways (the cheapest the node allows)."""
    from autosymm.backends.launch import LeanLauncher
    from autosymm.runtime.replay import capture_cuda_graph, replay_function

    x = torch.zeros(16, dtype=torch.int32, device="cuda")
    lean = LeanLauncher(_one_program, (1,), {"STEP": 1}, num_warps=1)
    lean(x)
    direct, addr = lean.direct, x.data_ptr()
    assert direct is not None, "LeanLauncher did not bind"
    graph = capture_cuda_graph(lambda: direct(addr), x.device)
    return {"kernel[grid]": lambda: _one_program[(1,)](x, STEP=1, num_warps=1),
            "LeanLauncher.direct": lambda: direct(addr),
            "graph replay": replay_function(graph),
            "x.add_(1)": lambda: x.add_(1)}


def _host_pieces(calls: int, repeats: int) -> dict[str, tuple[float, float, float]]:
    """Host us per call of the pieces of autosymm's eager hit path (no GPU work but the replay
    row): what each costs on this host, beside the whole call above. Device column: 0."""
    import autosymm
    from autosymm import api
    from autosymm.spec import ALL_REDUCE, ALL_REDUCE_RMSNORM, call_key
    from autosymm.epilogue import DEFAULT
    from autosymm.runtime.group import current_raw_stream, stream_capturing

    x = torch.zeros(HOST_BYTES // 2, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        autosymm.all_reduce(x)
    entry = api.STATES[None].cache[call_key(ALL_REDUCE, x.dtype, x.numel(), x.device, False, "sum")]
    state = api.STATES[None]
    key = call_key(ALL_REDUCE, x.dtype, x.numel(), x.device, False, "sum")

    def nothing():
        pass

    pieces = {"empty Python call": nothing,
              "stream_capturing()": stream_capturing,
              "current_raw_stream(index)": lambda: current_raw_stream(x.device.index),
              "x.data_ptr()": x.data_ptr,
              "x.numel()": x.numel,
              "x.is_contiguous()": x.is_contiguous,
              "x.dtype": lambda: x.dtype,
              "cache key + lookup": lambda: state.cache.get(call_key(ALL_REDUCE, x.dtype, x.numel(), x.device,
                                                                      stream_capturing(), "sum")),
              "entry.launcher(x) (the replay wrapper + replay)": lambda: entry.launcher(x)}
    rows = {}
    for name, fn in pieces.items():
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            samples.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
        rows[f"piece {name}"] = (min(samples), statistics.median(samples), 0.0)
    return rows


def _all_reduce_loops(numel: int) -> dict:
    """Eager all-reduce loops of ``numel`` bf16 elements: autosymm (the row's pick, zero-copy, both
    eager launch styles, the unwrapped launcher), torch's two-shot, NCCL."""
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    import autosymm
    from autosymm import api
    from autosymm.spec import ALL_REDUCE, ALL_REDUCE_RMSNORM, call_key
    from autosymm.epilogue import DEFAULT
    from autosymm.runtime.replay import EagerReplay, capture_cuda_graph, eager_launch, wrap_eager

    x = torch.zeros(numel, dtype=torch.bfloat16, device="cuda")
    zero_copy = autosymm.empty((numel,), torch.bfloat16).zero_()
    autosymm.all_reduce(x)
    entry = api.STATES[None].cache[call_key(ALL_REDUCE, x.dtype, numel, x.device, False, "sum")]
    wired = isinstance(entry.launcher, EagerReplay)
    raw = entry.launcher.launcher if wired else entry.launcher
    tuned = entry.launcher if wired else wrap_eager(raw, entry.decision)  # what api's prepare makes
    group_name = dist.group.WORLD.group_name
    symm = symm_mem.empty(numel, dtype=torch.bfloat16, device="cuda").zero_()
    symm_mem.rendezvous(symm, group_name)
    tag = f"{entry.decision.backend}, row: {eager_launch(entry.decision.config)}"
    loops = {f"autosymm [{tag}{'' if wired else '; api not wired, wrapped here'}]": _with(entry, tuned, x),
             "autosymm zero-copy": _with(entry, tuned, zero_copy)}
    if tuned is not raw:
        loops.update({"autosymm eager_launch=replay": _with(entry, EagerReplay(raw, capture_cuda_graph), x),
                      "autosymm eager_launch=direct": _with(entry, EagerReplay(raw, None), x)})
    loops.update({"autosymm no wrapper": _with(entry, raw, x),
                  "torch two-shot (symm)": lambda: torch.ops.symm_mem.two_shot_all_reduce_(symm, "sum", group_name),
                  "nccl": lambda: dist.all_reduce(x)})
    return loops


def _with(entry, launcher, *args):
    """One autosymm call of ``args`` whose api entry runs ``launcher`` (hot plans of another are
    dropped when it is swapped in)."""
    import autosymm
    from autosymm.runtime.replay import forget_all

    call = autosymm.all_reduce if len(args) == 1 else autosymm.all_reduce_rmsnorm

    def run():
        if entry.launcher is not launcher:
            entry.launcher = launcher
            forget_all()
        return call(*args)
    return run


def _fused_loops(n_tokens: int) -> dict:
    """Eager fused all-reduce + RMSNorm loops of [n_tokens, FUSED_HIDDEN] bf16: the row's pick, both
    launch styles and the unwrapped launcher of its Triton launcher (the first config of the pull
    one-shot where the DB picks NCCL), and NCCL + add + rms_norm."""
    import torch.distributed as dist

    import autosymm
    from autosymm import api
    from autosymm.spec import ALL_REDUCE, ALL_REDUCE_RMSNORM, call_key
    from autosymm.epilogue import DEFAULT
    from autosymm.backends.triton_fused import triton_fused_one_shot

    from autosymm.runtime.replay import FusedReplay, capture_cuda_graph, eager_launch

    x = torch.zeros(n_tokens, FUSED_HIDDEN, dtype=torch.bfloat16, device="cuda")  # zeros: nothing overflows
    residual, weight = torch.ones_like(x), torch.ones(FUSED_HIDDEN, dtype=torch.bfloat16, device="cuda")
    autosymm.all_reduce_rmsnorm(x, residual, weight)
    state = api.STATES[None]
    entry = state.cache[call_key(ALL_REDUCE_RMSNORM, x.dtype, x.shape, x.device, False, DEFAULT)]
    tuned = entry.launcher
    loops = {f"fused autosymm [{entry.decision.backend}, row: {eager_launch(entry.decision.config)}]":
             _with(entry, tuned, x, residual, weight)}
    raw, tag = (tuned.launcher, "") if isinstance(tuned, FusedReplay) else (None, " (one_shot, not the DB's pick)")
    problem = autosymm.Problem.all_reduce_rmsnorm(n_tokens, FUSED_HIDDEN, "bf16", state.world_size)
    if raw is None and triton_fused_one_shot.why_not(problem, state.caps, "eager") is None:
        raw = triton_fused_one_shot.prepare(problem, triton_fused_one_shot.search_space(problem)[0], state.ctx)
    if raw is not None:
        for style, capture in (("replay", capture_cuda_graph), ("direct", None)):
            loops[f"fused autosymm eager_launch={style}{tag}"] = _with(entry, FusedReplay(raw, capture), x, residual,
                                                                       weight)
        loops[f"fused autosymm no wrapper{tag}"] = _with(entry, raw, x, residual, weight)
    rms_norm = torch.nn.functional.rms_norm
    loops["fused nccl + add + rms_norm"] = lambda: (dist.all_reduce(x), residual.add_(x),
                                                    rms_norm(residual, (FUSED_HIDDEN,), weight, 1e-6))
    return loops


def _print(gathered: list, world_size: int, args) -> None:
    names = list(gathered[0])
    worst = {name: tuple(max(rows[name][i] for rows in gathered) for i in range(3)) for name in names}
    print(f"torch {torch.__version__}, {world_size} x {torch.cuda.get_device_name()}, "
          f"{args.calls} calls x {args.repeats} bursts, MAX over ranks")
    print(f"{'call':<84} {'host best':>10} {'host med':>10} {'device/call':>12}")
    for name in names:
        best, median, device = worst[name]
        print(f"{name:<84} {best:>10.2f} {median:>10.2f} {device:>12.2f}")
    floor = min(v[0] for k, v in worst.items() if k.startswith("floor"))
    host = f"@ {HOST_BYTES >> 10} KiB"
    for name in names:
        if name.startswith("autosymm") and name.endswith(host):
            print(f"floor gap {name:<52} {worst[name][0] - floor:+.2f} us (host best - cheapest floor {floor:.2f})")


def _stub_report(calls: int, repeats: int) -> None:
    """Python ns per call of the host path with a stub launch (a no-op Python function standing
    for triton's launcher), on simulated workspaces of 2 ranks: what autosymm adds to a launch."""
    import timeit

    import torch.distributed as dist

    import autosymm
    import autosymm.backends.triton_all_reduce as tar
    from autosymm import api
    from autosymm.spec import ALL_REDUCE, ALL_REDUCE_RMSNORM, call_key
    from autosymm.epilogue import DEFAULT
    from autosymm.backends.base import RunContext
    from autosymm.configs import AllReduceConfig
    from autosymm.problem import Problem
    from autosymm.runtime.replay import EagerReplay
    from autosymm.workspace.symm import simulated_workspaces

    def stub(*args):
        pass

    class StubLean:  # binds at once; every launch is the stub
        direct = staticmethod(stub)

        def __init__(self, *args, **kwargs):
            pass

        __call__ = staticmethod(stub)

    def ns(fn) -> float:  # this thread's CPU time: other processes on the machine do not count
        return min(timeit.Timer(fn, timer=time.thread_time).repeat(number=calls, repeat=repeats)) / calls * 1e9

    tar.LeanLauncher = StubLean
    wss = simulated_workspaces(2, all_reduce_bytes=1 << 20, moe_bytes=256)
    numel = HOST_BYTES // 2
    x = torch.zeros(numel, dtype=torch.bfloat16)
    zero_copy = wss[0].empty((numel,), torch.bfloat16)
    empty_call = ns(lambda: stub(x))
    print(f"torch {torch.__version__}, Python ns per call beyond the launch itself (stub launch; an empty "
          f"call, {empty_call:.0f} ns, subtracted), {HOST_BYTES} bytes bf16, thread CPU time, best of {repeats} x {calls}")
    for double in (False, True):
        config = AllReduceConfig("one_shot", 1024, 4, 4, double_buffer=double)
        launcher = tar.triton_one_shot.prepare(Problem.all_reduce(HOST_BYTES, "bf16", 2), config,
                                               RunContext(workspace=wss[0]))
        graphed = EagerReplay(launcher, lambda launch, device: type("G", (), {"replay": staticmethod(stub)}))
        memoised = EagerReplay(launcher, None)
        for name, tensor in (("plain", x), ("zero-copy", zero_copy)):
            for fn in (launcher, graphed, memoised):
                fn(tensor), fn(tensor)  # bind, plan
            what = f"one_shot{' double_buffer' if double else ''} {name}"
            print(f"  {what:<32} launcher (checked): {ns(lambda: launcher(tensor)) - empty_call:6.0f}   "
                  f"bound launch: {ns(lambda: memoised(tensor)) - empty_call:6.0f}   "
                  f"graph replay: {ns(lambda: graphed(tensor)) - empty_call:6.0f}")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("gloo", rank=0, world_size=1)
    autosymm.all_reduce(x)  # a 1-rank group: the no-op decision; its entry then runs our launcher
    entry = api.STATES[None].cache[call_key(ALL_REDUCE, x.dtype, numel, x.device, False, "sum")]
    entry.launcher = graphed
    autosymm.all_reduce(x), autosymm.all_reduce(x)  # capture: the address is hot from now on
    print(f"  autosymm.all_reduce -> graph replay (stub):  {ns(lambda: autosymm.all_reduce(x)) - empty_call:6.0f}")
    entry.launcher = launcher
    api.forget_all()
    print(f"  autosymm.all_reduce -> launcher (checked):   {ns(lambda: autosymm.all_reduce(x)) - empty_call:6.0f}")
    _stub_fused(ns, stub, empty_call)
    dist.destroy_process_group()


def _stub_fused(ns, stub, empty_call: float) -> None:
    """The fused op's rows of the stub report: [1, FUSED_HIDDEN] bf16 on a simulated one-rank
    workspace (the launcher's host path is the same at any world size), launcher, bound launch and
    graph replay, then autosymm.all_reduce_rmsnorm in front (its hot call, and the key path)."""
    import autosymm
    import autosymm.backends.triton_fused as tf
    from autosymm import api
    from autosymm.spec import ALL_REDUCE, ALL_REDUCE_RMSNORM, call_key
    from autosymm.epilogue import DEFAULT
    from autosymm.backends.base import RunContext

    from autosymm.configs import FusedConfig
    from autosymm.problem import Problem
    from autosymm.runtime.replay import FusedReplay, forget_all
    from autosymm.workspace.symm import simulated_workspaces

    class StubLean:  # binds at once; every launch is the stub
        direct = staticmethod(stub)

        def __init__(self, *args, **kwargs):
            pass

        __call__ = staticmethod(stub)

    tf.LeanLauncher = StubLean
    (ws,) = simulated_workspaces(1, all_reduce_bytes=1 << 20, moe_bytes=256)
    problem = Problem.all_reduce_rmsnorm(1, FUSED_HIDDEN, "bf16", 1)
    launcher = tf.triton_fused_one_shot.prepare(problem, FusedConfig("one_shot", FUSED_HIDDEN, 8, 1),
                                                RunContext(workspace=ws))
    x = torch.zeros(1, FUSED_HIDDEN, dtype=torch.bfloat16)
    residual, weight = torch.zeros_like(x), torch.ones(FUSED_HIDDEN, dtype=torch.bfloat16)
    graphed = FusedReplay(launcher, lambda launch, device: type("G", (), {"replay": staticmethod(stub)}))
    memoised = FusedReplay(launcher, None)
    for fn in (launcher, graphed, memoised):
        fn(x, residual, weight), fn(x, residual, weight)  # bind, plan (the output's block comes back)
    print(f"  fused [1, {FUSED_HIDDEN}]              launcher (checked): "
          f"{ns(lambda: launcher(x, residual, weight)) - empty_call:6.0f}   "
          f"bound launch: {ns(lambda: memoised(x, residual, weight)) - empty_call:6.0f}   "
          f"graph replay: {ns(lambda: graphed(x, residual, weight)) - empty_call:6.0f}   "
          f"(torch.empty_like of the output: {ns(lambda: torch.empty_like(x)) - empty_call:.0f})")
    autosymm.all_reduce_rmsnorm(x, residual, weight)  # a 1-rank group: NCCL's composition; its entry runs ours
    entry = api.STATES[None].cache[call_key(ALL_REDUCE_RMSNORM, x.dtype, x.shape, x.device, False, DEFAULT)]
    entry.launcher = graphed
    autosymm.all_reduce_rmsnorm(x, residual, weight)  # the key path makes it the group's hot call
    call = lambda: autosymm.all_reduce_rmsnorm(x, residual, weight)  # noqa: E731
    print(f"  autosymm.all_reduce_rmsnorm -> graph replay (stub, hot call): {ns(call) - empty_call:6.0f}")
    entry.launcher = launcher
    forget_all()
    print(f"  autosymm.all_reduce_rmsnorm -> launcher (checked):            {ns(call) - empty_call:6.0f}")


if __name__ == "__main__":
    main()
