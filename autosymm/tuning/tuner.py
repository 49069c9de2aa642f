"""The search: which backend and config is fastest for one problem, chosen the same on every rank.

Each tuned backend is searched in turn with its own budget (every backend's best row is recorded):
``grid``, ``optuna`` (autosymm.tuning.search; only rank 0 runs a study) or ``auto``. Baselines
(NCCL, torch's ops) are evaluated once, first, outside any budget. Every rank runs :func:`tune` in
lock-step over autosymm.tuning.rank_comm (small float64 tensors, no pickling): rank 0 picks and
broadcasts each candidate; every rank prepares it and the ranks agree on failures before any
launches it; measurements (validated, then timed) are combined by MAX, so one failing rank scores
+inf everywhere; after a timeout a rank that does not recover aborts the problem on every rank and
nothing is recorded for it. The measurement must not join host-side collectives. The records
(candidates, results, outcome) are in autosymm.tuning.outcome.

Design notes: docs/TUNING.md#tuning-tuner
"""

from __future__ import annotations

import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence

from ..configs import AnyConfig, config_to_json
from ..problem import Problem
from .outcome import Candidate, TrialResult, TuneOutcome, build_candidates
from .rank_comm import Agreement, RankComm, call_with_timeout, device_healthy
from .search import STRATEGIES, SequentialChooser, default_trials, make_chooser, resolve_strategy
from .timing import Timing


@dataclass(frozen=True)
class SearchSettings:
    """How :func:`tune` searches one problem; the same on every rank. ``trials``: the optuna
    budget per tuned backend (None: :func:`default_trials` of its space; grid ignores it).
    Seconds: ``timeout_s`` per measurement (None: no thread, no timeout), ``prepare_timeout_s``
    per prepare, ``grace_s`` for a timed-out call to come back before the search stops."""

    strategy: str = "auto"
    trials: Optional[int] = None
    seed: int = 0
    timeout_s: Optional[float] = 60.0
    prepare_timeout_s: Optional[float] = 600.0
    grace_s: float = 10.0
    #: seconds after which rank 0 picks no further candidate (the baselines always run; None:
    #: no deadline): warm-up tuning's budget per key (autosymm.tuning.warmup)
    deadline_s: Optional[float] = None
    clock: Callable[[], float] = field(default=time.monotonic, compare=False, repr=False)
    #: seconds an agreement of the protocol waits for a peer (None: the process group's timeout,
    #: as a peer may still be preparing; warm-up tuning: the agreement deadline)
    agree_s: Optional[float] = None

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy={self.strategy!r} is not one of {STRATEGIES}")
        if self.trials is not None and self.trials < 1:
            raise ValueError(f"trials={self.trials} must be at least 1 (None: the default budget)")
        for name in ("timeout_s", "prepare_timeout_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name}={value} must be > 0 s (None: no timeout)")
        if not self.grace_s >= 0:
            raise ValueError(f"grace_s={self.grace_s} must be >= 0 s")
        if self.deadline_s is not None and not self.deadline_s >= 0:
            raise ValueError(f"deadline_s={self.deadline_s} must be >= 0 s (None: no deadline)")


class Evaluator(Protocol):
    """Runs on every rank in lock-step. ``prepare`` is local (compile, allocate, poison outputs)
    and may raise; ``measure`` validates (raising on a wrong result) and times, joining no
    host-side collective. Optional: ``release(prepared)`` frees what prepare made;
    ``healthy(timeout_s) -> bool`` overrides the device probe after a timeout; ``reset()`` runs
    on every rank in lock-step after a measurement failed on any rank (it may join host
    collectives on the tuner's group; raising stops the search)."""

    def prepare(self, candidate: Candidate) -> Any: ...

    def measure(self, prepared: Any) -> Timing: ...


class _CallableEvaluator:
    """The plain-callable form: ``evaluate(candidate) -> Timing`` is the measurement."""

    def __init__(self, fn: Callable[[Candidate], Any]):
        self.fn = fn

    def prepare(self, candidate: Candidate) -> Candidate:
        return candidate

    def measure(self, prepared: Candidate) -> Any:
        return self.fn(prepared)


