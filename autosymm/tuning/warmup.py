"""Warm-up tuning, the tuning side: ``autosymm.autotune(...)`` (and ``AUTOSYMM_AUTOTUNE``) tunes the
calls a model makes, on the spot, at the first eager call of each key this node has no row for
(autosymm.runtime.warmup decides which, and hands the call here on every rank together).

One key's tune is ``autosymm tune``'s search (the rank protocol, validation before timing, eager
and graph, MAX over ranks, rank 0's word) with a light timing plan, a few configs per backend and a
deadline per key. Inside a serving stack the stack's own path is a baseline and the default to
beat; only candidates computing the reference path's formula compete (``numerics='any'`` lifts
it), under the deterministic setting only batch-invariant ones. The rows go into the user database
and every rank's sources at once; the budget (seconds in total, rank 0's clock) bounds a start,
after which the untuned path serves and ``explain`` says so.

Design notes: docs/TUNING.md#tuning-warmup
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence

import torch.distributed as dist

from .. import settings as env, spec
from ..backends import get_backend
from ..backends.stack import path_formula
from ..db.schema import Key
from ..db.store import Row, TuningDB, user_db_path
from ..problem import MODES, Problem
from ..runtime import warmup as runtime_warmup
from ..runtime.agreement import timeout_s as agree_timeout_s
from .rank_comm import RankComm
from .session import TuneSession, TuneSettings, _load_backends
from .sweep import SweepItem, TimingPlan

log = logging.getLogger("autosymm")

#: Default total budget of a start (s): a TP2 8B-class model's first start stays within 30 s more.
DEFAULT_BUDGET_S = 30.0
#: Default search time of one key (s), both modes; the baselines always run.
DEFAULT_KEY_S = 2.0
#: Tuned configs per backend a key's search may try within its deadline.
DEFAULT_TRIALS = 4
#: A key within this factor of a size already tuned here (same op, dtype, shape and stack) is
#: served from that row's neighbourhood (autosymm.runtime.neighbours) instead of being tuned: a
#: serving stack's 51 default capture sizes need about 16 tunes, not 51.
DEFAULT_SPACING = 1.5
NUMERICS = ("same", "any")


def warmup_plan(problem: Problem, mode: str) -> TimingPlan:
    """A short timing plan (two input buffers, 2 warm-up and 10 timed samples): a warm-up key is
    timed in tens of milliseconds, MAX over ranks, median of the samples."""
    small = problem.nbytes <= (256 << 10)
    return TimingPlan(2, warmup=2, repeats=10, calls_per_sample=4 if small and mode == "eager" else 1,
                      calls_per_graph=8 if small else 2)


@dataclass(frozen=True)
class WarmupSettings:
    """``budget_s``: seconds of tuning in total (0: none); ``key_s``: one key's search;
    ``ops``: the ops tuned (None: every op); ``db``: the database the rows go to (None: the user
    database; '': none, rows served in memory only); ``numerics``: 'same' (only candidates of the
    reference path's formula compete) or 'any'; ``trials``: configs per backend; ``modes``;
    ``backends``: the candidates by name (None: every registered one); ``spacing``: a key within
    this factor of a size tuned here is not tuned (1: every key is); ``clock``: seconds."""

    budget_s: float = DEFAULT_BUDGET_S
    key_s: float = DEFAULT_KEY_S
    ops: Optional[tuple[str, ...]] = None
    db: Optional[str] = None
    numerics: str = "same"
    trials: int = DEFAULT_TRIALS
    modes: tuple[str, ...] = MODES
    backends: Optional[tuple[str, ...]] = None
    spacing: float = DEFAULT_SPACING
    clock: Callable[[], float] = field(default=time.monotonic, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("budget_s", "key_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
                raise ValueError(f"autotune: {name}={value!r} must be a number of seconds >= 0")
        if self.numerics not in NUMERICS:
            raise ValueError(f"autotune: numerics={self.numerics!r} is not one of {NUMERICS}")
        if not isinstance(self.trials, int) or self.trials < 1:
            raise ValueError(f"autotune: trials={self.trials!r} must be an integer >= 1")
        if self.ops is not None:
            unknown = [op for op in self.ops if op not in spec.names()]
            if unknown:
                raise ValueError(f"autotune: ops {unknown} are not among {spec.names()}")
        if not set(self.modes) <= set(MODES) or not self.modes:
            raise ValueError(f"autotune: modes={self.modes!r} must be some of {MODES}")
        if not isinstance(self.spacing, (int, float)) or not self.spacing >= 1:
            raise ValueError(f"autotune: spacing={self.spacing!r} must be a factor >= 1 (1: every key is tuned)")


@dataclass
class KeyReport:
    """One key's warm-up tune (what ``autosymm tune`` prints per key): the winner and its margins."""

    problem: Problem
    seconds: float
    rows: int
    winners: dict[str, str]  # mode -> backend
    margins: dict[str, str]  # mode -> "x over the stack's path, y over NCCL"
    note: str


class WarmupTuner:
    """The tuner :func:`autotune` registers (autosymm.runtime.warmup.WarmupTuner): the budget
    spent so far (agreed on every rank) and a report per key tuned."""

    def __init__(self, settings: WarmupSettings, backends: Optional[dict] = None) -> None:
        self.settings = settings
        self._backends = backends
        self.spent_s = 0.0
        self.reports: list[KeyReport] = []

    def modes_for(self, state) -> tuple[str, ...]:
        """The modes tuned on ``state``'s group: the settings' (a CPU group has no CUDA graphs: eager)."""
        return tuple(m for m in self.settings.modes if m == "eager" or state.device.type == "cuda")

    def tunes(self, problem: Problem) -> bool:
        return self.settings.ops is None or problem.op in self.settings.ops

    def tune(self, state, problem: Problem, why: str) -> runtime_warmup.Tuned:
        """One key on every rank of ``state``'s group, in lock-step; never raises."""
        settings = self.settings
        near = nearby_tuned(state, problem, self.modes_for(state), settings.spacing)
        if near:
            return runtime_warmup.Tuned(note=f"not tuned: {near}")
        left = settings.budget_s - self.spent_s
        if left <= 0:
            return runtime_warmup.Tuned(note=f"not tuned: the warm-up budget of {settings.budget_s:g} s is spent "
                                             f"({why})")
        start = settings.clock()
        try:
            rows, items = self._tune(state, _keyed(problem), min(settings.key_s, left))
            failure = ""
        except Exception as exc:  # reported on every rank as the key's note (the agreement below)
            rows, items, failure = [], [], f"{type(exc).__name__}: {exc}"
        try:  # every rank spends the slowest rank's time; a failure on any rank leaves the key untuned
            elapsed, failed = RankComm(_control_group(state), agree_timeout_s()).max(
                [settings.clock() - start, 1.0 if failure else 0.0])
        except Exception as exc:  # a peer gone: this rank ends the tune alone, untuned, nothing stored
            self.spent_s = settings.budget_s
            return runtime_warmup.Tuned(note=f"the tune ended without a peer ({type(exc).__name__}: {exc})")
        self.spent_s += elapsed
        if failed:
            return runtime_warmup.Tuned(note=f"the tune failed ({failure or 'on another rank'}): the untuned path "
                                             f"serves")
        label, stored = self._store(state, rows)
        report = _report(problem, elapsed, rows, items, state.caps.stack)
        self.reports.append(report)
        log.info("autosymm: warm-up tuned %s in %.2f s: %s", problem.describe(), elapsed, report.note)
        return runtime_warmup.Tuned(rows, label, f"tuned here in {elapsed:.2f} s ({report.note}){stored}")

    def _tune(self, state, problem: Problem, key_s: float) -> tuple[list[Row], list[SweepItem]]:
        settings = self.settings
        modes = self.modes_for(state)
        search = TuneSettings(strategy="auto", trials=settings.trials, modes=modes, plan_for=warmup_plan,
                              deadline_s=key_s / len(modes), clock=settings.clock, agree_s=agree_timeout_s(),
                              timeout_s=max(10.0, 5 * key_s), prepare_timeout_s=max(60.0, 30 * key_s))
        backends = self._backends
        if backends is None:
            backends, _ = _load_backends(settings.backends)
        session = TuneSession(search, backends, group=state.group, workspace=state.workspace,
                              hardware=state.fingerprint, control_group=_control_group(state))
        session.caps, session.ctx = state.caps, state.ctx  # the group's: the stack's path included
        session.screen = _Screen(state, settings.numerics, settings.trials)
        rows, items = [], []
        for mode in session.modes_for(problem):
            item = session.tune_one(problem, mode, compile_ahead=mode == session.modes_for(problem)[0])
            items.append(item)
            if item.status == "tuned":
                rows += _rows(item, session, state.caps.stack)
        return rows, items

    def _store(self, state, rows: list[Row]) -> tuple[str, str]:
        """Rank 0 writes ``rows`` into the database; (the label decisions name, what to add to the
        note: a failed write is said, the rows are still served from memory)."""
        path = self.settings.db
        if path == "" or not rows:
            return "warm-up tuning (memory)", ""
        path = path if path is not None else str(user_db_path())
        if state.rank != 0:
            return path, ""
        try:
            with TuningDB(path) as db:
                db.record_many(rows)
        except Exception as exc:  # the peers cannot wait: said in the note, served from memory
            return path, f"; not stored ({type(exc).__name__}: {exc})"
        return path, ""


def nearby_tuned(state, problem: Problem, modes: Sequence[str], spacing: float) -> str:
    """Where a size within ``spacing`` of ``problem``'s was tuned here in every one of ``modes``
    (rows of this node and stack; a pure function of the agreed sources), said; else ''."""
    if spacing <= 1:
        return ""
    stack = state.caps.stack or None
    for mode in modes:
        key = Key.for_problem(state.hardware, problem, mode)
        near = [row.bucket for source in state.sources for row in source.family(key)
                if row.stack == stack and max(row.bucket, key.bucket) <= spacing * min(row.bucket, key.bucket)]
        if not near:
            return ""
    return (f"served from the rows tuned here at {problem.record.size_text(min(near, key=lambda b: abs(b - key.bucket)))}"
            f" (within {spacing:g}x)")


class _Screen:
    """Which eligible candidates of a key compete (TuneSession.screen): the reference path's
    formula only (the stack's path, else the op's fallback; ``numerics`` 'any': every formula),
    under the deterministic setting only batch-invariant ones, and of each backend at most
    ``trials`` configs (:func:`picked`). The baselines (the fallback and the stack's path) always
    run."""

    def __init__(self, state, numerics: str, trials: int) -> None:
        self.state, self.numerics, self.trials = state, numerics, trials

    def __call__(self, problem: Problem, mode: str, candidates: dict) -> tuple[dict, dict]:
        state, stack = self.state, self.state.caps.stack
        baselines = {problem.record.fallback, stack}
        reference = (path_formula(state.ctx.stack, problem) if stack
                     else get_backend(problem.record.fallback).formula(problem))
        kept, refused = {}, {}
        for name, configs in candidates.items():
            if name in baselines:
                kept[name] = configs
                continue
            backend, formula = get_backend(name), get_backend(name).formula(problem)
            if self.numerics == "same" and formula != reference:
                refused[name] = (f"computes the {formula} formula, the reference path the {reference} one "
                                 f"(autotune(numerics='any') lets it compete)")
            elif state.deterministic and not backend.invariant_for(problem):
                refused[name] = "not batch-invariant (deterministic)"
            else:
                kept[name] = picked(name, configs, problem, mode, state.sources, state.hardware, self.trials)
        return kept, refused


def picked(backend: str, configs: list, problem: Problem, mode: str, sources, hardware: str, trials: int) -> list:
    """At most ``trials`` of ``backend``'s ``configs`` for a warm-up key: the configs its rows of
    the same op, dtype, shape and mode hold at the nearest sizes first (a neighbour's winner is
    the likeliest), then its untuned default, then configs spread evenly over the space."""
    if len(configs) <= trials:
        return list(configs)
    key = Key.for_problem(hardware, problem, mode)
    rows = sorted((row for source in sources for row in source.family(key) if row.backend == backend),
                  key=lambda row: abs(row.bucket - problem.bucket))
    ordered = [row.config_obj for row in rows] + [get_backend(backend).fallback_config(problem)]
    step = max(1, len(configs) // trials)
    ordered += configs[::step] + configs
    chosen: list = []
    for config in ordered:
        if config in configs and config not in chosen:
            chosen.append(config)
        if len(chosen) == trials:
            break
    return chosen


def _keyed(problem: Problem) -> Problem:
    """The problem a key's rows are measured for: its dtype as its rows are keyed (an all-gather
    of int32 copies bytes: the bf16 rows of its size)."""
    dtype = problem.record.key_dtype(problem)
    return problem if dtype == problem.dtype else dataclasses.replace(problem, dtype=dtype)


def _control_group(state):
    """The gloo group over ``state``'s ranks that carries the tuner's protocol, apart from the
    group the candidates run on (a candidate's collective must never meet a protocol message),
    made by the group's ranks together at their first tune."""
    if state.control_group is None:
        ranks = dist.get_process_group_ranks(state.group)
        state.control_group = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
    return state.control_group


def _rows(item: SweepItem, session: TuneSession, stack: str) -> list[Row]:
    """The tuned item's rows (every backend's best), each with the stack path's time beside
    NCCL's, or why it was not timed."""
    stack_us, stack_note = None, None
    if stack:
        result = next((r for r in item.outcome.results if r.candidate.backend == stack), None)
        if result is not None and result.ok:
            stack_us = result.score
        else:
            stack_note = (result.error if result is not None else item.unsupported.get(stack)) or "not timed"
    rows = item.outcome.rows(mode=item.mode, hardware=session.hardware_slug, provenance=session.provenance)
    return [Row(**row, stack=stack or None, stack_us=stack_us, stack_note=stack_note) for row in rows]


def _report(problem: Problem, seconds: float, rows: Sequence[Row], items: Sequence[SweepItem], stack: str) -> KeyReport:
    winners, margins = {}, {}
    for item in items:
        if item.status != "tuned":
            winners[item.mode] = f"{item.status}: {item.reason}"
            continue
        best = item.outcome.best
        winners[item.mode] = best.candidate.backend
        row = next(r for r in rows if r.mode == item.mode and r.backend == best.candidate.backend)
        parts = []
        if row.stack_us:
            parts.append(f"{row.stack_us / row.median_us:.2f}x over {stack}'s path")
        elif stack:
            parts.append(f"{stack}'s path not timed: {row.stack_note}")
        if row.nccl_us:
            parts.append(f"{row.nccl_us / row.median_us:.2f}x over NCCL")
        margins[item.mode] = ", ".join(parts)
    note = "; ".join(f"{mode}: {winners[mode]}" + (f" ({margins[mode]})" if margins.get(mode) else "")
                     for mode in winners)
    return KeyReport(problem, seconds, len(rows), winners, margins, note)


@contextlib.contextmanager
def autotune(budget_s: float = DEFAULT_BUDGET_S, *, backends=None, **options) -> Iterator[WarmupTuner]:
    """Within: the first eager call of a key this node has no row for is tuned on the spot, on
    every rank together (autosymm.runtime.warmup; the module docstring says how), and served from
    its rows from the next call on. ``budget_s`` bounds the whole context; ``options`` are
    :class:`WarmupSettings`' (``key_s``, ``ops``, ``db``, ``numerics``, ``trials``, ``modes``,
    ``spacing``, ``clock``); ``backends``: the candidates by name, or name -> Backend (None: every
    registered one). Every rank must enter it alike (a rank outside it leaves every rank's calls
    untuned). Yields the tuner: its ``reports`` and ``spent_s``. Outside, nothing changes; inside
    a CUDA-graph capture nothing is tuned."""
    names, instances = (None, dict(backends)) if isinstance(backends, dict) else (backends, None)
    for name in ("ops", "modes"):
        if options.get(name) is not None:
            options[name] = tuple(options[name])
    settings = WarmupSettings(budget_s=budget_s, backends=None if names is None else tuple(names), **options)
    tuner = WarmupTuner(settings, instances)
    runtime_warmup.TUNERS.append(tuner)
    try:
        yield tuner
    finally:
        runtime_warmup.TUNERS.remove(tuner)


def enable_from_settings() -> Optional[WarmupTuner]:
    """``AUTOSYMM_AUTOTUNE`` (seconds of budget; a switch: on = the default budget): the same as
    a process-wide :func:`autotune` (None where unset or off)."""
    budget = env.get("AUTOSYMM_AUTOTUNE")
    if not budget:
        return None
    tuner = WarmupTuner(WarmupSettings(budget_s=float(budget)))
    runtime_warmup.TUNERS.insert(0, tuner)
    return tuner
