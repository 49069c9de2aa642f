"""`autosymm bench`: autosymm against NCCL and torch's symmetric-memory ops, each run the way its
users run it at its best (autosymm.bench.baselines), reported by autosymm.bench.report. Runs in
every worker (autosymm.tuning.workers; the environment as the caller set it, recorded). Per size
or MoE shape, and mode, every implementation's output is first compared with NCCL's on the same
random data (one wrong on any rank is reported as failed, not timed); each one that passed is
timed on rotating fresh inputs, every rank starting together: eager as back-to-back calls between
two CUDA events, graph as replays of a graph of those calls; the median over repeats, then the MAX
over ranks. Events are shared by many calls and torch's ops called directly on their buffers, so
the harness is not what is measured.

Design notes: docs/TUNING.md#bench-run
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.distributed as dist

import autosymm

from ..problem import DTYPES, MoEShape, Problem
from .baselines import (Setup, SymmetricPool, agree, bench_plan, build, check_output, measure, nccl_symm_why_not,
                        pool_bytes, torch_ops_why_not, zero_copy_why_not)
from .report import (ALL_REDUCE_IMPLS, COPY_OTHERS, MOE_OTHERS, NO_COPY_OTHERS, BenchOp, BenchResult, BenchRow,
                     all_reduce_table, benches, failures, losses, moe_link_gbps, moe_table, size_label, worst_ratios,
                     write_bench_csv)
from ..backends import RunContext, get_backend
from ..hardware import fingerprint, provenance
from .moe_plain import NOT_CAPTURABLE, PLAIN_IMPL, plain, plain_rows
from ..routing import make_expt_assignment, make_expt_dict_uniform, route
from ..spec import BYTES, TOKENS
from ..spec.moe import MOE_SHAPE
from ..tuning.ops import get as tuning_op
from ..tuning.ops.moe import DP_TO_EP, EP_TO_DP
from ..tuning.session import sweep_problems, workspace_bytes
from ..tuning.timing import comm_device, max_over_ranks, time_eager
from ..workspace.symm import get_workspace

__all__ = ["BenchOptions", "BenchResult", "BenchRow", "bench_job", "moe_link_gbps", "print_bench", "write_bench_csv"]


@dataclass
class BenchOptions:
    sizes: list[int]
    modes: list[str]
    shapes: dict[str, MoEShape]
    tokens: list[int]
    ops: list[str]
    dtype: str = "bf16"


def peer_bandwidth(workspace, group, nbytes: int = 256 * 1024**2) -> tuple[float, float]:
    """(read, write) GB/s of this GPU to its next peer through the workspace, MAX-time over ranks."""
    peer = (workspace.rank + 1) % workspace.world_size
    nbytes = min(nbytes, workspace.capacity("all_reduce"))
    numel = nbytes // 2
    remote = workspace.peer_view(peer, "all_reduce", (numel,), torch.bfloat16)
    local = torch.empty(numel, dtype=torch.bfloat16, device=workspace.device)
    read = max_over_ranks(time_eager(lambda: local.copy_(remote), [()], group=group), group).median_us
    write = max_over_ranks(time_eager(lambda: remote.copy_(local), [()], group=group), group).median_us
    return nbytes / read / 1e3, nbytes / write / 1e3


# ------------------------------------------------------------------------------------ all-reduce


def _why_not(name: str, setup: Setup, nbytes: int, count: int, world_size: int) -> Optional[str]:
    if name.startswith("torch_"):
        return torch_ops_why_not(setup, nbytes)
    if name == "autosymm_zero_copy":
        return zero_copy_why_not(setup, nbytes, count, world_size)
    if name.startswith("nccl_symm"):
        return nccl_symm_why_not(setup, nbytes, count, world_size, zero_copy=name == "nccl_symm")
    return None


def _time_impl(impl, pristine: torch.Tensor, reference: torch.Tensor, nbytes: int, modes: list[str],
               setup: Setup) -> list[BenchRow]:
    """Rows of one implementation at one size: its output on ``pristine`` checked against NCCL's
    ``reference`` on every rank, then (if right everywhere) one measurement per mode."""
    world_size = dist.get_world_size(setup.group)
    checked = impl.inputs[-1]  # the last rotating input: at an offset in a symmetric buffer
    checked[0].copy_(pristine)
    try:
        wrong = check_output(impl.launch(*checked), reference, world_size)
    except Exception as exc:  # host-side argument checks: the same shapes raise on every rank
        wrong = f"{type(exc).__name__}: {exc}"
    ok = agree(wrong is None, setup.group)
    gen = torch.Generator(device=setup.device).manual_seed(4321 + dist.get_rank(setup.group))
    rows = []
    for mode in modes:
        for args in impl.inputs:  # fresh random data (in-place sums double it every call)
            args[0].normal_(generator=gen)
        backend = impl.backend or autosymm.explain(checked[0], mode=mode).backend
        us = measure(impl.launch, impl.inputs, bench_plan(nbytes, mode), mode, setup.group, setup.device) if ok else None
        note = "" if ok else f"failed, not timed: {wrong or 'failed on another rank'}"
        rows.append(BenchRow("all_reduce", size_label(nbytes), nbytes, mode, impl.name, us, backend, note))
    return rows


def all_reduce_rows(options: BenchOptions, setup: Setup, caps) -> list[BenchRow]:
    """The all-reduce's rows at every size of ``options``."""
    return [row for nbytes in options.sizes for row in _all_reduce_size(nbytes, options.modes, setup)]


