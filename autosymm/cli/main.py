"""The `autosymm` command line: a thin click group over the library.

Commands: run, tune, bench, show, explain, info, db merge, db export.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import click
import torch

from .. import __version__
from .errors import OneLineErrorGroup
from .model import keys_line, model_calls, model_nproc, model_options, summary_table
from .regret import check_regret_options, regret_options, run_regret
from .. import spec
from .options import RegistryCommand, call_options, parsed, sweep_options
from .plans import (Target, check_hardware, console as rich_console, explain_lines, explained_problem, plan, table,
                    untuned_note)
from ..problem import DTYPES, MODEL_SHAPES, MODES
from ..bench.report import DEFAULT_SIZES as DEFAULT_BENCH_SIZES, parse_bench_sizes
from ..spec.kinds import parse_counts
from ..spec.moe import parse_moe_shapes
from ..backends import backend_names
from ..bench.plot import plot_bench
from ..bench.run import BenchOptions, bench_job, print_bench, write_bench_csv
from ..db.merge import merge_files
from ..db.read import DBSource, open_sources, winners
from ..db import store
from ..db.store import TuningDB, user_db_path, verdict
from ..hardware import fingerprint, hardware_slug_for
from .overview import overview
from ..settings import TUNING_MAX_POLLS, export
from ..tuning.session import TuneOptions, tune_job
from ..tuning import workers
from ..tuning.workers import torchrun_world_size

#: `autosymm tune --ops` (and `bench --ops`) by default: the ops tuned by default, registry order.
DEFAULT_OPS = ",".join(spec.default_tuned())


def _console():
    return rich_console()


def _parsed(parse, text: str, option: str):
    """``parse(text)``; a ValueError is a usage error naming ``option``."""
    try:
        return parse(text)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint=option) from None


@click.group(cls=OneLineErrorGroup)
@click.version_option(__version__, prog_name="autosymm")
def main() -> None:
    """Tuned symmetric-memory collectives for NVLink GPUs (all-reduce, MoE dp<->ep)."""


# ---------------------------------------------------------------------------------------- run
@main.command()
@click.pass_context
def run(ctx: click.Context) -> None:
    """The main job: `tune` with the default sweep on a GPU node; elsewhere, say so in a screenful:
    what this machine would run, what the shipped databases cover and what to do next."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= 1:
        ctx.invoke(tune)
        return

    for line in overview(fingerprint(), _open(()), open_sources(None, store.shipped_db_paths())):
        click.echo(line)


# --------------------------------------------------------------------------------------- tune
@main.command(cls=RegistryCommand, options_of=sweep_options)
@click.option("--nproc", type=int, default=None, help="GPUs (worker processes); default: all local GPUs")
@click.option("--ops", default=DEFAULT_OPS, show_default=True)
@click.option("--dtypes", default="bf16", show_default=True)
@click.option("--modes", default="eager,graph", show_default=True)
@click.option("--strategy", type=click.Choice(["auto", "grid", "optuna"]), default="auto", show_default=True)
@click.option("--trials", type=click.IntRange(min=1), default=None, help="Optuna trials per problem and backend (default: 30 % of the space, 16..24)")
@click.option("--db", "db_path", type=click.Path(dir_okay=False), default=None, help="database to write (default: the user DB)")
@click.option("--json-summary", type=click.Path(dir_okay=False), default=None, help="also write the summary rows as JSON")
@click.option("--backends", "backend_list", default=None,
              help="only these backends, comma-separated (default: every registered one; NCCL is always timed)")
@model_options
def tune(nproc, json_summary, **opts) -> None:
    """Tune every applicable backend on the local GPUs and record the winners.

    Each op's sweep takes its options (sizes, shapes, tokens, ...: the ops' records); --model
    CONFIG --tp N tunes exactly the keys that model calls instead. The summary gives each winner's
    margin over NCCL (and over a serving stack's own path where one was timed)."""
    calls = model_calls(click.get_current_context(), opts)
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        raise click.ClickException("autosymm tune needs CUDA GPUs; none is visible here (no database was touched)")

    options = _tune_options(opts)
    if calls is not None:
        nproc = model_nproc(calls, nproc, torch.cuda.device_count(), torchrun_world_size())
        options.model = calls
        click.echo(keys_line(calls))
    # Workers inherit it: a candidate whose peer failed gives up in seconds, not minutes.
    export({"AUTOSYMM_BARRIER_MAX_POLLS": str(TUNING_MAX_POLLS)}, overwrite=False)
    result = workers.run_workers(tune_job, nproc, options)
    if result is None:  # a rank other than 0 under torchrun: rank 0 reports
        return
    _console().print(summary_table(result.rows))
    if json_summary:
        Path(json_summary).write_text(json.dumps(result.rows, indent=1))
    if result.failures:
        raise click.ClickException(f"{len(result.failures)} (problem, mode) pair(s) failed (listed above)")


