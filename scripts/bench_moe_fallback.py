"""MoE conversions at real scale, one run: the measured peer-write bandwidth, then per (shape,
tokens per rank, direction) autosymm's NCCL path (backend nccl_all_to_all), the plain path a user
writes without autosymm (autosymm.bench.moe_plain: index_select + one ``all_to_all_single``
with device-computed split sizes; its rows in arrival order) and what ``autosymm.convert_*``
runs once ``autosymm.init(moe=[MoEPlan(...)])`` declared the calls (the Triton conversion),
eager and replayed from a CUDA graph.

Peer write: a Triton kernel streams a local buffer (256 MiB and 64 MiB) into the next rank's
symmetric buffer, every rank at once (as the conversions run), best of a few grid sizes; and
``peer_view.copy_(local)`` (torch's copy) as a second number. Median of repeats (CUDA events),
MAX over ranks, GB/s per direction. ``% peer`` is against the best of these numbers.

Every path's output is checked first against an expectation built from NCCL all_gathers of
every rank's inputs (autosymm.tuning.ops.moe.moe_reference_for_rank; the rows each path
writes, bit for bit), the graph one after a replay into a zeroed buffer. Then each is timed
(CUDA events, median of samples of back-to-back calls, MAX over ranks); graph: a graph of
``GRAPH_CALLS`` calls replayed, per-call time. The NCCL paths copy the split sizes to the host:
they run eagerly only. ``remote MB``: bytes of rows this rank sends to other ranks (MAX over
ranks); GB/s = remote MB / median time; ``plain/autosymm``: plain path time / autosymm's (eager
plain over graph autosymm in the graph column).

    source scripts/_node_env.sh && python3 scripts/bench_moe_fallback.py --csv $OUT/moe.csv --md $OUT/moe.md
    python3 scripts/bench_moe_fallback.py --shapes d5120_e160_k6 --tokens 3000
    python3 scripts/bench_moe_fallback.py --cpu --nproc 2 --shapes d64_e8_k2 --tokens 16   # gloo smoke run
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
from typing import Optional

import torch
import torch.distributed as dist
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SHAPES = "deepseek-v3,qwen3-30b-a3b,gpt-oss-120b,mixtral-8x7b,d5120_e160_k6,d4096_e128_k8"
TOKENS = "512,1024,3000"
PATHS = ("autosymm_nccl", "plain_nccl", "autosymm", "autosymm_graph")
GRAPH_CALLS = 10
#: Bytes sent per timed sample: sets the back-to-back calls per sample (2..20).
SAMPLE_BYTES = 256 << 20
PEER_WRITE_BYTES = (256 << 20, 64 << 20)
PEER_WRITE_BLOCK = 4096  # int32 words per program step (16 KiB)
PEER_WRITE_GRIDS = (1, 2, 4)  # programs per SM tried; the best counts
_KEEP_ALIVE: list = []  # the peer-write symmetric buffer: never freed while peers map it


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=SHAPES, help="model names of autosymm.MODEL_SHAPES or d{D}_e{E}_k{K} keys")
    parser.add_argument("--tokens", default=TOKENS, help="tokens per rank, comma-separated")
    parser.add_argument("--repeats", type=int, default=15, help="timed samples per path")
    parser.add_argument("--nproc", type=int, default=None)
    parser.add_argument("--csv", default=None)
    parser.add_argument("--md", default=None, help="write the report as a markdown table to this file")
    parser.add_argument("--cpu", action="store_true", help="gloo on the CPU (a smoke run of this script)")
    args = parser.parse_args(argv)
    shapes = args.shapes.split(",")
    tokens = [int(t) for t in args.tokens.split(",")]
    if args.cpu:
        result = _spawn_gloo(args.nproc or 2, shapes, tokens, args.repeats)
    else:
        from autosymm.tuning.workers import run_workers

        result = run_workers(_bench, args.nproc, shapes, tokens, args.repeats)
    rows = finish(result["rows"], result["peer"], measured=result["measured"])
    text = markdown(rows, result["peer"], result["note"])
    print(text)
    if args.md:
        with open(args.md, "w") as f:
            f.write(text)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


def _bench(rank, world_size, shapes, tokens, repeats) -> dict:
    """Worker: peer write, then every case; rank 0's return value is the result."""
    import autosymm

    cuda = torch.cuda.is_available() and dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    peer = peer_write(device, repeats) if cuda else {}
    note = "" if cuda else ("gloo on the CPU: nothing to measure, so no times and no ratios (a smoke run: every "
                            "path ran and was checked); no peer write, no CUDA graphs")
    autosymm.init(moe=[autosymm.MoEPlan(s, max(tokens)) for s in shapes])
    rows = []
    for shape_key in shapes:
        for n_tokens in tokens:
            case = _Case(autosymm.MoEPlan(shape_key, n_tokens).shape, n_tokens, rank, world_size, device)
            for op in ("dp_to_ep", "ep_to_dp"):
                rows.append(case.measure(op, repeats, graphs=cuda))
            del case
    return {"peer": peer, "rows": rows, "note": note, "measured": cuda}


