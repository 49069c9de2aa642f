"""`autosymm tune --model CONFIG --tp N`: the options that tune exactly the keys a model calls
(autosymm.tuning.model_calls), checked before any worker starts, and the tune's summary table
with each winner's margins.

With ``--model`` the model decides the ops, dtype, sizes and shapes, so the options that choose
them (``--ops``, ``--dtypes`` and every registered op's sweep option: ``--sizes``, ``--shapes``,
``--tokens``, ``--epilogues``, ...) given with it are a usage error naming them; ``--tp`` is the
world size the model runs at: the tune runs on exactly that many local GPUs.
"""

from __future__ import annotations

from collections import Counter
from typing import Optional

import click
from click.core import ParameterSource

from .options import registry_options, sweep_options
from .plans import table
from ..tuning.model_calls import ModelCalls, ModelShape, default_capture_sizes, parse_capture_sizes

#: The options `--model` takes besides the model's config (their click names).
MODEL_ONLY = ("tp", "capture_sizes", "sequence_parallel")


def model_options(command):
    """`tune`'s --model, --tp, --capture-sizes and --sequence-parallel (decorator)."""
    options = [
        click.option("--model", "model_path", type=click.Path(exists=True), default=None,
                     help="a Hugging Face config.json (or its folder): tune exactly the keys this model calls, "
                          "every op, no others (needs --tp)"),
        click.option("--tp", type=click.IntRange(min=2), default=None,
                     help="with --model: the tensor-parallel size the model runs at (the tune's world size)"),
        click.option("--capture-sizes", default=None,
                     help="with --model: tokens per forward, a list (1,2,4,8) or low:high (the stack's capture "
                          "sizes in that range; default: vLLM's, 1..512)"),
        click.option("--sequence-parallel", is_flag=True,
                     help="with --model: the sums are reduce-scatters and all-gathers"),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def model_calls(ctx: click.Context, opts: dict):
    """The autosymm.tuning.model_calls.ModelCalls `tune`'s options ask for (None without
    --model); usage errors naming the options that clash with it or need it, or a config that
    cannot be read."""
    given = [name for name in opts if ctx.get_parameter_source(name) not in (None, ParameterSource.DEFAULT)]
    if opts.get("model_path") is None:
        needing = [_flag(ctx, name) for name in MODEL_ONLY if name in given]
        if needing:
            raise click.UsageError(f"{', '.join(needing)} only go(es) with --model CONFIG")
        return None
    chosen = {"ops", "dtypes"} | {option.dest for option, _ in registry_options(sweep_options).values()}
    clashing = [_flag(ctx, name) for name in given if name in chosen]
    if clashing:
        raise click.UsageError(f"--model tunes exactly the keys the model calls (its ops, dtype and sizes): "
                               f"{', '.join(clashing)} cannot be given with it")
    if opts.get("tp") is None:
        raise click.UsageError("--model needs --tp N: the tensor-parallel size the model runs at")
    try:
        shape = ModelShape.from_file(opts["model_path"])
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--model") from None
    text = opts.get("capture_sizes")
    try:
        sizes = parse_capture_sizes(text) if text else default_capture_sizes()
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--capture-sizes") from None
    calls = ModelCalls(shape, opts["tp"], tuple(sizes), bool(opts.get("sequence_parallel")))
    try:
        calls.problems(calls.tp)  # a shape no call of these ops can have says so now, not in a worker
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--model") from None
    return calls


def _flag(ctx: click.Context, name: str) -> str:
    """The command-line flag of parameter ``name``."""
    param = next((p for p in ctx.command.get_params(ctx) if p.name == name), None)
    return max(param.opts, key=len) if param is not None else f"--{name.replace('_', '-')}"


def model_nproc(calls, nproc: Optional[int], local_gpus: int, torchrun_world: Optional[int]) -> int:
    """The worker count of a model's tune: its TP size; a usage error, before any worker starts,
    when --nproc asks for another count or this node (or the torchrun launch) has another."""
    if nproc is not None and nproc != calls.tp:
        raise click.UsageError(f"--nproc {nproc} with --tp {calls.tp}: a model's keys are tuned at the world size "
                               f"it runs at (leave --nproc out)")
    if torchrun_world is not None and torchrun_world != calls.tp:
        raise click.UsageError(f"--tp {calls.tp}, but torchrun started {torchrun_world} worker(s): start "
                               f"{calls.tp} (--nproc-per-node {calls.tp})")
    if torchrun_world is None and local_gpus < calls.tp:
        raise click.UsageError(f"--tp {calls.tp}: the model runs on {calls.tp} ranks, this node has {local_gpus} "
                               f"GPU(s); tune it on a node with at least {calls.tp} (nothing was run)")
    return calls.tp


def keys_line(calls) -> str:
    """What a model's tune covers, said before it starts: 'llama ... : 102 keys (all_reduce 51, ...)'."""
    problems = calls.problems(calls.tp)
    counts = Counter(p.op for p in problems)
    return (f"autosymm tune --model: {calls.describe()}: {len(problems)} keys "
            f"({', '.join(f'{op} {n}' for op, n in counts.items())}), each in every mode asked")


def summary_table(rows: list[dict]):
    """The tune's winners, one row per (key, mode), with the winner's margin over NCCL and, where a
    serving stack's path was timed, over that path (autosymm.tuning.sweep.SweepItem.summary)."""
    stacked = any(r.get("stack_us") for r in rows)
    columns = ["op", "size/shape", "mode", "winner", "config", "us", "NCCL us", "margin vs NCCL"]
    columns += ["stack us", "margin vs stack"] if stacked else []
    body = []
    for r in rows:
        line = [r["op"], r["label"], r["mode"], r["backend"], r["config"], f"{r['us']:.2f}",
                f"{r['nccl_us']:.2f}" if r.get("nccl_us") else "-", _margin(r.get("nccl_margin"))]
        if stacked:
            line += [f"{r['stack_us']:.2f} ({r['stack']})" if r.get("stack_us") else "-", _margin(r.get("stack_margin"))]
        body.append(line)
    return table("autosymm tune: winners (margin: the other's time over the winner's, minus 1)", columns, body)


def _margin(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:+.1%}"