def _tune_options(opts: dict):
    """autosymm.tuning.session.TuneOptions of `tune`'s options (the ops' sweep options by their
    names, as click gives them); bad values are usage errors."""
    def items(name: str) -> list[str]:
        return [t.strip() for t in opts[name].split(",") if t.strip()]

    points = parsed({**{option.dest: option.default for option in _sweep_defaults()}, **opts}, sweep_options)
    try:
        options = TuneOptions(
            ops=items("ops"), dtypes=items("dtypes"), modes=items("modes"), points=points, strategy=opts["strategy"],
            trials=opts["trials"], db_path=str(opts["db_path"] or user_db_path()),
            backends=_parse_backends(opts["backend_list"]))
        options.settings()  # validates strategy, trials and modes before any worker starts
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    return options


def _sweep_defaults():
    """Every registered op's sweep option (their defaults fill in what a caller leaves out)."""
    return [option for record in spec.registered() for option in record.sweep_options]


def _parse_backends(text: Optional[str]) -> Optional[list[str]]:
    """Backend names of --backends (None: all); unknown names are a usage error naming the known."""
    if not text:
        return None

    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in backend_names()]
    if unknown:
        raise click.BadParameter(f"unknown backend(s) {', '.join(unknown)}; known: {', '.join(backend_names())}",
                                 param_hint="--backends")
    # the fallbacks are the baselines every row's speedup is measured against
    return names + [n for n in dict.fromkeys(record.fallback for record in spec.registered()) if n not in names]


# -------------------------------------------------------------------------------------- bench
@main.command()
@click.option("--nproc", type=int, default=None, help="GPUs (worker processes); default: all local GPUs")
@click.option("--sizes", default=DEFAULT_BENCH_SIZES, show_default=True,
              help="all-reduce bytes: ranges low:high of powers of two and single sizes, comma-separated")
@click.option("--modes", default="eager,graph", show_default=True)
@click.option("--shapes", default=",".join(MODEL_SHAPES), show_default=True)
@click.option("--tokens", default="128,1024,4096", show_default=True)
@click.option("--ops", default=DEFAULT_OPS, show_default=True)
@click.option("--csv", "csv_path", type=click.Path(dir_okay=False), default=None, help="write all measurements as CSV")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None, help="draw latency/bandwidth vs size (PNG)")
@regret_options
def bench(nproc, sizes, modes, shapes, tokens, ops, csv_path, **opts) -> None:
    """Measure autosymm (through the dispatcher) against NCCL and torch's built-ins; with --regret,
    the database's regret between tuned points, winner flips and replay fidelity."""
    ctx = click.get_current_context()
    check_regret_options(ctx, opts)
    if opts["regret"]:
        run_regret(ctx, dict(ctx.params), _console())
        return
    plot_path = opts["plot_path"]

    options = BenchOptions(sizes=_parsed(parse_bench_sizes, sizes, "--sizes"), modes=[m.strip() for m in modes.split(",")],
                           shapes=_parsed(parse_moe_shapes, shapes, "--shapes"),
                           tokens=_parsed(parse_counts, tokens, "--tokens"),
                           ops=[o.strip() for o in ops.split(",") if o.strip()])
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        raise click.ClickException("autosymm bench needs CUDA GPUs; none is visible here")
    result = workers.run_workers(bench_job, nproc, options)
    print_bench(result, _console())
    if csv_path:
        write_bench_csv(result, csv_path)
    if plot_path:
        plot_bench(result, plot_path)


