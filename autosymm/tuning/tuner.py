"""The search: which backend and config is fastest for one problem, chosen the same on every rank.

Each tuned backend is searched in turn with its own budget (every backend's best row is recorded:
the dispatcher needs the runner-up when the winner cannot serve a call). Strategies: ``grid``
visits every config in a deterministic order; ``optuna`` runs a TPE study (in memory, seeded)
over the config fields with a trial budget; ``auto`` is grid for a backend space of at most
GRID_THRESHOLD configs, else optuna (autosymm.tuning.search, the only module that imports optuna,
lazily; only rank 0 runs a study). Baselines (candidates without a config: NCCL, torch's ops)
are always evaluated once, first, outside any budget. The ranks talk through
autosymm.tuning.rank_comm.

Rank protocol (every rank runs :func:`tune` in lock-step; all traffic is small float64 tensors on
``group``, no pickling):

1. the ranks check they hold the same candidate list and search settings (a CRC, MAX/MIN);
2. per step, rank 0 picks the next candidate (it alone runs the study) and broadcasts its index
   in the deterministic candidate list (-1: done);
3. every rank ``prepare``s it locally (compile, allocate; may fail) under a timeout, then the
   ranks agree by MAX on "some rank failed": if one did, nobody launches it (no rank waits in a
   collective kernel for a peer that never comes). This agreement is also the barrier that lines
   the ranks up for the measurement;
4. every rank ``measure``s it (validate against the reference, raising on a wrong result, then
   time) in a worker thread joined with ``timeout_s``. An exception, a non-finite time or a
   timeout scores +inf. The ranks combine (median, p10, p90) and per-rank failure flags by MAX,
   so one failing rank makes it +inf everywhere, and every rank then holds the same numbers;
5. after a timeout, the ranks that timed out wait ``grace_s`` for the stuck measurement and every
   rank probes its device; if any rank did not recover, the search of this problem stops on
   every rank (``TuneOutcome.aborted``) and nothing must be recorded for it. Otherwise, when the
   measurement failed on any rank (the MAX says so on every rank), every rank calls the
   evaluator's optional ``reset()`` in lock-step (e.g. re-arming device signal pads a peer left
   unbalanced) and the ranks agree by MAX that it worked, else the search stops likewise;
6. rank 0 tells the study the score; at the end it broadcasts the winner's index.

The measurement must not join host-side collectives (barriers, all_reduce on ``group``): a rank
that timed out has left it behind while its peers go on to step 4's MAX. Device collectives (the
candidate kernel) are fine. Limit: a GPU kernel that truly hangs (a peer never arrived at its
device barrier) poisons that process's stream; no thread can cancel it. The tuner then aborts the
problem on every rank and records nothing for it, never a wrong row; the caller should stop
(see :func:`autosymm.tuning.sweep.run_sweep`). autosymm's own barriers are bounded (a wait gives up and
flags the workspace, autosymm.kernels.barrier), so with a timeout above their spin limit a
missing peer costs one failed candidate and a ``reset()``, not the search.
"""

from __future__ import annotations

import math
import threading
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence

import torch

from ..configs import AnyConfig, config_fields, config_to_json
from ..problem import Problem
from .rank_comm import RankComm, call_with_timeout, device_healthy, flagged_ranks
from .search import GRID_THRESHOLD, SequentialChooser, default_trials, make_chooser, resolve_strategy
from .timing import Timing



@dataclass(frozen=True)
class Candidate:
    """One way to run the problem: a backend name and its config (None for baselines)."""

    backend: str
    config: Optional[AnyConfig] = None

    def describe(self) -> str:
        if self.config is None:
            return self.backend
        fields = ",".join(f"{k}={v}" for k, v in config_fields(self.config).items())
        return f"{self.backend}[{fields}]"


@dataclass(frozen=True)
class TrialResult:
    """A candidate's outcome: ``timing`` (the same on every rank) or None with ``error`` (the same
    text on every rank) when it failed; ``detail`` is this rank's own exception, if any."""

    candidate: Candidate
    timing: Optional[Timing]
    error: Optional[str] = None
    detail: Optional[str] = field(default=None, compare=False)

    @property
    def ok(self) -> bool:
        return self.timing is not None and self.timing.ok

    @property
    def score(self) -> float:
        """Median us, +inf for a failure."""
        return self.timing.median_us if self.ok else math.inf


