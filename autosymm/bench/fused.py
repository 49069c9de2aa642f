"""`autosymm bench` of the fused all-reduce + residual add + RMSNorm (``--ops all_reduce_rmsnorm``):
autosymm's dispatcher against the composition through NCCL (backend ``nccl_fused``) and FlashInfer's
fused call as vLLM runs it (backend ``flashinfer_fused``, FlashInfer's own one-shot heuristic and
fp32 accumulation), under the rules of autosymm.bench.run: every output checked against the
NCCL composition's first, then timed eager and graph, MAX over ranks. Points: the op's default
hidden sizes (autosymm.spec.all_reduce_rmsnorm.HIDDEN) x ``--tokens`` per rank.

FlashInfer's result is its own arithmetic (not autosymm's fp32 rank-order sum): outputs are compared
within :data:`RTOL` / :data:`ATOL` of the NCCL composition's, not bit for bit.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from rich.table import Table

import autosymm

from ..spec import ALL_REDUCE_RMSNORM
from ..spec.all_reduce_rmsnorm import HIDDEN
from ..problem import DTYPE_NAMES, Problem
from .baselines import Setup, agree, bench_plan, measure
from .report import FUSED_OTHERS, BenchOp, BenchRow, cells, compare
from ..backends import RunContext, get_backend

FUSED_IMPLS = ("nccl_fused", "flashinfer_fused", "autosymm")
#: How far a fused output may be from the NCCL composition's (x's dtype: 16-bit sums round).
RTOL = ATOL = 2.0 ** -5
EPS = 1e-6


def _args(problem: Problem, setup: Setup, count: int) -> tuple[tuple, list[tuple]]:
    """(the checked call's arguments, ``count`` timing calls' arguments): x random per rank, the
    residual and weight the same on every rank."""
    rank = dist.get_rank(setup.group)
    shape, dev, dtype = (problem.n_tokens_local, problem.hidden), setup.device, setup.dtype
    mine = torch.Generator(device=dev).manual_seed(4321 + rank)
    same = torch.Generator(device=dev).manual_seed(1234)
    x = torch.randn(shape, generator=mine, device=dev).to(dtype)
    residual = torch.randn(shape, generator=same, device=dev).to(dtype)
    weight = torch.randn(problem.hidden, generator=same, device=dev).to(dtype)
    timing = [(x.clone(), residual.clone(), weight, EPS) for _ in range(count)]
    return (x, residual, weight, EPS), timing


def _launcher(name: str, problem: Problem, setup: Setup, caps, mode: str):
    """(launcher, backend that runs, why not or None) of implementation ``name`` in ``mode``."""
    if name == "autosymm":
        decision = autosymm.api.state_of(None).decide(problem, mode)
        return (lambda x, r, w, eps: autosymm.all_reduce_rmsnorm(x, r, w, eps)), decision.backend, None
    backend = get_backend(name)
    why = backend.why_not(problem, caps, mode)
    if why is not None:
        return None, name, why
    return backend.prepare(problem, None, RunContext(group=setup.group, workspace=setup.workspace)), name, None


def _close(got, want) -> bool:
    return got.shape == want.shape and torch.allclose(got.float(), want.float(), rtol=RTOL, atol=ATOL)


def _point_rows(problem: Problem, modes: list[str], setup: Setup, caps) -> list[BenchRow]:
    label = f"h{problem.hidden} {problem.n_tokens_local} tok"
    checked, timing = _args(problem, setup, bench_plan(problem.nbytes, "eager").n_inputs)
    reference, _, _ = _launcher("nccl_fused", problem, setup, caps, "eager")
    want_residual = checked[1].clone()
    want = reference(checked[0].clone(), want_residual, checked[2], EPS)
    rows = []
    for name in FUSED_IMPLS:
        for mode in modes:
            launch, backend, why = _launcher(name, problem, setup, caps, mode)
            wrong: Optional[str] = why
            if launch is not None:
                try:
                    residual = checked[1].clone()
                    out = launch(checked[0].clone(), residual, checked[2], EPS)
                    wrong = None if _close(out, want) and _close(residual, want_residual) else \
                        "output differs from the NCCL composition's"
                except Exception as exc:  # the same shapes raise on every rank
                    wrong = f"{type(exc).__name__}: {exc}"
            ok = agree(wrong is None, setup.group)
            us = measure(launch, timing, bench_plan(problem.nbytes, mode), mode, setup.group, setup.device) \
                if ok else None
            note = "" if ok else (why if why is not None else f"failed, not timed: {wrong or 'failed on another rank'}")
            rows.append(BenchRow(problem.op, label, problem.nbytes, mode, name, us, backend, note))
    return rows


def fused_rows(options, setup: Setup, caps) -> list[BenchRow]:
    """The fused op's rows: every default hidden size x ``options.tokens`` tokens per rank."""
    world_size = dist.get_world_size(setup.group)
    dtype = DTYPE_NAMES[setup.dtype]
    return [row for hidden in HIDDEN for tokens in options.tokens
            for row in _point_rows(Problem.all_reduce_rmsnorm(tokens, hidden, dtype, world_size), options.modes,
                                   setup, caps)]


def fused_table(result, op: str = ALL_REDUCE_RMSNORM.name):
    table = Table(title=f"{op}: median us per call (MAX over ranks); ratio < 1: autosymm faster")
    for column in ["hidden/tokens", "mode", *[i.replace("_", " ") for i in FUSED_IMPLS], "chosen",
                   "autosymm / best other"]:
        table.add_column(column, overflow="fold")
    for (label, mode), cell in cells(result.rows, op).items():
        ratio = compare(cell, op).vs_no_copy
        chosen = cell["autosymm"].backend if "autosymm" in cell else "-"
        table.add_row(label, mode, *[f"{cell[i].us:.2f}" if i in cell and cell[i].us else "-" for i in FUSED_IMPLS],
                      chosen or "-", f"{ratio:.3f}" if ratio is not None else "-")
    return table


#: How bench measures the fused op (its spec names it: OpSpec.bench).
FUSED_BENCH = BenchOp(fused_rows, fused_table, (FUSED_OTHERS, FUSED_OTHERS))