# --------------------------------------------------------------------------------------- show
@main.command()
@click.option("--db", "db_paths", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="database(s) to read (default: the user DB and the shipped ones)")
@click.option("--all", "all_rows", is_flag=True, help="every backend's row, not only the winner per key")
@click.option("--json", "as_json", is_flag=True, help="print a JSON list of rows")
@click.option("--op", default=None)
@click.option("--world-size", type=int, default=None)
def show(db_paths, all_rows, as_json, op, world_size) -> None:
    """List tuned results (the winner per key, or every row with --all).

    A key's winner is its fastest row in the first database (user, then shipped) holding it."""
    rows = _collect_rows(db_paths, op, world_size, winners_only=not all_rows)
    if as_json:
        click.echo(json.dumps([_row_json(r) for r in rows], indent=1))
        return
    columns = ["gpu", "ws", "op", "dtype", "size/tokens", "shape", "mode", "backend", "config", "us", "NCCL us", "speedup"]
    body = []
    for r in rows:
        size = spec.get(r.op).unit.cell(r.bucket)
        body.append([r.gpu, r.world_size, r.op, r.dtype, size, r.shape or "-", r.mode, r.backend, _short_config(r.config),
                     f"{r.median_us:.2f}", f"{r.nccl_us:.2f}" if r.nccl_us else "-",
                     f"{r.speedup:.2f}x" if r.speedup else "-"])
    _console().print(table(f"{len(rows)} rows", columns, body))


def _db_paths(db_paths) -> list[Path]:
    if db_paths:
        return [Path(p) for p in db_paths]
    user = user_db_path()
    return ([user] if user.exists() else []) + list(store.shipped_db_paths())


def _collect_rows(db_paths, op, world_size, winners_only: bool):
    """Rows of the databases: every valid row, or with ``winners_only`` each key's winner
    (autosymm.db.read: the fastest row of the first database holding the key). A database that
    cannot be used is an error saying why (autosymm.db.store.verdict)."""
    filters = {k: v for k, v in (("op", op), ("world_size", world_size)) if v is not None}
    rows, sources = [], []
    for path in _db_paths(db_paths):
        why = verdict(path)
        if why is not None:
            raise click.ClickException(why)
        with TuningDB(path, readonly=True) as db:
            if winners_only:
                sources.append(DBSource(db, str(path)))  # reads its rows
            else:
                rows.extend(db.rows(**filters))
    if winners_only:
        rows = [row for _, row in winners(sources, **filters)]
    rows.sort(key=lambda r: (r.hardware, r.world_size, r.op, r.shape, r.dtype, r.mode, r.bucket, r.median_us))
    return rows


def _row_json(r) -> dict:
    out = {"gpu": r.gpu, "hardware": r.hardware, "world_size": r.world_size, "op": r.op, "dtype": r.dtype,
           "mode": r.mode, "backend": r.backend, "config": json.loads(r.config or "{}"), "us": r.median_us,
           "nccl_us": r.nccl_us, "speedup": r.speedup, "nccl_version": r.nccl_version}
    record = spec.get(r.op)  # rows are checked when read: a registered op
    if record.shape:
        out["shape"] = r.shape
    out[record.unit.json_field] = r.bucket
    return out


def _short_config(config_json: Optional[str]) -> str:
    data = json.loads(config_json or "{}")
    data.pop("type", None)
    return " ".join(f"{k}={v}" for k, v in data.items()) or "-"


# ------------------------------------------------------------------------------------ explain
class OpName(click.ParamType):
    """A registered op's name (the registry as it is when the command runs)."""

    name = "op"

    def get_metavar(self, param, ctx=None) -> str:
        return f"[{'|'.join(spec.names())}]"

    def convert(self, value, param, ctx):
        if value not in spec.names():
            self.fail(f"{value!r} is not one of {', '.join(spec.names())}", param, ctx)
        return value


