"""`autosymm bench`: autosymm through its dispatcher against NCCL and torch's built-ins.

Runs in every worker (autosymm.tuning.workers). For each size and mode, every implementation is first
checked against NCCL's result on random data, then timed the way the tuner times (timing.py:
warm-up, CUDA events or graph replay, median of repeats on rotating inputs, MAX over ranks).
Also measures the peer-read bandwidth once, for the link floor of the report.
"""

from __future__ import annotations

import csv
import os
from dataclasses import asdict, dataclass, field, replace
from typing import Optional

import torch
import torch.distributed as dist

from ..problem import MoEShape, Problem, format_bytes

ALL_REDUCE_IMPLS = ("autosymm", "nccl", "torch_one_shot", "torch_two_shot")


@dataclass
class BenchOptions:
    sizes: list[int]
    modes: list[str]
    shapes: dict[str, MoEShape]
    tokens: list[int]
    ops: list[str]
    dtype: str = "bf16"


@dataclass
class BenchRow:
    op: str
    label: str  # size or shape/tokens
    nbytes: int  # all-reduce bytes, or bytes each rank sends for MoE
    mode: str
    impl: str
    us: Optional[float]  # None: not applicable / failed validation
    backend: str = ""  # what the dispatcher chose (autosymm rows)
    note: str = ""


@dataclass
class BenchResult:
    hardware: dict
    world_size: int
    peer_read_gbps: float
    peer_write_gbps: float
    rows: list[BenchRow] = field(default_factory=list)


def _measure(fn, inputs, problem: Problem, mode: str, group) -> float:
    """Median us, MAX over ranks, timed exactly as the tuner times ``problem`` (sweep.timing_plan)."""
    from .sweep import timing_plan
    from .timing import max_over_ranks, time_eager, time_graph

    plan = timing_plan(problem, mode)
    if mode == "graph":
        timing = time_graph(fn, inputs, warmup=plan.warmup, repeats=plan.repeats,
                            calls_per_graph=plan.calls_per_graph, group=group)
    else:
        timing = time_eager(fn, inputs, warmup=plan.warmup, repeats=plan.repeats,
                            calls_per_sample=plan.calls_per_sample, group=group)
    return max_over_ranks(timing, group).median_us


def peer_bandwidth(workspace, group, nbytes: int = 256 * 1024**2) -> tuple[float, float]:
    """(read, write) GB/s of this GPU to its next peer through the workspace, MAX-time over ranks."""
    from .timing import max_over_ranks, time_eager

    peer = (workspace.rank + 1) % workspace.world_size
    nbytes = min(nbytes, workspace.capacity("all_reduce"))
    numel = nbytes // 2
    remote = workspace.peer_view(peer, "all_reduce", (numel,), torch.bfloat16)
    local = torch.empty(numel, dtype=torch.bfloat16, device=workspace.device)
    read = max_over_ranks(time_eager(lambda: local.copy_(remote), [()], group=group), group).median_us
    write = max_over_ranks(time_eager(lambda: remote.copy_(local), [()], group=group), group).median_us
    return nbytes / read / 1e3, nbytes / write / 1e3


def _all_reduce_rows(options: BenchOptions, group, workspace) -> list[BenchRow]:
    import autosymm

    from ..backends import RunContext, get_backend
    from ..problem import DTYPES

    rows = []
    world_size = dist.get_world_size(group)
    dtype = DTYPES[options.dtype]
    ctx = RunContext(group=group, workspace=workspace)
    state = autosymm.api._state(group)
    caps, device = state.caps, state.device
    for nbytes in options.sizes:
        problem = Problem.all_reduce(nbytes, options.dtype, world_size)
        numel = problem.numel
        from .sweep import timing_plan

        gen = torch.Generator(device=device).manual_seed(1234 + dist.get_rank(group))
        n_inputs = timing_plan(problem, "eager").n_inputs  # rotating inputs, as the tuner uses
        inputs = [(torch.randn(numel, generator=gen, device=device, dtype=torch.float32).to(dtype),)
                  for _ in range(n_inputs)]
        pristine = inputs[0][0].clone()  # timing reduces the inputs in place: validate on a copy
        reference = pristine.clone()
        dist.all_reduce(reference, group=group)
        for impl in ALL_REDUCE_IMPLS:
            if impl == "autosymm":
                launch, backend = autosymm.all_reduce, ""
            else:
                why_not = get_backend(impl).why_not(problem, caps)
                if why_not is not None:
                    rows += [BenchRow("all_reduce", format_bytes(nbytes), nbytes, m, impl, None, note=why_not)
                             for m in options.modes]
                    continue
                launch, backend = get_backend(impl).prepare(problem, None, ctx), impl
            out = pristine.clone()
            launch(out)
            error = _relative_error(out, reference)
            ok = _agree(error < 2e-2, group, device)
            for mode in options.modes:
                if impl == "autosymm":
                    backend = autosymm.explain(out, group=group, mode=mode).backend
                us = _measure(launch, inputs, problem, mode, group) if ok else None
                rows.append(BenchRow("all_reduce", format_bytes(nbytes), nbytes, mode, impl, us, backend,
                                     "" if ok else f"wrong result (rel. error {error:.3g})"))
        del inputs, reference
    return rows


