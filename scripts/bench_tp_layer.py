#!/usr/bin/env python3
"""Step time of a tensor-parallel Llama-style decoder layer (examples/tp_decoder_layer.py) with
each all-reduce: NCCL, torch's symm_mem one-shot and two-shot, autosymm.

On every local GPU (one process each; or under torchrun), for decode (1, 8, 32, 128 sequences)
and prefill (2048, 8192 tokens), eager and ``torch.compile`` with inductor's CUDA graphs (the
autosymm backends with autosymm's all-reduce + RMSNorm pass: ``compile_step``). Every backend
runs the same weights on the same inputs; each output is compared with NCCL's of the same mode,
and compiled NCCL's with eager NCCL's (bit-equal, or the relative L2 error, which must stay
within the dtype's tolerance: summation order and fusions only).
Step time: median of CUDA-event-timed repeats after warm-up, MAX over ranks (compile time is
spent in the warm-up). Prints a table and writes markdown to ``--out`` (and CSV next to it).

    python3 scripts/bench_tp_layer.py --out out/tp_layer.md          # 2x H200: about 3-4 minutes
    python3 scripts/bench_tp_layer.py --tiny --out /tmp/tp.md         # CPU, gloo, tiny layer: seconds

NVLink multicast stays off (TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NCCL_NVLS_ENABLE=0,
NVSHMEM_DISABLE_NVLS=1 are forced in every worker). Exit status 1 when an output disagrees.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from autosymm.settings import MULTICAST_OFF_ENV  # noqa: E402
from autosymm.tuning.workers import free_port, under_torchrun  # noqa: E402
from tp_decoder_layer import (BACKENDS, LLAMA_70B, TINY, ShardWeights, TPDecoderLayer, compile_step,  # noqa: E402
                              make_all_reduce)

MODES = ("eager", "compiled")
#: Relative L2 error allowed against the reference output where not bit-equal: summation order
#: (and inductor's fusions) only; a wrong all-reduce is off by O(1).
TOLERANCE = {torch.bfloat16: 2e-2, torch.float32: 1e-4}


@dataclass
class Result:
    """One (phase, tokens, mode, backend): step time (us, MAX over ranks) and agreement with the
    reference (NCCL of the same mode; for NCCL compiled, NCCL eager)."""

    phase: str
    n_tokens: int
    mode: str
    backend: str
    step_us: float
    bit_equal: bool  # on every rank
    rel_err: float  # worst over ranks
    ok: bool = True

    def describe(self) -> str:
        agree = "bit-equal" if self.bit_equal else f"rel err {self.rel_err:.1e}" + ("" if self.ok else " MISMATCH")
        return (f"{self.phase:7s} {self.n_tokens:5d} tok  {self.mode:8s} {self.backend:15s} "
                f"{self.step_us:10.1f} us  {agree}")


def _ints(text: str) -> list[int]:
    """'1,8,32' -> [1, 8, 32]; 'none' -> []."""
    return [] if text == "none" else [int(v) for v in text.split(",") if v]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="markdown report (CSV next to it, same stem)")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny layer, fp32, 2 gloo ranks, eager")
    p.add_argument("--nproc", type=int, default=None, help="ranks (default: all local GPUs; 2 with --tiny)")
    p.add_argument("--decode", type=_ints, default=None, help="decode batch sizes, or none (default 1,8,32,128)")
    p.add_argument("--prefill", type=_ints, default=None, help="prefill lengths, or none (default 2048,8192)")
    p.add_argument("--modes", default=None, help="eager,compiled (default both; eager with --tiny)")
    p.add_argument("--backends", default=",".join(BACKENDS), help=f"subset of {','.join(BACKENDS)}")
    p.add_argument("--warmup", type=int, default=None, help="steps before timing (default 5; 1 with --tiny)")
    p.add_argument("--repeats", type=int, default=None, help="timed steps (default 30; 3 with --tiny)")
    p.add_argument("--static-shapes", action="store_true", help="compile per size (default: dynamic token dim)")
    args = p.parse_args(argv)
    if args.decode is None:
        args.decode = [1, 2] if args.tiny else [1, 8, 32, 128]
    if args.prefill is None:
        args.prefill = [8] if args.tiny else [2048, 8192]
    if not args.decode + args.prefill:
        p.error("nothing to run: --decode and --prefill are both none")
    args.modes = (args.modes or ("eager" if args.tiny else ",".join(MODES))).split(",")
    args.backends = args.backends.split(",")
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 5)
    args.repeats = args.repeats if args.repeats is not None else (3 if args.tiny else 30)
    for value, allowed, what in ((args.modes, MODES, "--modes"), (args.backends, BACKENDS, "--backends")):
        if set(value) - set(allowed):
            p.error(f"{what} {sorted(set(value) - set(allowed))} not in {allowed}")
    return args


def _timed_steps(fn, x, args, compiled: bool, cuda: bool):
    """(output of the last step, median step time in us)."""
    def step():
        if compiled:
            torch.compiler.cudagraph_mark_step_begin()
        return fn(x)

    for _ in range(args.warmup):
        step()
    times = []
    if cuda:
        torch.cuda.synchronize()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(args.repeats)]
        for start, end in events:
            start.record()
            y = step()
            end.record()
        torch.cuda.synchronize()
        times = [start.elapsed_time(end) * 1e3 for start, end in events]
    else:
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            y = step()
            times.append((time.perf_counter() - t0) * 1e6)
    return y.clone(), sorted(times)[len(times) // 2]


def _agreement(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(1 if not bit-equal else 0, relative L2 error) of ``out`` against ``ref``."""
    if torch.equal(out, ref):
        return 0.0, 0.0
    diff = (out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)
    return 1.0, float(diff)


