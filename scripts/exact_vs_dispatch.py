"""What the dispatcher picks for sizes between tuned points, against a tune at the exact size.

Runs on all local GPUs (one process each, like `autosymm tune`). For every size (default: six
that are not powers of two, two of them odd element counts of bf16) and mode (graph, eager):

1. tune at exactly that size (autosymm.tuning.session.TuneSession, every backend, a temporary
   database: the user's is never written);
2. ask the dispatcher what it picks from the databases given (``--db``; default: the user DB,
   then the shipped ones, as `autosymm.all_reduce` reads them);
3. time both picks the same way in the same process: the tuner's evaluator and timing plan
   (inputs checked against NCCL, then CUDA events around eager calls or replays of a graph),
   ``--rounds`` times alternating, median of each (TuneSession.time_candidates).

`autosymm bench --regret` measures the same for every op, at the sizes between a database's
tuned points, with the winner-flip rate and replay fidelity (docs/BENCHMARKS.md).

Prints one row per (size, mode) with both picks, their times and dispatch / exact (the target:
<= 1.03), then the largest ratio. About 2-3 minutes on 2x H200.

    source scripts/_node_env.sh && python3 scripts/exact_vs_dispatch.py [--db tuning_db/X.sqlite] \
        [--sizes 6146,100000,800000,3000000,5000000,12582918] [--modes graph,eager] [--rounds 5]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

#: 6 KiB + 2 B (3073 bf16 elements), 100 KB, 800 KB, 3 MB, 5 MB, 12 MiB + 6 B (6291459 elements).
DEFAULT_SIZES = "6146,100000,800000,3000000,5000000,12582918"
TARGET = 1.03


def _job(rank: int, world_size: int, sizes: list[int], modes: list[str], db_paths: list[str], rounds: int):
    from autosymm.db.store import shipped_db_paths, user_db_path
    from autosymm.db.read import open_sources
    from autosymm.runtime.dispatch import decide
    from autosymm.problem import Problem
    from autosymm.tuning.outcome import Candidate
    from autosymm.tuning.session import TuneSession, TuneSettings

    problems = [Problem.all_reduce(n, "bf16", world_size) for n in sizes]
    with tempfile.TemporaryDirectory() as tmp:
        exact_db = str(Path(tmp) / "exact.sqlite") if rank == 0 else None
        session = TuneSession.open(TuneSettings(modes=tuple(modes)), problems, db_path=exact_db)
        sources = (open_sources(None, [Path(p) for p in db_paths]) if db_paths
                   else open_sources(user_db_path(), shipped_db_paths()))
        if rank == 0:
            print(f"dispatch reads: {[s.label for s in sources] or 'no database'}", flush=True)
        report = []
        for item in session.sweep(problems):
            if item.outcome is None or item.outcome.best is None:
                report.append((item.problem.nbytes, item.mode, f"exact tune {item.status}: {item.reason}"))
                continue
            decision = decide(item.problem, item.mode, session.caps, sources, session.hardware_slug)
            picks = {"exact": item.outcome.best.candidate, "dispatch": Candidate(decision.backend, decision.config)}
            timed = session.time_candidates(item.problem, item.mode, list(picks.values()), rounds)
            times = {label: timed[pick] for label, pick in picks.items()}
            row = (item.problem.nbytes, item.mode, picks["exact"].describe(), times["exact"],
                   picks["dispatch"].describe(), times["dispatch"], decision.reason)
            report.append(row)
            if rank == 0:
                _print_row(row)
    return report if rank == 0 else None


def _print_row(row) -> None:
    if len(row) == 3:
        print(f"{row[0]:>10d} B {row[1]:5s} {row[2]}", flush=True)
        return
    nbytes, mode, exact, exact_us, picked, picked_us, reason = row
    print(f"{nbytes:>10d} B {mode:5s} exact {exact_us:8.2f} us {exact:60s} dispatch {picked_us:8.2f} us "
          f"{picked:60s} ratio {picked_us / exact_us:6.3f}  [{reason}]", flush=True)


def main() -> None:
    from autosymm.problem import parse_size_range
    from autosymm.tuning.workers import run_workers

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help="all-reduce sizes in bytes (a list or low:high:N)")
    parser.add_argument("--modes", default="graph,eager")
    parser.add_argument("--db", action="append", default=[],
                        help="database(s) dispatch reads, in order (default: the user DB, then the shipped ones)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating timings of the two picks")
    parser.add_argument("--nproc", type=int, default=None)
    args = parser.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    report = run_workers(_job, args.nproc, parse_size_range(args.sizes), modes, args.db, args.rounds)
    print("\nsummary (dispatch / exact; target <= %.2f):" % TARGET)
    ratios = []
    for row in report:
        _print_row(row)
        if len(row) == 7:
            ratios.append(row[5] / row[3])
    if ratios:
        worst = max(ratios)
        print(f"largest ratio {worst:.3f} over {len(ratios)} (size, mode) pairs: "
              f"{'all within' if worst <= TARGET else 'NOT all within'} {100 * (TARGET - 1):.0f} %")


if __name__ == "__main__":
    main()
