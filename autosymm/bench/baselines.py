"""The all-reduce implementations `autosymm bench` measures, each as its users run it at its best,
how a measurement is planned, and how an output is checked against NCCL's.

Implementations (autosymm.bench.report.ALL_REDUCE_IMPLS), each built for one size as an
:class:`Impl` whose ``launch(*args)`` returns the output: ``nccl``; torch's ``symm_mem`` one-shot
and two-shot on a symmetric buffer (no copy) and on a plain tensor (``_copy``: with the copy it
needs); ``nccl_symm`` and ``nccl_symm_copy`` (window-registered buffers); ``autosymm`` on a plain
tensor and ``autosymm_zero_copy`` on ``autosymm.empty`` tensors. torch's symmetric buffers are
views of one rendezvoused ``symm_mem`` allocation (:class:`SymmetricPool`). What each one calls
exactly: the design notes and docs/BENCHMARKS.md's method.

Design notes: docs/TUNING.md#bench-baselines
"""

from __future__ import annotations

import math
from dataclasses import replace, dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

import autosymm

from ..geometry import ALIGN, align
from ..backends import Capabilities, RunContext, get_backend
from ..problem import DTYPE_NAMES, Problem
from ..runtime.agreement import Exchange
from ..tuning.timing import max_over_ranks, time_eager, time_graph

#: Bytes of all distinct inputs a measurement rotates over (fewer, larger ones for large calls).
ROTATION_BYTES = 64 << 20
#: Per-measurement traffic that sets the calls per sample: enough calls that an event's cost
#: (a driver call, several us on some nodes) is noise, few enough that large calls stay quick.
SAMPLE_BYTES = 1 << 30
MAX_CALLS, MIN_CALLS = 40, 8
POOL_ALIGN = ALIGN  # bytes between views of the symmetric pool (torch's ops want 16), as autosymm.empty
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}


@dataclass(frozen=True)
class BenchPlan:
    """How one call is measured, the same on every rank: ``calls`` back-to-back calls between two
    CUDA events (eager) or captured in one CUDA graph (graph), ``repeats`` such samples (median),
    rotating over ``n_inputs`` argument tuples of random data."""

    n_inputs: int
    calls: int
    repeats: int
    warmup_calls: int