def _all_reduce_size(nbytes: int, modes: list[str], setup: Setup) -> list[BenchRow]:
    """Every implementation's rows at one size (NCCL's result on the same data is the reference)."""
    world_size = dist.get_world_size(setup.group)
    elem = torch.empty((), dtype=setup.dtype).element_size()
    label = size_label(nbytes)
    if nbytes % elem:
        return [BenchRow("all_reduce", label, nbytes, m, name, None, note=f"not a multiple of {elem} bytes")
                for name in ALL_REDUCE_IMPLS for m in modes]
    numel = nbytes // elem
    gen = torch.Generator(device=setup.device).manual_seed(1234 + dist.get_rank(setup.group))
    pristine = torch.randn(numel, generator=gen, device=setup.device, dtype=torch.float32).to(setup.dtype)
    reference = pristine.clone()
    dist.all_reduce(reference, group=setup.group)
    count = bench_plan(nbytes, "eager").n_inputs
    rows = []
    for name in ALL_REDUCE_IMPLS:
        why_not = _why_not(name, setup, nbytes, count, world_size)
        if why_not is not None:
            rows += [BenchRow("all_reduce", label, nbytes, m, name, None, note=why_not) for m in modes]
            continue
        try:
            rows += _time_impl(build(name, setup, numel, count), pristine, reference, nbytes, modes, setup)
        finally:
            if name in ("autosymm_zero_copy", "nccl_symm"):
                setup.workspace.reset_empty()  # the region's bottom is free for the next size
    return rows


# ------------------------------------------------------------------------------------ MoE


def _moe_equal(got, expected, to_experts: bool, expt_indx, assignment, rank) -> bool:
    """Compare only rows that the conversion defines (the rest of the buffer is don't-care)."""
    if to_experts:
        owner = assignment.expt_boolmask[rank][expt_indx.long().flatten()]
        gate_indx, _ = route(expt_indx)
        rows = gate_indx.long().flatten()[owner]
        return torch.equal(got[rows], expected[rows])
    return torch.equal(got, expected)


