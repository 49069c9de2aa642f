"""The per-rank tuning driver: problems -> candidates -> validated, timed search -> database rows.

Every rank of the group calls :func:`run_sweep` with the same arguments, in lock-step. Per
problem and mode it asks each backend whether it serves the problem and for its space, builds
the inputs and a reference (all-reduce: NCCL's result of the same input; MoE: a gathered copy of
every rank's input routed by plain torch), and runs :func:`autosymm.tuner.tune` with an
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
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from .configs import config_to_json
from .problem import DTYPES, MODEL_SHAPES, MOE_OPS, Problem, format_bytes
from .timing import comm_device, time_eager, time_graph
from .tuner import Candidate, TuneOutcome, tune

ALL_REDUCE_SIZES = [1 << p for p in range(12, 29)]  # 4 KiB .. 256 MiB
#: MoE tokens per rank of the default sweep: powers of four from 1 to 4096, and 8192. The
#: dispatcher serves a count in between from the next larger tuned one (its bucket), so the
#: range 1..8192 is covered with 8 points instead of 14 (a sweep of minutes, not tens).
MOE_TOKENS = [1, 4, 16, 64, 256, 1024, 4096, 8192]
GRAPH_TOKENS_MAX = 256
_SEED = 1234
MEASURE_TIMEOUT_S = 120.0  # default per-measurement timeout floor (s)


def measure_timeout_s() -> float:
    """Default timeout of one measurement (s): at least twice a barrier wait's pessimistic spin
    limit plus a minute, so a kernel whose peer never arrives gives up by itself first."""
    from .kernels.barrier import max_wait_s

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
# Inputs and references
# ------------------------------------------------------------------------------------------


def moe_reference_for_rank(op: str, gathered: torch.Tensor, owner_of_pair: torch.Tensor, indx: torch.Tensor,
                           rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(expected output, bool mask of the rows the op writes) of ``rank``, on ``gathered``'s
    device. ``gathered`` [R, rows, d] holds every rank's src; ``owner_of_pair`` [n_pairs] the
    rank owning each (token, k) pair's expert (-1: dropped); ``indx`` is gate_indx (dp_to_ep) or
    topk_indx (ep_to_dp). Same semantics as autosymm.moe.reference_* (tested against them)."""
    world_size, rows, d_model = gathered.shape
    owner = owner_of_pair.reshape(-1).long()
    n_pairs = owner.numel()
    idx = indx.reshape(-1).long()
    if op == "dp_to_ep":
        k = n_pairs // (world_size * rows)
        x = gathered.reshape(world_size * rows, d_model)
        pairs = torch.nonzero(owner == rank).flatten()
        ref = torch.zeros((n_pairs, d_model), dtype=gathered.dtype, device=gathered.device)
        mask = torch.zeros(n_pairs, dtype=torch.bool, device=gathered.device)
        ref[idx[pairs]] = x[pairs // k]
        mask[idx[pairs]] = True
        return ref, mask
    if op == "ep_to_dp":
        n_local_pairs = n_pairs // world_size
        sorted_rows = torch.arange(n_pairs, device=gathered.device)
        pairs = idx[sorted_rows]
        sender = owner[pairs]
        sel = (sender >= 0) & (pairs // n_local_pairs == rank)
        ref = torch.zeros((n_local_pairs, d_model), dtype=gathered.dtype, device=gathered.device)
        mask = torch.zeros(n_local_pairs, dtype=torch.bool, device=gathered.device)
        dest = pairs[sel] - rank * n_local_pairs
        ref[dest] = gathered[sender[sel], sorted_rows[sel]]
        mask[dest] = True
        return ref, mask
    raise ValueError(f"op={op!r} is not one of {MOE_OPS}")


def check_output(out: Any, expected: torch.Tensor, mask: Optional[torch.Tensor], *, exact: bool) -> None:
    """Raise ValueError unless ``out`` matches ``expected`` (on the rows of ``mask``). NaN never
    passes; ``exact`` for pure copies, else a bf16-level tolerance (atol = rtol = 1e-2)."""
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"launcher returned {type(out).__name__}, not a tensor")
    if tuple(out.shape) != tuple(expected.shape) or out.dtype != expected.dtype:
        raise ValueError(f"output {tuple(out.shape)} {out.dtype} != expected {tuple(expected.shape)} {expected.dtype}")
    got, want = (out[mask], expected[mask]) if mask is not None else (out, expected)
    if got.numel() == 0:
        return
    if exact:
        bad = got.view(torch.int16 if got.element_size() == 2 else torch.int32) != \
            want.view(torch.int16 if want.element_size() == 2 else torch.int32)
        if bool(bad.any()):
            raise ValueError(f"wrong result: {int(bad.any(dim=-1).sum())} of {got.shape[0]} rows differ")
        return
    got32, want32 = got.float(), want.float()
    err = (got32 - want32).abs()
    tol = 1e-2 + 1e-2 * want32.abs()
    bad = ~(err <= tol)  # NaN compares False: never passes
    if bool(bad.any()):
        first = int(torch.nonzero(bad.reshape(-1))[0])
        got_v, want_v = got32.reshape(-1)[first].item(), want32.reshape(-1)[first].item()
        raise ValueError(f"wrong result: {int(bad.sum())} of {bad.numel()} elements off (first at flat index "
                         f"{first}: got {got_v}, expected {want_v})")


class ProblemData:
    """One problem's inputs and this rank's reference, on ``device``. ``allocate`` is local (may
    fail: out of memory); ``build_reference`` runs NCCL collectives on ``group``."""

    def __init__(self, problem: Problem, group, device: torch.device, rank: int, n_inputs: int):
        self.problem, self.group, self.device, self.rank, self.n_inputs = problem, group, device, rank, n_inputs
        self.dtype = DTYPES[problem.dtype]
        self.expected: Optional[torch.Tensor] = None
        self.mask: Optional[torch.Tensor] = None
        self.exact = problem.op in MOE_OPS

    def allocate(self) -> None:
        p, dev = self.problem, self.device
        gen = torch.Generator(device=dev).manual_seed(_SEED * 1009 + self.rank)
        if p.op == "all_reduce":
            # small multiples of 1/4: every partial sum of <= 8 ranks is exact in bf16/fp16/fp32,
            # so the reference does not depend on the summation order
            self.val_input = torch.randint(-8, 9, (p.numel,), generator=gen, device=dev, dtype=torch.int8
                                           ).to(self.dtype).mul_(0.25)
            self.timing = [torch.empty(p.numel, dtype=self.dtype, device=dev) for _ in range(self.n_inputs)]
            self.extra: tuple = ()
        else:
            from .moe import make_expt_assignment, make_expt_dict_uniform, random_expt_indx, route

            shape, world_size = p.shape, p.world_size
            n_global = world_size * p.n_tokens_local
            self.assignment = make_expt_assignment(world_size, shape.n_expts_tot,
                                                   make_expt_dict_uniform(world_size, shape.n_expts_tot), dev)
            self.expt_indx = random_expt_indx(n_global, shape.n_expts_tot, shape.n_expts_act,
                                              seed=_SEED + p.n_tokens_local, device=dev)  # same on every rank
            gate_indx, topk_indx = route(self.expt_indx, shape.n_expts_tot)
            self.indx = gate_indx if p.op == "dp_to_ep" else topk_indx
            rows = p.n_tokens_local if p.op == "dp_to_ep" else n_global * shape.n_expts_act
            self.val_input = torch.randn((rows, shape.d_model), generator=gen, device=dev).to(self.dtype)
            self.timing = [torch.empty_like(self.val_input) for _ in range(self.n_inputs)]
            self.extra = (self.assignment, self.expt_indx, self.indx)
        self.refresh()

    def refresh(self) -> None:
        """Fresh random timing inputs (in-place all-reduces grow them call after call)."""
        for t in self.timing:
            t.normal_()

    def build_reference(self) -> None:
        import torch.distributed as dist

        p = self.problem
        if p.op == "all_reduce":
            self.expected = self.val_input.clone()
            dist.all_reduce(self.expected, group=self.group)
        else:
            gathered = torch.empty((p.world_size, *self.val_input.shape), dtype=self.dtype, device=self.device)
            dist.all_gather(list(gathered.unbind(0)), self.val_input, group=self.group)  # stable API, any torch
            e = self.expt_indx.reshape(-1).long()
            n_expts = self.assignment.n_expts_tot
            owner = torch.where((e >= 0) & (e < n_expts),
                                self.assignment.expt_owner.long()[e.clamp(0, n_expts - 1)], -1)
            self.expected, self.mask = moe_reference_for_rank(p.op, gathered, owner, self.indx, self.rank)
            del gathered
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def validation_args(self) -> tuple:
        x = self.val_input.clone() if self.problem.op == "all_reduce" else self.val_input  # all-reduce is in place
        return (x, *self.extra)

    def timing_args(self) -> list[tuple]:
        return [(t, *self.extra) for t in self.timing]


# ------------------------------------------------------------------------------------------
# The evaluator
# ------------------------------------------------------------------------------------------


class BarrierTimeout(RuntimeError):
    """A collective kernel's barrier wait gave up on this rank: a peer never arrived."""


class SweepEvaluator:
    """prepare: backend launcher + fresh inputs + poisoned workspace (then a device sync, so the
    tuner's agreement step also orders the poison before every peer's first write); measure:
    one validated call, then timing in ``mode`` (no host collective: see autosymm.tuner);
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


def compile_threads() -> int:
    """Threads that compile a problem's kernels: AUTOSYMM_COMPILE_THREADS, else this process's
    share of the CPUs (every local rank compiles its own kernels), at most 16."""
    value = os.environ.get("AUTOSYMM_COMPILE_THREADS", "")
    if value:
        return max(1, int(value))
    ranks = max(1, torch.cuda.device_count()) if torch.cuda.is_available() else 1
    return max(1, min(16, (os.cpu_count() or 1) // ranks))


def precompile(problem: Problem, candidates: dict[str, list], backends: dict, ctx, args: tuple,
               device: torch.device) -> int:
    """Compile every kernel the candidates of backends with ``compiles_kernels`` would launch for
    ``args``, in :func:`compile_threads` threads; returns how many launchers ran. Local only (no
    launch, no collective: autosymm.backends.launch.compile_only). A failure is left for the
    candidate's own prepare/measure to report. Without it, the first candidates of each problem
    compile one by one (about 0.3-1 s per kernel variant)."""
    from .backends.launch import compile_only, interpreter_active

    if interpreter_active():
        return 0
    jobs = [(name, config) for name, configs in candidates.items()
            if getattr(backends[name], "compiles_kernels", False) for config in configs]
    if not jobs:
        return 0

    def build(job) -> bool:
        name, config = job
        if device.type == "cuda":
            torch.cuda.set_device(device)  # triton compiles for (and caches under) the current device
        try:
            launcher = backends[name].prepare(problem, config, ctx)
            with compile_only():
                launcher(*args)
            return True
        except Exception:  # reported by the candidate's own prepare/measure
            return False

    # Each backend's first launcher alone: triton creates a kernel's per-device cache on first
    # use, and two threads creating it at once would lose one's compiled kernels.
    firsts = {name: i for i, (name, _) in reversed(list(enumerate(jobs)))}
    built = sum(build(jobs[i]) for i in sorted(firsts.values()))
    rest = [job for i, job in enumerate(jobs) if i not in firsts.values()]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=compile_threads()) as pool:
        return built + sum(pool.map(build, rest))


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
    from .backends import Capabilities

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

    from .backends import FALLBACK, RunContext
    from .hardware import fingerprint, provenance

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
                             seed, timeout_s, plan_for(problem, mode))
            item.seconds = time.monotonic() - start
            if item.outcome is not None and item.status == "tuned" and rank == 0 and db is not None:
                from .db import Row

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
              timeout_s, plan) -> SweepItem:
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
    precompile(problem, candidates, backends, ctx, data.validation_args(), device)
    evaluator = SweepEvaluator(problem, mode, backends, data, ctx, plan, control_group=control)
    outcome = tune(problem, candidates, evaluator, strategy=strategy, trials=trials, seed=seed, group=control,
                   timeout_s=timeout_s, baseline_backend=fallback.get(problem.op))
    if outcome.aborted:
        return SweepItem(problem, mode, "aborted", outcome.aborted, outcome, unsupported=why_not)
    if outcome.best is None:
        return SweepItem(problem, mode, "failed", "no candidate passed validation", outcome, unsupported=why_not)
    return SweepItem(problem, mode, "tuned", "", outcome, unsupported=why_not)
