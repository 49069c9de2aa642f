"""The per-rank tuning driver: problems -> candidates -> validated, timed search -> database rows.

Every rank of the group calls :func:`run_sweep` with the same arguments, in lock-step. Per
problem and mode it asks each backend whether it serves the problem and for its space, builds
the inputs and a reference (all-reduce: NCCL's result of the same input; MoE: a gathered copy of
every rank's input routed by plain torch), and runs :func:`autosymm.tuning.tuner.tune` with an
evaluator whose ``prepare`` builds the launcher and poisons the workspace (NaN bytes) and whose
``measure`` validates one call against the reference (a wrong row or a NaN disqualifies it) and
then times it in the problem's mode. Rank 0 writes each backend's best row to the database.

Default modes (:func:`default_modes`): all-reduce in ``eager`` and ``graph`` at every size. MoE
conversions in ``eager`` at every token count and in ``graph`` up to :data:`GRAPH_TOKENS_MAX`
tokens per rank: serving engines capture CUDA graphs for decode steps (small batches), where
launch overhead is a large share of the time and the two modes rank kernels differently;
prefill and training run large batches eagerly, where launch overhead is noise, and the
dispatcher serves a graph-mode call there from the eager row. NCCL's all_to_all is not
capturable (its split sizes go through the host), so graph-mode MoE rows carry no ``nccl_us``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from ..configs import config_to_json
from .precompile import precompile
from ..problem import MODEL_SHAPES, MOE_OPS, Problem, format_bytes
from .reference import ProblemData, check_output
from .timing import comm_device, time_eager, time_graph
from .tuner import Candidate, TuneOutcome, tune

ALL_REDUCE_SIZES = [1 << p for p in range(12, 29)]  # 4 KiB .. 256 MiB
#: MoE tokens per rank of the default sweep: powers of four from 1 to 4096, and 8192. The
#: dispatcher serves a count in between from the next larger tuned one (its bucket), so the
#: range 1..8192 is covered with 8 points instead of 14 (a sweep of minutes, not tens).
MOE_TOKENS = [1, 4, 16, 64, 256, 1024, 4096, 8192]
GRAPH_TOKENS_MAX = 256
MEASURE_TIMEOUT_S = 120.0  # default per-measurement timeout floor (s)


def measure_timeout_s() -> float:
    """Default timeout of one measurement (s): at least twice a barrier wait's pessimistic spin
    limit plus a minute, so a kernel whose peer never arrives gives up by itself first."""
    from ..kernels.barrier import max_wait_s

    return max(MEASURE_TIMEOUT_S, 2 * max_wait_s() + 60.0)


def default_sweep(world_size: int, dtype: str = "bf16") -> list[Problem]:
    """All-reduce of 4 KiB..256 MiB (powers of two), then dp->ep and ep->dp of every
    problem.MODEL_SHAPES shape at :data:`MOE_TOKENS` tokens per rank."""
    problems = [Problem.all_reduce(n, dtype, world_size) for n in ALL_REDUCE_SIZES]
    for shape in MODEL_SHAPES.values():
        for op in MOE_OPS:
            problems += [Problem.moe(op, shape, t, dtype, world_size) for t in MOE_TOKENS]
    return problems


def default_modes(problem: Problem) -> tuple[str, ...]:
    """Modes tuned by default for ``problem`` (see the module docstring for why)."""
    if problem.op in MOE_OPS and problem.n_tokens_local > GRAPH_TOKENS_MAX:
        return ("eager",)
    return ("eager", "graph")


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
# The evaluator
# ------------------------------------------------------------------------------------------


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
        ws = self.ctx.workspace
        try:
            out = launcher(*self.data.validation_args())
            if ws is not None:
                if _inside(ws, out):
                    out = out.clone()  # stream-ordered: before this rank signals the barrier below
                ws.device_barrier()  # no peer's timing call starts before every rank's copy is done
        finally:  # nothing of this candidate may still run when the next one poisons the workspace
            if self.data.device.type == "cuda":
                torch.cuda.synchronize(self.data.device)
        self._check_barriers("validation")
        check_output(out, self.data.expected, self.data.mask, exact=self.data.exact)
        plan = self.plan
        if self.mode == "graph":
            timing = time_graph(launcher, self.data.timing_args(), warmup=plan.warmup, repeats=plan.repeats,
                                calls_per_graph=plan.calls_per_graph)
        else:
            timing = time_eager(launcher, self.data.timing_args(), warmup=plan.warmup, repeats=plan.repeats,
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
        lined up on the control group (autosymm.symm.Workspace.reset_signals)."""
        ws = self.ctx.workspace
        if ws is not None and hasattr(ws, "reset_signals"):
            ws.reset_signals(self.control_group)