def as_evaluator(evaluate: Any) -> Evaluator:
    if hasattr(evaluate, "prepare") and hasattr(evaluate, "measure"):
        return evaluate
    if callable(evaluate):
        return _CallableEvaluator(evaluate)
    raise TypeError(f"evaluate must be callable or have prepare/measure, got {type(evaluate).__name__}")


def _local_timing(value: Any) -> tuple[str, Timing, Optional[str]]:
    """(status, timing, detail) of what this rank's ``measure`` returned: a Timing or a float
    (us); anything else, or a non-finite time, is an 'error'."""
    if isinstance(value, (int, float)):
        v = float(value)
        value = Timing(v, v, v, 1)
    if not isinstance(value, Timing):
        return "error", Timing.failed(), f"measure returned {type(value).__name__}, expected Timing or float (us)"
    if not value.ok:
        return "error", value, f"non-finite time {value.median_us}"
    return "ok", value, None


def _ranks(ranks: Sequence[int]) -> str:
    return str(list(ranks))


class _Chooser:
    """Rank 0's chooser (None on the other ranks): ``pick()`` is the next index, -1 when done (or
    past ``deadline``, a time of ``clock``), -2 when the study itself failed (``error``): an optuna
    failure ends the search, never a rank."""

    def __init__(self, chooser: Any, tuned_indices: set[int], deadline: Optional[float] = None,
                 clock: Callable[[], float] = time.monotonic):
        self.chooser, self.tuned_indices, self.error = chooser, tuned_indices, None
        self.deadline, self.clock = deadline, clock

    def pick(self) -> int:
        if self.deadline is not None and self.clock() >= self.deadline:
            return -1  # rank 0's clock alone decides; its -1 reaches every rank
        if self.chooser is not None and self.error is None:
            try:
                index = self.chooser.next()
                return -1 if index is None else index
            except Exception as exc:
                self.error = f"{type(exc).__name__}: {exc}"
        return -2 if self.error else -1

    def tell(self, index: int, score: float) -> None:
        if self.chooser is None or self.error is not None or index not in self.tuned_indices:
            return
        try:
            self.chooser.tell(index, score)  # 6. only rank 0 holds a study
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"


