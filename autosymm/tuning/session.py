"""A tune session (:class:`TuneSession`): what a tune needs on one rank (settings, backends,
workspace, control group, database, hardware) and the sweep over it; and the worker body of
`autosymm tune` (:func:`tune_job`, one process per GPU, see autosymm.tuning.workers).

`autosymm tune`, `autosymm bench` and scripts/optuna_vs_grid.py set up through
:meth:`TuneSession.open`; the CPU tests build one directly, with a workspace (or none), fake
backends and a short timing plan.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from .. import spec
from ..spec import PointRequest, Values
from ..problem import MODES, Problem
from .evaluator import SweepEvaluator
from .model_calls import ModelCalls
from .outcome import Candidate
from .outcome import TuneOutcome
from .precompile import precompile
from .rank_comm import RankComm
from .reference import ProblemData
from .sweep import SweepItem, TimingPlan, candidates_for, control_group_for, measure_timeout_s, timing_plan
from .timing import comm_device
from .tuner import SearchSettings, tune
from ..backends import Capabilities, RunContext, backend_names, get_backend
from ..db.store import Row, TuningDB
from ..hardware import fingerprint, provenance
from .ops import workspace_bytes as needs
from ..settings import default_region_bytes
from ..workspace.symm import get_workspace


@dataclass
class TuneOptions:
    """What `autosymm tune` was asked for (the CLI's options): ``points`` the parsed values of the
    ops' sweep options, flag -> value (autosymm.spec.OpSpec.sweep_options: sizes, shapes, ...);
    ``model`` (`--model`): the keys a model calls (autosymm.tuning.model_calls.ModelCalls) instead
    of ``ops`` x ``dtypes`` x ``points``."""

    ops: list[str]
    dtypes: list[str]
    modes: list[str]
    points: Values = field(default_factory=dict)
    strategy: str = "auto"
    trials: Optional[int] = None
    db_path: str = ""  # "": a dry run, nothing written
    seed: int = 0
    backends: Optional[list[str]] = None  # None: every registered backend
    model: Optional[ModelCalls] = None

    def settings(self) -> TuneSettings:
        """The session settings of these options."""
        return TuneSettings(strategy=self.strategy, trials=self.trials, seed=self.seed, modes=tuple(self.modes),
                            backends=tuple(self.backends) if self.backends else None)


def problems_for(options: TuneOptions, world_size: int) -> list[Problem]:
    """The sweep of ``options`` (see :func:`sweep_problems`), or the keys of its model (every op
    the model calls, no others: autosymm.tuning.model_calls)."""
    if options.model is not None:
        return options.model.problems(world_size)
    return sweep_problems(options.ops, options.dtypes, world_size, options.points)


def sweep_problems(ops: Sequence[str], dtypes: Sequence[str], world_size: int, points: Values) -> list[Problem]:
    """The problems of the ops in ``ops``, in registry order (autosymm.spec.registered), each op's
    points as the values ``points`` of its sweep options ask (flag -> value; an option not given:
    the op's default points): its unit's sizes (and its points' extra sizes inside their range)
    x the shapes its shape kind selects, x ``dtypes``."""
    problems = []
    for record in spec.registered():
        if record.name in ops:
            shapes = record.shape.select(points, record.points.shapes) if record.shape else None
            request = PointRequest(tuple(dtypes), world_size, sizes=record.unit.sweep.of(points), shapes=shapes)
            problems += record.problems(request)
    return problems


def workspace_bytes(problems: list[Problem]) -> tuple[int, int]:
    """(all-reduce, MoE) region bytes the sweep needs (at least the defaults): each op's needs
    (autosymm.tuning.ops: the push one-shot's slot per peer; the fused two-shot's x and out rows;
    both MoE buffers)."""
    return needs(problems, default_region_bytes())


@dataclass(frozen=True)
class TuneSettings(SearchSettings):
    """A tune's settings, the same on every rank: the search's (autosymm.tuning.tuner.SearchSettings;
    here ``timeout_s`` defaults to :func:`measure_timeout_s`), the ``modes`` to tune (intersected
    with both modes; None: both), the ``backends`` by name that
    :meth:`TuneSession.open` loads (None: every registered one) and ``plan_for(problem, mode)``,
    the :class:`TimingPlan` of a measurement."""

    timeout_s: Optional[float] = field(default_factory=measure_timeout_s)
    modes: Optional[tuple[str, ...]] = None
    backends: Optional[tuple[str, ...]] = None
    plan_for: Callable[[Problem, str], TimingPlan] = timing_plan

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.modes is not None:
            object.__setattr__(self, "modes", tuple(self.modes))
            unknown = [m for m in self.modes if m not in MODES]
            if unknown:
                raise ValueError(f"modes {unknown} are not in {MODES}")
        if self.backends is not None:
            object.__setattr__(self, "backends", tuple(self.backends))


class TuneSession:
    """One rank's tune: every rank of ``group`` builds one and calls its methods in lock-step.

    ``backends``: name -> Backend. ``workspace``: the group's symm.Workspace (None: NCCL-style
    backends only). ``db``: a TuningDB, written by rank 0 only (None: a dry run). ``hardware``:
    a hardware.Fingerprint or a slug (default: this node's). ``control_group``: the group of the
    tuner's protocol (default: :func:`control_group_for` ``group``, a collective). Inputs live on
    the workspace's device, else the group's (the CPU for gloo); ``caps`` follow from the
    workspace and the fingerprint.
    """

    def __init__(self, settings: TuneSettings, backends: dict, *, group=None, workspace=None, db=None,
                 hardware=None, control_group=None):
        self.settings, self.backends = settings, dict(backends)
        self.group, self.workspace, self.db = group, workspace, db
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        fp = hardware if hardware is not None and not isinstance(hardware, str) else fingerprint()
        self.hardware_slug = hardware if isinstance(hardware, str) else fp.hardware_slug
        self.provenance = provenance(fp)
        self.caps = Capabilities.of(self.world_size, workspace=workspace, compute_capability=fp.compute_capability)
        self.device = workspace.device if workspace is not None else comm_device(group)
        self.control_group = control_group if control_group is not None else control_group_for(group)
        self.ctx = RunContext(group=group, workspace=workspace)
        self.unavailable: dict[str, str] = {}  # backend -> why it could not be loaded (open)
        #: ``screen(problem, mode, candidates) -> (kept, {backend: why refused})``: which of the
        #: eligible candidates compete (warm-up tuning's numerics rule); None: all of them
        self.screen: Optional[Callable[[Problem, str, dict], tuple[dict, dict]]] = None
        #: what measures a (problem, mode)'s candidates: the evaluator's class (or a factory of
        #: its arguments; autosymm.bench.stand_in: stand-in timings on the CPU)
        self.evaluator_type: Callable[..., SweepEvaluator] = SweepEvaluator

    @classmethod
    def open(cls, settings: TuneSettings, problems: Sequence[Problem], *, group=None, db_path: Optional[str] = None,
             backends: Optional[dict] = None) -> "TuneSession":
        """Set up a tune of ``problems`` on this rank; collective over ``group`` (default: the
        world). On an NCCL group of several ranks, the workspace sized for the problems
        (:func:`workspace_bytes`); the control group; on rank 0 the database at ``db_path``
        (None or '': a dry run); the settings' backends (``backends``: name -> Backend instead)."""
        group = group if group is not None else dist.group.WORLD
        device, workspace = comm_device(group), None
        if dist.get_world_size(group) > 1 and device.type == "cuda":
            ar_bytes, moe_bytes = workspace_bytes(list(problems))
            workspace = get_workspace(group, device, all_reduce_bytes=ar_bytes, moe_bytes=moe_bytes)
        unavailable: dict[str, str] = {}
        if backends is None:
            backends, unavailable = _load_backends(settings.backends)
        db = TuningDB(db_path) if db_path and dist.get_rank(group) == 0 else None
        session = cls(settings, backends, group=group, workspace=workspace, db=db)
        session.unavailable = unavailable
        return session

    def with_settings(self, settings: TuneSettings) -> "TuneSession":
        """This session (group, workspace, DB, hardware) with other settings; its backends are
        those of this one named in ``settings.backends`` (None: all)."""
        session = copy.copy(self)
        session.settings = settings
        wanted = settings.backends
        session.backends = {n: b for n, b in self.backends.items() if wanted is None or n in wanted}
        return session

    def modes_for(self, problem: Problem) -> tuple[str, ...]:
        """The modes tuned for ``problem``: both (every op is tuned eager and graph at every size and
        token count) that the settings ask for."""
        wanted = self.settings.modes
        return tuple(m for m in MODES if wanted is None or m in wanted)

    def sweep(self, problems: Sequence[Problem], progress: Optional[Callable[[SweepItem], None]] = None
              ) -> list[SweepItem]:
        """Tune ``problems`` in each of :meth:`modes_for`, in lock-step with the other ranks.

        ``progress(item)`` is called on every rank after each (problem, mode). The workspace's
        signal pads are reset (collectively) first and after every failed candidate. A problem
        whose search aborts (a candidate still stuck after the timeout) stops the sweep: nothing
        more is measured in a process whose GPU stream may be stuck. A failed database write
        (rank 0) is reported in the item's ``reason`` and the sweep goes on (the other ranks
        cannot wait)."""
        if self.workspace is not None:  # stale counts from earlier use of the workspace must not leak in
            self.workspace.reset_signals(self.control_group)
        items: list[SweepItem] = []
        for problem in problems:
            if problem.world_size != self.world_size:
                raise ValueError(f"{problem.describe()} does not match the group's world size {self.world_size}")
            modes = self.modes_for(problem)
            for mode in modes:
                start = time.monotonic()
                item = self.tune_one(problem, mode, compile_ahead=mode == modes[0])
                item.seconds = time.monotonic() - start
                self._record(item)
                items.append(item)
                if progress is not None:
                    progress(item)
                if item.status == "aborted":
                    return items
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        return items

    def tune_one(self, problem: Problem, mode: str, *, compile_ahead: bool = True) -> SweepItem:
        """One (problem, mode), nothing recorded. ``compile_ahead``: precompile the candidates
        first (the problem's first mode; the kernels are the same in both, so the second finds
        them compiled)."""
        candidates, why_not = candidates_for(problem, mode, self.backends, self.caps)
        if self.screen is not None:
            candidates, refused = self.screen(problem, mode, candidates)
            why_not.update(refused)
        if not any(name != problem.record.fallback for name in candidates):
            return SweepItem(problem, mode, "skipped", "no backend but the fallback serves it", unsupported=why_not)
        evaluator, failure = self.evaluator(problem, mode)
        if evaluator is None:
            return SweepItem(problem, mode, "failed", failure, unsupported=why_not)
        if compile_ahead:
            precompile(problem, candidates, self.backends, self.ctx, evaluator.data.validation_args(), self.device)
        outcome = self.search(problem, candidates, evaluator)
        if outcome.aborted:
            return SweepItem(problem, mode, "aborted", outcome.aborted, outcome, unsupported=why_not)
        if outcome.best is None:
            return SweepItem(problem, mode, "failed", "no candidate passed validation", outcome, unsupported=why_not)
        return SweepItem(problem, mode, "tuned", "", outcome, unsupported=why_not)

    def evaluator(self, problem: Problem, mode: str) -> tuple[Optional[SweepEvaluator], str]:
        """(the evaluator of ``problem`` in ``mode``: its inputs and reference built, '') on every
        rank, or (None, why) on every rank when some rank could not allocate them. Collective."""
        plan = self.settings.plan_for(problem, mode)
        data = ProblemData(problem, self.group, self.device, self.rank, plan.n_inputs)
        failure = ""
        try:
            data.allocate()
        except Exception as exc:  # e.g. out of memory on one rank: agree before any collective
            failure = f"{type(exc).__name__}: {exc}"
        if RankComm(self.control_group, self.settings.agree_s).agree(failed=bool(failure)).failed:
            return None, f"inputs could not be built on some rank ({failure or 'see others'})"
        data.build_reference()
        return self.evaluator_type(problem, mode, self.backends, data, self.ctx, plan,
                                   control_group=self.control_group), ""

    def time_candidates(self, problem: Problem, mode: str, candidates: Sequence[Candidate], rounds: int = 3
                        ) -> dict[Candidate, float]:
        """Median us per call of each of ``candidates`` in ``mode``, timed the tuner's way (each
        validated, then this session's timing plan, MAX over ranks) ``rounds`` times, interleaved:
        every round times each candidate once, in one order, so drift between rounds does not
        favour one. +inf for a candidate that fails (or whose backend this session lacks).
        Collective."""
        samples: dict[Candidate, list[float]] = {c: [] for c in candidates}
        evaluator, _ = self.evaluator(problem, mode)
        if evaluator is None:
            return {c: math.inf for c in candidates}
        configs: dict[str, list] = {}
        for candidate in samples:
            configs.setdefault(candidate.backend, []).append(candidate.config)
        grid = dataclasses.replace(self.settings, strategy="grid", deadline_s=None)
        for _ in range(rounds):
            outcome = tune(problem, configs, evaluator, grid, group=self.control_group,
                           baseline_backend=problem.record.fallback)
            for result in outcome.results:
                if result.candidate in samples:
                    samples[result.candidate].append(result.score)
        return {c: statistics.median(times) if times else math.inf for c, times in samples.items()}

    def search(self, problem: Problem, candidates: dict[str, list], evaluator) -> TuneOutcome:
        """The search of one problem's ``candidates`` (autosymm.tuning.tuner.tune) with these
        settings, on the control group, against the op's fallback."""
        return tune(problem, candidates, evaluator, self.settings, group=self.control_group,
                    baseline_backend=problem.record.fallback)

    def _record(self, item: SweepItem) -> None:
        """Rank 0 writes a tuned item's rows; a failure lands in ``item.reason``, never raised."""
        if self.rank != 0 or self.db is None or item.status != "tuned" or item.outcome is None:
            return

        try:
            rows = item.outcome.rows(mode=item.mode, hardware=self.hardware_slug, provenance=self.provenance)
            item.rows_written = self.db.record_many([Row(**row) for row in rows])
        except Exception as exc:  # never leave the other ranks waiting in the next collective
            item.reason = f"database write failed: {type(exc).__name__}: {exc}"


def _load_backends(names: Optional[Sequence[str]]) -> tuple[dict, dict[str, str]]:
    """({name: Backend} of ``names`` (None: every registered one), {name: why unavailable}):
    one that cannot be imported (e.g. torch without symmetric memory) leaves the others."""
    backends, unavailable = {}, {}
    for name in names or backend_names():
        try:
            backends[name] = get_backend(name)
        except ImportError as exc:
            unavailable[name] = str(exc)
    return backends, unavailable


@dataclass
class TuneResult:
    """What `autosymm tune` reports (rank 0): the winners' summary rows (the CLI's table) and one
    line per (problem, mode) that went wrong (:meth:`SweepItem.failure`); any makes the exit
    status non-zero."""

    rows: list[dict]
    failures: list[str]


def tune_job(rank: int, world_size: int, options: TuneOptions) -> Optional[TuneResult]:
    """Tune ``options`` on this rank; rank 0 writes the DB and returns the :class:`TuneResult`
    (None on the other ranks)."""
    from ..kernels import barrier  # Triton kernels load at the first launch: a CPU group imports none

    if rank == 0 and int(barrier.MAX_POLLS.value) > barrier.TUNING_MAX_POLLS:
        print(f"autosymm tune: barrier waits give up after {int(barrier.MAX_POLLS.value)} polls; set "
              f"AUTOSYMM_BARRIER_MAX_POLLS={barrier.TUNING_MAX_POLLS} before starting the workers (torchrun) "
              "so a failed candidate costs seconds")
    problems = problems_for(options, world_size)
    session = TuneSession.open(options.settings(), problems, db_path=options.db_path)
    if rank == 0:
        for name, why in session.unavailable.items():
            print(f"autosymm tune: backend {name} unavailable: {why}")
    progress, finish = _progress(session, problems)
    started = time.time()
    items = session.sweep(problems, progress)
    finish()
    if rank != 0:
        return None
    result = TuneResult(rows=[s for s in (item.summary(session.caps.stack) for item in items) if s],
                        failures=[f for f in (item.failure() for item in items) if f])
    print(f"autosymm tune: {len(items)} (problem, mode) pairs in {time.time() - started:.1f} s on {world_size} "
          f"GPU(s); {sum(i.rows_written for i in items)} rows written to {options.db_path or 'no database'}")
    for line in result.failures + [s for s in (item.skip_line() for item in items) if s]:
        print("  " + line)
    return result


def _progress(session: TuneSession, problems: list[Problem]):
    """A rich progress bar on rank 0 (no-op elsewhere): (callback per item, finish)."""
    if session.rank != 0:
        return (lambda item: None), (lambda: None)
    # rich: only the CLI's tune draws progress; the serving warm-up imports this module
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    total = sum(len(session.modes_for(p)) for p in problems)
    bar = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                   TimeElapsedColumn())
    task = bar.add_task("tuning", total=total)
    bar.start()

    started = time.time()
    log_lines = not bar.console.is_terminal  # a log file gets one line per item instead of redraws

    def advance(item) -> None:
        summary = item.summary()
        text = f"{item.problem.describe()} [{item.mode}] -> {summary['backend'] if summary else item.status}"
        bar.update(task, advance=1, description=text[:90])
        if log_lines:
            us = f" {summary['us']:.2f} us" if summary else ""
            print(f"[{time.time() - started:7.1f} s] {text}{us}", flush=True)

    return advance, bar.stop
