"""Dispatch plans for the command line: the decision for a call, or over every default and tuned
size, on a given machine, this one or another, without a GPU (`autosymm explain`; the decisions
`autosymm run` shows without a GPU: autosymm.cli.overview).

What a plan says is what a call would do: a time is marked measured (the row's own, at the
call's size, dtype, shape and mode) or modelled; a call no backend can serve in its mode (a
graph-mode MoE call too large for the MoE region: NCCL's all_to_all cannot be captured) is shown
as raising, with the remedy, never as served by the backend that cannot take it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple, Optional, Sequence

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

from .. import settings
from ..spec import OpSpec, OptionError, PointRequest, Values
from ..problem import MODES, Problem
from ..backends import Capabilities, get_backend
from ..configs import config_fields
from ..runtime.dispatch import decide
from ..settings import default_region_bytes

#: Width of a console that is not a terminal (a pipe, a file, a test): wide enough that no
#: table is cut or wrapped. On a terminal, columns fold (never cut) to its width.
PLAIN_WIDTH = 10_000
#: Longest word a table column keeps whole on a narrow terminal (longer ones fold).
MAX_WORD = 48

PLAN_CAPTION = ("us: measured at the tuned point; ~us: modelled (between or beyond tuned sizes, or from "
                "another dtype's or mode's rows). raises: no backend can serve the call in that mode")


def console():
    """A rich console for the commands' output (see PLAIN_WIDTH)."""
    terminal = Console()
    return terminal if terminal.is_terminal else Console(width=PLAIN_WIDTH)


def table(title: str, columns: list[str], rows: list[list], caption: Optional[str] = None):
    """A rich table whose cells wrap between words, never inside one, when the console is narrow
    (each column at least its longest word wide, up to MAX_WORD): names are never cut."""
    cells = [[str(v) for v in row] for row in rows]
    table = Table(title=title, caption=caption)
    for i, column in enumerate(columns):
        longest = max((len(word) for row in cells for word in row[i].split()), default=0)
        table.add_column(column, overflow="fold", min_width=min(longest, MAX_WORD))
    for row in cells:
        table.add_row(*[Text(v) for v in row])  # text, not markup: configs and remedies hold [...]
    return table


class Target(NamedTuple):
    """The machine and call family `explain` and the plans are for."""

    hardware: str
    gpu: str
    world_size: int
    dtype: str


def tuned_hardware(sources) -> dict[str, tuple[str, set]]:
    """hardware slug -> (GPU name, world sizes) of every row of ``sources``."""
    tuned: dict[str, tuple[str, set]] = {}
    for source in sources:
        for row in source.db.rows():
            tuned.setdefault(row.hardware, (row.gpu, set()))[1].add(row.world_size)
    return tuned


def _listing(sources) -> str:
    """The tuned hardware of ``sources`` as `--gpu` options ('none' without any)."""
    return "; ".join(f"--gpu {gpu!r} ({slug}, world size {', '.join(map(str, sorted(sizes)))})"
                     for slug, (gpu, sizes) in sorted(tuned_hardware(sources).items())) or "none"


def check_hardware(target: Target, sources) -> None:
    """A usage error (--gpu) when no row of ``sources`` is for the GPU ``--gpu`` named
    (``target.hardware``), listing the tuned hardware."""
    if target.hardware in tuned_hardware(sources):
        return
    where = ", ".join(source.label for source in sources) or "no tuning database found"
    raise click.BadParameter(
        f"--gpu {target.gpu!r} (hardware {target.hardware}) matches no tuned hardware in {where}; "
        f"tuned: {_listing(sources)} (on untuned hardware NCCL serves every call)", param_hint="--gpu")


def untuned_note(target: Target, sources) -> Optional[str]:
    """What `explain` says first when it answers for this machine and no row of ``sources`` is
    for its hardware (None where one is)."""
    if target.hardware in tuned_hardware(sources):
        return None
    return (f"This machine (GPU {target.gpu!r}, hardware {target.hardware}) is untuned: no tuning database row is "
            f"for it, so each call takes its op's fallbacks. Tuned: {_listing(sources)}.")


def selected_shapes(record: OpSpec, values: Values, candidates: Sequence) -> list:
    """The shapes of ``record``'s kind option ``values`` ask for among ``candidates``; a usage
    error naming the option whose values no call has."""
    try:
        return record.shape.select(values, candidates)
    except OptionError as exc:
        raise click.BadParameter(str(exc), param_hint=exc.flag) from None


def explained_problem(record: OpSpec, values: Values, size_text: str, target: Target) -> Problem:
    """The Problem `explain` is asked about: one size in the op's unit (its ``unit.option``, given
    as ``size_text``) with the one shape its kind's options name; a size or shape no call can have
    (or that the unit refuses: autosymm.spec.kinds.BucketUnit.refuse) is a usage error."""
    unit, kind = record.unit, record.shape
    size = unit.option.of(values)
    if size is None:
        raise click.BadParameter(f"give {unit.option.flag} or --all", param_hint=unit.option.flag)
    shape = None
    if kind:
        if kind.option.of(values) is None:
            raise click.BadParameter(f"{record.name} needs {kind.option.flag}", param_hint=kind.option.flag)
        shape = selected_shapes(record, values, ())[0]
        why = record.no_calls(shape)
        if why:
            raise click.BadParameter(why, param_hint=kind.option.flag)
    try:
        problem = record.problem_at(target.dtype, target.world_size, size, shape)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint=(kind or unit).option.flag) from None
    why = unit.refuse(problem, size_text)
    if why:
        raise click.BadParameter(why, param_hint=unit.option.flag)
    return problem