def _layers(args, rank, world_size, device):
    cfg = replace(TINY if args.tiny else LLAMA_70B, max_batch=max(args.decode, default=1))
    dtype = torch.float32 if args.tiny else torch.bfloat16
    weights = ShardWeights(cfg, rank, world_size, dtype, device, seed=0)
    max_bytes = max(args.decode + args.prefill) * cfg.hidden * torch.finfo(dtype).bits // 8
    layers, skipped = {}, {}
    for backend in args.backends:
        if backend.startswith("torch_") and device.type != "cuda":
            skipped[backend] = "torch symm_mem needs CUDA"
            continue
        layers[backend] = TPDecoderLayer(weights, make_all_reduce(backend, None, max_bytes, dtype))
    return cfg, dtype, layers, skipped


def _compiled(layer, static: bool, fuse: bool):
    """The layer's phases under torch.compile with inductor's CUDA graphs; ``fuse``: with autosymm's
    all-reduce + RMSNorm pass (the autosymm backends only: NCCL's column stays NCCL's)."""
    import torch._dynamo

    for name in ("cache_size_limit", "recompile_limit"):  # one entry per (backend, phase, shape class)
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    return {phase: compile_step(getattr(layer, phase), fuse=fuse, dynamic=False if static else None)
            for phase in ("decode", "prefill")}


def run(rank: int, world_size: int, args) -> tuple[list[Result], dict, dict]:
    """Every (mode, backend, phase, tokens) on this rank: (results MAX over ranks, skipped
    backends and why, facts for the report header)."""
    cuda = not args.tiny
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    cfg, dtype, layers, skipped = _layers(args, rank, world_size, device)
    gen = torch.Generator(device=device).manual_seed(1234)  # same inputs on every rank (replicated activations)
    cases = [("decode", n) for n in args.decode] + [("prefill", n) for n in args.prefill]
    inputs = {case: torch.randn(case[1], cfg.hidden, generator=gen, device=device).to(dtype) for case in cases}
    refs, results, begin = {}, [], time.monotonic()
    for mode in args.modes:
        for backend, layer in layers.items():
            fns = _compiled(layer, args.static_shapes, backend.startswith("autosymm")) if mode == "compiled" else {
                "decode": layer.decode, "prefill": layer.prefill}
            for phase, n_tokens in cases:
                x = inputs[(phase, n_tokens)]
                if mode == "compiled" and not args.static_shapes:
                    torch._dynamo.maybe_mark_dynamic(x, 0)
                dist.barrier()
                with torch.no_grad():
                    out, median_us = _timed_steps(fns[phase], x, args, mode == "compiled", cuda)
                ref = refs.get((phase, n_tokens, mode))
                if ref is None:  # the first backend of a mode (NCCL) is its reference; it meets eager's
                    refs[(phase, n_tokens, mode)] = out
                    ref = refs.get((phase, n_tokens, "eager"), out)
                worst = torch.tensor([median_us, *_agreement(out, ref)], dtype=torch.float64, device=device)
                dist.all_reduce(worst, op=dist.ReduceOp.MAX)
                result = Result(phase, n_tokens, mode, backend, worst[0].item(), not worst[1].item(), worst[2].item())
                result.ok = result.bit_equal or result.rel_err <= TOLERANCE[dtype]
                results.append(result)
                if rank == 0:
                    print(f"[{time.monotonic() - begin:6.1f} s] {result.describe()}", flush=True)
    facts = {"device": _device_name(device), "world size": world_size, "dtype": str(dtype).removeprefix("torch."),
             "layer": cfg, "torch": torch.__version__, "warm-up / repeats": f"{args.warmup} / {args.repeats}"}
    return results, skipped, facts


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _init(rank: int, world_size: int, tiny: bool) -> None:
    if tiny:
        torch.set_num_threads(1)  # two ranks on a small CPU: no oversubscription
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        # a rank that fails leaves the others in a collective: time out instead of hanging
        dist.init_process_group("nccl", rank=rank, world_size=world_size, timeout=timedelta(minutes=5),
                                device_id=torch.device("cuda", torch.cuda.current_device()))


