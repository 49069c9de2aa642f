"""`autosymm bench --regret`: what the tuned database's choices cost where a call is not at a
tuned point, how stable a tune's winners are, and whether a graph row is what a user's graph
runs (the measures and their report: autosymm.bench.regret_report). Runs in every worker
(autosymm.tuning.workers), every rank in lock-step: the points (:func:`regret_points`: between
the databases' tuned sizes, or the sizes asked for); per point and mode the dispatcher's pick
against a tune at the exact size, both re-timed interleaved ``rounds`` times (regret); every point
tuned again by a second session (winner flips); the databases' graph rows replayed in a user's
CUDA graph through the public call (replay fidelity). ``stand_in`` (``--cpu``): gloo ranks,
stand-in backends and times (autosymm.bench.stand_in), no time printed.

Design notes: docs/TUNING.md#bench-regret
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch.distributed as dist

import autosymm

from .. import spec
from ..problem import MODES, Problem
from ..spec import BYTES, Values
from .regret_report import FlipRow, RegretResult, RegretRow, ReplayRow, regret_of
from ..configs import config_fields
from ..db.read import open_sources, winners
from ..db import store
from ..hardware import fingerprint
from ..runtime.dispatch import decide
from .stand_in import STAND_IN_MAX_BYTES, StandInEvaluator, stand_in_backends, stand_in_caps, stand_in_us
from ..tuning.outcome import Candidate
from ..tuning.rank_comm import RankComm
from ..tuning.reference import check_output
from ..tuning.session import TuneSession, TuneSettings
from ..tuning.timing import max_over_ranks, time_graph

#: Sizes that are not round (odd element counts of bf16 among them), by bucket unit: where a
#: bucketed dispatcher is weakest (6 KiB + 2 B, 100 kB, 800 kB, 3 MB, 5 MB, 12 MiB + 6 B).
ODD_POINTS = {BYTES: (6146, 100000, 800000, 3000000, 5000000, 12582918)}
#: How far below a midpoint to look for a size a call can have (bytes of a few elements).
_NEAR = 64


@dataclass
class RegretOptions:
    """What `autosymm bench --regret` asks: ``ops`` (None: every op the databases hold rows of
    here), ``modes``, ``points`` (a unit's sweep flag -> the sizes asked; a unit not named: the
    points between the tuned ones), ``limit`` (points and replayed rows per op; None: all),
    ``rounds`` (interleaved re-timings), ``calls`` (per user graph), ``stand_in`` (--cpu)."""

    ops: Optional[list[str]] = None
    modes: tuple[str, ...] = MODES
    points: Values = field(default_factory=dict)
    limit: Optional[int] = None
    rounds: int = 3
    calls: int = 8
    stand_in: bool = False


def tuned_families(sources, hardware: str, world_size: int, ops=None) -> dict[tuple[str, str, str], list[int]]:
    """(op, dtype, shape key) -> the buckets tuned (in any mode) for ``hardware`` at ``world_size``
    in ``sources``, of the ops in ``ops`` (None: all)."""
    families: dict[tuple[str, str, str], set[int]] = {}
    for _, row in winners(sources, hardware=hardware, world_size=world_size):
        if ops is None or row.op in ops:
            families.setdefault((row.op, row.dtype, row.shape), set()).add(row.bucket)
    return {key: sorted(buckets) for key, buckets in sorted(families.items())}


def regret_points(families: dict, world_size: int, asked: Values, limit: Optional[int] = None,
                  max_bytes: Optional[int] = None) -> list[Problem]:
    """The problems regret is measured at (see the module docstring, step 1), registry order;
    ``max_bytes``: only calls of at most that many bytes (None: any)."""
    by_op: dict[str, list[Problem]] = {}
    for (op, dtype, shape_key), buckets in families.items():
        record = spec.get(op)
        sizes = record.unit.sweep.of(asked)
        if sizes is None:
            middles = [(low + high) // 2 for low, high in zip(buckets, buckets[1:])]
            odd = [s for s in ODD_POINTS.get(record.unit, ()) if buckets[0] < s < buckets[-1]]
            sizes = [s for s in middles + odd if s not in buckets]
        shape = record.shape_of_key(shape_key) if record.shape else None
        made = (_callable(record, dtype, world_size, size, shape) for size in sorted(set(sizes)))
        by_op.setdefault(op, []).extend(dict.fromkeys(p for p in made if p is not None and _fits(p, max_bytes)))
    order = spec.names()
    return [p for op in sorted(by_op, key=order.index) for p in spread(by_op[op], limit)]


def _fits(problem: Problem, max_bytes: Optional[int]) -> bool:
    return max_bytes is None or problem.nbytes <= max_bytes


def _callable(record, dtype: str, world_size: int, size: int, shape) -> Optional[Problem]:
    """The problem of the largest size at most :data:`_NEAR` below ``size`` that a call can have
    (the op's own rules; a whole number of elements), or None."""
    for near in range(size, max(0, size - _NEAR), -1):
        try:
            problem = record.problem_at(dtype, world_size, near, shape)
        except ValueError:
            continue
        if not record.unit.refuse(problem, str(near)):
            return problem
    return None


def spread(items: list, limit: Optional[int]) -> list:
    """At most ``limit`` of ``items``, evenly spaced, first and last kept (None: all)."""
    if limit is None or len(items) <= limit:
        return list(items)
    if limit <= 1:
        return items[:limit]
    return [items[round(i * (len(items) - 1) / (limit - 1))] for i in range(limit)]


def replay_keys(sources, hardware: str, world_size: int, ops, limit: Optional[int],
                max_bytes: Optional[int] = None) -> list:
    """(problem, winner row) of the databases' graph-mode keys for ``hardware`` at ``world_size``
    (calls of at most ``max_bytes``; None: any), at most ``limit`` per op, registry order."""
    by_op: dict[str, list] = {}
    for _, row in winners(sources, hardware=hardware, world_size=world_size, mode="graph"):
        problem = spec.get(row.op).problem_of_row(row)
        if (ops is None or row.op in ops) and _fits(problem, max_bytes):
            by_op.setdefault(row.op, []).append((problem, row))
    order = spec.names()
    return [key for op in sorted(by_op, key=order.index) for key in spread(by_op[op], limit)]


@dataclass
class Rig:
    """What the measures run on, on this rank: the tune ``session`` (group, workspace, backends),
    ``decide(problem, mode)`` (the dispatcher as a call gets it), its ``sources`` and
    ``hardware``, ``second()`` (the flips' second session) and ``stand_in``."""

    session: object
    decide: Callable
    sources: list
    hardware: str
    second: Callable
    stand_in: bool = False


def _gpu_rig(options: RegretOptions, world_size: int) -> tuple[Rig, list[Problem], list]:
    """Collective: the session (its workspace sized for every point and replayed key), then the
    runtime on that workspace (autosymm.init): its databases and capabilities decide."""
    hardware = fingerprint().hardware_slug
    sources = open_sources(store.user_db_path(), store.shipped_db_paths(), hardware)
    points, keys = _plan(options, sources, hardware, world_size)
    session = TuneSession.open(TuneSettings(modes=tuple(options.modes)), points + [p for p, _ in keys], db_path=None)
    autosymm.init()
    state = autosymm.api.state_of(None)
    rig = Rig(session, state.decide, state.sources, state.hardware, lambda: session.with_settings(session.settings))
    return rig, points, keys


def _stand_in_rig(options: RegretOptions, world_size: int) -> tuple[Rig, list[Problem], list]:
    """The stand-in node (autosymm.bench.stand_in) over the gloo world: the databases' rows of the
    first hardware that has rows at this world size, decided as `autosymm explain` decides them."""
    sources = open_sources(store.user_db_path(), store.shipped_db_paths())
    hardware = min((row.hardware for _, row in winners(sources, world_size=world_size)), default="none")
    points, keys = _plan(options, sources, hardware, world_size, STAND_IN_MAX_BYTES)
    session = TuneSession(TuneSettings(modes=tuple(options.modes)), stand_in_backends(), group=dist.group.WORLD,
                          hardware=hardware)
    session.caps = caps = stand_in_caps(world_size)
    session.evaluator_type = functools.partial(StandInEvaluator, salt="first")

    def second():
        again = session.with_settings(session.settings)
        again.evaluator_type = functools.partial(StandInEvaluator, salt="second")
        return again

    rig = Rig(session, lambda p, m: decide(p, m, caps, sources, hardware), sources, hardware, second, stand_in=True)
    return rig, points, keys


def _plan(options: RegretOptions, sources, hardware: str, world_size: int, max_bytes: Optional[int] = None
          ) -> tuple[list[Problem], list]:
    """(the points, the replayed keys) of ``options`` in ``sources``."""
    families = tuned_families(sources, hardware, world_size, options.ops)
    return (regret_points(families, world_size, options.points, options.limit, max_bytes),
            replay_keys(sources, hardware, world_size, options.ops, options.limit, max_bytes))


def regret_job(rank: int, world_size: int, options: RegretOptions) -> Optional[RegretResult]:
    """Worker body of `autosymm bench --regret`; rank 0 returns the result."""
    rig, points, keys = (_stand_in_rig if options.stand_in else _gpu_rig)(options, world_size)
    result = RegretResult(rig.hardware, world_size, rig.stand_in, [s.label for s in rig.sources])
    firsts = measure_regret(rig, points, options.rounds, result)
    measure_flips(rig, firsts, result)
    for problem, row in keys:
        result.replay.append(measure_replay(rig, problem, row, options.calls))
    return result if rank == 0 else None


def measure_regret(rig: Rig, points: list[Problem], rounds: int, result: RegretResult) -> list:
    """Step 2 for every point and mode (rows into ``result.regret``); the exact tunes' items."""
    firsts = []
    for problem in points:
        modes = rig.session.modes_for(problem)
        for mode in modes:
            decision = rig.decide(problem, mode)
            chosen = Candidate(decision.backend, decision.config)
            row = RegretRow(problem.op, _label(problem), mode, pick_text(chosen), _source(decision, problem),
                            decision.reason)
            result.regret.append(row)
            item = rig.session.tune_one(problem, mode, compile_ahead=mode == modes[0])
            if item.status != "tuned":
                row.note = f"the exact tune {item.status}: {item.reason}"
                continue
            firsts.append(item)
            best = item.outcome.best
            row.best = pick_text(best.candidate)
            if best.candidate == chosen:
                row.chosen_us, row.best_us, row.regret = best.score, best.score, 0.0
                continue
            times = rig.session.time_candidates(problem, mode, [chosen, best.candidate], rounds)
            row.chosen_us, row.best_us = times[chosen], times[best.candidate]
            row.regret = regret_of(row.chosen_us, row.best_us)
            if row.regret is None:
                row.note = "the dispatcher's pick failed at this size" if math.isinf(row.chosen_us) else \
                    "the exact winner failed when re-timed"
    return firsts


def measure_flips(rig: Rig, firsts: list, result: RegretResult) -> None:
    """Step 3: each exact tune again, by a second session (rows into ``result.flips``)."""
    second = rig.second()
    for item in firsts:
        again = second.tune_one(item.problem, item.mode)
        if again.status != "tuned":
            continue
        first, other = item.outcome.best, again.outcome.best.candidate
        in_first = next((r for r in item.outcome.results if r.candidate == other and r.ok), None)
        gap = in_first.score / first.score - 1.0 if in_first is not None and first.score > 0 else None
        result.flips.append(FlipRow(item.problem.op, _label(item.problem), item.mode, pick_text(first.candidate),
                                    pick_text(other), gap))


def measure_replay(rig: Rig, problem: Problem, row, calls: int) -> ReplayRow:
    """Step 4 for one graph row (see the module docstring)."""
    decision = rig.decide(problem, "graph")
    served = Candidate(decision.backend, decision.config)
    out = ReplayRow(problem.op, _label(problem), pick_text(Candidate(row.backend, row.config_obj)), pick_text(served),
                    row.median_us, calls)
    evaluator, why = rig.session.evaluator(problem, "graph")
    call = evaluator.data.op.public_call(evaluator.data) if evaluator is not None else None
    if call is None:
        out.note = why or f"{problem.op} has no public call to capture"
        return out
    us, out.note = _replayed(rig, evaluator, call, served, calls)
    if us is not None:
        out.replay_us, out.ratio = us, us / row.median_us
    return out


def _replayed(rig: Rig, evaluator, call, served, calls: int) -> tuple[Optional[float], str]:
    """(per-call us of ``call`` replayed in a user's graph, MAX over ranks; or None, why):
    checked against the reference first, on every rank. A stand-in run captures nothing: its
    time is the stand-in's of the pick that serves."""
    session, data = rig.session, evaluator.data
    failure = ""
    try:
        args = data.validation_args()
        check_output(data.result(call(*args), args), data.expected, data.mask, exact=data.exact)
    except Exception as exc:  # the same call fails on every rank (the door's checks are agreed)
        failure = f"{type(exc).__name__}: {exc}"
    if RankComm(session.control_group, session.settings.agree_s).agree(failed=bool(failure)).failed:
        return None, f"the public call failed its check ({failure or 'on another rank'})"
    if rig.stand_in:
        return stand_in_us(served, data.problem, "graph", "replay"), ""
    plan = evaluator.plan
    timing = time_graph(call, data.timing_args(), warmup=plan.warmup, repeats=plan.repeats, calls_per_graph=calls,
                        group=session.group)
    return max_over_ranks(timing, session.control_group).median_us, ""


def _label(problem: Problem) -> str:
    return problem.record.point_label(problem)


def pick_text(candidate) -> str:
    """'triton_one_shot block_size=1024 num_blocks=4 ...' (words a table wraps between)."""
    fields = config_fields(candidate.config) if candidate.config is not None else {}
    return " ".join([candidate.backend, *(f"{k}={v}" for k, v in fields.items())])


def _source(decision, problem: Problem) -> str:
    """Where the dispatcher's pick came from: the tuned row's size (and mode), or why none."""
    if not decision.tuned:
        return "no row: the op's fallbacks"
    return f"{decision.mode} row at {problem.record.size_text(decision.bucket)}" if decision.measured else \
        f"row at {problem.record.size_text(decision.bucket)}"