def _moe_op_rows(problem: Problem, args: tuple, label: str, modes: list[str], setup: Setup, caps) -> list[BenchRow]:
    """autosymm's, the NCCL all_to_all path's and the plain path's (autosymm.bench.moe_plain)
    rows for one MoE problem: every output checked against the NCCL path's (the reference; the
    plain path's rows in its arrival order), then timed in every mode it can run in."""
    rank, world_size = dist.get_rank(setup.group), dist.get_world_size(setup.group)
    nbytes = problem.nbytes * problem.shape.n_expts_act  # the rows each rank sends
    baseline = get_backend("nccl_all_to_all")
    nccl = baseline.prepare(problem, None, RunContext(group=setup.group, workspace=setup.workspace))
    record = problem.record
    auto = tuning_op(problem.op).autosymm_call()
    expected = nccl(*args).clone()
    expt_indx, assignment = args[2], args[1]
    plain_expected = expected[plain_rows(problem.op, assignment, expt_indx, args[3], rank, world_size)]
    rows = []
    for impl, fn in (("autosymm", auto), ("nccl", nccl), (PLAIN_IMPL, plain(problem.op, rank, world_size, setup.group))):
        got = fn(*args)
        right = torch.equal(got, plain_expected) if impl == PLAIN_IMPL else \
            _moe_equal(got, expected, record.to_experts, expt_indx, assignment, rank)
        ok = agree(right, setup.group)
        for mode in modes:
            why_not = baseline.why_not(problem, caps, mode) if impl == "nccl" else \
                NOT_CAPTURABLE if impl == PLAIN_IMPL and mode == "graph" else None
            backend = autosymm.api.state_of(None).decide(problem, mode).backend if impl == "autosymm" else \
                baseline.name if impl == "nccl" else "index_select + all_to_all_single"
            if why_not is not None:
                rows.append(BenchRow(problem.op, label, nbytes, mode, impl, None, backend, why_not))
                continue
            us = measure(fn, [args], bench_plan(nbytes, mode), mode, setup.group, setup.device) if ok else None
            rows.append(BenchRow(problem.op, label, nbytes, mode, impl, us, backend,
                                 "" if ok else "failed, not timed: output differs from the NCCL path's"))
    return rows


def _moe_args(op, shape: MoEShape, tokens: int, setup: Setup, assignment) -> tuple:
    """Random routing and rows for ``tokens`` tokens per rank: the arguments of ``op`` (a MoE
    conversion's tuning side)."""
    world_size = dist.get_world_size(setup.group)
    gen = torch.Generator(device=setup.device).manual_seed(99 + tokens)  # the same routing on every rank
    n_global = tokens * world_size
    scores = torch.rand(n_global, shape.n_expts_tot, generator=gen, device=setup.device)
    expt_indx = scores.topk(shape.n_expts_act, dim=1).indices.to(torch.int32)
    gate_indx, topk_indx = route(expt_indx)
    rows = op.record.src_rows(tokens, n_global * shape.n_expts_act)
    src = torch.randn(rows, shape.d_model, device=setup.device, dtype=torch.float32).to(setup.dtype)
    return (src, assignment, expt_indx, op.bench_indx(gate_indx, topk_indx))


def moe_rows(options: BenchOptions, setup: Setup, caps) -> list[BenchRow]:
    """The MoE conversions' rows (of those in ``options.ops``): per shape, token count and op."""
    world_size = dist.get_world_size(setup.group)
    rows = []
    for name, shape in options.shapes.items():
        assignment = make_expt_assignment(world_size, shape.n_expts_tot,
                                          make_expt_dict_uniform(world_size, shape.n_expts_tot), setup.device)
        for tokens in options.tokens:
            for op in (o for o in (DP_TO_EP, EP_TO_DP) if o.name in options.ops):
                problem = Problem.moe(op.name, shape, tokens, options.dtype, world_size)
                args = _moe_args(op, shape, tokens, setup, assignment)
                rows += _moe_op_rows(problem, args, f"{name} {tokens} tok", options.modes, setup, caps)
    return rows


# ------------------------------------------------------------------------------------ worker


