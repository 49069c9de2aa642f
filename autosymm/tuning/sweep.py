"""What a tune sweeps and how it times it: problems, modes, timing plans, candidates per backend,
and the record of each (problem, mode) (:class:`SweepItem`). The driver is
:class:`autosymm.tuning.session.TuneSession`: every rank calls its ``sweep`` in lock-step; per
problem and mode it asks each backend whether it serves the problem and for its space
(:func:`candidates_for`), builds the inputs and a reference (autosymm.tuning.reference), and
searches with the evaluator of autosymm.tuning.evaluator; rank 0 writes each backend's best row
under the problem's exact size (autosymm.problem).

Default sizes: all-reduce at two points per octave, 2^k and 1.5 * 2^k bytes from 4 KiB to
256 MiB (:data:`ALL_REDUCE_SIZES`, 33 sizes; `autosymm tune --sizes` default
:data:`ALL_REDUCE_SIZES_SPEC`): the dispatcher serves a call between tuned sizes from its two
neighbours (autosymm.dispatch), and at most 1.5x apart the neighbours' configs stay close to what
a tune at the call's own size finds; at one point per octave the 4 MiB config served 3 MB 15 %
slower than a 3 MB tune (2x H200). MoE at :data:`MOE_TOKENS` tokens per rank.

Default modes (:func:`default_modes`): ``eager`` and ``graph`` for every problem: all-reduce at
every size, the MoE conversions at every token count (decode batches are captured, and so are
prefill batches where users capture them; the tune's workspace is sized to fit the sweep). A
(problem, mode) that no tuned backend can serve (e.g. graph mode where only NCCL's host-split
all_to_all would) is skipped and reported (:meth:`SweepItem.skip_line`). NCCL's all_to_all is
not capturable, so graph-mode MoE rows carry no ``nccl_us``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from ..configs import config_to_json
from ..problem import MODEL_SHAPES, MODES, MOE_OPS, Problem, format_bytes, octave_points
from .outcome import TuneOutcome

#: `autosymm tune --sizes` by default: 4 KiB..256 MiB, two points per octave (2^k, 1.5 * 2^k).
ALL_REDUCE_SIZES_SPEC = "4KiB:256MiB:2"
ALL_REDUCE_SIZES = octave_points(4 << 10, 256 << 20, 2)
#: MoE tokens per rank of the default sweep: powers of four from 1 to 4096, and 8192. The
#: dispatcher serves a count in between from its tuned neighbours, so the range 1..8192 is
#: covered with 8 points instead of 14 (a sweep of minutes, not tens).
MOE_TOKENS = [1, 4, 16, 64, 256, 1024, 4096, 8192]
#: Hidden sizes of the fused all-reduce + RMSNorm sweep (``--ops all_reduce_rmsnorm``: the hidden
#: sizes of common tensor-parallel models), at :func:`fused_tokens` (by default MOE_TOKENS and
#: FUSED_EXTRA_TOKENS), eager and graph: 4 x 10 x 2 = 80 (problem, mode) pairs.
FUSED_HIDDEN = (4096, 5120, 7168, 8192)
#: Token counts the fused op is also tuned at, inside the ``--tokens`` range: where its targets
#: are stated (fused within 1 us of the all-reduce alone up to 128 tokens, 1.5x NCCL + rms_norm
#: up to 2048), so the DB holds a measured row there rather than a neighbour's config.
FUSED_EXTRA_TOKENS = (128, 2048)


def fused_tokens(tokens: list[int]) -> list[int]:
    """Tokens per rank of the fused sweep: ``tokens`` plus the :data:`FUSED_EXTRA_TOKENS` within
    their range, sorted."""
    if not tokens:
        return []
    extra = [t for t in FUSED_EXTRA_TOKENS if min(tokens) <= t <= max(tokens)]
    return sorted(set(tokens) | set(extra))
MEASURE_TIMEOUT_S = 120.0  # default per-measurement timeout floor (s)


def measure_timeout_s() -> float:
    """Default timeout of one measurement (s): at least twice a barrier wait's pessimistic spin
    limit plus a minute, so a kernel whose peer never arrives gives up by itself first."""
    from ..kernels.barrier import max_wait_s

    return max(MEASURE_TIMEOUT_S, 2 * max_wait_s() + 60.0)


def default_sweep(world_size: int, dtype: str = "bf16") -> list[Problem]:
    """All-reduce at :data:`ALL_REDUCE_SIZES`, then dp->ep and ep->dp of every
    problem.MODEL_SHAPES shape at :data:`MOE_TOKENS` tokens per rank."""
    problems = [Problem.all_reduce(n, dtype, world_size) for n in ALL_REDUCE_SIZES]
    for shape in MODEL_SHAPES.values():
        for op in MOE_OPS:
            problems += [Problem.moe(op, shape, t, dtype, world_size) for t in MOE_TOKENS]
    return problems


def default_modes(problem: Problem) -> tuple[str, ...]:
    """Modes tuned by default for ``problem``: both, at every size and token count (module
    docstring)."""
    return MODES


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

    def summary(self) -> Optional[dict]:
        """The CLI's summary row of the winner (None when nothing won)."""
        if self.outcome is None or self.outcome.best is None:
            return None
        best, base = self.outcome.best, self.outcome.baseline
        p = self.problem
        nccl_us = base.score if base is not None and base.ok else None
        label = format_bytes(p.nbytes) if p.op == "all_reduce" else f"{p.shape_key} t={p.n_tokens_local}"
        return {"op": p.op, "label": label, "mode": self.mode, "backend": best.candidate.backend,
                "config": config_to_json(best.candidate.config), "us": best.score, "nccl_us": nccl_us,
                "speedup": (nccl_us / best.score) if nccl_us else None, "world_size": p.world_size,
                "bucket": p.bucket, "dtype": p.dtype}


def candidates_for(problem: Problem, mode: str, backends: dict, caps) -> tuple[dict[str, list], dict[str, str]]:
    """({backend: configs} of the backends serving ``problem`` in ``mode``, {backend: why not}),
    by the backends' one eligibility contract (autosymm.backends.base.Backend.why_not)."""
    out: dict[str, list] = {}
    why_not: dict[str, str] = {}
    for name in sorted(backends):
        backend = backends[name]
        if problem.op not in backend.needs.ops:
            continue
        reason = backend.why_not(problem, caps, mode)
        if reason is not None:
            why_not[name] = reason
            continue
        out[name] = list(backend.search_space(problem))
    return out, why_not


def control_group_for(group):
    """A gloo group over ``group``'s ranks for the tuner's protocol (kept off the GPU, so a hung
    stream cannot block it). Collective over the default group: every process must call it."""
    import torch.distributed as dist

    if "gloo" in str(dist.get_backend(group)).lower():
        return group
    ranks = dist.get_process_group_ranks(group) if group is not None else None
    return dist.new_group(ranks=ranks, backend="gloo")
