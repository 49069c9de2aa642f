"""Warm-up tuning, the runtime's half: where the first eager call of a key this node has no row
for is handed to the warm-up tuner the user switched on (``autosymm.autotune``, the tuning side,
autosymm.tuning.warmup), and how the rows it measured join the group's sources. The runtime never
imports the tuning side: the tuner registers itself in :data:`TUNERS` (as the workspace hands its
staging listeners).

Every rank does the same: a call's first use is agreed (autosymm.runtime.entry), and each rank's
word that it is inside a tuner's context rides in that agreement, so either every rank tunes the
key, in lock-step, or none does; whether a key lacks rows is a pure function of the agreed
sources. Nothing is tuned (nor allocated) while the current stream captures a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, Sequence

from ..db.schema import Key
from ..hardware import nccl_version
from ..problem import MODES, Problem

#: The warm-up tuners switched on in this process, innermost last (autosymm.tuning.warmup).
TUNERS: list = []


@dataclass(frozen=True)
class Tuned:
    """What one warm-up tune of a key gave, the same on every rank: the rows to serve from now
    on (``rows``, db.schema.Row; none where the tune found nothing or could not run), where they
    were stored (``label``: the user database, for decisions) and what to say of it (``note``:
    autosymm.explain adds it to the key's decisions)."""

    rows: Sequence[Any] = ()
    label: str = ""
    note: str = ""


class WarmupTuner(Protocol):
    """What the tuning side registers: ``modes_for(state)`` (the modes it tunes on a group),
    ``tunes(problem)`` (this op, by the tuner's settings) and ``tune(state, problem, why)``
    (collective over the group's ranks, in lock-step; never raises: a failure is a Tuned without
    rows saying why)."""

    def modes_for(self, state: Any) -> Sequence[str]: ...

    def tunes(self, problem: Problem) -> bool: ...

    def tune(self, state: Any, problem: Problem, why: str) -> Tuned: ...


def active_tuner() -> Optional[WarmupTuner]:
    return TUNERS[-1] if TUNERS else None


def wants(problem: Problem) -> bool:
    """This rank's word on a call's first use: a warm-up tuner is on here and tunes its op."""
    tuner = active_tuner()
    return tuner is not None and tuner.tunes(problem)


@dataclass
class WarmupLog:
    """A group's warm-up tuning so far: keys tuned, and the note of each key tried."""

    tuned: int = 0
    notes: dict[tuple, str] = field(default_factory=dict)


def missing(state: Any, problem: Problem, modes: Sequence[str] = MODES) -> str:
    """Why ``problem`` has no rows of its own on this node ('' where it has): no row at its exact
    key (hardware, world size, op, dtype, size, shape) in each of ``modes`` measured with the
    running NCCL (major.minor), or, on a group inside a serving stack, none that timed that
    stack's path."""
    if problem.record.outside_domain(problem):
        return ""  # no kernel computes it: nothing to tune
    running = nccl_version()
    for mode in modes:
        key = Key.for_problem(state.hardware, problem, mode)
        rows = [row for source in state.sources for row in source.family(key) if row.bucket == key.bucket]
        if not rows:
            return f"no {mode}-mode row at this size on {state.hardware}"
        if running and not any(_same_nccl(row.nccl_version, running) for row in rows):
            return f"no {mode}-mode row measured with NCCL {running}"
        stack = state.caps.stack
        if stack and not any(row.stack == stack for row in rows):
            return f"no {mode}-mode row timed against {stack}'s own path"
    return ""


def _same_nccl(measured: Optional[str], running: str) -> bool:
    return bool(measured) and measured.split(".")[:2] == running.split(".")[:2]


def tune_first_call(state: Any, problem: Problem, every_rank_wants: bool) -> bool:
    """At a key's first use, after the agreement (every rank here together): tune ``problem``
    when every rank's tuner is on and no rank's stream captures (``every_rank_wants``) and the
    node has no rows for it; its rows then join ``state``'s sources. True when rows were added
    (the caller decides the call again)."""
    if not every_rank_wants:
        return False
    tuner = active_tuner()
    why = missing(state, problem, tuner.modes_for(state))
    if not why:
        return False
    tuned = tuner.tune(state, problem, why)
    state.warmup.notes[key_of(problem)] = tuned.note
    if not tuned.rows:
        return False
    state.add_rows(tuned.rows, tuned.label)
    state.warmup.tuned += 1
    return True


def key_of(problem: Problem) -> tuple:
    """The key a warm-up note is kept under (the problem's database key, mode aside)."""
    return problem.op, problem.record.key_dtype(problem), problem.bucket, problem.shape_key
