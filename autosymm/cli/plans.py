"""Dispatch plans for the command line: the decision for a call, or over every default and tuned
size, on a given machine without a GPU (`autosymm explain`, `autosymm run` without GPUs).

What a plan says is what a call would do: a time is marked measured (the row's own, at the
call's size, dtype, shape and mode) or modelled; a call no backend can serve in its mode (a
graph-mode MoE call too large for the MoE region: NCCL's all_to_all cannot be captured) is shown
as raising, with the remedy, never as served by the backend that cannot take it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple, Optional

import click

from .. import spec, settings
from ..spec import PointRequest
from ..spec.moe import TOKENS
from ..problem import MODES, Problem, format_bytes, parse_bytes, parse_size_range
from ..settings import MAX_WORKSPACE_BYTES
from ..units import MAX_SIZE

DEFAULT_SIZES = "4KiB:256MiB"
DEFAULT_TOKENS = ",".join(map(str, TOKENS))  # the MoE specs' default tuning points

#: Width of a console that is not a terminal (a pipe, a file, a test): wide enough that no
#: table is cut or wrapped. On a terminal, columns fold (never cut) to its width.
PLAIN_WIDTH = 10_000
#: Longest word a table column keeps whole on a narrow terminal (longer ones fold).
MAX_WORD = 48

PLAN_CAPTION = ("us: measured at the tuned point; ~us: modelled (between or beyond tuned sizes, or from "
                "another dtype's or mode's rows). raises: no backend can serve the call in that mode")


def console():
    """A rich console for the commands' output (see PLAIN_WIDTH)."""
    from rich.console import Console

    terminal = Console()
    return terminal if terminal.is_terminal else Console(width=PLAIN_WIDTH)


def table(title: str, columns: list[str], rows: list[list], caption: Optional[str] = None):
    """A rich table whose cells wrap between words, never inside one, when the console is narrow
    (each column at least its longest word wide, up to MAX_WORD): names are never cut."""
    from rich.table import Table
    from rich.text import Text

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


def check_hardware(target: Target, sources, whose: str) -> None:
    """A usage error (--gpu) when no row of ``sources`` is for ``target.hardware``, listing the
    tuned hardware; ``whose``: how the GPU name was chosen, for the message."""
    tuned: dict[str, tuple[str, set]] = {}
    for source in sources:
        for row in source.db.rows():
            tuned.setdefault(row.hardware, (row.gpu, set()))[1].add(row.world_size)
    if target.hardware in tuned:
        return
    listing = "; ".join(f"--gpu {gpu!r} ({slug}, world size {', '.join(map(str, sorted(sizes)))})"
                        for slug, (gpu, sizes) in sorted(tuned.items()))
    where = ", ".join(source.label for source in sources) or "no tuning database found"
    raise click.BadParameter(
        f"{whose} {target.gpu!r} (hardware {target.hardware}) matches no tuned hardware in {where}; "
        f"tuned: {listing or 'none'} (on untuned hardware NCCL serves every call)", param_hint="--gpu")


def explained_epilogue(opts: dict, record):
    """The fused op's epilogue of `explain`'s --epilogue, or of --quant/--gemma/--no-residual
    (None: not the fused op, or the default); a usage error naming the option otherwise."""
    from ..epilogue import DEFAULT, Epilogue
    from ..spec.all_reduce_rmsnorm import parse_epilogues

    flags = opts["quant"] is not None or opts["gemma"] or opts["no_residual"]
    if (flags or opts["epilogue"]) and not record.shape.takes_epilogue:
        raise click.BadParameter(f"--epilogue, --quant, --gemma and --no-residual are all_reduce_rmsnorm's, not "
                                 f"{opts['op']}'s", param_hint="--op")
    if opts["epilogue"] is None:
        return Epilogue(residual=not opts["no_residual"], gemma=opts["gemma"], quant=opts["quant"]) if flags else None
    if flags:
        raise click.BadParameter("give --epilogue or --quant/--gemma/--no-residual, not both", param_hint="--epilogue")
    try:
        epilogues = parse_epilogues(opts["epilogue"])
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--epilogue") from None
    if len(epilogues) != 1:
        raise click.BadParameter(f"{opts['epilogue']!r} is not one epilogue", param_hint="--epilogue")
    return None if epilogues[0] == DEFAULT else epilogues[0]


def explained_problem(record, opts: dict, moe_shape, target: Target, epilogue=None) -> Problem:
    """The Problem `explain` is asked about: one size in the op's unit (``--bytes`` or
    ``--tokens``: ``record.unit.option``) with the op's shape (``moe_shape`` or ``--hidden``) and
    the fused op's ``epilogue`` (None the default); sizes no call can have (or that exceed the
    workspace's all-reduce region) are usage errors."""
    unit = record.unit
    request = PointRequest((target.dtype,), target.world_size, moe_shapes=(moe_shape,), hidden=(opts["hidden"],),
                           extra_tokens=False, epilogues=None if epilogue is None else (epilogue,))
    given = opts[unit.option_dest]
    if given is None:
        raise click.BadParameter(f"give {unit.option} or --all", param_hint=unit.option)
    return _SIZE_READERS[unit](record, request, given, target, epilogue)


def _bytes_problem(record, request: PointRequest, text: str, target: Target, epilogue) -> Problem:
    try:
        size = parse_bytes(text)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--bytes") from None
    return record.problems(replace(request, sizes=(_checked_bytes(text, size, target),)))[0]