@dataclass
class TuneOutcome:
    """What :func:`tune` found, identical on every rank."""

    problem: Problem
    best: Optional[TrialResult]
    results: list[TrialResult]  # fastest first, failures last
    baseline: Optional[TrialResult]  # the baseline backend's result (NCCL), if it was a candidate
    strategies: dict[str, str] = field(default_factory=dict)  # tuned backend -> 'grid' | 'optuna'
    space_size: int = 0  # tuned (configurable) candidates in the space
    aborted: Optional[str] = None  # why the search stopped early; nothing may be recorded then

    def best_by_backend(self) -> dict[str, TrialResult]:
        """Each backend's fastest valid result (fastest backend first)."""
        out: dict[str, TrialResult] = {}
        for result in self.results:
            if result.ok and result.candidate.backend not in out:
                out[result.candidate.backend] = result
        return out

    def rows(self, *, mode: str, hardware: str, provenance: Optional[dict] = None,
             created: Optional[str] = None) -> list[dict]:
        """One database row (as a dict of autosymm.db.Row fields) per backend's best result,
        with ``nccl_us`` the baseline's median of the same run. [] when the search aborted."""
        if self.aborted:
            return []
        prov = dict(provenance or {})
        nccl_us = self.baseline.score if self.baseline is not None and self.baseline.ok else None
        trials: dict[str, int] = {}
        for result in self.results:
            trials[result.candidate.backend] = trials.get(result.candidate.backend, 0) + 1
        problem = self.problem
        rows = []
        for backend, result in self.best_by_backend().items():
            timing = result.timing
            assert timing is not None
            row = dict(
                hardware=hardware, gpu=prov.get("gpu", ""), world_size=problem.world_size, op=problem.op,
                dtype=problem.dtype, bucket=problem.bucket, shape=problem.shape_key, mode=mode,
                backend=backend, config=config_to_json(result.candidate.config),
                median_us=timing.median_us, p10_us=timing.p10_us, p90_us=timing.p90_us,
                nccl_us=nccl_us, speedup=(nccl_us / timing.median_us) if nccl_us and timing.median_us > 0 else None,
                trials=trials[backend],
            )
            for key in ("autosymm_version", "torch_version", "triton_version", "cuda_version", "driver_version"):
                row[key] = prov.get(key, "")
            if created is not None:
                row["created"] = created
            rows.append(row)
        return rows


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


def _as_timing(value: Any) -> Timing:
    if isinstance(value, Timing):
        return value
    if isinstance(value, (int, float)):
        v = float(value)
        return Timing(v, v, v, 1)
    raise TypeError(f"measure returned {type(value).__name__}, expected Timing or float (us)")


# ------------------------------------------------------------------------------------------
# Candidates
# ------------------------------------------------------------------------------------------


def build_candidates(candidates_by_backend: dict[str, Sequence[Optional[AnyConfig]]]) -> list[Candidate]:
    """The deterministic candidate list: backends by name; each backend's configs in the given
    order, duplicates dropped. A config None is a baseline (evaluated once, outside budgets)."""
    out: list[Candidate] = []
    seen: set[Candidate] = set()
    for backend in sorted(candidates_by_backend):
        for config in candidates_by_backend[backend]:
            candidate = Candidate(backend, config)
            if candidate not in seen:
                seen.add(candidate)
                out.append(candidate)
    return out


# ------------------------------------------------------------------------------------------
# The search
# ------------------------------------------------------------------------------------------


