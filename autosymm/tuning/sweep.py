"""What a tune sweeps and how it times it: problems, modes, timing plans, candidates per backend,
and the record of each (problem, mode) (:class:`SweepItem`). The driver is
:class:`autosymm.tuning.session.TuneSession`: every rank calls its ``sweep`` in lock-step; per
problem and mode it asks each backend whether it serves and for its space (:func:`candidates_for`),
builds the inputs and a reference (autosymm.tuning.reference) and searches with the evaluator of
autosymm.tuning.evaluator; rank 0 writes each backend's best row under the problem's exact size.
Default points are each op's spec's (all-reduce: 2^k and 1.5 x 2^k bytes from 4 KiB to 256 MiB,
so a call between tuned sizes has neighbours at most 1.5x apart); modes: eager and graph for every
problem. A (problem, mode) that no tuned backend can serve is skipped and reported
(:meth:`SweepItem.skip_line`).

Design notes: docs/TUNING.md#tuning-sweep
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional

import torch.distributed as dist

from ..configs import config_to_json
from ..problem import Problem
from .outcome import TuneOutcome

MEASURE_TIMEOUT_S = 120.0  # default per-measurement timeout floor (s)


def measure_timeout_s() -> float:
    """Default timeout of one measurement (s): at least twice a barrier wait's pessimistic spin
    limit plus a minute, so a kernel whose peer never arrives gives up by itself first."""
    from ..kernels.barrier import max_wait_s  # Triton kernels load at the first launch: a CPU group imports none

    return max(MEASURE_TIMEOUT_S, 2 * max_wait_s() + 60.0)


@dataclass(frozen=True)
class TimingPlan:
    """How one problem is timed; a pure function of the problem, so the same on every rank."""

    n_inputs: int
    warmup: int
    repeats: int
    calls_per_sample: int  # eager: calls between two events
    calls_per_graph: int  # graph: calls captured in one graph


def timing_plan(problem: Problem, mode: str) -> TimingPlan:
    """Rotating inputs: enough distinct buffers that the same one is not reused while hot
    (2..8, fewer for large problems); tiny calls are batched between events; fewer repeats for
    large problems (their samples are steadier)."""
    nbytes = max(problem.nbytes, 1)
    n_inputs = max(2, min(8, math.ceil((64 << 20) / nbytes)))
    small, large = nbytes <= (256 << 10), nbytes > (16 << 20)
    if mode == "graph":
        return TimingPlan(n_inputs, warmup=3, repeats=10 if large else 30, calls_per_sample=1,
                          calls_per_graph=max(n_inputs, 16 if small else n_inputs))
    return TimingPlan(n_inputs, warmup=3 if large else 10, repeats=20 if large else 50,
                      calls_per_sample=4 if small else 1, calls_per_graph=n_inputs)


# ------------------------------------------------------------------------------------------
# What happened, and what is tried
# ------------------------------------------------------------------------------------------


@dataclass
class SweepItem:
    """What happened to one (problem, mode); the same on every rank."""

    problem: Problem
    mode: str
    status: str  # 'tuned' | 'skipped' | 'failed' | 'aborted'
    reason: str = ""
    outcome: Optional[TuneOutcome] = None
    rows_written: int = 0
    seconds: float = 0.0
    unsupported: dict[str, str] = field(default_factory=dict)  # backend -> why not

    def failure(self) -> Optional[str]:
        """The line reporting what went wrong (a failed or aborted search, or a tuned one whose
        database write failed); None when nothing did."""
        if self.status in ("failed", "aborted") or (self.status == "tuned" and self.reason):
            return f"{self.problem.describe()} [{self.mode}]: {self.status} {self.reason}"
        return None

    def skip_line(self) -> Optional[str]:
        """The line saying that this (problem, mode), which the tune was asked for, was skipped
        and why, with each backend's reason; None when it was not skipped."""
        if self.status != "skipped":
            return None
        why = "; ".join(f"{name}: {reason}" for name, reason in sorted(self.unsupported.items()))
        return f"{self.problem.describe()} [{self.mode}]: skipped, {self.reason}" + (f" ({why})" if why else "")

    def summary(self, stack: str = "") -> Optional[dict]:
        """The CLI's summary row of the winner (None when nothing won): its time, NCCL's and, where
        ``stack`` names a serving stack's path timed beside them (autosymm.backends.stack), that
        path's; each margin is the other's time over the winner's, minus 1 (0.25: the winner is
        25 % faster; None: not timed)."""
        if self.outcome is None or self.outcome.best is None:
            return None
        best, base = self.outcome.best, self.outcome.baseline
        p = self.problem
        nccl_us = base.score if base is not None and base.ok else None
        stack_us = next((r.score for r in self.outcome.results if stack and r.ok and r.candidate.backend == stack),
                        None)
        label = p.record.point_label(p)
        return {"op": p.op, "label": label, "mode": self.mode, "backend": best.candidate.backend,
                "config": config_to_json(best.candidate.config), "us": best.score, "nccl_us": nccl_us,
                "speedup": (nccl_us / best.score) if nccl_us else None, "world_size": p.world_size,
                "bucket": p.bucket, "dtype": p.dtype, "nccl_margin": margin(nccl_us, best.score),
                "stack": stack or None, "stack_us": stack_us, "stack_margin": margin(stack_us, best.score)}


def margin(other_us: Optional[float], winner_us: float) -> Optional[float]:
    """How much slower ``other_us`` is than ``winner_us``: other / winner - 1 (None: not timed)."""
    if not other_us or not winner_us > 0 or not math.isfinite(other_us):
        return None
    return other_us / winner_us - 1.0


def candidates_for(problem: Problem, mode: str, backends: dict, caps) -> tuple[dict[str, list], dict[str, str]]:
    """({backend: configs} of the backends serving ``problem`` in ``mode``, {backend: why not}),
    by the backends' one eligibility contract (autosymm.backends.base.Backend.why_not)."""
    out: dict[str, list] = {}
    why_not: dict[str, str] = {}
    for name in sorted(backends):
        backend = backends[name]
        if not backend.serves(problem.record):
            continue
        reason = backend.why_not(problem, caps, mode)
        if reason is not None:
            why_not[name] = reason
            continue
        out[name] = with_eager_launches(list(backend.search_space(problem)), mode)
    return out, why_not


def with_eager_launches(configs: list, mode: str) -> list:
    """``configs``, and in eager mode each one that has an ``eager_launch`` field (the Triton
    all-reduce and fused configs) again as a bound direct launch: the tuner times both launch
    styles (autosymm.configs.EAGER_LAUNCHES) and the eager row stores the winner's."""
    if mode != "eager":
        return configs
    return configs + [dataclasses.replace(c, eager_launch="direct") for c in configs if hasattr(c, "eager_launch")]


def control_group_for(group):
    """A gloo group over ``group``'s ranks for the tuner's protocol (kept off the GPU, so a hung
    stream cannot block it). Collective over the default group: every process must call it."""
    if "gloo" in str(dist.get_backend(group)).lower():
        return group
    ranks = dist.get_process_group_ranks(group) if group is not None else None
    return dist.new_group(ranks=ranks, backend="gloo")
