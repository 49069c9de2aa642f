"""Problem -> Decision: which backend and config serve a call, and why.

The decision is a pure function of (problem, mode, capabilities, database rows), so every rank
that sees the same databases decides the same (api.py checks the databases' digest across ranks
once per group, and caches each decision per (op, dtype, size, mode)). Rules, in order:

1. ``AUTOSYMM_DISABLE=1`` -> the fallback backend (NCCL) everywhere.
2. all-reduce over world size 1 -> ``noop`` (the identity).
3. a group spanning nodes -> NCCL, the engine for that scale.
4. the user database, then the shipped ones, under the lookups (dtype, mode, shape) in order:
   the call's own; the other mode's rows; for all-reduce in fp16/fp32 the bf16 rows of the same
   byte size (the kernels are byte-bound); for a MoE shape without rows, the nearest tuned
   shape (below); each fallback said in the reason.
   Points: rows are stored at the size they were tuned at (autosymm.problem: bytes, or tokens
   per rank). A call tuned at its exact size uses those rows; any other uses the rows of its
   neighbouring tuned sizes below and above (one when it lies outside the tuned range), each
   point's rows from the first database that has it. Every candidate row's time at the call is
   modelled from the rows (autosymm.neighbours: interpolated when the same backend and config
   was tuned on both sides, else its floor plus its work scaled to the call, in rounds per
   program for the Triton all-reduce configs), the candidates ranked by it, and the first whose
   backend can serve the call wins (a faster one that cannot — dtype, alignment, size over the
   workspace, no multicast, not capturable in graph mode — is skipped, said in ``skipped``).
   NCCL's own row takes part, so where NCCL measured faster it wins. ``expected_us`` is the
   modelled time; the reason names the tuned point and, off it, the neighbours.
   MoE shapes: the shape (d_model, experts, top-k) is matched exactly; without rows for it, the
   nearest tuned (shape, tokens per rank) by bytes per row and rows per rank.
5. nothing usable -> the fallback: NCCL for all-reduce; for MoE the Triton conversion with its
   default config where it can serve (no NCCL path is graph-capturable), else NCCL all_to_all.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional, Sequence

from . import settings
from .backends import FALLBACK, FALLBACK_ORDER, Capabilities, get_backend
from .configs import AnyConfig, config_fields
from .db_read import DBSource, Lookup
from .db_schema import Key, Row, version_mismatch
from .hardware import running_versions
from .neighbours import RowCandidate, candidates, floors_of, moe_ratios, nearest_moe_point, points_around
from .problem import MOE_OPS, Problem, format_bytes


@dataclass(frozen=True)
class Decision:
    """What serves a call: backend name, its config, and where that came from."""

    backend: str
    config: Optional[AnyConfig]
    reason: str
    source: str = ""  # database file the row came from ('' for fallbacks)
    expected_us: Optional[float] = None
    nccl_us: Optional[float] = None
    bucket: int = 0
    mode: str = "eager"
    skipped: tuple[str, ...] = field(default=(), compare=False)  # "backend: why" of faster rows passed over
    measured: bool = False  # expected_us is the row's own time (the call's size, dtype, shape, mode), not modelled

    def describe(self) -> str:
        text = f"{self.backend}"
        if self.config is not None:
            fields = ", ".join(f"{k}={v}" for k, v in config_fields(self.config).items())
            text += f" [{fields}]"
        if self.expected_us is not None:
            text += f", expected {self.expected_us:.2f} us ({'measured' if self.measured else 'modelled'}"
            if self.nccl_us:
                text += f"; NCCL {self.nccl_us:.2f} us, {self.nccl_us / self.expected_us:.2f}x"
            text += ")"
        text += f" - {self.reason}"
        if self.source:
            text += f" ({Path(self.source).name})"
        return text


def fallback_decision(problem: Problem, mode: str, caps: Capabilities, reason: str) -> Decision:
    """The decision when no tuned row serves ``problem``: the first backend of the op's
    FALLBACK_ORDER that can serve it, with its ``fallback_config``; else the op's FALLBACK."""
    for name in FALLBACK_ORDER[problem.op]:
        backend = get_backend(name)
        if backend.why_not(problem, caps, mode) is None:
            config = backend.fallback_config(problem)
            note = "; untuned default config" if config is not None else ""
            return Decision(name, config, reason + note, bucket=problem.bucket, mode=mode)
    return Decision(FALLBACK[problem.op], None, reason, bucket=problem.bucket, mode=mode)


def _lookups(problem: Problem, mode: str):
    """(dtype, row mode, nearest shape?, note) lookups in order of preference."""
    other = "graph" if mode == "eager" else "eager"
    yield problem.dtype, mode, False, ""
    yield problem.dtype, other, False, f"no {mode}-mode row, using the {other}-mode row"
    if problem.dtype != "bf16" and problem.op == "all_reduce":
        yield "bf16", mode, False, f"no {problem.dtype} row, using the bf16 row of the same byte size"
        yield "bf16", other, False, f"no {problem.dtype} row, using the bf16 {other}-mode row"
    if problem.op in MOE_OPS:
        yield problem.dtype, mode, True, ""
        yield problem.dtype, other, True, f"no {mode}-mode row, using the {other}-mode row"