def bench_plan(nbytes: int, mode: str) -> BenchPlan:
    """The plan for a call moving ``nbytes`` per rank in ``mode`` ('eager' | 'graph')."""
    if mode not in ("eager", "graph"):
        raise ValueError(f"mode={mode!r} is not 'eager' or 'graph'")
    nbytes = max(1, nbytes)
    n_inputs = max(2, min(8, math.ceil(ROTATION_BYTES / nbytes)))
    calls = max(MIN_CALLS, min(MAX_CALLS, SAMPLE_BYTES // nbytes))
    return BenchPlan(n_inputs, calls, repeats=20 if mode == "eager" else 15,
                     warmup_calls=calls if mode == "eager" else 3)


def pool_bytes(sizes: list[int], world_size: int) -> int:
    """Bytes of the symmetric pool (torch's no-copy inputs) and of the zero-copy tensors plus a
    push stage in autosymm's all-reduce region: every size's rotating inputs, one slot per peer."""
    return max((bench_plan(n, "eager").n_inputs + world_size - 1) * align(n, POOL_ALIGN) for n in sizes)


def check_output(out: torch.Tensor, reference: torch.Tensor, world_size: int) -> Optional[str]:
    """None when ``out`` matches NCCL's ``reference``, else why not.

    With 2 ranks each element is one addition of two values, rounded once: commutative, so every
    implementation must be bit-equal to NCCL. With more ranks the summation order differs
    (NCCL's ring vs a one-shot's rank order): the relative L2 error may reach
    ``4 * (world_size - 1)`` unit roundoffs of the dtype (bf16 2^-8, fp16 2^-11, fp32 2^-24).
    """
    if out.shape != reference.shape or out.dtype != reference.dtype:
        return f"output {tuple(out.shape)} {out.dtype}, expected {tuple(reference.shape)} {reference.dtype}"
    if world_size <= 2:
        differ = int((out.view(-1) != reference.view(-1)).sum())
        return None if differ == 0 else f"differs from NCCL's sum in {differ} of {out.numel()} elements"
    ref = reference.double()
    error = float((out.double() - ref).norm() / ref.norm().clamp_min(1e-30))
    tolerance = 4 * (world_size - 1) * UNIT_ROUNDOFF.get(out.dtype, 2.0**-8)
    if not error <= tolerance:  # NaN fails too
        return f"relative error {error:.3g} over NCCL's sum (tolerance {tolerance:.3g})"
    return None


class SymmetricPool:
    """One torch symmetric-memory allocation of ``nbytes`` on ``device``, rendezvoused with the
    group ``group_name`` (collective: every rank constructs it together); views of it are
    symmetric buffers for torch's ops."""

    def __init__(self, nbytes: int, device: torch.device, group_name: str) -> None:
        # symmetric memory: `import torch` skips it; only a workspace needs it
        import torch.distributed._symmetric_memory as symm_mem

        self.buffer = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(self.buffer, group_name)

    def views(self, count: int, numel: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """``count`` disjoint 1-D views of ``numel`` elements, ``POOL_ALIGN``-byte aligned."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        stride = align(nbytes, POOL_ALIGN)
        if count * stride > self.buffer.numel():
            raise ValueError(f"{count} x {nbytes} bytes do not fit the symmetric pool of {self.buffer.numel()} bytes")
        return [self.buffer[i * stride:i * stride + nbytes].view(dtype) for i in range(count)]


@dataclass
class Impl:
    """One implementation ready for one size: ``launch(*args)`` -> output tensor, for every
    ``args`` in ``inputs``; ``args[0]`` is the tensor that holds the data to reduce."""

    name: str
    launch: Callable[..., torch.Tensor]
    inputs: list[tuple]
    backend: str = ""


@dataclass
class Setup:
    """What the builders share on one rank: the group (and its name for torch's ops), device,
    dtype, the symmetric pool (None: torch's ops do not run here) and autosymm's workspace."""

    group: Any
    group_name: str
    device: torch.device
    dtype: torch.dtype
    pool: Optional[SymmetricPool] = None
    workspace: Any = None

    def plain(self, count: int, numel: int) -> list[torch.Tensor]:
        return [torch.empty(numel, dtype=self.dtype, device=self.device) for _ in range(count)]


def torch_ops_why_not(setup: Setup, nbytes: int) -> Optional[str]:
    """None when torch's symm_mem all-reduce ops can run a call of ``nbytes`` here."""
    if setup.pool is None:
        return "no torch symmetric memory here (needs CUDA, one node, torch.ops.symm_mem)"
    if setup.dtype not in (torch.bfloat16, torch.float32):
        return f"torch's symm_mem ops take bf16 and fp32, not {setup.dtype}"
    if nbytes % 4:
        return f"{nbytes} bytes: torch's symm_mem ops need a multiple of 4 bytes"
    return None


def _nccl(s: Setup, numel: int, count: int) -> Impl:
    all_reduce, group = dist.all_reduce, s.group

    def launch(x):
        all_reduce(x, group=group)
        return x

    return Impl("nccl", launch, [(x,) for x in s.plain(count, numel)], "nccl")


def _torch_no_copy(s: Setup, numel: int, count: int, algorithm: str) -> Impl:
    ops, name = torch.ops.symm_mem, s.group_name
    buffers = s.pool.views(count, numel, s.dtype)
    if algorithm == "one_shot":
        one_shot = ops.one_shot_all_reduce_out
        return Impl("torch_one_shot", lambda buf, out: one_shot(buf, "sum", name, out),
                    list(zip(buffers, s.plain(count, numel))), "torch_one_shot")
    two_shot = ops.two_shot_all_reduce_
    return Impl("torch_two_shot", lambda buf: two_shot(buf, "sum", name), [(b,) for b in buffers], "torch_two_shot")


def _torch_one_shot_copy(s: Setup, numel: int, count: int) -> Impl:
    ops, name = torch.ops.symm_mem, s.group_name
    (staging,) = s.pool.views(1, numel, s.dtype)
    inputs = list(zip(s.plain(count, numel), s.plain(count, numel)))
    if hasattr(ops, "one_shot_all_reduce_copy_out"):
        fused = ops.one_shot_all_reduce_copy_out
        return Impl("torch_one_shot_copy", lambda x, out: fused(staging, x, "sum", name, out), inputs,
                    "torch one_shot_all_reduce_copy_out")
    one_shot = ops.one_shot_all_reduce_out

    def launch(x, out):
        staging.copy_(x)
        return one_shot(staging, "sum", name, out)

    return Impl("torch_one_shot_copy", launch, inputs, "copy_ + torch one_shot_all_reduce_out")


def _torch_two_shot_copy(s: Setup, numel: int, count: int) -> Impl:
    ops, name = torch.ops.symm_mem, s.group_name
    (staging,) = s.pool.views(1, numel, s.dtype)
    inputs = [(x,) for x in s.plain(count, numel)]
    if hasattr(ops, "two_shot_all_reduce_out"):
        two_shot_out = ops.two_shot_all_reduce_out

        def launch(x):
            staging.copy_(x)
            return two_shot_out(staging, "sum", name, x)

        return Impl("torch_two_shot_copy", launch, inputs, "copy_ + torch two_shot_all_reduce_out")
    two_shot = ops.two_shot_all_reduce_

    def launch_back(x):
        staging.copy_(x)
        two_shot(staging, "sum", name)
        return x.copy_(staging)

    return Impl("torch_two_shot_copy", launch_back, inputs, "copy_ + torch two_shot_all_reduce_ + copy_")


def _autosymm(s: Setup, numel: int, count: int, zero_copy: bool) -> Impl:
    if not zero_copy:
        return Impl("autosymm", autosymm.all_reduce, [(x,) for x in s.plain(count, numel)])
    tensors = [autosymm.empty((numel,), s.dtype) for _ in range(count)]
    return Impl("autosymm_zero_copy", autosymm.all_reduce, [(x,) for x in tensors])


def zero_copy_why_not(s: Setup, nbytes: int, count: int, world_size: int) -> Optional[str]:
    """None when ``count`` zero-copy tensors of ``nbytes`` and a push stage fit the workspace."""
    if s.workspace is None:
        return "no autosymm workspace here (needs CUDA and one node)"
    need = (count + world_size - 1) * align(nbytes, POOL_ALIGN)
    have = s.workspace.capacity("all_reduce") - s.workspace.empty_bytes
    return None if need <= have else f"{need} bytes of zero-copy inputs and stage, the all-reduce region has {have}"


def _problem(s: Setup, nbytes: int, world_size: int):
    return Problem.all_reduce(nbytes, DTYPE_NAMES[s.dtype], world_size)


def nccl_symm_why_not(s: Setup, nbytes: int, count: int, world_size: int, zero_copy: bool) -> Optional[str]:
    """None when the nccl_symm backend can run a call of ``nbytes`` here (its own eligibility; the
    zero-copy form also needs ``count`` tensors of ``autosymm.empty``)."""
    if s.workspace is None:
        return "no autosymm workspace here (needs CUDA and one node)"
    why = get_backend("nccl_symm").why_not(_problem(s, nbytes, world_size), Capabilities.of(world_size,
                                                                                            workspace=s.workspace))
    return why if why is not None or not zero_copy else zero_copy_why_not(s, nbytes, count, world_size)


def _nccl_symm(s: Setup, numel: int, count: int, zero_copy: bool) -> Impl:
    problem = _problem(s, numel * torch.empty((), dtype=s.dtype).element_size(), s.workspace.world_size)
    launcher = get_backend("nccl_symm").prepare(problem, None, RunContext(group=s.group, workspace=s.workspace))
    if zero_copy:
        tensors = [autosymm.empty((numel,), s.dtype) for _ in range(count)]
        return Impl("nccl_symm", launcher, [(x,) for x in tensors], "nccl_symm")
    return Impl("nccl_symm_copy", launcher, [(x,) for x in s.plain(count, numel)], "nccl_symm")


def build(name: str, s: Setup, numel: int, count: int) -> Impl:
    """Implementation ``name`` for ``numel`` elements with ``count`` rotating inputs. The torch
    ones need :func:`torch_ops_why_not` to be None, the zero-copy one :func:`zero_copy_why_not`."""
    if name == "nccl":
        return _nccl(s, numel, count)
    if name in ("torch_one_shot", "torch_two_shot"):
        return _torch_no_copy(s, numel, count, name[len("torch_"):])
    if name == "torch_one_shot_copy":
        return _torch_one_shot_copy(s, numel, count)
    if name == "torch_two_shot_copy":
        return _torch_two_shot_copy(s, numel, count)
    if name in ("autosymm", "autosymm_zero_copy"):
        return _autosymm(s, numel, count, zero_copy=name == "autosymm_zero_copy")
    if name in ("nccl_symm", "nccl_symm_copy"):
        return _nccl_symm(s, numel, count, zero_copy=name == "nccl_symm")
    raise ValueError(f"unknown all-reduce implementation {name!r}")


def measure(fn, inputs: list[tuple], plan: BenchPlan, mode: str, group, device: torch.device) -> float:
    """Median us per call of ``fn`` in ``mode`` under ``plan``, MAX over the ranks of ``group``."""
    if device.type != "cuda":  # gloo (the CPU tests): a token measurement of the same code path
        plan = replace(plan, calls=2, repeats=3, warmup_calls=1)
    # timing's clock: CUDA events created and recorded before the timed loop (CudaClock.reserve)
    if mode == "graph":
        timing = time_graph(fn, inputs, warmup=plan.warmup_calls, repeats=plan.repeats,
                            calls_per_graph=plan.calls, group=group)
    else:
        timing = time_eager(fn, inputs, warmup=plan.warmup_calls, repeats=plan.repeats,
                            calls_per_sample=plan.calls, group=group)
    return max_over_ranks(timing, group).median_us


def agree(ok: bool, group) -> bool:
    """True on every rank iff ``ok`` on every rank (autosymm.runtime.agreement): measuring starts with a
    host barrier, so all ranks must make the same choice (or the ones that measure wait forever)."""
    return not Exchange(group, dist.get_rank(group), dist.get_world_size(group)).all_ok("bench", ok)
