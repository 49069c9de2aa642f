"""`autosymm bench --regret`: its options, checked before any worker starts, and its output (the
measures: autosymm.bench.regret). The points are the database's (between its tuned points) unless
an op's unit option is given (the bench's --sizes, --tokens: the ops' records name them); ops
default to every op the databases hold rows of here. ``--cpu`` runs the plumbing on 2 gloo ranks
with stand-in timings and prints no time.
"""

from __future__ import annotations

import click
import torch
from click.core import ParameterSource

from .. import spec
from ..problem import MODES
from ..bench.regret import RegretOptions, regret_job
from ..bench.regret_report import lines, tables, write_csv, write_json
from .plans import table
from ..settings import export
from ..tuning import workers

#: `bench`'s options that only go with --regret, and those that do not (their click names).
REGRET_ONLY = ("db_path", "rounds", "limit", "replay_calls", "cpu", "json_summary")
NOT_WITH_REGRET = ("plot_path", "shapes")
#: Points and replayed rows per op of a --cpu run without --limit.
CPU_LIMIT = 2


def regret_options(command):
    """`bench`'s --regret and the options of its regret mode (decorator)."""
    options = [
        click.option("--regret", is_flag=True,
                     help="measure the database's regret between tuned points, the winner-flip rate of two tunes "
                          "and replay fidelity (default ops: every op the databases hold rows of here; points: "
                          "between the tuned ones, or --sizes / --tokens given, at the databases' shapes)"),
        click.option("--db", "db_path", type=click.Path(exists=True, dir_okay=False), default=None,
                     help="with --regret: the database under test, read first (as AUTOSYMM_DB; then the shipped ones)"),
        click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True,
                     help="with --regret: interleaved re-timings of the two picks"),
        click.option("--limit", type=click.IntRange(min=1), default=None,
                     help=f"with --regret: at most N points and N replayed rows per op (default: all; --cpu: "
                          f"{CPU_LIMIT})"),
        click.option("--replay-calls", type=click.IntRange(min=1), default=8, show_default=True,
                     help="with --regret: calls per user CUDA graph"),
        click.option("--cpu", is_flag=True,
                     help="with --regret: the plumbing on 2 gloo ranks, stand-in timings, no time printed"),
        click.option("--json-summary", type=click.Path(dir_okay=False), default=None,
                     help="with --regret: write the summary as JSON"),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _given(ctx: click.Context, name: str) -> bool:
    return ctx.get_parameter_source(name) not in (None, ParameterSource.DEFAULT)


def check_regret_options(ctx: click.Context, opts: dict) -> None:
    """Usage errors naming an option that does not go with the mode asked for."""
    if opts.get("regret"):
        wrong = [f"--{name.removesuffix('_path').replace('_', '-')}" for name in NOT_WITH_REGRET if _given(ctx, name)]
        if wrong:
            raise click.UsageError(f"{', '.join(wrong)} cannot be given with --regret (it measures the shapes the "
                                   "databases hold and draws no plot)")
        return
    wrong = [f"--{name.removesuffix('_path').replace('_', '-')}" for name in REGRET_ONLY if _given(ctx, name)]
    if wrong:
        raise click.UsageError(f"{', '.join(wrong)} only go(es) with --regret")


def regret_options_of(ctx: click.Context, opts: dict):
    """autosymm.bench.regret.RegretOptions of `bench`'s options; bad values are usage errors."""
    modes = tuple(m.strip() for m in opts["modes"].split(",") if m.strip())
    ops = [o.strip() for o in opts["ops"].split(",") if o.strip()] if _given(ctx, "ops") else None
    unknown = [m for m in modes if m not in MODES] + [o for o in ops or () if o not in spec.names()]
    if unknown or not modes:
        raise click.BadParameter(f"unknown mode(s) or op(s): {', '.join(unknown) or 'none given'}")
    points = {}
    for unit in dict.fromkeys(record.unit for record in spec.registered()):
        if unit.sweep.dest in opts and _given(ctx, unit.sweep.dest):
            try:
                points[unit.sweep.flag] = unit.sweep.parse(opts[unit.sweep.dest])
            except ValueError as exc:
                raise click.BadParameter(str(exc), param_hint=unit.sweep.flag) from None
    limit = opts["limit"] if opts["limit"] is not None or not opts["cpu"] else CPU_LIMIT
    return RegretOptions(ops=ops, modes=modes, points=points, limit=limit, rounds=opts["rounds"],
                         calls=opts["replay_calls"], stand_in=opts["cpu"])


def run_regret(ctx: click.Context, opts: dict, console) -> None:
    """`autosymm bench --regret`: the workers (GPUs, or 2 gloo ranks with --cpu), then the report."""
    options = regret_options_of(ctx, opts)
    if not options.stand_in and (not torch.cuda.is_available() or torch.cuda.device_count() == 0):
        raise click.ClickException("autosymm bench --regret needs CUDA GPUs; none is visible here (--cpu runs its "
                                   "plumbing on 2 gloo ranks with stand-in timings)")
    if opts["db_path"]:
        export({"AUTOSYMM_DB": str(opts["db_path"])})  # the workers' runtime reads it first, as a user's does
    nproc = opts["nproc"] or (2 if options.stand_in else None)
    result = workers.run_workers(regret_job, nproc, options, cpu=options.stand_in)
    if result is None:  # a rank other than 0 under torchrun
        return
    for title, columns, body in tables(result):
        if body:
            console.print(table(title, columns, body))
    for line in lines(result):
        console.print(line)
    if opts["csv_path"]:
        write_csv(result, opts["csv_path"])
    if opts["json_summary"]:
        write_json(result, opts["json_summary"])