class _Search:
    """One problem's search on this rank: steps 2-6 of the protocol over ``comm``."""

    def __init__(self, candidates: list[Candidate], evaluator: Evaluator, comm: RankComm, settings: SearchSettings,
                 log: Optional[Callable[[TrialResult], None]]):
        self.candidates, self.evaluator, self.comm = candidates, evaluator, comm
        self.settings, self.log = settings, log
        self.results: dict[int, TrialResult] = {}
        self.aborted: Optional[str] = None

    def run(self, baselines: list[int], chooser: _Chooser) -> None:
        """Baselines first, each once, in list order; then what rank 0 picks, until it says done."""
        order = list(baselines)
        while self.aborted is None:
            if order:
                index = order.pop(0)
            else:  # 2. rank 0 picks, everybody follows (-1: done, -2: rank 0's search itself failed)
                index = self.comm.broadcast_int(chooser.pick())
                if index == -2:
                    self.aborted = f"the search on rank 0 failed ({chooser.error or 'see rank 0'}): nothing recorded"
                    return
                if index < 0:
                    return
                if index >= len(self.candidates) or index in self.results:
                    raise RuntimeError(f"tune: rank 0 sent candidate index {index} (of {len(self.candidates)}); "
                                       "protocol broken")
            chooser.tell(index, self.evaluate(index).score)

    def evaluate(self, index: int) -> TrialResult:
        """Steps 3-5 of the protocol for candidate ``index``, on every rank."""
        candidate = self.candidates[index]
        stuck: list[threading.Thread] = []
        # 3. prepare locally, then agree (also the barrier before the measurement)
        status, prepared, detail, thread = call_with_timeout(self.evaluator.prepare, candidate,
                                                             self.settings.prepare_timeout_s)
        if status == "timeout":
            stuck.append(thread)
        agreement = self.comm.agree(failed=status != "ok", timed_out=status == "timeout")
        timing: Optional[Timing] = None
        measured = not agreement.failed
        if agreement.timed_out:
            error: Optional[str] = f"prepare timed out on rank(s) {_ranks(agreement.timed_out_ranks)}"
        elif agreement.failed:
            error = f"prepare failed on rank(s) {_ranks(agreement.failed_ranks)}"
        else:  # 4. measure under a timeout; combine by MAX
            timing, agreement, detail, error = self._measure(prepared, stuck)
        self._release(prepared, stuck)
        # 5. after any timeout: did every rank recover?
        if agreement.timed_out:
            verdict = self.comm.agree(failed=not self._recovered(stuck))
            if verdict.failed:
                self.aborted = (f"{candidate.describe()}: {error}; rank(s) {_ranks(verdict.failed_ranks)} did not "
                                f"recover within {self.settings.grace_s:g} s (a hung kernel or call): search stopped, "
                                "nothing recorded")
        # 5b. a failed measurement may leave device state unbalanced (signal pads): reset it everywhere
        if measured and agreement.failed and self.aborted is None:
            self._reset(candidate, error)
        result = TrialResult(candidate, timing, error, detail)
        self.results[index] = result
        if self.log is not None:
            try:
                self.log(result)
            except Exception:
                pass
        return result

    def _measure(self, prepared: Any, stuck: list[threading.Thread]
                 ) -> tuple[Optional[Timing], Agreement, Optional[str], Optional[str]]:
        """Step 4: (timing or None, agreement, this rank's detail, the error every rank reports)."""
        timeout_s = self.settings.timeout_s
        status, value, detail, thread = call_with_timeout(self.evaluator.measure, prepared, timeout_s)
        local = Timing.failed()
        if status == "timeout":
            stuck.append(thread)
        elif status == "ok":
            status, local, detail = _local_timing(value)
        timing, agreement = self.comm.combine_measurement(local, status)
        if agreement.timed_out:
            error = f"measure timed out after {timeout_s:g} s on rank(s) {_ranks(agreement.timed_out_ranks)}"
            if agreement.raised_ranks:  # often the cause: a rank that failed early left the others waiting
                error += f"; failed on rank(s) {_ranks(agreement.raised_ranks)}"
            return None, agreement, detail, error
        if agreement.failed:
            return None, agreement, detail, f"measure failed on rank(s) {_ranks(agreement.failed_ranks)}"
        return timing, agreement, detail, None

    def _release(self, prepared: Any, stuck: list[threading.Thread]) -> None:
        """The evaluator's optional ``release`` of what prepare made (not while a call is stuck)."""
        release = getattr(self.evaluator, "release", None)
        if release is not None and prepared is not None and not stuck:
            try:
                release(prepared)
            except Exception:
                pass

    def _reset(self, candidate: Candidate, error: Optional[str]) -> None:
        """Every rank calls the evaluator's ``reset`` (collective), then the ranks agree it worked."""
        reset = getattr(self.evaluator, "reset", None)
        if reset is None:
            return
        problem = None
        try:
            reset()
        except Exception as exc:  # reported, never raised through the search
            problem = f"{type(exc).__name__}: {exc}"
        verdict = self.comm.agree(failed=problem is not None)
        if verdict.failed:
            self.aborted = (f"{candidate.describe()}: {error}; the reset after it failed on rank(s) "
                            f"{_ranks(verdict.failed_ranks)} ({problem or 'see those ranks'}): search stopped, "
                            "nothing recorded")

    def _recovered(self, stuck: list[threading.Thread]) -> bool:
        deadline = time.monotonic() + self.settings.grace_s
        for thread in stuck:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                return False
        healthy = getattr(self.evaluator, "healthy", None)
        remaining = max(0.1, deadline - time.monotonic())
        return bool(healthy(remaining)) if healthy is not None else device_healthy(remaining)

    def outcome(self, problem: Problem, baseline_backend: str, strategies: dict[str, str]) -> TuneOutcome:
        """6. The winner as rank 0 sees it (every rank computed the same; rank 0's word counts)."""
        ranked = sorted(self.results.items(), key=lambda item: (item[1].score, item[0]))
        local_best = ranked[0][0] if ranked and ranked[0][1].ok else -1
        best_index = self.comm.broadcast_int(local_best)
        results = [r for _, r in ranked]
        baseline = next((r for r in results if r.candidate == Candidate(baseline_backend)), None)
        best = None if self.aborted is not None or best_index < 0 else self.results.get(best_index)
        return TuneOutcome(problem=problem, best=best, results=results, baseline=baseline, strategies=strategies,
                           aborted=self.aborted)


