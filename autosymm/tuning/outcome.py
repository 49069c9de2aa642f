"""What the search works on and what it finds: candidates, trial results, a problem's outcome and
its database rows (autosymm.tuning.tuner runs the search; these records are the same on every rank).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

from ..configs import AnyConfig, config_fields, config_to_json
from ..db.schema import PROVENANCE_COLUMNS, Key
from ..problem import Problem
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
    """What :func:`autosymm.tuning.tuner.tune` found, identical on every rank."""

    problem: Problem
    best: Optional[TrialResult]
    results: list[TrialResult]  # fastest first, failures last
    baseline: Optional[TrialResult]  # the baseline backend's result (NCCL), if it was a candidate
    strategies: dict[str, str] = field(default_factory=dict)  # tuned backend -> 'grid' | 'optuna'
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
        """One database row (as a dict of autosymm.db.store.Row fields) per backend's best result, under
        the key the dispatcher reads the problem by (``Key.for_problem``), with ``nccl_us`` the
        baseline's median of the same run. [] when the search aborted."""
        if self.aborted:
            return []
        prov = dict(provenance or {})
        nccl_us = self.baseline.score if self.baseline is not None and self.baseline.ok else None
        trials: dict[str, int] = {}
        for result in self.results:
            trials[result.candidate.backend] = trials.get(result.candidate.backend, 0) + 1
        at = Key.for_problem(hardware, self.problem, mode)._asdict()
        rows = []
        for backend, result in self.best_by_backend().items():
            timing = result.timing
            assert timing is not None
            row = dict(
                **at, gpu=prov.get("gpu", ""), backend=backend, config=config_to_json(result.candidate.config),
                median_us=timing.median_us, p10_us=timing.p10_us, p90_us=timing.p90_us,
                nccl_us=nccl_us, speedup=(nccl_us / timing.median_us) if nccl_us and timing.median_us > 0 else None,
                trials=trials[backend],
            )
            for column in PROVENANCE_COLUMNS:
                row[column] = prov.get(column, "")
            if created is not None:
                row["created"] = created
            rows.append(row)
        return rows