def _setup(options: BenchOptions, world_size: int) -> tuple[Setup, object]:
    """Collective: the workspace sized for every measured call (zero-copy inputs and stages
    included, as a user would size it), autosymm initialised on the default group, torch's
    symmetric pool. Returns the Setup and autosymm's Capabilities."""
    group = dist.group.WORLD
    device = comm_device(group)
    if world_size > 1 and device.type == "cuda":
        problems = sweep_problems(options.ops, [options.dtype], world_size, _sweep_points(options))
        ar_bytes, moe_bytes = workspace_bytes(problems)
        ar_bytes = max(ar_bytes, _pool_bytes(options, world_size))
        get_workspace(group, device, all_reduce_bytes=ar_bytes, moe_bytes=moe_bytes)
    autosymm.init()  # the default group, as `autosymm.all_reduce(x)` finds it
    state = autosymm.api.state_of(None)
    pool = None
    if state.caps.torch_symm_ops and _pool_bytes(options, world_size):
        pool = SymmetricPool(_pool_bytes(options, world_size), device, group.group_name)
    setup = Setup(group, group.group_name, device, DTYPES[options.dtype], pool=pool, workspace=state.workspace)
    return setup, state.caps


def _sweep_points(options: BenchOptions) -> dict:
    """The sweep options' values (autosymm.spec.OpSpec.sweep_options) of what bench measures."""
    shapes, = MOE_SHAPE.sweep
    return {BYTES.sweep.flag: options.sizes, TOKENS.sweep.flag: options.tokens,
            shapes.flag: tuple(options.shapes.values())}


def bench_job(rank: int, world_size: int, options: BenchOptions) -> Optional[BenchResult]:
    """Worker body of `autosymm bench`; rank 0 returns the result."""
    setup, caps = _setup(options, world_size)
    if setup.device.type != "cuda":  # gloo (tests): no CUDA graphs
        options = replace(options, modes=[m for m in options.modes if m == "eager"])
    workspace = setup.workspace
    read_gbps, write_gbps = peer_bandwidth(workspace, setup.group) if workspace is not None else (0.0, 0.0)
    result = BenchResult(fingerprint().as_dict(), world_size, read_gbps, write_gbps,
                         comm_env=provenance()["comm_env"])
    # each op's bench function once (the MoE conversions share one), in registry order
    for rows_of in dict.fromkeys(bench.rows for spec, bench in benches().items() if spec.name in options.ops):
        result.rows += rows_of(options, setup, caps)
    return result if rank == 0 else None


def _pool_bytes(options: BenchOptions, world_size: int) -> int:
    """Bytes of torch's symmetric pool (and zero-copy inputs) the benched ops need (0: none)."""
    return max((bench.pool_bytes(options.sizes, world_size) for spec, bench in benches().items()
                if spec.name in options.ops), default=0)


#: How bench measures the all-reduce and the MoE conversions (their specs name them: OpSpec.bench).
ALL_REDUCE_BENCH = BenchOp(all_reduce_rows, lambda result, op: all_reduce_table(result), (NO_COPY_OTHERS, COPY_OTHERS),
                           pool_bytes)
MOE_BENCH = BenchOp(moe_rows, moe_table, (MOE_OTHERS, MOE_OTHERS))


def print_bench(result: BenchResult, console) -> None:
    """The tables of ``result``, then where autosymm loses and what was not timed."""
    console.print(f"{result.hardware.get('topology')}: peer read {result.peer_read_gbps:.1f} GB/s, "
                  f"peer write {result.peer_write_gbps:.1f} GB/s; {result.comm_env or 'comm env not recorded'}")
    for spec, bench in benches().items():  # registry order: each measured op's table
        table = bench.table(result, spec.name) if any(r.op == spec.name for r in result.rows) else None
        if table is not None:
            console.print(table)
    for line in worst_ratios(result.rows) + worst_ratios(result.rows, "autosymm_zero_copy"):
        console.print(line)
    lost = losses(result.rows)
    console.print(f"autosymm loses in {len(lost)} comparison(s)" + (":" if lost else "."))
    for line in lost:
        console.print(f"  {line}")
    for line in failures(result.rows):
        console.print(f"  not timed: {line}")