def _digest(candidates: list[Candidate], settings: str) -> float:
    text = settings + "|" + "|".join(f"{c.backend}:{config_to_json(c.config)}" for c in candidates)
    return float(zlib.crc32(text.encode()))


def _plans(candidates: list[Candidate], settings: SearchSettings) -> tuple[dict[str, list[int]], dict]:
    """({tuned backend: candidate indices}, {tuned backend: (strategy, budget)})."""
    tuned: dict[str, list[int]] = {}
    for i, c in enumerate(candidates):
        if c.config is not None:
            tuned.setdefault(c.backend, []).append(i)
    plans: dict[str, tuple[str, int]] = {}
    for backend, indices in tuned.items():
        used = resolve_strategy(settings.strategy, len(indices))
        trials = settings.trials
        budget = len(indices) if used == "grid" else default_trials(len(indices)) if trials is None else trials
        plans[backend] = (used, max(1, min(budget, len(indices))))
    return tuned, plans


def tune(problem: Problem, candidates_by_backend: dict[str, Sequence[Optional[AnyConfig]]], evaluate: Any,
         settings: SearchSettings = SearchSettings(), *, group=None, baseline_backend: Optional[str] = None,
         log: Optional[Callable[[TrialResult], None]] = None) -> TuneOutcome:
    """Search ``candidates_by_backend`` for the fastest valid candidate of ``problem``.

    ``evaluate``: an :class:`Evaluator` (``prepare``/``measure``) or a callable
    ``evaluate(candidate) -> Timing``; it runs on every rank. ``settings``: strategy, budget,
    seed and timeouts (:class:`SearchSettings`). ``group``: the protocol's group
    (None: the default group, or none at all). ``baseline_backend``: whose result is
    ``outcome.baseline`` (default: the op's fallback, 'nccl' for all-reduce). Returns the same
    :class:`TuneOutcome` on every rank; failures are reported in it, never raised.
    """
    baseline_backend = baseline_backend or problem.record.fallback
    candidates = build_candidates(candidates_by_backend)
    tuned, plans = _plans(candidates, settings)
    comm = RankComm(group, settings.agree_s)
    evaluator = as_evaluator(evaluate)

    # 1. the same candidates and settings everywhere, or a clear error on every rank
    digest = _digest(candidates, f"{problem.describe()}|{sorted(plans.items())}|{settings.seed}")
    low_high = comm.max([digest, -digest])
    if low_high[0] != -low_high[1]:
        raise RuntimeError(f"tune({problem.describe()}): the ranks hold different candidate lists or settings "
                           f"(backends, workspace or multicast differ?); this rank has {len(candidates)} candidates")

    chooser = None
    if comm.rank == 0 and tuned:  # only rank 0 searches (and imports optuna)
        chooser = SequentialChooser([make_chooser(candidates, tuned[b], *plans[b], settings.seed)
                                     for b in sorted(tuned)])
    search = _Search(candidates, evaluator, comm, settings, log)
    deadline = None if settings.deadline_s is None else settings.clock() + settings.deadline_s
    search.run([i for i, c in enumerate(candidates) if c.config is None],
               _Chooser(chooser, {i for indices in tuned.values() for i in indices}, deadline, settings.clock))
    return search.outcome(problem, baseline_backend, {b: plan[0] for b, plan in plans.items()})
