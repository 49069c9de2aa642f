"""Search strategies over one backend's configs: the order in which the tuner measures them.

``grid`` visits every config in a deterministic order; ``optuna`` runs a seeded TPE study (in
memory) over the config fields with a trial budget; ``auto`` is grid for a space of at most
:data:`GRID_THRESHOLD` configs, else optuna. Only this module imports optuna, lazily, and only
the rank that searches (rank 0 of autosymm.tuning.tuner's protocol) creates a study. A chooser's
``next()`` returns the index of the next candidate to measure (None: done); ``tell(index,
score)`` reports its score (+inf for a failed candidate).
"""

from __future__ import annotations

import math
import random
from typing import Any, Iterable, Optional

from ..configs import iter_space_fields

STRATEGIES = ("auto", "grid", "optuna")
GRID_THRESHOLD = 48  # 'auto' searches spaces of at most this many configs exhaustively
TRIAL_FRACTION = 0.3  # default optuna budget: this share of the space ...
MIN_TRIALS = 16  # ... but at least this many trials (and at most the whole space) ...
#: ... and at most this many: on 2x H200 one candidate costs 5-250 ms (compile, validation,
#: graph capture, timing; more for larger problems), and 30 % of the largest all-reduce spaces
#: (100+ trials per backend) made the default sweep take over 5 minutes.
MAX_DEFAULT_TRIALS = 24
_PENALTY = 1e30  # what the study is told for a failed candidate (TPE only ranks the values)


def default_trials(space_size: int) -> int:
    """Default optuna budget: TRIAL_FRACTION of the space, clamped to MIN_TRIALS..MAX_DEFAULT_TRIALS,
    at most the whole space."""
    share = math.ceil(TRIAL_FRACTION * space_size)
    return min(space_size, max(MIN_TRIALS, min(MAX_DEFAULT_TRIALS, share)))


def resolve_strategy(strategy: str, space_size: int) -> str:
    """'grid' or 'optuna' for ``strategy`` over a space of ``space_size`` configs."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} is not one of {STRATEGIES}")
    if strategy == "auto":
        return "grid" if space_size <= GRID_THRESHOLD else "optuna"
    return strategy


class _GridChooser:
    def __init__(self, indices: list[int]):
        self._todo = list(indices)

    def next(self) -> Optional[int]:
        return self._todo.pop(0) if self._todo else None

    def tell(self, index: int, score: float) -> None:
        pass


class _OptunaChooser:
    """TPE over one backend's config fields. Numeric fields are suggested as an index into their
    sorted values (ordinal, so TPE sees 'bigger'/'smaller'); strings as categories. A suggested
    point maps to the nearest valid candidate; one already evaluated is told its known score and
    not evaluated again (after a few such duplicates in a row, the nearest unvisited candidate is
    evaluated and added to the study as a trial of its own)."""

    MAX_DUPLICATES = 8

    def __init__(self, candidates: list[Any], indices: list[int], budget: int, seed: int):
        import optuna  # optuna may be missing (make_chooser then samples at random) and costs ~0.15 s

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self._optuna = optuna
        self.indices = list(indices)
        self.budget = min(budget, len(indices))
        configs = [candidates[i].config for i in indices]
        self.axes: list[tuple[str, list[Any], bool]] = []  # (name, values, ordinal)
        names: list[str] = []
        for cls in sorted({type(c) for c in configs}, key=lambda t: t.__name__):
            for name, _ in iter_space_fields([c for c in configs if type(c) is cls]):
                if name not in names:
                    names.append(name)
        for name in names:
            values = sorted({getattr(c, name) for c in configs if hasattr(c, name)}, key=lambda v: (str(type(v)), v))
            if len(values) < 2:
                continue
            ordinal = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
            self.axes.append((name, values, ordinal))
        self.distributions = {
            name: (optuna.distributions.IntDistribution(0, len(values) - 1) if ordinal
                   else optuna.distributions.CategoricalDistribution(values))
            for name, values, ordinal in self.axes
        }
        self._coords = {i: self._coordinates(candidates[i]) for i in indices}
        sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=max(4, min(10, self.budget // 3)))
        self.study = optuna.create_study(direction="minimize", sampler=sampler)
        self.visited: dict[int, float] = {}
        self._pending: Optional[tuple[int, Any]] = None
        self._duplicates = 0

    def _coordinates(self, candidate: Any) -> dict[str, Any]:
        coords: dict[str, Any] = {}
        for name, values, ordinal in self.axes:
            value = getattr(candidate.config, name, None)
            if value is None:
                coords[name] = None
            else:
                coords[name] = values.index(value) if ordinal else value
        return coords

    def _distance(self, point: dict[str, Any], index: int) -> float:
        coords = self._coords[index]
        dist = 0.0
        for name, values, ordinal in self.axes:
            mine, want = coords[name], point.get(name)
            if mine is None or want is None:
                dist += 1.0 if mine != want else 0.0
            elif ordinal:
                dist += abs(mine - want) / (len(values) - 1)
            elif mine != want:
                dist += 1000.0  # another algorithm is far away
        return dist

    def _nearest(self, point: dict[str, Any], exclude: Iterable[int] = ()) -> Optional[int]:
        excluded = set(exclude)
        best, best_dist = None, math.inf
        for index in self.indices:  # ties go to the earlier candidate: deterministic
            if index in excluded:
                continue
            d = self._distance(point, index)
            if d < best_dist:
                best, best_dist = index, d
        return best

    def next(self) -> Optional[int]:
        while len(self.visited) < self.budget:
            trial = self.study.ask(self.distributions)
            index = self._nearest(trial.params)
            if index not in self.visited:
                self._duplicates = 0
                self._pending = (index, trial)
                return index
            self.study.tell(trial, self.visited[index])
            self._duplicates += 1
            if self._duplicates >= self.MAX_DUPLICATES:
                self._duplicates = 0
                index = self._nearest(trial.params, exclude=self.visited)
                self._pending = (index, None)
                return index
        return None

    def tell(self, index: int, score: float) -> None:
        value = score if math.isfinite(score) else _PENALTY
        pending_index, trial = self._pending if self._pending else (index, None)
        assert pending_index == index, (pending_index, index)
        if trial is not None:
            self.study.tell(trial, value)
        else:
            params = {k: v for k, v in self._coords[index].items() if v is not None}
            dists = {k: d for k, d in self.distributions.items() if k in params}
            self.study.add_trial(self._optuna.trial.create_trial(params=params, distributions=dists, value=value))
        self.visited[index] = value
        self._pending = None


class SequentialChooser:
    """One chooser per tuned backend, run one after the other (each with its own budget, so every
    backend's best row is a real search, not leftovers: the dispatcher needs runners-up)."""

    def __init__(self, parts: list[Any]):
        self._parts = list(parts)

    def next(self) -> Optional[int]:
        while self._parts:
            index = self._parts[0].next()
            if index is not None:
                return index
            self._parts.pop(0)
        return None

    def tell(self, index: int, score: float) -> None:
        self._parts[0].tell(index, score)


def make_chooser(candidates: list[Any], indices: list[int], strategy: str, budget: int, seed: int) -> Any:
    if strategy == "grid":
        return _GridChooser(indices)
    try:
        return _OptunaChooser(candidates, indices, budget, seed)
    except ImportError:  # no optuna on this node: a seeded random sample of the same size
        return _GridChooser(sorted(random.Random(seed).sample(indices, budget)))