def _tokens_problem(record, request: PointRequest, tokens: int, target: Target, epilogue) -> Problem:
    problems = record.problems(replace(request, tokens=(tokens,)))
    if not problems:  # the epilogue cannot take this hidden size (NVFP4: a multiple of 16)
        raise click.BadParameter(f"epilogue {epilogue.key!r} cannot serve hidden={request.hidden[0]} (NVFP4 packs "
                                 "blocks of 16)", param_hint="--hidden")
    problem = problems[0]
    if problem.nbytes > MAX_SIZE:
        raise click.BadParameter(f"{tokens} tokens per rank make {problem.nbytes} bytes, over 2^63 - 1",
                                 param_hint="--tokens")
    return problem


#: How `explain` reads one size, per bucket unit (autosymm.spec.BYTES / TOKENS).
_SIZE_READERS = {spec.BYTES: _bytes_problem, spec.TOKENS: _tokens_problem}


def _checked_bytes(text: str, size: int, target: Target) -> int:
    """``size`` (read from ``text``) when an all-reduce tensor of ``target.dtype`` can have it
    and it fits the all-reduce region; a usage error saying which limit it breaks otherwise."""
    elem = Problem.all_reduce(0, target.dtype, target.world_size).elem_bytes
    region = offline_caps(target).all_reduce_bytes
    if size < elem or size % elem:
        raise click.BadParameter(f"{text!r} ({size} B) is not a whole, non-zero number of {target.dtype} elements "
                                 f"({elem} B each)", param_hint="--bytes")
    if size > region:
        raise click.BadParameter(
            f"{text!r} ({format_bytes(size)}) is over the workspace's all-reduce region ({format_bytes(region)}: the "
            f"default, or half of AUTOSYMM_WORKSPACE_BYTES, at most {format_bytes(MAX_WORKSPACE_BYTES // 2)}); "
            f"no tuned kernel can take it (NCCL serves such a call)",
            param_hint="--bytes")
    return size


def offline_caps(target: Target):
    """Capabilities assumed when explaining for another machine: the default workspace (or
    AUTOSYMM_WORKSPACE_BYTES), intra-node (autosymm.backends.Capabilities.of)."""
    from ..backends import Capabilities
    from ..settings import default_region_bytes

    cc = (9, 0) if any(name in target.gpu.upper() for name in ("H100", "H200", "H800", "H20", "GH200")) else (8, 0)
    return Capabilities.of(target.world_size, region_bytes=default_region_bytes(), compute_capability=cc)


def cannot_serve(decision, problem: Problem, caps, mode: str) -> Optional[tuple[str, str]]:
    """(why, remedy) when the call raises although ``decision`` names a backend: that backend
    cannot serve it in ``mode`` (NCCL's all_to_all inside a CUDA-graph capture); the remedy is
    the one the skipped backends name (autosymm.init(moe=[autosymm.MoEPlan(...)])) or ''.
    None when the backend serves the call."""
    from ..backends import get_backend

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
    from ..runtime.dispatch import decide

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


def plan(console, target: Target, sources, moe_shape, ops, modes=MODES, hidden: Optional[int] = None,
         epilogue=None) -> None:
    """One table per op: the decision at every default and tuned size (or shape x token count)."""
    from ..runtime.dispatch import decide

    hardware, gpu, world_size, dtype = target
    caps, deterministic = offline_caps(target), settings.deterministic()
    for this_op in ops:
        record = spec.get(this_op)
        problems = _plan_problems(record, target, sources, moe_shape, hidden, epilogue)
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
        console.print(table(f"{this_op} plan: {world_size}x {gpu} ({hardware}), {dtype}", columns, body, PLAN_CAPTION))


def _plan_cells(decision, problem: Problem, caps, mode: str) -> list[str]:
    """(backend, config, us, vs NCCL) of one decision; a call that would raise says so."""
    raises = cannot_serve(decision, problem, caps, mode)
    if raises:
        return ["raises", "; ".join(text for text in raises if text), "-", "-"]
    us = decision.expected_us
    return [decision.backend, _short_config_obj(decision.config),
            "-" if not us else f"{us:.2f}" if decision.measured else f"~{us:.2f}",
            f"{decision.nccl_us / us:.2f}x" if decision.nccl_us and us else "-"]


def _plan_problems(record, target: Target, sources, moe_shape, hidden: Optional[int],
                   epilogue=None) -> list[tuple[str, Problem]]:
    """(label, problem) of every default point of the op (``record``: its sizes; its shapes or
    hidden sizes, tuned by default; the fused op's ``epilogue``, None the default) and every
    point the sources tuned it at, 1.5 x 2^k too, for the target's hardware and world size."""
    hardware, _, world_size, dtype = target
    rows = [row for source in sources
            for row in source.db.rows(hardware=hardware, world_size=world_size, op=record.name)]
    points = {row.bucket for row in rows}
    tuned = [record.shape_of_key(key) for key in sorted({row.shape for row in rows if row.shape})]
    request = PointRequest((dtype,), world_size, sizes=sorted(points | set(parse_size_range(DEFAULT_SIZES))),
                           tokens=sorted(points | set(TOKENS)), extra_tokens=False,
                           epilogues=None if epilogue is None else (epilogue,))
    kind = record.shape
    if kind:
        one = {"moe_shapes": moe_shape, "hidden": hidden}[kind.request_field]
        default = getattr(record.points, kind.points_field)
        request = replace(request, **{kind.request_field: [one] if one else
                                      sorted(set(tuned) | set(default), key=kind.sort_key)})
    return [(f"{record.point_label(p, ' ')}{record.unit.label_suffix}", p) for p in record.problems(request)]


def _short_config_obj(config) -> str:
    from ..configs import config_fields

    if config is None:
        return "-"
    return " ".join(f"{k}={v}" for k, v in config_fields(config).items() if k != "algorithm")