class _Search:
    def __init__(self, candidates, evaluator, comm, timeout_s, prepare_timeout_s, grace_s, log):
        self.candidates = candidates
        self.evaluator = evaluator
        self.comm = comm
        self.timeout_s = timeout_s
        self.prepare_timeout_s = prepare_timeout_s
        self.grace_s = grace_s
        self.log = log
        self.results: dict[int, TrialResult] = {}
        self.aborted: Optional[str] = None

    def evaluate(self, index: int) -> TrialResult:
        """Steps 3-5 of the protocol for candidate ``index``, on every rank."""
        comm, candidate = self.comm, self.candidates[index]
        stuck: list[threading.Thread] = []
        # 3. prepare locally, then agree (also the barrier before the measurement)
        status, prepared, detail, thread = call_with_timeout(self.evaluator.prepare, candidate, self.prepare_timeout_s)
        if status == "timeout":
            stuck.append(thread)
        agreed = comm.max(comm.flags(status != "ok") + comm.flags(status == "timeout"))
        failed, timed_out = agreed[:comm.world_size], agreed[comm.world_size:]
        timing, error, measured = None, None, False
        if any(failed):
            error = f"prepare failed on rank(s) {flagged_ranks(failed)}"
            if any(timed_out):
                error = f"prepare timed out on rank(s) {flagged_ranks(timed_out)}"
        else:
            # 4. measure under a timeout; combine by MAX
            measured = True
            status, value, detail, thread = call_with_timeout(self.evaluator.measure, prepared, self.timeout_s)
            local = Timing.failed()
            if status == "timeout":
                stuck.append(thread)
            elif status == "ok":
                try:
                    local = _as_timing(value)
                except TypeError as exc:
                    status, detail = "error", str(exc)
                if status == "ok" and not local.ok:
                    status, detail = "error", f"non-finite time {local.median_us}"
            numbers = [local.median_us, local.p10_us, local.p90_us, float(local.samples)]
            numbers = [math.inf if (math.isnan(v) or status != "ok") else v for v in numbers]
            combined = comm.max(numbers + comm.flags(status != "ok") + comm.flags(status == "timeout"))
            median, p10, p90, samples = combined[:4]
            failed = combined[4:4 + comm.world_size]
            timed_out = combined[4 + comm.world_size:]
            raised = [f and not t for f, t in zip(failed, timed_out)]
            if any(timed_out):
                error = f"measure timed out after {self.timeout_s:g} s on rank(s) {flagged_ranks(timed_out)}"
                if any(raised):  # often the cause: a rank that failed early left the others waiting
                    error += f"; failed on rank(s) {flagged_ranks(raised)}"
            elif any(failed):
                error = f"measure failed on rank(s) {flagged_ranks(failed)}"
            else:
                timing = Timing(median, p10, p90, int(samples))
        release = getattr(self.evaluator, "release", None)
        if release is not None and prepared is not None and not stuck:
            try:
                release(prepared)
            except Exception:
                pass
        # 5. after any timeout: did every rank recover?
        if any(timed_out):
            unhealthy = not self._recovered(stuck)
            verdict = comm.max(comm.flags(unhealthy))
            if any(verdict):
                self.aborted = (f"{candidate.describe()}: {error}; rank(s) {flagged_ranks(verdict)} did not recover "
                                f"within {self.grace_s:g} s (a hung kernel or call): search stopped, nothing recorded")
        # 5b. a failed measurement may leave device state unbalanced (signal pads): reset it everywhere
        if measured and any(failed) and self.aborted is None:
            self._reset(candidate, error)
        result = TrialResult(candidate, timing, error, detail)
        self.results[index] = result
        if self.log is not None:
            try:
                self.log(result)
            except Exception:
                pass
        return result

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
        verdict = self.comm.max(self.comm.flags(problem is not None))
        if any(verdict):
            self.aborted = (f"{candidate.describe()}: {error}; the reset after it failed on rank(s) "
                            f"{flagged_ranks(verdict)} ({problem or 'see those ranks'}): search stopped, nothing recorded")

    def _recovered(self, stuck: list[threading.Thread]) -> bool:
        import time

        deadline = time.monotonic() + self.grace_s
        for thread in stuck:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                return False
        healthy = getattr(self.evaluator, "healthy", None)
        remaining = max(0.1, deadline - time.monotonic())
        return bool(healthy(remaining)) if healthy is not None else device_healthy(remaining)


def _digest(candidates: list[Candidate], settings: str) -> float:
    text = settings + "|" + "|".join(f"{c.backend}:{config_to_json(c.config)}" for c in candidates)
    return float(zlib.crc32(text.encode()))