@main.command(cls=RegistryCommand, options_of=call_options)
@click.option("--op", type=OpName(), default=spec.ALL[0].name, show_default=True)
@click.option("--dtype", type=click.Choice(sorted(DTYPES)), default="bf16", show_default=True)
@click.option("--world-size", type=click.IntRange(min=1), required=True)
@click.option("--gpu", default=None, help='GPU name, e.g. "NVIDIA H200" (default: this machine\'s, tuned or not)')
@click.option("--links", type=click.Choice(["nvlink", "pcie"]), default="nvlink", show_default=True)
@click.option("--mode", type=click.Choice(["eager", "graph"]), default=None, help="default: both")
@click.option("--all", "all_sizes", is_flag=True, help="plan over all sizes (or token counts)")
@click.option("--db", "db_paths", multiple=True, type=click.Path(exists=True, dir_okay=False))
def explain(**opts) -> None:
    """Which backend and config would serve a call, and why (no GPU needed).

    Each op takes its own options for the call's size and shape (the ops' records)."""
    record, values = spec.get(opts["op"]), parsed(opts, call_options)
    _check_own_options(record, values)
    fp = fingerprint()
    gpu = opts["gpu"] or fp.gpu_name
    hardware = hardware_slug_for(gpu, opts["links"]) if gpu != fp.gpu_name else fp.hardware_slug
    target = Target(hardware, gpu, opts["world_size"], opts["dtype"])
    modes = [opts["mode"]] if opts["mode"] else list(MODES)
    problem = None if opts["all_sizes"] else explained_problem(record, values, opts[record.unit.option.dest], target)
    sources = _open(opts["db_paths"])
    if opts["gpu"]:
        check_hardware(target, sources)
    else:  # this machine, tuned or not: say which, and whether any row is for it
        note = untuned_note(target, sources)
        if note:
            click.echo(note)
    if problem is None:
        plan(_console(), target, sources, [record], modes, values)
        return
    for line in explain_lines(problem, modes, target, sources):
        click.echo(line)


def _check_own_options(record, values: dict) -> None:
    """A usage error naming an option given that is another op's, not ``record``'s."""
    own = {option.flag for option in record.call_options}
    for flag in values:
        if flag not in own:
            takers = [r.name for r in spec.registered() if any(o.flag == flag for o in r.call_options)]
            raise click.BadParameter(f"{'/'.join(takers)}'s, not {record.name}'s", param_hint=flag)


def _open(db_paths):
    """Sources for --db paths (as given) or, without any, the user DB then the shipped ones; a
    database that cannot be used is an error saying why, as in `show` (autosymm.db.store.verdict)."""
    paths = _db_paths(db_paths)
    why = next((why for why in map(verdict, paths) if why is not None), None)
    if why is not None:
        raise click.ClickException(why)
    return open_sources(None, paths)


# --------------------------------------------------------------------------------------- info
@main.command()
def info() -> None:
    """This machine's hardware fingerprint and the databases autosymm would read."""
    def state(path: Path) -> str:  # the verdict `show` and `explain` act on
        why = verdict(path) if path.exists() else "absent"
        return "usable" if why is None else why if why == "absent" else f"unusable: {why}"

    fp = fingerprint()
    console = _console()
    for key, value in fp.as_dict().items():
        console.print(f"{key:20s} {value}")
    console.print(f"{'user_db':20s} {user_db_path()} ({state(user_db_path())})")
    for path in store.shipped_db_paths():
        console.print(f"{'shipped_db':20s} {path} ({state(path)})")


# ----------------------------------------------------------------------------------------- db
@main.group()
def db() -> None:
    """Merge and export tuning databases."""


@db.command("merge")
@click.argument("sources", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--into", "target", required=True, type=click.Path(dir_okay=False), help="database to merge into (created if absent)")
def db_merge(sources, target) -> None:
    """Merge SOURCES into --into, keeping the faster row per key."""
    for source, counts in zip(sources, merge_files(sources, target)):
        skipped = f", {counts.skipped} bad rows skipped" if counts.skipped else ""
        click.echo(f"{source}: {counts.inserted} new, {counts.replaced} replaced by faster rows, {counts.kept} kept"
                   f"{skipped}")


@db.command("export")
@click.argument("output", type=click.Path(dir_okay=False))
@click.option("--db", "source", type=click.Path(exists=True, dir_okay=False), default=None, help="default: the user DB")
@click.option("--hardware", default=None, help="only this hardware slug")
@click.option("--world-size", type=int, default=None)
@click.option("--overwrite", is_flag=True)
def db_export(output, source, hardware, world_size, overwrite) -> None:
    """Export (a subset of) a database into a new shippable file, e.g. tuning_db/<node slug>.sqlite."""
    filters = {k: v for k, v in (("hardware", hardware), ("world_size", world_size)) if v is not None}
    with TuningDB(Path(source) if source else user_db_path(), readonly=True) as src:
        count = src.export(output, overwrite=overwrite, **filters)
    click.echo(f"exported {count} rows to {output}")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