def offline_caps(target: Target):
    """Capabilities assumed when explaining for another machine: the default workspace (or
    AUTOSYMM_WORKSPACE_BYTES), intra-node (autosymm.backends.Capabilities.of)."""
    cc = (9, 0) if any(name in target.gpu.upper() for name in ("H100", "H200", "H800", "H20", "GH200")) else (8, 0)
    return Capabilities.of(target.world_size, region_bytes=default_region_bytes(), compute_capability=cc)


def cannot_serve(decision, problem: Problem, caps, mode: str) -> Optional[tuple[str, str]]:
    """(why, remedy) when the call raises although ``decision`` names a backend: that backend
    cannot serve it in ``mode`` (NCCL's all_to_all inside a CUDA-graph capture); the remedy is
    the one the skipped backends name (autosymm.init(moe=[autosymm.MoEPlan(...)])) or ''.
    None when the backend serves the call."""
    try:
        why = get_backend(decision.backend).why_not(problem, caps, mode)
    except KeyError as exc:
        why = str(exc)
    if why is None:
        return None
    remedies = [text[text.index("autosymm.init("):] for text in decision.skipped if "autosymm.init(" in text]
    return f"{decision.backend}: {why}", (f"reserve the MoE room before capturing: {remedies[0]}" if remedies else "")


def explain_lines(problem: Problem, modes, target: Target, sources) -> list[str]:
    """`explain`'s lines for one call: the decision per mode and the faster rows passed over."""
    caps, lines = offline_caps(target), []
    for mode in modes:
        decision = decide(problem, mode, caps, sources, target.hardware, settings.deterministic())
        raises = cannot_serve(decision, problem, caps, mode)
        verdict = decision.describe()
        if raises:
            why, remedy = raises
            verdict = f"raises - no backend can serve it in {mode} mode ({why})" + (f"; {remedy}" if remedy else "")
        lines.append(f"{problem.describe()} [{mode}] on {target.gpu} ({target.hardware}): {verdict}")
        lines += [f"  skipped {skipped}" for skipped in decision.skipped]
    return lines


def plan(console, target: Target, sources, records: Sequence[OpSpec], modes=MODES,
         values: Optional[Values] = None) -> None:
    """One table per op of ``records``: the decision at every default and tuned size (and shape,
    as its kind's option ``values`` select)."""
    hardware, gpu, world_size, dtype = target
    caps, deterministic = offline_caps(target), settings.deterministic()
    for record in records:
        problems = _plan_problems(record, target, sources, values or {})
        if not problems:
            continue
        body = []
        for label, problem in problems:
            row = [label]
            for m in modes:
                row += _plan_cells(decide(problem, m, caps, sources, hardware, deterministic), problem, caps, m)
            body.append(row)
        columns = [record.unit.column]
        for m in modes:
            columns += [f"{m} backend", f"{m} config", f"{m} us", f"{m} vs NCCL"]
        title = f"{record.name} plan: {world_size}x {gpu} ({hardware}), {dtype}"
        console.print(table(title, columns, body, PLAN_CAPTION))


def _plan_cells(decision, problem: Problem, caps, mode: str) -> list[str]:
    """(backend, config, us, vs NCCL) of one decision; a call that would raise says so."""
    raises = cannot_serve(decision, problem, caps, mode)
    if raises:
        return ["raises", "; ".join(text for text in raises if text), "-", "-"]
    us = decision.expected_us
    return [decision.backend, _short_config_obj(decision.config),
            "-" if not us else f"{us:.2f}" if decision.measured else f"~{us:.2f}",
            f"{decision.nccl_us / us:.2f}x" if decision.nccl_us and us else "-"]


def _plan_problems(record: OpSpec, target: Target, sources, values: Values) -> list[tuple[str, Problem]]:
    """(label, problem) of every default point of the op (its ``points``) and every point the
    sources tuned it at, for the target's hardware and world size; its shapes (of the default and
    tuned ones) as its kind's option ``values`` select."""
    hardware, _, world_size, dtype = target
    rows = [row for source in sources
            for row in source.db.rows(hardware=hardware, world_size=world_size, op=record.name)]
    sizes = sorted({row.bucket for row in rows} | set(record.points.sizes))
    request = PointRequest((dtype,), world_size, sizes=sizes, extra_sizes=False)
    if record.shape:
        tuned = {record.shape_of_key(row.shape) for row in rows}
        candidates = sorted(tuned | set(record.points.shapes), key=record.shape.sort_key)
        request = replace(request, shapes=selected_shapes(record, values, candidates))
    return [(f"{record.point_label(p, ' ')}{record.unit.label_suffix}", p) for p in record.problems(request)]


def _short_config_obj(config) -> str:
    if config is None:
        return "-"
    return " ".join(f"{k}={v}" for k, v in config_fields(config).items() if k != "algorithm")