def tune(problem: Problem, candidates_by_backend: dict[str, Sequence[Optional[AnyConfig]]], evaluate: Any, *,
         strategy: str = "auto", trials: Optional[int] = None, seed: int = 0, group=None,
         timeout_s: Optional[float] = 60.0, prepare_timeout_s: Optional[float] = 600.0, grace_s: float = 10.0,
         device: Optional[torch.device | str] = None, baseline_backend: Optional[str] = None,
         grid_threshold: int = GRID_THRESHOLD,
         log: Optional[Callable[[TrialResult], None]] = None) -> TuneOutcome:
    """Search ``candidates_by_backend`` for the fastest valid candidate of ``problem``.

    ``evaluate``: an :class:`Evaluator` (``prepare``/``measure``) or a callable
    ``evaluate(candidate) -> Timing``; it runs on every rank. ``trials``: optuna budget per tuned
    backend, default :func:`default_trials` of that backend's space (grid ignores it). ``timeout_s``: per measurement
    (None: no thread, no timeout). ``device``: where the protocol's small tensors live (default:
    CPU for gloo, the current GPU for NCCL). ``baseline_backend``: whose result is
    ``outcome.baseline`` (default: the op's fallback, 'nccl' for all-reduce). Returns the same
    :class:`TuneOutcome` on every rank; failures are reported in it, never raised.
    """
    from ..backends import FALLBACK

    baseline_backend = baseline_backend or FALLBACK.get(problem.op, "nccl")
    candidates = build_candidates(candidates_by_backend)
    baselines = [i for i, c in enumerate(candidates) if c.config is None]
    tuned: dict[str, list[int]] = {}
    for i, c in enumerate(candidates):
        if c.config is not None:
            tuned.setdefault(c.backend, []).append(i)
    plans: dict[str, tuple[str, int]] = {}  # backend -> (strategy, budget)
    for backend, indices in tuned.items():
        used = resolve_strategy(strategy, len(indices), grid_threshold)
        budget = len(indices) if used == "grid" else default_trials(len(indices)) if trials is None else trials
        plans[backend] = (used, max(1, min(budget, len(indices))))
    comm = RankComm(group, device)
    evaluator = as_evaluator(evaluate)

    # 1. the same candidates and settings everywhere, or a clear error on every rank
    digest = _digest(candidates, f"{problem.describe()}|{sorted(plans.items())}|{seed}")
    low_high = comm.max([digest, -digest])
    if low_high[0] != -low_high[1]:
        raise RuntimeError(f"tune({problem.describe()}): the ranks hold different candidate lists or settings "
                           f"(backends, workspace or multicast differ?); this rank has {len(candidates)} candidates")

    search = _Search(candidates, evaluator, comm, timeout_s, prepare_timeout_s, grace_s, log)
    chooser: Any = None
    chooser_error: Optional[str] = None
    if comm.rank == 0 and tuned:  # only rank 0 searches (and imports optuna)
        chooser = SequentialChooser([make_chooser(candidates, tuned[b], *plans[b], seed) for b in sorted(tuned)])
    tuned_indices = {i for indices in tuned.values() for i in indices}
    order = list(baselines)  # baselines first, each once, in list order
    while search.aborted is None:
        # 2. rank 0 picks, everybody follows (-1: done, -2: rank 0's search itself failed)
        if order:
            index = order.pop(0)
        else:
            picked = -1
            if chooser is not None and chooser_error is None:
                try:
                    nxt = chooser.next()
                    picked = -1 if nxt is None else nxt
                except Exception as exc:  # an optuna failure ends the search, never a rank
                    chooser_error = f"{type(exc).__name__}: {exc}"
            index = comm.broadcast_int(-2 if chooser_error else picked)
            if index == -2:
                search.aborted = f"the search on rank 0 failed ({chooser_error or 'see rank 0'}): nothing recorded"
                break
            if index < 0:
                break
            if index >= len(candidates) or index in search.results:
                raise RuntimeError(f"tune: rank 0 sent candidate index {index} (of {len(candidates)}); protocol broken")
        result = search.evaluate(index)
        if chooser is not None and index in tuned_indices and chooser_error is None:
            try:
                chooser.tell(index, result.score)  # 6. only rank 0 holds a study
            except Exception as exc:
                chooser_error = f"{type(exc).__name__}: {exc}"

    # 6. the winner, as rank 0 sees it (every rank computed the same; rank 0's word counts)
    ranked = sorted(search.results.items(), key=lambda item: (item[1].score, item[0]))
    local_best = ranked[0][0] if ranked and ranked[0][1].ok else -1
    best_index = comm.broadcast_int(local_best)
    results = [r for _, r in ranked]
    baseline = next((r for r in results if r.candidate == Candidate(baseline_backend)), None)
    if search.aborted is not None:
        best = None
    else:
        best = search.results.get(best_index) if best_index >= 0 else None
    return TuneOutcome(problem=problem, best=best, results=results, baseline=baseline,
                       strategies={b: plan[0] for b, plan in plans.items()},
                       space_size=len(tuned_indices), aborted=search.aborted)