def _worker(rank: int, world_size: int, port: int, args, results) -> None:
    os.environ.update(MULTICAST_OFF_ENV)  # a shared host: multicast stays off
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    try:
        _init(rank, world_size, args.tiny)
        value = run(rank, world_size, args)
        if rank == 0:
            results.put(("ok", value))
    except BaseException:
        results.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))
        raise
    finally:
        if dist.is_initialized():
            import autosymm

            autosymm.reset()
            dist.destroy_process_group()


def _cell(result: Result) -> str:
    mark = "" if result.bit_equal else (" ~" if result.ok else " MISMATCH")
    return f"{result.step_us:.1f}{mark}"


def _ratio(base, result) -> str:
    return f"{base.step_us / result.step_us:.2f}x" if base is not None and result is not None else "-"


def markdown(results: list[Result], skipped: dict, facts: dict) -> str:
    """The report: step time per backend (columns), per (phase, tokens, mode) (rows)."""
    backends = list(dict.fromkeys(r.backend for r in results))
    by_key = {(r.phase, r.n_tokens, r.mode, r.backend): r for r in results}
    lines = ["# Tensor-parallel decoder layer: step time per all-reduce", ""]
    lines += [f"- {name}: {value}" for name, value in facts.items()]
    lines += [f"- skipped {name}: {why}" for name, why in skipped.items()]
    lines += ["- step time: median of CUDA-event-timed steps after warm-up, MAX over ranks, in us; "
              "compiled = torch.compile with inductor's CUDA graphs (the autosymm backends with autosymm's "
              "all-reduce + RMSNorm pass)",
              "- agreement with NCCL's output of the same mode (NCCL compiled: with NCCL eager): plain = "
              "bit-equal, ~ = within the dtype's tolerance (relative L2 error in the CSV), MISMATCH = wrong", ""]
    # On the CPU every backend is the same gloo call (autosymm's fallback is NCCL's stand-in):
    # the times measure noise, not a speed-up.
    ratios = "autosymm" in backends and facts.get("device") != "cpu"
    if facts.get("device") == "cpu":
        lines += ["- a CPU run (gloo): every backend is the same gloo call, so there is nothing to measure "
                  "here and no speed-up is reported; the run checks that the outputs agree", ""]
    head = ["phase", "tokens", "mode"] + backends
    if ratios:
        head += ["autosymm vs NCCL", "autosymm vs best other"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for phase, n_tokens, mode in dict.fromkeys((r.phase, r.n_tokens, r.mode) for r in results):
        row = {b: by_key.get((phase, n_tokens, mode, b)) for b in backends}
        cells = [phase, str(n_tokens), mode] + [_cell(row[b]) if row[b] else "-" for b in backends]
        if ratios:
            others = [row[b] for b in backends if b != "autosymm" and row[b] is not None]
            best = min(others, key=lambda r: r.step_us) if others else None
            cells += [_ratio(row.get("nccl"), row["autosymm"]), _ratio(best, row["autosymm"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_report(out: Path, results: list[Result], skipped: dict, facts: dict) -> int:
    """Print and write the markdown (``out``) and CSV (``out`` with .csv); 1 if any output disagrees."""
    text = markdown(results, skipped, facts)
    print(text)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(results[0])))
        writer.writeheader()
        writer.writerows(asdict(r) for r in results)
    bad = [r.describe() for r in results if not r.ok]
    if bad:
        print("outputs disagree with the reference:\n  " + "\n  ".join(bad), file=sys.stderr)
    return 1 if bad else 0


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.update(MULTICAST_OFF_ENV)  # a shared host: multicast stays off
    if under_torchrun():
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        _init(rank, world_size, args.tiny)
        try:
            value = run(rank, world_size, args)
        finally:
            import autosymm

            autosymm.reset()
            dist.destroy_process_group()
        return write_report(args.out, *value) if rank == 0 else 0
    import torch.multiprocessing as mp

    nproc = args.nproc or (2 if args.tiny else torch.cuda.device_count())
    if nproc < 2 and not args.tiny:
        print(f"bench_tp_layer needs at least 2 GPUs, found {nproc}", file=sys.stderr)
        return 2
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(nproc, free_port(), args, results), nprocs=nproc, join=True,
                       start_method="spawn")
    status, value = results.get()
    if status != "ok":
        print(value, file=sys.stderr)
        return 1
    return write_report(args.out, *value)


if __name__ == "__main__":
    sys.exit(main())