def _inside(ws, out: Any) -> bool:
    """Does tensor ``out`` live in the workspace's buffer (where peers may write)?"""
    if not isinstance(out, torch.Tensor) or getattr(ws, "buffer", None) is None:
        return False
    start, addr = int(ws.buffer.data_ptr()), int(out.data_ptr())
    return out.device == ws.buffer.device and start <= addr < start + ws.buffer.numel()


# ------------------------------------------------------------------------------------------
# The driver
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
    """({backend: configs} of the backends serving ``problem`` in ``mode``, {backend: why not})."""
    out: dict[str, list] = {}
    why_not: dict[str, str] = {}
    for name in sorted(backends):
        backend = backends[name]
        if problem.op not in getattr(backend, "ops", ()):
            continue
        reason = backend.unsupported_reason(problem, caps)
        if reason is None and mode == "graph" and not getattr(backend, "graph_capturable", True):
            reason = "not CUDA-graph capturable"
        if reason is not None:
            why_not[name] = reason
            continue
        out[name] = list(backend.search_space(problem))
    return out, why_not


def _capabilities(workspace, world_size: int, fingerprint):
    from ..backends import Capabilities

    ops = getattr(torch.ops, "symm_mem", None)
    return Capabilities(
        world_size=world_size,
        all_reduce_bytes=workspace.capacity("all_reduce") if workspace is not None else 0,
        moe_bytes=workspace.capacity("moe") if workspace is not None else 0,
        has_multicast=bool(workspace is not None and workspace.has_multicast),
        intra_node=True,
        torch_symm_ops=workspace is not None and ops is not None and hasattr(ops, "two_shot_all_reduce_"),
        compute_capability=tuple(getattr(fingerprint, "compute_capability", (0, 0))),
    )


def control_group_for(group):
    """A gloo group over ``group``'s ranks for the tuner's protocol (kept off the GPU, so a hung
    stream cannot block it). Collective over the default group: every process must call it."""
    import torch.distributed as dist

    if "gloo" in str(dist.get_backend(group)).lower():
        return group
    ranks = dist.get_process_group_ranks(group) if group is not None else None
    return dist.new_group(ranks=ranks, backend="gloo")


