"""How close does Optuna (seeded TPE) get to the exhaustive grid's best, with what share of trials?

Runs on all local GPUs (one process each, like `autosymm tune`), dry-run (no database written):
for each problem, the whole grid of every Triton backend, then Optuna with the budget
`autosymm tune` uses by default (autosymm.tuning.search.default_trials: 30 % of the space, clamped to
16..24 trials) or ``--budget`` (a share of the space), and prints best(optuna) / best(grid) per
(problem, backend, mode) with the share of the space Optuna tried.

    PYTHONPATH=$PWD python3 scripts/optuna_vs_grid.py [--budget 0.3] [--sizes 64KiB,1MiB,16MiB]
"""

from __future__ import annotations

import argparse
import math
from typing import Optional


def _job(rank: int, world_size: int, sizes: list[int], budget: Optional[float], moe_tokens: list[int]):
    from dataclasses import replace

    from autosymm.problem import MODEL_SHAPES, Problem
    from autosymm.tuning.search import default_trials
    from autosymm.tuning.session import TuneSession, TuneSettings

    problems = [Problem.all_reduce(n, "bf16", world_size) for n in sizes]
    problems += [Problem.moe("dp_to_ep", MODEL_SHAPES["deepseek-v3"], t, "bf16", world_size) for t in moe_tokens]
    names = ("triton_one_shot", "triton_one_shot_push", "triton_two_shot", "triton_moe")
    session = TuneSession.open(TuneSettings(strategy="grid", backends=names), problems)  # dry run: no database
    if rank == 0 and session.unavailable:
        print(f"backends left out: {session.unavailable}")
    report = []
    for problem in problems:
        grid_settings = replace(session.settings, modes=("graph",) if problem.op == "all_reduce" else ("eager",))
        grid = session.with_settings(grid_settings).sweep([problem])[0]
        for name, best_grid in (grid.outcome.best_by_backend() if grid.outcome else {}).items():
            space = len(session.backends[name].search_space(problem))
            trials = default_trials(space) if budget is None else max(1, math.floor(budget * space))
            optuna = replace(grid_settings, strategy="optuna", trials=trials, backends=(name,))
            tuned = session.with_settings(optuna).sweep([problem])[0]
            best_optuna = tuned.outcome.best_by_backend().get(name) if tuned.outcome else None
            report.append((problem.describe(), grid.mode, name, space, trials, best_grid.score,
                           best_optuna.score if best_optuna else float("inf")))
            if rank == 0:  # as it goes: a run cut short still reports what it measured
                _print_row(*report[-1])
    return report if rank == 0 else None


def main() -> None:
    from autosymm.problem import parse_size_range
    from autosymm.tuning.workers import run_workers

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--budget", type=float, default=None,
                        help="Optuna trials as a share of the grid (default: autosymm tune's default budget)")
    parser.add_argument("--sizes", default="64KiB,1MiB,16MiB")
    parser.add_argument("--moe-tokens", default="1024")
    parser.add_argument("--nproc", type=int, default=None)
    args = parser.parse_args()
    tokens = [int(t) for t in args.moe_tokens.split(",") if t]
    report = run_workers(_job, args.nproc, parse_size_range(args.sizes), args.budget, tokens)
    print("summary:")
    for row in report:
        _print_row(*row)


def _print_row(desc, mode, name, space, trials, grid_us, tpe_us) -> None:
    print(f"{desc:44s} {mode:6s} {name:20s} grid {space:4d} TPE {trials:3d} ({trials / space:6.1%}) "
          f"grid {grid_us:9.2f} us TPE {tpe_us:9.2f} us TPE/grid {tpe_us / grid_us:6.3f}", flush=True)


if __name__ == "__main__":
    main()
