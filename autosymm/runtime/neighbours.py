"""Which tuned rows may serve a call that was not tuned at its exact size, and how long each
would take there: a model fitted to the rows. Pure functions of the call and the rows, so every
rank that reads the same databases gets the same answer (autosymm.runtime.dispatch decides with them).

Points. A row is tuned at one size, its ``bucket`` (bytes for all-reduce, tokens per rank for
MoE; autosymm.problem). A call of size n uses the rows at n when there are any, else those at its
neighbouring tuned sizes L < n < U (only one of them outside the tuned range). Every backend runs
any size its ``why_not`` accepts with any of its configs, so a row tuned at another size is a
valid candidate (the dispatcher still asks ``why_not`` for the call itself); only its time at n
is unknown, and is modelled:

* a call below the smallest tuned size: the times measured there (they bound a smaller call);
* a (backend, config) tuned at both L and U (config-less backends such as NCCL always are, Triton
  configs often at large sizes): the two measured times, interpolated linearly in n;
* else, from its one row (time t at size s): ``f + (t - f) * growth``, where f is the
  backend's floor (:func:`floors_of`: its time at size 0 on the line through its two smallest
  tuned sizes, launch and synchronisation, below its fastest time) and ``growth``
  (:func:`growth`) how the work on the critical path changes from s to n: for a Triton
  all-reduce config the rounds one program makes (a config tuned larger keeps its time at a
  smaller call until a round drops; on 2x H200 the 4 MiB push config took the 4 MiB time at
  3 MB), else the bytes moved; for n > s never less than the bytes ratio.

MoE shapes without rows: the nearest tuned (shape, tokens per rank) point by bytes per row
(d_model x element bytes) and rows per rank (tokens x top-k), distance
``|ln(a / a')| + |ln(b / b')|`` (:func:`nearest_moe_point`); its rows are modelled with the
bytes-moved growth above.
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
