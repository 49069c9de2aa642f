"""The sweep's evaluator: what the tuner's ``prepare``, ``measure`` and ``reset`` do for one
(problem, mode) on this rank (autosymm.tuning.session.TuneSession.tune_one builds it).
"""

from __future__ import annotations

from typing import Any

import torch

from ..problem import Problem
from ..runtime.replay import EagerReplay, Launched, wrap_eager
from .outcome import Candidate
from .reference import ProblemData, check_output
from .sweep import TimingPlan
from .timing import time_eager, time_graph


class BarrierTimeout(RuntimeError):
    """A collective kernel's barrier wait gave up on this rank: a peer never arrived."""


class SweepEvaluator:
    """prepare: backend launcher + fresh inputs + poisoned workspace (then a device sync, so the
    tuner's agreement step also orders the poison before every peer's first write); measure:
    one validated call, then timing in ``mode`` (no host collective: see autosymm.tuning.tuner);
    reset (collective): re-arm the workspace's signal pads after a failed candidate.

    A MoE output is a view into the workspace that any rank's *next* call overwrites, so it is
    copied out and the ranks line up on the device (``Workspace.device_barrier``) before it is
    checked: else a fast peer's first timing call could overwrite rows a slower rank is still
    checking; that rank then rejects the candidate and never launches its timing calls, and the
    peer's kernels wait for it (how a graph-mode tune on 2 x H200 hung). Barrier waits are
    bounded (autosymm.kernels.barrier); one that gave up fails the candidate on this rank
    (:class:`BarrierTimeout`): +inf on every rank, then :meth:`reset` on every rank."""

    def __init__(self, problem: Problem, mode: str, backends: dict, data: ProblemData, ctx, plan: TimingPlan,
                 control_group=None):
        self.problem, self.mode, self.backends = problem, mode, backends
        self.data, self.ctx, self.plan = data, ctx, plan
        self.control_group = control_group

    def prepare(self, candidate: Candidate):
        launcher = self.backends[candidate.backend].prepare(self.problem, candidate.config, self.ctx)
        if self.mode == "eager":  # what autosymm.runtime.group prepares for an eager call: replays where it can
            launcher = wrap_eager(launcher, Launched(candidate.backend, candidate.config, "eager"))
        launcher = self.data.op.callable(self.data, launcher)
        self.data.refresh()
        ws = self.ctx.workspace
        if ws is not None:
            for name in ("all_reduce", "moe"):
                region = ws.regions[name]
                ws.buffer[region.offset:region.offset + region.nbytes].fill_(0xFF)  # NaN in bf16/fp16/fp32
        if self.data.device.type == "cuda":
            torch.cuda.synchronize(self.data.device)
        return launcher

    def measure(self, launcher):
        """Validate ``launcher`` (:meth:`validate`), then time it (:meth:`time`)."""
        self.validate(launcher)
        return self.time(launcher)

    def validate(self, launcher) -> None:
        """One call on the validation input, checked against the reference (ValueError if wrong)."""
        ws = self.ctx.workspace
        try:
            args = self.data.validation_args()
            out = self.data.result(launcher(*args), args)
            if ws is not None:
                if _inside(ws, out):
                    out = out.clone()  # stream-ordered: before this rank signals the barrier below
                ws.device_barrier()  # no peer's timing call starts before every rank's copy is done
        finally:  # nothing of this candidate may still run when the next one poisons the workspace
            if self.data.device.type == "cuda":
                torch.cuda.synchronize(self.data.device)
        self._check_barriers("validation")
        check_output(out, self.data.expected, self.data.mask, exact=self.data.exact)

    def time(self, launcher):
        """The Timing of ``launcher`` in this evaluator's mode, by its plan (this rank's)."""
        plan = self.plan
        if self.mode == "graph":
            timing = time_graph(launcher, self.data.timing_args(), warmup=plan.warmup, repeats=plan.repeats,
                                calls_per_graph=plan.calls_per_graph)
        else:
            inputs = self.data.timing_args()
            if isinstance(launcher, EagerReplay):  # every input's graph captured before the clock runs
                for args in inputs:
                    for _ in range(launcher.capture_after):
                        launcher(*args)
            timing = time_eager(launcher, inputs, warmup=plan.warmup, repeats=plan.repeats,
                                calls_per_sample=plan.calls_per_sample)
        self._check_barriers("timing")
        return timing

    def _check_barriers(self, phase: str) -> None:
        """Raise BarrierTimeout when a barrier wait of this rank gave up (syncs the device)."""
        ws = self.ctx.workspace
        errors = ws.barrier_errors() if ws is not None and hasattr(ws, "barrier_errors") else 0
        if errors:
            raise BarrierTimeout(f"barrier timed out: a peer never arrived ({errors} wait(s) gave up on this "
                                 f"rank during {phase}; results are garbage)")

    def reset(self) -> None:
        """Collective (every rank, in lock-step): zero the workspace's signal pads and error slots,
        lined up on the control group (autosymm.workspace.symm.Workspace.reset_signals)."""
        ws = self.ctx.workspace
        if ws is not None and hasattr(ws, "reset_signals"):
            ws.reset_signals(self.control_group)


def _inside(ws, out: Any) -> bool:
    """Does tensor ``out`` live in the workspace's buffer (where peers may write)?"""
    if not isinstance(out, torch.Tensor) or getattr(ws, "buffer", None) is None:
        return False
    start, addr = int(ws.buffer.data_ptr()), int(out.data_ptr())
    return out.device == ws.buffer.device and start <= addr < start + ws.buffer.numel()
