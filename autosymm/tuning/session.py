"""Worker bodies of `autosymm tune` (one process per GPU, see autosymm.tuning.workers)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..problem import DTYPES, MOE_OPS, MoEShape, Problem


@dataclass
class TuneOptions:
    ops: list[str]
    sizes: list[int]
    dtypes: list[str]
    modes: list[str]
    shapes: dict[str, MoEShape]
    tokens: list[int]
    strategy: str = "auto"
    trials: Optional[int] = None
    db_path: str = ""
    seed: int = 0
    backends: Optional[list[str]] = None  # None: every registered backend
    extra: dict = field(default_factory=dict)


def problems_for(options: TuneOptions, world_size: int) -> list[Problem]:
    """The sweep of ``options`` (see :func:`sweep_problems`)."""
    return sweep_problems(options.ops, options.sizes, options.dtypes, options.shapes, options.tokens, world_size)


def sweep_problems(ops: list[str], sizes: list[int], dtypes: list[str], shapes: dict[str, MoEShape],
                   tokens: list[int], world_size: int) -> list[Problem]:
    """All-reduce sizes x dtypes, then MoE shapes x token counts x ops (of those in ``ops``)."""
    problems = []
    if "all_reduce" in ops:
        problems += [Problem.all_reduce(n, d, world_size) for d in dtypes for n in sizes]
    for op in (o for o in ops if o in MOE_OPS):
        problems += [Problem.moe(op, shape, t, d, world_size)
                     for d in dtypes for shape in shapes.values() for t in tokens]
    return problems


def workspace_bytes(problems: list[Problem]) -> tuple[int, int]:
    """(all-reduce, MoE) region bytes the sweep needs (at least the defaults)."""
    from ..backends.triton_all_reduce import stage_bytes
    from ..symm import default_region_bytes

    ar_default, moe_default = default_region_bytes()
    # the largest stage any all-reduce backend needs: the push one-shot's slot per peer
    ar = max([stage_bytes("one_shot_push", p.nbytes, p.world_size) for p in problems if p.op == "all_reduce"]
             + [ar_default])
    moe = moe_default
    for p in problems:
        if p.op in MOE_OPS:
            rows_global = p.world_size * p.n_tokens_local * p.shape.n_expts_act
            rows_local = p.n_tokens_local * p.shape.n_expts_act
            moe = max(moe, (rows_global + rows_local) * p.shape.d_model * p.elem_bytes + (1 << 20))
    return ar, moe


def tune_job(rank: int, world_size: int, options: TuneOptions) -> Optional[list[dict]]:
    """Tune ``options`` on this rank; rank 0 writes the DB and returns the summary rows."""
    import torch.distributed as dist

    from ..backends import backend_names, get_backend
    from ..db import TuningDB
    from ..hardware import fingerprint
    from .sweep import control_group_for, run_sweep
    from ..symm import get_workspace

    from ..kernels import barrier

    group = dist.group.WORLD
    if rank == 0 and int(barrier.MAX_POLLS.value) > barrier.TUNING_MAX_POLLS:
        print(f"autosymm tune: barrier waits give up after {int(barrier.MAX_POLLS.value)} polls; set "
              f"AUTOSYMM_BARRIER_MAX_POLLS={barrier.TUNING_MAX_POLLS} before starting the workers (torchrun) "
              "so a failed candidate costs seconds")
    problems = problems_for(options, world_size)
    for p in problems:
        if p.dtype not in DTYPES:
            raise ValueError(f"dtype {p.dtype!r} is not one of {sorted(DTYPES)}")
    ar_bytes, moe_bytes = workspace_bytes(problems)
    device = torch.device("cuda", torch.cuda.current_device())
    workspace = get_workspace(group, device, all_reduce_bytes=ar_bytes, moe_bytes=moe_bytes) if world_size > 1 else None
    control = control_group_for(group)
    db = TuningDB(options.db_path) if rank == 0 else None
    backends = {}
    for name in options.backends or backend_names():
        try:
            backends[name] = get_backend(name)
        except ImportError as exc:  # e.g. torch without symmetric memory: the others still tune
            if rank == 0:
                print(f"autosymm tune: backend {name} unavailable: {exc}")
    progress, finish = _progress(rank, problems, options)
    started = time.time()
    items = run_sweep(problems, backends=backends, group=group, workspace=workspace, db=db, hardware=fingerprint(),
                      strategy=options.strategy, trials=options.trials, modes=options.modes, progress=progress,
                      control_group=control, seed=options.seed)
    finish()
    if rank != 0:
        return None
    elapsed = time.time() - started
    summary = [s for s in (item.summary() for item in items) if s]
    failed = [f"{i.problem.describe()} [{i.mode}]: {i.status} {i.reason}" for i in items if i.status in ("failed", "aborted")]
    print(f"autosymm tune: {len(items)} (problem, mode) pairs in {elapsed:.1f} s on {world_size} GPU(s); "
          f"{sum(i.rows_written for i in items)} rows written to {options.db_path}")
    for line in failed:
        print("  " + line)
    return summary


def _progress(rank: int, problems: list[Problem], options: TuneOptions):
    """A rich progress bar on rank 0 (no-op elsewhere): (callback per item, finish)."""
    if rank != 0:
        return (lambda item: None), (lambda: None)
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from .sweep import default_modes

    total = sum(len([m for m in default_modes(p) if m in options.modes]) for p in problems)
    bar = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                   TimeElapsedColumn())
    task = bar.add_task("tuning", total=total)
    bar.start()

    started = time.time()
    log_lines = not bar.console.is_terminal  # a log file gets one line per item instead of redraws

    def advance(item) -> None:
        summary = item.summary()
        text = f"{item.problem.describe()} [{item.mode}] -> {summary['backend'] if summary else item.status}"
        bar.update(task, advance=1, description=text[:90])
        if log_lines:
            us = f" {summary['us']:.2f} us" if summary else ""
            print(f"[{time.time() - started:7.1f} s] {text}{us}", flush=True)

    return advance, bar.stop