# ------------------------------------------------------------------------------------ peer write


@triton.jit
def _peer_write_kernel(dst_ptrs, src_ptr, n_words, BLOCK: tl.constexpr):
    """src[0:n_words] -> the int32 buffer at address dst_ptrs[0] (n_words % BLOCK == 0)."""
    dst = tl.multiple_of(tl.load(dst_ptrs).to(tl.pointer_type(tl.int32)), 16)  # 256-byte aligned buffer
    offs = tl.arange(0, BLOCK)
    for start in range(tl.program_id(0) * BLOCK, n_words, tl.num_programs(0) * BLOCK):
        tl.store(dst + start + offs, tl.load(src_ptr + start + offs))


def launch_peer_write(dst_ptrs: torch.Tensor, src: torch.Tensor, programs: int) -> None:
    """Copy int32 ``src`` to the address in int64 ``dst_ptrs[0]`` with ``programs`` programs."""
    if src.dtype != torch.int32 or src.numel() % PEER_WRITE_BLOCK:
        raise ValueError(f"peer write: src {src.dtype} [{src.numel()}] must be int32, a multiple of "
                         f"{PEER_WRITE_BLOCK} words")
    grid = (max(1, min(programs, src.numel() // PEER_WRITE_BLOCK)),)
    _peer_write_kernel[grid](dst_ptrs, src, src.numel(), BLOCK=PEER_WRITE_BLOCK, num_warps=8)


def peer_write(device: torch.device, repeats: int) -> dict[str, float]:
    """{'triton 256MiB': GB/s, 'copy_ 256MiB': GB/s, ...}: this rank writing into the next
    rank's symmetric buffer while every rank does the same, MAX time over ranks (collective)."""
    import torch.distributed._symmetric_memory as symm_mem

    from autosymm.workspace.symm import peer_buffers
    from autosymm.tuning.timing import max_over_ranks, time_eager

    group = dist.group.WORLD
    buffer = symm_mem.empty((max(PEER_WRITE_BYTES),), dtype=torch.uint8, device=device)
    peers, handle, _ = peer_buffers(buffer, group)
    _KEEP_ALIVE.append((buffer, handle))
    target = peers[(handle.rank + 1) % handle.world_size]
    local = torch.randint(0, 255, (max(PEER_WRITE_BYTES),), dtype=torch.uint8, device=device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    out = {}
    for nbytes in PEER_WRITE_BYTES:
        dst, src = target[:nbytes], local[:nbytes]
        dst_ptrs = torch.tensor([dst.data_ptr()], dtype=torch.int64, device=device)
        label = f"{nbytes >> 20}MiB"
        best = min(max_over_ranks(time_eager(launch_peer_write, [(dst_ptrs, src.view(torch.int32), sms * per_sm)],
                                             warmup=3, repeats=repeats, group=group), group).median_us
                   for per_sm in PEER_WRITE_GRIDS)
        out[f"triton {label}"] = gbps(nbytes / 1e6, best)
        copy = max_over_ranks(time_eager(dst.copy_, [(src,)], warmup=3, repeats=repeats, group=group), group)
        out[f"copy_ {label}"] = gbps(nbytes / 1e6, copy.median_us)
    torch.cuda.synchronize(device)
    dist.barrier(group=group)  # every rank's writes are done before the cases start
    return out


# ------------------------------------------------------------------------------------ cases


class _Case:
    """Inputs of one (shape, tokens per rank) on this rank: random placement and routing, the
    same on every rank; random rows per rank."""

    def __init__(self, shape, n_tokens, rank, world_size, device) -> None:
        from autosymm.routing import make_expt_assignment, make_expt_dict_random, random_expt_indx, route

        self.shape, self.n_tokens, self.rank, self.world_size, self.device = shape, n_tokens, rank, world_size, device
        k, n_experts = shape.n_expts_act, shape.n_expts_tot
        self.assignment = make_expt_assignment(world_size, n_experts,
                                               make_expt_dict_random(world_size, n_experts, seed=n_tokens), device)
        self.expt_indx = random_expt_indx(world_size * n_tokens, n_experts, k, seed=n_tokens + 1, device=device)
        self.gate, self.topk = route(self.expt_indx)
        gen = torch.Generator(device=device).manual_seed(1000 * rank + n_tokens)
        self.src = torch.randn(n_tokens, shape.d_model, generator=gen, device=device).bfloat16()
        self.ep_src = torch.randn(world_size * n_tokens * k, shape.d_model, generator=gen, device=device).bfloat16()
        self.owner = self.assignment.expt_owner.long()[self.expt_indx.reshape(-1).long()]  # per pair (no drops)

    def args(self, op: str) -> tuple:
        if op == "dp_to_ep":
            return self.src, self.assignment, self.expt_indx, self.gate
        return self.ep_src, self.assignment, self.expt_indx, self.topk

    def problem(self, op: str):
        from autosymm.problem import Problem

        return Problem.moe(op, self.shape, self.n_tokens, "bf16", self.world_size)

    def measure(self, op: str, repeats: int, graphs: bool) -> dict:
        """One report row of ``op``: every path checked, then timed."""
        from autosymm.backends import RunContext, get_backend
        from autosymm.bench.moe_plain import plain

        args = self.args(op)
        fns = {"autosymm_nccl": get_backend("nccl_all_to_all").prepare(self.problem(op), None,
                                                                      RunContext(group=dist.group.WORLD)),
               "plain_nccl": plain(op, self.rank, self.world_size), "autosymm": _public(op)}
        eager, graph = self._decision(op, "eager"), self._decision(op, "graph") if graphs else None
        graph_why_not = _graph_why_not(graph, graphs)
        self._check(op, fns, graph_why_not is None)
        row = {"shape": self.shape.key, "model": _model(self.shape), "tokens": self.n_tokens, "op": op,
               "world_size": self.world_size, "remote_MB": self._remote_mb(op), "autosymm_backend": eager.backend,
               "autosymm_graph_backend": graph.backend if graph is not None else "", "note": graph_why_not or ""}
        calls = _calls(self.n_tokens * self.shape.n_expts_act * self.shape.d_model * 2) if graphs else 1
        for name, fn in fns.items():
            row[f"{name}_us"] = _time(fn, args, repeats, calls, graph=False)
        row["autosymm_graph_us"] = _time(fns["autosymm"], args, repeats, GRAPH_CALLS, graph=True) \
            if graph_why_not is None else None
        return row

    def _decision(self, op: str, mode: str):
        import autosymm

        return autosymm.explain(problem=self.problem(op), mode=mode)

    def _check(self, op: str, fns: dict, graph: bool) -> None:
        """Every path's rows against the all_gathered expectation (AssertionError naming the path)."""
        from autosymm.bench.moe_plain import plain_rows
        from autosymm.tuning.ops.moe import moe_reference_for_rank

        args = self.args(op)
        gathered = [torch.empty_like(args[0]) for _ in range(self.world_size)]
        dist.all_gather(gathered, args[0])
        expected, mask = moe_reference_for_rank(op, torch.stack(gathered), self.owner, args[3], self.rank)
        del gathered
        rows = plain_rows(op, self.assignment, self.expt_indx, args[3], self.rank, self.world_size)
        checks = [(name, lambda fn=fn: fn(*args)) for name, fn in fns.items()]
        if graph:  # last: it zeroes the workspace view the eager autosymm call returned
            checks.append(("autosymm_graph", lambda: _graph_output(fns["autosymm"], args)))
        for name, run in checks:
            got = run()
            ok = torch.equal(got, expected[rows]) if name == "plain_nccl" else torch.equal(got[mask], expected[mask])
            if not ok:
                raise AssertionError(f"rank {self.rank}: {name} {op} {self.shape.key} {self.n_tokens} tok: wrong rows")
        dist.barrier()

    def _remote_mb(self, op: str) -> float:
        """MB of rows this rank sends to other ranks, MAX over ranks."""
        n_pairs_local = self.n_tokens * self.shape.n_expts_act
        if op == "dp_to_ep":
            mine = self.owner[self.rank * n_pairs_local:(self.rank + 1) * n_pairs_local]
            remote = int((mine != self.rank).sum())
        else:
            home = self.topk.long() // n_pairs_local
            remote = int(((self.owner[self.topk.long()] == self.rank) & (home != self.rank)).sum())
        t = torch.tensor([remote * self.shape.d_model * 2 / 1e6], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return round(float(t), 4)


def _graph_why_not(decision, graphs: bool) -> Optional[str]:
    """None when autosymm's graph-mode choice can be captured here, else why not (the same on
    every rank: the decision is)."""
    from autosymm.backends import get_backend

    if not graphs:
        return "no CUDA graphs here"
    if not get_backend(decision.backend).needs.graph_capturable:
        return f"graph: {decision.backend} is not CUDA-graph capturable"
    return None


def _graph_output(fn, args) -> torch.Tensor:
    """The output of one graph replay of ``fn(*args)`` into a zeroed output buffer (every
    rank's zeroing finishes before any rank's replay writes)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(*args)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*args)
    out.zero_()
    torch.cuda.synchronize()
    dist.barrier()
    graph.replay()
    torch.cuda.synchronize()
    return out


def _time(fn, args, repeats: int, calls: int, graph: bool) -> float:
    """Median us per call, MAX over ranks."""
    from autosymm.tuning.timing import max_over_ranks, time_eager, time_graph

    group = dist.group.WORLD
    if graph:
        timing = time_graph(fn, [args], warmup=3, repeats=repeats, calls_per_graph=calls, group=group)
    else:
        timing = time_eager(fn, [args], warmup=calls, repeats=repeats, calls_per_sample=calls, group=group)
    return round(max_over_ranks(timing, group).median_us, 1)


def _calls(nbytes: int) -> int:
    """Back-to-back calls per timed sample of a call sending ``nbytes``."""
    return max(2, min(20, SAMPLE_BYTES // max(1, nbytes)))


def _public(op: str):
    import autosymm

    return autosymm.convert_dp_to_ep if op == "dp_to_ep" else autosymm.convert_ep_to_dp


def _model(shape) -> str:
    from autosymm.problem import MODEL_SHAPES

    return next((name for name, s in MODEL_SHAPES.items() if s == shape), "")


# ------------------------------------------------------------------------------------ report


def gbps(mb: float, us: Optional[float]) -> Optional[float]:
    """GB/s of ``mb`` megabytes (1e6 bytes) in ``us`` microseconds (MB/us = TB/s)."""
    return mb / us * 1e3 if us else None


def pct(value: Optional[float], reference: Optional[float]) -> Optional[float]:
    """``value`` as a percentage of ``reference`` (None when either is missing or zero)."""
    return 100.0 * value / reference if value and reference else None


def ratio(numerator: Optional[float], denominator: Optional[float]) -> Optional[float]:
    return numerator / denominator if numerator and denominator else None


def finish(rows: list[dict], peer: dict[str, float], measured: bool = True) -> list[dict]:
    """The measured rows with GB/s, % of the best peer write and plain/autosymm added; not
    ``measured`` (a CPU smoke run): no times either (gloo's and Python's: they compare nothing)."""
    best = max(peer.values(), default=None)
    out = []
    for r in rows:
        if not measured:
            r = {**r, **{k: None for k in ("autosymm_us", "plain_nccl_us", "autosymm_nccl_us", "autosymm_graph_us")}}
        eager, graph = gbps(r["remote_MB"], r["autosymm_us"]), gbps(r["remote_MB"], r["autosymm_graph_us"])
        out.append({**r, "autosymm_GBps": _round(eager), "autosymm_graph_GBps": _round(graph),
                    "autosymm_pct_peer": _round(pct(eager, best)), "autosymm_graph_pct_peer": _round(pct(graph, best)),
                    "plain_over_autosymm": _round(ratio(r["plain_nccl_us"], r["autosymm_us"]), 3),
                    "plain_over_autosymm_graph": _round(ratio(r["plain_nccl_us"], r["autosymm_graph_us"]), 3),
                    "plain_over_autosymm_nccl": _round(ratio(r["plain_nccl_us"], r["autosymm_nccl_us"]), 3),
                    "peer_write_GBps": _round(best)})
    return out


def _round(value: Optional[float], digits: int = 1) -> Optional[float]:
    return None if value is None else round(value, digits)


def _cell(value, fmt: str = "{:.1f}") -> str:
    return "-" if value is None or value == "" else fmt.format(value)


COLUMNS = (("shape", "shape", "{}"), ("model", "model", "{}"), ("tok/rank", "tokens", "{}"), ("op", "op", "{}"),
           ("remote MB", "remote_MB", "{:.2f}"), ("autosymm NCCL us", "autosymm_nccl_us", "{:.1f}"),
           ("plain NCCL us", "plain_nccl_us", "{:.1f}"), ("autosymm eager us", "autosymm_us", "{:.1f}"),
           ("eager GB/s", "autosymm_GBps", "{:.0f}"), ("eager % peer", "autosymm_pct_peer", "{:.0f}%"),
           ("graph us", "autosymm_graph_us", "{:.1f}"), ("graph GB/s", "autosymm_graph_GBps", "{:.0f}"),
           ("graph % peer", "autosymm_graph_pct_peer", "{:.0f}%"), ("plain / eager", "plain_over_autosymm", "{:.2f}x"),
           ("plain / graph", "plain_over_autosymm_graph", "{:.2f}x"),
           ("plain / NCCL path", "plain_over_autosymm_nccl", "{:.2f}x"), ("backend eager", "autosymm_backend", "{}"),
           ("backend graph", "autosymm_graph_backend", "{}"))


def markdown(rows: list[dict], peer: dict[str, float], note: str = "") -> str:
    """The report: peer-write numbers, then one table row per (shape, tokens, op)."""
    world = rows[0]["world_size"] if rows else "?"
    lines = [f"## MoE conversions on {world} ranks (bf16; median us per call, MAX over ranks)", ""]
    if peer:
        lines.append("Peer write, per direction, every rank at once: "
                     + ", ".join(f"{name} {value:.1f} GB/s" for name, value in peer.items())
                     + f"; % peer = against the best, {max(peer.values()):.1f} GB/s.")
    if note:
        lines.append(f"Note: {note}.")
    lines += ["GB/s = remote MB (rows sent to other ranks, MAX over ranks) / time; plain / X = plain "
              "index_select + all_to_all_single time / X's (the plain path runs eagerly only).", "",
              "| " + " | ".join(c[0] for c in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        lines.append("| " + " | ".join(_cell(r.get(key), fmt) for _, key, fmt in COLUMNS) + " |")
    notes = sorted({r["note"] for r in rows if r.get("note")})
    lines += [""] + [f"- {n}" for n in notes] if notes else []
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------ gloo smoke run


def _gloo_worker(rank, world_size, port, shapes, tokens, repeats, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result = _bench(rank, world_size, shapes, tokens, repeats)
        if rank == 0:
            results.put(result)
    finally:
        import autosymm

        autosymm.reset()
        dist.destroy_process_group()


def _spawn_gloo(nproc, shapes, tokens, repeats) -> dict:
    import torch.multiprocessing as mp

    from autosymm.tuning.workers import free_port

    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.start_processes(_gloo_worker, args=(nproc, free_port(), shapes, tokens, repeats, results), nprocs=nproc,
                       join=True, start_method="spawn")
    return results.get()


if __name__ == "__main__":
    main()
