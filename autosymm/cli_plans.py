"""Dispatch plans for the command line: the decision for a call, or over every default size,
on a given machine without a GPU (`autosymm explain`, `autosymm run` without GPUs)."""

from __future__ import annotations

from typing import NamedTuple, Optional

import click

from .problem import MODES, MoEShape, Problem, format_bytes, parse_bytes, parse_size_range

DEFAULT_SIZES = "4KiB:256MiB"
DEFAULT_TOKENS = "1,4,16,64,256,1024,4096,8192"  # autosymm.tuning.sweep.MOE_TOKENS


def table(title: str, columns: list[str], rows: list[list]):
    from rich.table import Table

    table = Table(title=title)
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*[str(v) for v in row])
    return table


class Target(NamedTuple):
    """The machine and call family `explain` and the plans are for."""

    hardware: str
    gpu: str
    world_size: int
    dtype: str


def explained_problem(op: str, nbytes: Optional[str], tokens: Optional[int], moe_shape, target: Target,
                      hidden: Optional[int] = None) -> Problem:
    if op == "all_reduce":
        if nbytes is None:
            raise click.BadParameter("give --bytes or --all", param_hint="--bytes")
        try:
            size = parse_bytes(nbytes)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--bytes") from None
        return Problem.all_reduce(size, target.dtype, target.world_size)
    if tokens is None:
        raise click.BadParameter("give --tokens or --all", param_hint="--tokens")
    if op == "all_reduce_rmsnorm":
        return Problem.all_reduce_rmsnorm(tokens, hidden, target.dtype, target.world_size)
    return Problem.moe(op, moe_shape, tokens, target.dtype, target.world_size)


def offline_caps(target: Target):
    """Capabilities assumed when explaining for another machine: the default workspace (or
    AUTOSYMM_WORKSPACE_BYTES), intra-node (autosymm.backends.Capabilities.of)."""
    from .backends import Capabilities
    from .settings import default_region_bytes

    cc = (9, 0) if any(name in target.gpu.upper() for name in ("H100", "H200", "H800", "H20", "GH200")) else (8, 0)
    return Capabilities.of(target.world_size, region_bytes=default_region_bytes(), compute_capability=cc)


def plan(console, target: Target, sources, moe_shape, ops, modes=MODES, hidden: Optional[int] = None) -> None:
    """One table per op: the decision at every default size (or shape x token count)."""
    from .dispatch import decide

    hardware, gpu, world_size, dtype = target
    caps = offline_caps(target)
    tokens = [int(t) for t in DEFAULT_TOKENS.split(',')]
    for this_op in ops:
        if this_op == "all_reduce":
            problems = [(format_bytes(s), Problem.all_reduce(s, dtype, world_size)) for s in parse_size_range(DEFAULT_SIZES)]
        elif this_op == "all_reduce_rmsnorm":
            from .tuning.sweep import FUSED_HIDDEN

            problems = [(f"h{h} {t} tok", Problem.all_reduce_rmsnorm(t, h, dtype, world_size))
                        for h in ([hidden] if hidden else FUSED_HIDDEN) for t in tokens]
        else:
            shapes = [moe_shape] if moe_shape else _shapes_in(sources, hardware, world_size, this_op)
            problems = [(f"{s.key} {t} tok", Problem.moe(this_op, s, t, dtype, world_size)) for s in shapes for t in tokens]
        if not problems:
            continue
        body = []
        for label, problem in problems:
            row = [label]
            for m in modes:
                d = decide(problem, m, caps, sources, hardware)
                row += [d.backend, _short_config_obj(d.config),
                        f"{d.expected_us:.2f}" if d.expected_us else "-",
                        f"{d.nccl_us / d.expected_us:.2f}x" if d.nccl_us and d.expected_us else "-"]
            body.append(row)
        columns = ["size" if this_op == "all_reduce" else "shape/tokens"]
        for m in modes:
            columns += [f"{m} backend", f"{m} config", f"{m} us", f"{m} vs NCCL"]
        console.print(table(f"{this_op} plan: {world_size}x {gpu} ({hardware}), {dtype}", columns, body))


def _shapes_in(sources, hardware, world_size, op) -> list[MoEShape]:
    keys = set()
    for source in sources:
        for row in source.db.rows(hardware=hardware, world_size=world_size, op=op):
            keys.add(row.shape)
    return [MoEShape.from_key(k) for k in sorted(keys) if k]


def _short_config_obj(config) -> str:
    from .configs import config_fields

    if config is None:
        return "-"
    return " ".join(f"{k}={v}" for k, v in config_fields(config).items() if k != "algorithm")