def run_sweep(problems: Sequence[Problem], *, backends: dict, group=None, workspace=None, db=None,
              hardware: Any = None, strategy: str = "auto", trials: Optional[int] = None,
              modes: Optional[Sequence[str]] = None, progress: Optional[Callable[[SweepItem], None]] = None,
              caps=None, control_group=None, seed: int = 0, timeout_s: Optional[float] = None,
              device: Optional[torch.device | str] = None,
              plan_for: Callable[[Problem, str], TimingPlan] = timing_plan) -> list[SweepItem]:
    """Tune ``problems`` on this rank, in lock-step with the other ranks of ``group``.

    ``backends``: name -> Backend. ``workspace``: the group's symm.Workspace (None: NCCL-style
    backends only). ``db``: a TuningDB written by rank 0 (None: dry run). ``hardware``: a
    hardware.Fingerprint (default: this node's). ``modes``: the modes to tune, intersected with
    :func:`default_modes` per problem (None: the defaults). ``progress(item)`` is called on every
    rank after each (problem, mode). ``control_group``: the group of the tuner's protocol (default:
    a new gloo group over ``group``'s ranks, see :func:`control_group_for`). ``device``: where
    inputs live (default: the workspace's, else the group's: CPU for gloo, for tests).
    ``plan_for(problem, mode)``: the :class:`TimingPlan` (default :func:`timing_plan`).
    ``timeout_s``: per measurement (default :func:`measure_timeout_s`). The workspace's signal
    pads are reset (collectively) first and after every failed candidate. A problem whose
    search aborts (a candidate still stuck after the timeout) stops the sweep: nothing more is
    measured in a process whose GPU stream may be stuck. A failed database write (rank 0) is
    reported in the item's ``reason`` and the sweep goes on (the other ranks cannot wait).
    """
    import torch.distributed as dist

    from ..backends import FALLBACK, RunContext
    from ..hardware import fingerprint, provenance

    fp = hardware if hardware is not None and not isinstance(hardware, str) else fingerprint()
    slug = hardware if isinstance(hardware, str) else fp.hardware_slug
    prov = provenance(fp)
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    if device is None:
        device = workspace.device if workspace is not None else comm_device(group)
    device = torch.device(device)
    caps = caps or _capabilities(workspace, world_size, fp)
    control = control_group if control_group is not None else control_group_for(group)
    ctx = RunContext(group=group, workspace=workspace)
    timeout_s = measure_timeout_s() if timeout_s is None else timeout_s
    if workspace is not None:  # stale counts from earlier use of the workspace must not leak in
        workspace.reset_signals(control)
    items: list[SweepItem] = []
    for problem in problems:
        if problem.world_size != world_size:
            raise ValueError(f"{problem.describe()} does not match the group's world size {world_size}")
        wanted = [m for m in default_modes(problem) if modes is None or m in modes]
        for mode in wanted:
            start = time.monotonic()
            item = _tune_one(problem, mode, backends, caps, ctx, device, rank, control, FALLBACK, strategy, trials,
                             seed, timeout_s, plan_for(problem, mode), compile_ahead=mode == wanted[0])
            item.seconds = time.monotonic() - start
            if item.outcome is not None and item.status == "tuned" and rank == 0 and db is not None:
                from ..db import Row

                try:
                    rows = item.outcome.rows(mode=mode, hardware=slug, provenance=prov)
                    item.rows_written = db.record_many([Row(**row) for row in rows])
                except Exception as exc:  # never leave the other ranks waiting in the next collective
                    item.reason = f"database write failed: {type(exc).__name__}: {exc}"
            items.append(item)
            if progress is not None:
                progress(item)
            if item.status == "aborted":
                return items
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return items


def _tune_one(problem, mode, backends, caps, ctx, device, rank, control, fallback, strategy, trials, seed,
              timeout_s, plan, compile_ahead: bool = True) -> SweepItem:
    """One (problem, mode). ``compile_ahead``: precompile the candidates first (the problem's
    first mode; the kernels are the same in both, so the second finds them compiled)."""
    candidates, why_not = candidates_for(problem, mode, backends, caps)
    if not any(name != fallback.get(problem.op) for name in candidates):
        return SweepItem(problem, mode, "skipped", "no backend but the fallback serves it", unsupported=why_not)
    data = ProblemData(problem, ctx.group, device, rank, plan.n_inputs)
    failure = ""
    try:
        data.allocate()
    except Exception as exc:  # e.g. out of memory on one rank: agree before any collective
        failure = f"{type(exc).__name__}: {exc}"
    import torch.distributed as dist

    flags = torch.tensor([1.0 if failure else 0.0], device=comm_device(control))
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=control)
    if flags.item() > 0:
        return SweepItem(problem, mode, "failed", f"inputs could not be built on some rank ({failure or 'see others'})",
                         unsupported=why_not)
    data.build_reference()
    if compile_ahead:
        precompile(problem, candidates, backends, ctx, data.validation_args(), device)
    evaluator = SweepEvaluator(problem, mode, backends, data, ctx, plan, control_group=control)
    outcome = tune(problem, candidates, evaluator, strategy=strategy, trials=trials, seed=seed, group=control,
                   timeout_s=timeout_s, baseline_backend=fallback.get(problem.op))
    if outcome.aborted:
        return SweepItem(problem, mode, "aborted", outcome.aborted, outcome, unsupported=why_not)
    if outcome.best is None:
        return SweepItem(problem, mode, "failed", "no candidate passed validation", outcome, unsupported=why_not)
    return SweepItem(problem, mode, "tuned", "", outcome, unsupported=why_not)