def _size_text(op: str, size: int) -> str:
    if op != "all_reduce":
        return f"{size} tokens/rank"
    return format_bytes(size) if size % 1024 == 0 else f"{size} B"


def _rows_for(problem: Problem, key: Key, nearest: bool,
              sources: Sequence[DBSource]) -> tuple[list[tuple[str, Row]], list[Row], str]:
    """(source label, row) pairs of the tuned point(s) a call uses under the lookup ``key`` (each
    point's rows from the first source that has it: autosymm.db_read), all rows of the lookup
    (for the backends' floors), and how the point(s) relate to the call."""
    lookup = Lookup(sources, key, any_shape=nearest)
    if nearest:
        point = nearest_moe_point(problem, [p for p in lookup.points() if p[0]])
        if point is None:
            return [], [], ""
        wanted = [point]
        bpr, rpr = moe_ratios(problem, *point)
        how = (f"no row for shape {problem.shape_key}: nearest tuned problem {point[0]} at {point[1]} tokens/rank "
               f"(bytes per row x{bpr:.2f}, rows per rank x{rpr:.2f}), time scaled by the bytes moved")
    else:
        points = points_around(problem.bucket, sorted({bucket for _, bucket in lookup.points()}))
        wanted = [(key.shape, p) for p in points]
        how = _between(problem, points)
    chosen = [pair for point in wanted for pair in lookup.at(*point)]
    return chosen, lookup.rows({shape for shape, _ in wanted}), how


def _between(problem: Problem, points: tuple[int, ...]) -> str:
    """How the tuned ``points`` relate to the call ('' when it was tuned at its size)."""
    size = problem.bucket
    call = f"call of {_size_text(problem.op, size)}"
    if len(points) == 2:
        return f"{call} between tuned {_size_text(problem.op, points[0])} and {_size_text(problem.op, points[1])}"
    if not points or points[0] == size:
        return ""
    side = "below the smallest" if points[0] > size else "above the largest"
    return f"{call} {side} tuned size"


def decide(problem: Problem, mode: str, caps: Capabilities, sources: Sequence[DBSource], hardware: str) -> Decision:
    """The decision for ``problem`` in ``mode`` (see the module docstring for the rules)."""
    if settings.disabled():
        return Decision(FALLBACK[problem.op], None, "AUTOSYMM_DISABLE=1", bucket=problem.bucket, mode=mode)
    if problem.world_size == 1 and problem.op == "all_reduce":
        return Decision("noop", None, "world size 1: nothing to exchange", bucket=problem.bucket, mode=mode)
    if not caps.intra_node:
        return Decision(FALLBACK[problem.op], None, "group spans nodes: NCCL", bucket=problem.bucket, mode=mode)
    skipped: list[str] = []
    key = Key.for_problem(hardware, problem, mode)
    for dtype, row_mode, nearest, note in _lookups(problem, mode):
        chosen, family, how = _rows_for(problem, key._replace(dtype=dtype, mode=row_mode), nearest, sources)
        ranked = candidates(problem, chosen, floors_of(family))
        for candidate in ranked:
            row = candidate.row
            why_not = _why_not(row.backend, problem, caps, mode)
            if why_not is not None:
                text = f"{row.backend}: {why_not}"
                if text not in skipped:
                    skipped.append(text)
                continue
            return _decision(problem, mode, candidate, ranked, (how, note), skipped)
    reason = "no tuned row for this hardware/world size/shape" if not skipped else "no tuned backend can serve the call"
    decision = fallback_decision(problem, mode, caps, reason)
    return replace(decision, skipped=tuple(skipped))


def _decision(problem: Problem, mode: str, candidate: RowCandidate, ranked: list[RowCandidate],
              notes: tuple[str, str], skipped: list[str]) -> Decision:
    """The Decision for the winning ``candidate``. NCCL's time: the row's ``nccl_us`` at the call's
    own size, else the modelled time of the op's baseline row among ``ranked``, else the row's
    ``nccl_us`` (measured at its point)."""
    row = candidate.row
    exact = row.bucket == problem.bucket and row.shape == problem.shape_key
    reason = f"tuned {row.mode} row at {_size_text(problem.op, row.bucket)}"
    how, note = notes
    if how:
        estimate = "interpolated" if candidate.interpolated else "modelled"
        reason += f" ({how}; {estimate} {candidate.modelled_us:.2f} us)"
    for remark in (note, version_mismatch(row, *running_versions())):
        if remark:
            reason += f" ({remark})"
    baseline = next((c.modelled_us for c in ranked if c.row.backend == FALLBACK[problem.op]), None)
    nccl_us = row.nccl_us if (exact and row.nccl_us) or baseline is None else baseline
    return Decision(row.backend, row.config_obj, reason, source=candidate.source, expected_us=candidate.modelled_us,
                    nccl_us=nccl_us, bucket=row.bucket, mode=mode, skipped=tuple(skipped),
                    measured=exact and row.dtype == problem.dtype and row.mode == mode)


def _why_not(backend_name: str, problem: Problem, caps: Capabilities, mode: str) -> Optional[str]:
    try:
        backend = get_backend(backend_name)
    except (KeyError, ImportError) as exc:
        return f"not available here ({exc})"
    return backend.why_not(problem, caps, mode)
