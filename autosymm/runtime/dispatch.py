"""Problem -> Decision: which backend and config serve a call, and why. The one decider: every
call of every op, inside the tuned domain or not, is decided here (the front doors only check
and launch), so ``autosymm.explain`` answers for every call.

The decision is a pure function of (problem, mode, capabilities, database rows), so every rank
that sees the same databases decides the same. Rules, in order: 1. nothing to exchange ->
``noop``; 2. ``AUTOSYMM_DISABLE=1`` -> :func:`last_resort`; 3. a group spanning nodes ->
:func:`last_resort` (NCCL); 4. a call outside the op's tuned domain -> :func:`fallback_decision`,
no row read; 5. the databases' rows under the op's lookups, each modelled at the call, the fastest
trusted one whose backend can serve wins; 6. nothing usable -> :func:`fallback_decision` (the op's
``fallback_order``). ``deterministic``: only backends batch-invariant for the call serve.

Design notes: docs/DISPATCH.md#runtime-dispatch
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional, Sequence

from .. import settings
from ..backends import STACK_PATHS, Capabilities, get_backend
from ..configs import AnyConfig, config_fields
from ..db.read import DBSource, Lookup
from ..db.schema import Key, Row, nccl_trust, version_mismatch
from ..hardware import nccl_version, running_versions
from .neighbours import RowCandidate, candidates, floors_of, moe_ratios, nearest_moe_point, points_around
from ..problem import Problem


@dataclass(frozen=True)
class Decision:
    """What serves a call: backend name, its config, and where that came from."""

    backend: str
    config: Optional[AnyConfig]
    reason: str
    source: str = ""  # database file the row came from ('' for fallbacks)
    expected_us: Optional[float] = None
    nccl_us: Optional[float] = None
    bucket: int = 0
    mode: str = "eager"
    skipped: tuple[str, ...] = field(default=(), compare=False)  # "backend: why" of faster rows passed over
    measured: bool = False  # expected_us is the row's own time (the call's size, dtype, shape, mode), not modelled
    hardware: str = ""  # the hardware slug decided for (autosymm.hardware)
    exchanges: bool = True  # False: nothing to exchange (backend noop: rule 1)
    stack_us: Optional[float] = None  # inside a serving stack: its own path's time at the call (us)
    formula: str = ""  # the numerics the backend computes (Backend.formula: 'sum', 'single-rounding', ...)

    @property
    def tuned(self) -> bool:
        """True when a database row decided (False: a fallback, a one-rank or disabled call)."""
        return bool(self.source)

    def describe(self) -> str:
        text = f"{self.backend}"
        if self.config is not None:
            fields = ", ".join(f"{k}={v}" for k, v in config_fields(self.config).items())
            text += f" [{fields}]"
        if self.expected_us is not None:
            text += f", expected {self.expected_us:.2f} us ({'measured' if self.measured else 'modelled'}"
            if self.nccl_us:
                text += f"; NCCL {self.nccl_us:.2f} us, {self.nccl_us / self.expected_us:.2f}x"
            text += ")"
        text += f" - {self.reason}"
        if self.formula not in ("", "sum", "copy"):
            text += f"; computes the {self.formula} formula"
        if self.source:
            text += f" ({Path(self.source).name})"
        timed = self.expected_us is not None or not self.exchanges
        if self.hardware or not timed:
            text += f" [{'on ' + self.hardware if self.hardware else ''}{'' if timed else ': no measured time'}]"
        return text


def last_resort(problem: Problem, deterministic: bool = False) -> str:
    """The backend that always serves ``problem``: the op's ``fallback``; with ``deterministic``,
    its ``invariant_fallback`` unless the fallback is batch-invariant itself (RuntimeError for an
    op that has neither: no call of it may break the setting)."""
    record = problem.record
    if not deterministic or get_backend(record.fallback).invariant_for(problem):
        return record.fallback
    if not record.invariant_fallback:
        raise RuntimeError(f"autosymm: {problem.describe()} has no batch-invariant backend; "
                           "unset AUTOSYMM_DETERMINISTIC (or init(deterministic=False)) for it")
    return record.invariant_fallback


def with_note(decision: Decision, note: str) -> Decision:
    """``decision`` with ``note`` added to its reason (what warm-up tuning did of the key)."""
    return replace(decision, reason=f"{decision.reason}; {note}")


def unagreed_decision(problem: Problem, mode: str, why: str, deterministic: bool = False,
                      hardware: str = "") -> Decision:
    """The decision of every call on a group whose ranks failed or disagree at set-up (``why``):
    :func:`last_resort` on every rank (nothing to exchange: 'noop', as anywhere)."""
    record = problem.record
    nothing = record.empty_reason(problem) or (record.one_rank_reason(deterministic) if problem.world_size == 1
                                               else "")
    backend = "noop" if nothing else last_resort(problem, deterministic)
    return Decision(backend, None, nothing or f"ranks failed or disagree at set-up ({why})", bucket=problem.bucket,
                    mode=mode, hardware=hardware, exchanges=not nothing)


def fallback_decision(problem: Problem, mode: str, caps: Capabilities, reason: str,
                      deterministic: bool = False, hardware: str = "") -> Decision:
    """The decision when no tuned row serves ``problem``: the first backend of the op's
    ``fallback_order`` that can serve it (batch-invariant for the call, with ``deterministic``),
    with its ``fallback_config``; else :func:`last_resort`."""
    for name in problem.record.fallback_order:
        backend = get_backend(name)
        if (not deterministic or backend.invariant_for(problem)) and backend.why_not(problem, caps, mode) is None:
            config = backend.fallback_config(problem)
            note = "; untuned default config" if config is not None else ""
            return Decision(name, config, reason + note, bucket=problem.bucket, mode=mode, hardware=hardware)
    note = "; deterministic: batch-invariant backends only" if deterministic else ""
    return Decision(last_resort(problem, deterministic), None, reason + note, bucket=problem.bucket, mode=mode,
                    hardware=hardware)


def _lookups(problem: Problem, mode: str):
    """(dtype, row mode, nearest shape?, note) lookups in order of preference (the op's
    spec's :class:`~autosymm.spec.Lookups`)."""
    lookups = problem.record.lookups
    dtype = problem.record.key_dtype(problem)
    other = "graph" if mode == "eager" else "eager"
    yield dtype, mode, False, ""
    if lookups.other_mode:
        yield dtype, other, False, f"no {mode}-mode row, using the {other}-mode row"
    if dtype != "bf16" and lookups.bf16_same_bytes:
        yield "bf16", mode, False, f"no {dtype} row, using the bf16 row of the same byte size"
        yield "bf16", other, False, f"no {dtype} row, using the bf16 {other}-mode row"
    if lookups.nearest_shape:
        yield dtype, mode, True, ""
        if lookups.other_mode:
            yield dtype, other, True, f"no {mode}-mode row, using the {other}-mode row"


def _rows_for(problem: Problem, key: Key, nearest: bool,
              sources: Sequence[DBSource]) -> tuple[list[tuple[str, Row]], list[Row], str]:
    """(source label, row) pairs of the tuned point(s) a call uses under the lookup ``key`` (each
    point's rows from the first source that has it: autosymm.db.read), all rows of the lookup
    (for the backends' floors), and how the point(s) relate to the call."""
    lookup = Lookup(sources, key, any_shape=nearest)
    if nearest:
        point = nearest_moe_point(problem, [p for p in lookup.points() if p[0]])
        if point is None:
            return [], [], ""
        wanted = [point]
        bpr, rpr = moe_ratios(problem, *point)
        how = (f"no row for shape {problem.shape_key}: nearest tuned problem {point[0]} at {point[1]} tokens/rank "
               f"(bytes per row x{bpr:.2f}, rows per rank x{rpr:.2f}), time scaled by the bytes moved")
    else:
        points = points_around(problem.bucket, sorted({bucket for _, bucket in lookup.points()}))
        wanted = [(key.shape, p) for p in points]
        how = _between(problem, points)
    chosen = [pair for point in wanted for pair in lookup.at(*point)]
    return chosen, lookup.rows({shape for shape, _ in wanted}), how


def _between(problem: Problem, points: tuple[int, ...]) -> str:
    """How the tuned ``points`` relate to the call ('' when it was tuned at its size)."""
    size, text = problem.bucket, problem.record.size_text
    call = f"call of {text(size)}"
    if len(points) == 2:
        return f"{call} between tuned {text(points[0])} and {text(points[1])}"
    if not points or points[0] == size:
        return ""
    side = "below the smallest" if points[0] > size else "above the largest"
    return f"{call} {side} tuned size"


def decide(problem: Problem, mode: str, caps: Capabilities, sources: Sequence[DBSource], hardware: str,
           deterministic: bool = False) -> Decision:
    """The decision for ``problem`` in ``mode`` (the rules: the module docstring and
    docs/DISPATCH.md#runtime-dispatch)."""
    record = problem.record

    def plain(backend: str, reason: str) -> Decision:
        return Decision(backend, None, reason, bucket=problem.bucket, mode=mode, hardware=hardware)

    nothing = record.empty_reason(problem) or (record.one_rank_reason(deterministic) if problem.world_size == 1
                                               else "")
    if nothing:
        return replace(plain("noop", nothing), exchanges=False)
    if settings.disabled():
        return plain(last_resort(problem, deterministic), "AUTOSYMM_DISABLE=1")
    if not caps.intra_node:
        return plain(last_resort(problem, deterministic), "group spans nodes: NCCL")
    outside = record.outside_domain(problem)
    if outside:
        decision, ranked = fallback_decision(problem, mode, caps, outside, deterministic, hardware), []
    else:
        decision, ranked = _from_rows(problem, mode, caps, sources, hardware, deterministic)
    if caps.stack:
        decision = _stack_rule(problem, mode, caps, decision, ranked)
    return replace(decision, formula=_formula(decision.backend, problem))


def _from_rows(problem: Problem, mode: str, caps: Capabilities, sources: Sequence[DBSource], hardware: str,
               deterministic: bool) -> tuple[Decision, list[RowCandidate]]:
    """Rules 5 and 6: the fastest trusted row whose backend can serve the call, else the op's
    fallbacks; with the ranked rows of the lookup that decided (none for a fallback)."""
    skipped: list[str] = []
    key = Key.for_problem(hardware, problem, mode)
    for dtype, row_mode, nearest, note in _lookups(problem, mode):
        chosen, family, how = _rows_for(problem, key._replace(dtype=dtype, mode=row_mode), nearest, sources)
        ranked = candidates(problem, chosen, floors_of(family))
        for candidate in ranked:
            row = candidate.row
            trusted, why_not = nccl_trust(row, nccl_version())
            if trusted:
                why_not = _why_not(row.backend, problem, caps, mode, deterministic)
            if why_not is not None:
                text = f"{row.backend}: {why_not}"
                if text not in skipped:
                    skipped.append(text)
                continue
            decision = _decision(problem, mode, candidate, ranked, (how, note), skipped)
            return replace(decision, hardware=hardware), ranked
    reason = "no tuned row for this hardware/world size/shape" if not skipped else "no tuned backend can serve the call"
    decision = fallback_decision(problem, mode, caps, reason, deterministic, hardware)
    return replace(decision, skipped=tuple(skipped)), []


def _stack_rule(problem: Problem, mode: str, caps: Capabilities, decision: Decision,
                ranked: list[RowCandidate]) -> Decision:
    """Inside a serving stack (``caps.stack``), the stack's own path is the default to beat: it
    serves unless a row measured the winner faster than the stack's path at this call by the
    margin (AUTOSYMM_STACK_MARGIN), so timing jitter never displaces it; an untuned call, or one
    no row timed against the stack, is the stack's."""
    stack = caps.stack
    if decision.backend == stack or not decision.exchanges:
        return decision
    why = get_backend(stack).why_not(problem, caps, mode)
    if why:  # the stack's path cannot run (or be timed) here: NCCL is the bar, and the reason says so
        return replace(decision, reason=f"{decision.reason}; {stack}'s own path not a candidate here: {why}")
    stack_row = next((c for c in ranked if c.row.backend == stack), None)
    own = (f"{stack}'s own path" if stack_row is None else
           f"{stack}'s own path ({stack_row.modelled_us:.2f} us)")
    if not decision.tuned or decision.expected_us is None:
        return replace(decision, backend=stack, config=None, reason=f"{own}: {decision.reason}")
    if stack_row is None:
        notes = sorted({c.row.stack_note for c in ranked if c.row.stack_note})
        why = f"not timed against it ({'; '.join(notes)})" if notes else "no row of this call timed it"
        return replace(decision, backend=stack, config=None, reason=f"{own}: {why}", expected_us=None)
    margin = settings.get("AUTOSYMM_STACK_MARGIN")
    stack_us = stack_row.modelled_us
    if decision.expected_us * (1.0 + margin) > stack_us:
        return replace(decision, backend=stack, config=None, expected_us=stack_us, stack_us=stack_us,
                       reason=f"{own}: {decision.backend}'s {decision.expected_us:.2f} us is not {margin:.0%} "
                              f"faster")
    return replace(decision, stack_us=stack_us,
                   reason=f"{decision.reason}; {stack_us / decision.expected_us:.2f}x faster than {stack}'s own path "
                          f"({stack_us:.2f} us, margin {margin:.0%})")


def _formula(backend: str, problem: Problem) -> str:
    """The formula the deciding backend computes for ``problem`` (Backend.formula)."""
    return get_backend(backend).formula(problem)


def _decision(problem: Problem, mode: str, candidate: RowCandidate, ranked: list[RowCandidate],
              notes: tuple[str, str], skipped: list[str]) -> Decision:
    """The Decision for the winning ``candidate``. NCCL's time: the row's ``nccl_us`` at the call's
    own size, else the modelled time of the op's baseline row among ``ranked``, else the row's
    ``nccl_us`` (measured at its point)."""
    row = candidate.row
    exact = row.bucket == problem.bucket and row.shape == problem.shape_key
    reason = f"tuned {row.mode} row at {problem.record.size_text(row.bucket)}"
    how, note = notes
    if how:
        estimate = "interpolated" if candidate.interpolated else "modelled"
        reason += f" ({how}; {estimate} {candidate.modelled_us:.2f} us)"
    for remark in (note, version_mismatch(row, *running_versions()), nccl_trust(row, nccl_version())[1]):
        if remark:
            reason += f" ({remark})"
    baseline = next((c.modelled_us for c in ranked if c.row.backend == problem.record.fallback), None)
    nccl_us = row.nccl_us if (exact and row.nccl_us) or baseline is None else baseline
    return Decision(row.backend, row.config_obj, reason, source=candidate.source, expected_us=candidate.modelled_us,
                    nccl_us=nccl_us, bucket=row.bucket, mode=mode, skipped=tuple(skipped),
                    measured=exact and row.dtype == problem.dtype and row.mode == mode)


def _why_not(backend_name: str, problem: Problem, caps: Capabilities, mode: str,
             deterministic: bool = False) -> Optional[str]:
    try:
        backend = get_backend(backend_name)
    except (KeyError, ImportError) as exc:
        return f"not available here ({exc})"
    if deterministic and not backend.invariant_for(problem) and backend_name not in STACK_PATHS:
        return "not batch-invariant (deterministic)"
    return backend.why_not(problem, caps, mode)