def _agree(ok: bool, group, device) -> bool:
    """True on every rank iff ``ok`` on every rank: measuring starts with a host barrier, so all
    ranks must make the same choice (or the ones that measure wait forever)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref64 = ref.double()
    diff = (out.double() - ref64).norm() / ref64.norm().clamp_min(1e-30)
    value = float(diff)
    return value if value == value else float("inf")  # NaN never passes


def _moe_rows(options: BenchOptions, group, workspace) -> list[BenchRow]:
    import autosymm

    from ..backends import RunContext, get_backend
    from ..routing import make_expt_assignment, make_expt_dict_uniform, route
    from ..problem import DTYPES

    rows = []
    world_size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    dtype = DTYPES[options.dtype]
    device = autosymm.api._state(group).device
    ctx = RunContext(group=group, workspace=workspace)
    for name, shape in options.shapes.items():
        assignment = make_expt_assignment(world_size, shape.n_expts_tot,
                                          make_expt_dict_uniform(world_size, shape.n_expts_tot), device)
        for tokens in options.tokens:
            gen = torch.Generator(device=device).manual_seed(99 + tokens)
            n_global = tokens * world_size
            scores = torch.rand(n_global, shape.n_expts_tot, generator=gen, device=device)
            expt_indx = scores.topk(shape.n_expts_act, dim=1).indices.to(torch.int32)
            gate_indx, topk_indx = route(expt_indx)
            src = torch.randn(tokens, shape.d_model, device=device, dtype=torch.float32).to(dtype)
            label = f"{name} {tokens} tok"
            nbytes = tokens * shape.n_expts_act * shape.d_model * src.element_size()
            for op in ("dp_to_ep", "ep_to_dp"):
                if op not in options.ops:
                    continue
                problem = Problem.moe(op, shape, tokens, options.dtype, world_size)
                if op == "dp_to_ep":
                    args = (src, assignment, expt_indx, gate_indx)
                    auto = autosymm.convert_dp_to_ep
                else:
                    ep_src = torch.randn(n_global * shape.n_expts_act, shape.d_model, device=device,
                                         dtype=torch.float32).to(dtype)
                    args = (ep_src, assignment, expt_indx, topk_indx)
                    auto = autosymm.convert_ep_to_dp
                nccl = get_backend("nccl_all_to_all").prepare(problem, None, ctx)
                expected = nccl(*args).clone()
                for impl, fn in (("autosymm", auto), ("nccl_all_to_all", nccl)):
                    got = fn(*args)
                    ok = _agree(_moe_equal(got, expected, op, expt_indx, assignment, rank, shape), group, device)
                    for mode in options.modes:
                        if impl == "nccl_all_to_all" and mode == "graph":
                            rows.append(BenchRow(op, label, nbytes, mode, impl, None, note="not capturable"))
                            continue
                        backend = impl
                        if impl == "autosymm":
                            backend = autosymm.api._state(group).decide(problem, mode).backend
                        us = _measure(fn, [args], problem, mode, group) if ok else None
                        rows.append(BenchRow(op, label, nbytes, mode, impl, us, backend, "" if ok else "wrong result"))
    return rows


def _moe_equal(got, expected, op, expt_indx, assignment, rank, shape) -> bool:
    """Compare only rows that the conversion defines (the rest of the buffer is don't-care)."""
    if op == "dp_to_ep":
        owner = assignment.expt_boolmask[rank][expt_indx.long().flatten()]
        from ..routing import route

        gate_indx, _ = route(expt_indx)
        rows = gate_indx.long().flatten()[owner]
        return torch.equal(got[rows], expected[rows])
    return torch.equal(got, expected)


def bench_job(rank: int, world_size: int, options: BenchOptions) -> Optional[BenchResult]:
    """Worker body of `autosymm bench`; rank 0 returns the result."""
    import autosymm

    from ..hardware import fingerprint
    from .session import TuneSession, TuneSettings, sweep_problems

    group = dist.group.WORLD
    # a workspace large enough for every measured call (as a user would size it), else the
    # largest MoE calls fall back to NCCL, which a CUDA graph cannot capture; autosymm.init finds it
    problems = sweep_problems(options.ops, options.sizes, [options.dtype], options.shapes, options.tokens, world_size)
    TuneSession.open(TuneSettings(), problems, group=group)
    autosymm.init(group)
    state = autosymm.api._state(group)
    workspace = state.workspace
    if state.device.type != "cuda":  # gloo (tests): no CUDA graphs
        options = replace(options, modes=[m for m in options.modes if m == "eager"])
    read_gbps, write_gbps = peer_bandwidth(workspace, group) if workspace is not None else (0.0, 0.0)
    result = BenchResult(fingerprint().as_dict(), world_size, read_gbps, write_gbps)
    if "all_reduce" in options.ops:
        result.rows += _all_reduce_rows(options, group, workspace)
    if any(op in options.ops for op in ("dp_to_ep", "ep_to_dp")):
        result.rows += _moe_rows(options, group, workspace)
    return result if rank == 0 else None


def moe_link_gbps(nbytes: int, us: float, world_size: int) -> float:
    """GB/s over NVLink of a MoE conversion moving ``nbytes`` of rows per rank in ``us``: with
    uniformly spread experts a fraction (W-1)/W of the rows goes to peers, the rest stays local."""
    return nbytes * (world_size - 1) / world_size / us / 1e3


def print_bench(result: BenchResult, console) -> None:
    from rich.table import Table

    console.print(f"{result.hardware.get('topology')}: peer read {result.peer_read_gbps:.1f} GB/s, "
                  f"peer write {result.peer_write_gbps:.1f} GB/s")
    for op in ("all_reduce", "dp_to_ep", "ep_to_dp"):
        rows = [r for r in result.rows if r.op == op]
        if not rows:
            continue
        impls = list(dict.fromkeys(r.impl for r in rows))
        table = Table(title=f"{op}: median us (MAX over ranks)")
        moe = op != "all_reduce"
        link = ["link GB/s", "% peer write"] if moe else []
        for column in ["shape/tokens" if moe else "size", "mode", *impls, "chosen", "autosymm/best other", *link]:
            table.add_column(column)
        for label, mode in dict.fromkeys((r.label, r.mode) for r in rows):
            cells = {r.impl: r for r in rows if r.label == label and r.mode == mode}
            others = [c.us for i, c in cells.items() if i != "autosymm" and c.us]
            auto = cells.get("autosymm")
            ratio = f"{auto.us / min(others):.3f}" if auto and auto.us and others else "-"
            extra = []
            if moe:
                gbps = moe_link_gbps(auto.nbytes, auto.us, result.world_size) if auto and auto.us else None
                extra = [f"{gbps:.1f}" if gbps else "-",
                         f"{gbps / result.peer_write_gbps:.0%}" if gbps and result.peer_write_gbps else "-"]
            table.add_row(label, mode, *[f"{cells[i].us:.2f}" if i in cells and cells[i].us else "-" for i in impls],
                          auto.backend if auto else "-", ratio, *extra)
        console.print(table)


def write_bench_csv(result: BenchResult, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(result.rows[0]).keys()) + ["world_size", "gpu"])
        writer.writeheader()
        for row in result.rows:
            writer.writerow({**asdict(row), "world_size": result.world_size, "gpu": result.hardware.get("gpu_name")})
