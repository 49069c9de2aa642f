"""Which tuned rows may serve a call that was not tuned at its exact size, and how long each would
take there: a model fitted to the rows, pure functions of the call and the rows (every rank that
reads the same databases gets the same answer; autosymm.runtime.dispatch decides with them).

A call of size n uses the rows at n, else those at its neighbouring tuned sizes L < n < U. A row
tuned at another size is a valid candidate (``why_not`` is still asked for the call); its time at
n is modelled: below the smallest tuned size, the time measured there; a (backend, config) tuned at
both L and U, interpolated linearly; else ``f + (t - f) * growth`` from its one row (f the
backend's floor, :func:`floors_of`; :func:`growth` the change of the critical path's work: rounds
per program for a Triton all-reduce config, else bytes moved). MoE shapes without rows take the
nearest tuned (shape, tokens per rank) point (:func:`nearest_moe_point`).

Design notes: docs/DISPATCH.md#runtime-neighbours
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from ..configs import AllReduceConfig
from ..db.schema import Row
from ..problem import DTYPES, MoEShape, Problem

_ELEM_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
assert set(_ELEM_BYTES) == set(DTYPES)


@dataclass(frozen=True)
class RowCandidate:
    """A tuned row that may serve a call: its source (database label) and modelled time (us)."""

    row: Row
    source: str
    modelled_us: float
    interpolated: bool = False  # measured at both neighbours: interpolated, not modelled from one


def points_around(size: int, tuned: Sequence[int]) -> tuple[int, ...]:
    """The tuned sizes a call of ``size`` uses: ``(size,)`` when tuned, else its nearest tuned
    sizes below and above (one of them when ``size`` is outside the tuned range; () without any)."""
    if size in tuned:
        return (size,)
    below = [s for s in tuned if s < size]
    above = [s for s in tuned if s > size]
    return tuple(([max(below)] if below else []) + ([min(above)] if above else []))


def _rounds(config: AllReduceConfig, nbytes: int, elem_bytes: int, world_size: int) -> int:
    """BLOCK-wide chunks one program of ``config`` handles for an all-reduce of ``nbytes``."""
    numel = max(1, -(-nbytes // elem_bytes))
    chunks = -(-config.record.share(numel, world_size) // config.block_size)
    return -(-chunks // config.num_blocks)


def growth(row: Row, problem: Problem) -> float:
    """How the work on the critical path grows from ``row``'s tuned point to the call ``problem``
    (1.0 at the same point; see the module docstring)."""
    moved = problem.record.moved_ratio(problem, row)  # bytes, tokens, or MoE bytes moved (the op's model)
    config = row.config_obj
    if not isinstance(config, AllReduceConfig):
        return moved
    rounds = (_rounds(config, problem.nbytes, problem.elem_bytes, problem.world_size)
              / _rounds(config, row.bucket, _ELEM_BYTES[row.dtype], row.world_size))
    return max(rounds, moved) if moved > 1.0 else rounds


def modelled_us(row: Row, problem: Problem, floor_us: float) -> float:
    """``row``'s time (us) modelled at ``problem`` from its own median: the part above the
    backend's floor ``floor_us`` (:func:`floors_of`) scales with :func:`growth`."""
    fixed = min(floor_us, row.median_us)
    return fixed + (row.median_us - fixed) * growth(row, problem)


def _interpolated(low: Row, high: Row, size: int) -> float:
    share = (size - low.bucket) / (high.bucket - low.bucket)
    return low.median_us + (high.median_us - low.median_us) * share


def candidates(problem: Problem, rows: Iterable[tuple[str, Row]], floors: dict[str, float]) -> list[RowCandidate]:
    """Every (source label, row) as a :class:`RowCandidate` at ``problem``, fastest modelled first
    (ties: the row tuned nearest, then backend name); a (backend, config) with rows on both sides
    of the call is one candidate, its times interpolated. A call below the smallest tuned size
    (of its own shape) keeps the times measured there, which bound it. ``floors``: backend -> its
    floor (:func:`floors_of`)."""
    size = problem.bucket
    rows = list(rows)
    by_config: dict[tuple[str, str], list[tuple[str, Row]]] = {}
    for label, row in rows:
        by_config.setdefault((row.backend, row.config), []).append((label, row))
    # below the smallest tuned size of the call's own shape: the times measured there bound it
    below_range = all(row.bucket > size and row.shape == problem.shape_key for _, row in rows)
    out = []
    for (backend, _), found in by_config.items():
        below = [item for item in found if item[1].bucket < size]
        above = [item for item in found if item[1].bucket > size]
        if below and above:
            label, low = max(below, key=lambda item: item[1].bucket)
            high = min(above, key=lambda item: item[1].bucket)[1]
            out.append(RowCandidate(low, label, _interpolated(low, high, size), interpolated=True))
            continue
        for label, row in found:
            modelled = row.median_us if below_range else modelled_us(row, problem, floors.get(backend, row.median_us))
            out.append(RowCandidate(row, label, modelled))
    out.sort(key=lambda c: (c.modelled_us, abs(math.log(c.row.bucket / size)), c.row.backend, c.row.bucket))
    return out


#: A backend's floor is at most this share of its fastest time: a round more never models as free.
FLOOR_MAX_SHARE = 0.95


def floors_of(rows: Iterable[Row]) -> dict[str, float]:
    """backend -> its floor (us): the time its line through its two smallest tuned sizes takes
    at size 0 (launch and synchronisation), within [0, FLOOR_MAX_SHARE x its fastest time]
    (that bound alone with one tuned size). ``rows``: one lookup's rows of one shape."""
    by_backend: dict[str, dict[int, float]] = {}
    for row in rows:
        times = by_backend.setdefault(row.backend, {})
        times[row.bucket] = min(times.get(row.bucket, math.inf), row.median_us)
    floors = {}
    for backend, times in by_backend.items():
        bound = FLOOR_MAX_SHARE * min(times.values())
        sizes = sorted(times)
        if len(sizes) < 2:
            floors[backend] = bound
            continue
        (s1, t1), (s2, t2) = (sizes[0], times[sizes[0]]), (sizes[1], times[sizes[1]])
        floors[backend] = min(bound, max(0.0, t1 - s1 * (t2 - t1) / (s2 - s1)))
    return floors


def nearest_moe_point(problem: Problem, points: Iterable[tuple[str, int]]) -> Optional[tuple[str, int]]:
    """The tuned (shape key, tokens per rank) nearest to the MoE call ``problem`` by bytes per
    row and rows per rank (module docstring); ties broken by shape key, then tokens. None
    without points."""
    shape = problem.shape
    row_bytes, rows = shape.d_model * problem.elem_bytes, problem.n_tokens_local * shape.n_expts_act

    def distance(point: tuple[str, int]) -> tuple[float, str, int]:
        other = MoEShape.from_key(point[0])
        return (abs(math.log(other.d_model * problem.elem_bytes / row_bytes))
                + abs(math.log(point[1] * other.n_expts_act / rows)), point[0], point[1])

    return min(points, key=distance, default=None)


def moe_ratios(problem: Problem, shape_key: str, tokens: int) -> tuple[float, float]:
    """(bytes per row, rows per rank) of the call over those of the tuned point (shape, tokens)."""
    other = MoEShape.from_key(shape_key)
    return (problem.shape.d_model / other.d_model,
            problem.n_tokens_local * problem.shape.n_expts_act / (tokens * other.n_expts_act))
