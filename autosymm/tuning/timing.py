"""Rank-consistent timing of a (collective) call: barrier, warm-up, CUDA events or graph replay,
median of per-call samples, MAX over ranks.

:func:`time_eager` launches the call from Python each time, the host running ahead of the GPU, so
a sample is the steady-state cost of a call with its launch overhead where the host bounds it (what
an eager model pays); events in one chain, ``calls_per_sample`` calls between two (the same number
on every rank: every call is a collective). :func:`time_graph` captures one CUDA graph of
``len(inputs)`` calls on a side stream after an eager warm-up and times replays. Every call
rotates over fresh inputs (not reduced again while in L2); :func:`max_over_ranks` gives every rank
the same (pessimistic) numbers. The clock is pluggable (:class:`Clock`: :class:`CudaClock`,
:class:`HostClock`, a fake one in tests).

Design notes: docs/TUNING.md#tuning-timing
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, Sequence

import torch
import torch.distributed as dist

from ..dist_compat import group_device

DEFAULT_WARMUP = 5
DEFAULT_REPEATS = 50
DEFAULT_GRAPH_REPEATS = 20


@dataclass(frozen=True)
class Timing:
    """Per-call time of a candidate, in microseconds (median, 10th and 90th percentile) and the
    number of samples it came from. A failed candidate is ``Timing.failed()`` (all +inf)."""

    median_us: float
    p10_us: float
    p90_us: float
    samples: int = 0

    @classmethod
    def failed(cls) -> "Timing":
        return cls(math.inf, math.inf, math.inf, 0)

    @classmethod
    def from_samples(cls, samples_us: Sequence[float]) -> "Timing":
        """Median / p10 / p90 of per-call samples (linear interpolation, like numpy)."""
        values = sorted(float(v) for v in samples_us)
        if not values:
            raise ValueError("no timing samples")
        if any(math.isnan(v) for v in values):
            return cls.failed()
        return cls(percentile(values, 50), percentile(values, 10), percentile(values, 90), len(values))

    @property
    def ok(self) -> bool:
        """True for a finite, non-negative median."""
        return math.isfinite(self.median_us) and self.median_us >= 0


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of already sorted values, linear interpolation."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    pos = (len(sorted_values) - 1) * q / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(sorted_values) - 1)
    frac = pos - low
    if frac == 0.0:
        return float(sorted_values[low])
    return float(sorted_values[low] + (sorted_values[high] - sorted_values[low]) * frac)


# ------------------------------------------------------------------------------------------
# Clocks
# ------------------------------------------------------------------------------------------


class Clock(Protocol):
    """Where a sample starts and ends: ``mark()`` a point, ``synchronize()`` once after the
    last mark, then ``elapsed_us(start, end)`` between two marks."""

    def mark(self) -> Any: ...

    def synchronize(self) -> None: ...

    def elapsed_us(self, start: Any, end: Any) -> float: ...


class CudaClock:
    """CUDA events on the current stream (``elapsed_time`` is in ms, returned in us).

    ``reserve(n)`` creates and records ``n`` events ahead of a timed loop: an event's first
    record creates the driver object (cudaEventCreate), microseconds of host time that would
    otherwise sit inside every eager sample."""

    def __init__(self) -> None:
        self._ready: list = []

    def reserve(self, n: int) -> None:
        events = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        for event in events:
            event.record()
        torch.cuda.synchronize()
        self._ready = events[::-1]

    def mark(self) -> Any:
        event = self._ready.pop() if self._ready else torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def elapsed_us(self, start: Any, end: Any) -> float:
        return float(start.elapsed_time(end)) * 1e3


class HostClock:
    """Wall clock of the host (for CPU functions and tests)."""

    def mark(self) -> Any:
        return time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_us(self, start: Any, end: Any) -> float:
        return (end - start) * 1e6


def default_clock() -> Clock:
    return CudaClock() if torch.cuda.is_available() else HostClock()


# ------------------------------------------------------------------------------------------
# Timing
# ------------------------------------------------------------------------------------------


def _as_args(inputs: Sequence[Any]) -> list[tuple]:
    if not inputs:
        raise ValueError("time_*: inputs must hold at least one argument tuple")
    return [tuple(a) if isinstance(a, (tuple, list)) else (a,) for a in inputs]


def _barrier(group) -> None:
    if group is None:
        return

    if dist.is_available() and dist.is_initialized():
        dist.barrier(group=group)


def _chain_samples(clock: Clock, repeats: int, run_one: Callable[[], None], divisor: int) -> Timing:
    reserve = getattr(clock, "reserve", None)
    if reserve is not None:  # every mark's event exists before the first timed call
        reserve(repeats + 1)
    marks = [clock.mark()]
    for _ in range(repeats):
        run_one()
        marks.append(clock.mark())
    clock.synchronize()
    samples = [clock.elapsed_us(a, b) / divisor for a, b in zip(marks, marks[1:])]
    return Timing.from_samples(samples)


def time_eager(fn: Callable[..., Any], inputs: Sequence[Any], *, warmup: int = DEFAULT_WARMUP,
               repeats: int = DEFAULT_REPEATS, calls_per_sample: int = 1, group=None,
               clock: Optional[Clock] = None) -> Timing:
    """Per-call time (us) of ``fn(*inputs[i % len(inputs)])`` launched eagerly.

    ``group``: when given, a host barrier first so the ranks start together. (The tuner passes
    None: its own agreement step is that barrier, and a measurement it runs under a timeout must
    not join host collectives.) ``fn`` is called ``warmup + repeats * calls_per_sample`` times;
    every rank must use the same numbers.
    """
    if repeats < 1 or calls_per_sample < 1 or warmup < 0:
        raise ValueError(f"repeats={repeats}, calls_per_sample={calls_per_sample} must be >= 1, warmup={warmup} >= 0")
    args = _as_args(inputs)
    clock = clock or default_clock()
    _barrier(group)
    n = len(args)
    for i in range(warmup):
        fn(*args[i % n])
    counter = [warmup]

    def run_batch() -> None:
        for _ in range(calls_per_sample):
            fn(*args[counter[0] % n])
            counter[0] += 1

    return _chain_samples(clock, repeats, run_batch, calls_per_sample)


def cuda_graph_capture(fn: Callable[..., Any], args: list[tuple], calls: int, warmup: int) -> Callable[[], None]:
    """Warm ``fn`` up eagerly on a side stream, capture ``calls`` calls (rotating over ``args``)
    into one CUDA graph and return its ``replay``. The graph is freed with the returned object."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(max(1, warmup)):  # lazy init (compilation, NCCL communicators) before capture
            fn(*args[i % len(args)])
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # captures on its own side stream
        for i in range(calls):
            fn(*args[i % len(args)])
    torch.cuda.synchronize()
    return graph.replay


def time_graph(fn: Callable[..., Any], inputs: Sequence[Any], *, warmup: int = DEFAULT_WARMUP,
               repeats: int = DEFAULT_GRAPH_REPEATS, calls_per_graph: Optional[int] = None, group=None,
               clock: Optional[Clock] = None,
               capture: Callable[[Callable[..., Any], list[tuple], int, int], Callable[[], None]] = cuda_graph_capture,
               ) -> Timing:
    """Per-call time (us) of ``fn`` replayed from a CUDA graph of ``calls_per_graph`` calls
    (default: one per input). ``capture(fn, args, calls, warmup) -> replay`` is pluggable for
    tests. Two warm-up replays precede the ``repeats`` timed ones."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    args = _as_args(inputs)
    calls = calls_per_graph or len(args)
    clock = clock or default_clock()
    _barrier(group)
    replay = capture(fn, args, calls, warmup)  # the graph is freed with the last reference to replay
    for _ in range(2):
        replay()
    return _chain_samples(clock, repeats, replay, calls)


# ------------------------------------------------------------------------------------------
# Across ranks
# ------------------------------------------------------------------------------------------


def comm_device(group=None, device: Optional[torch.device | str] = None) -> torch.device:
    """Device for the small tensors of host-side collectives on ``group``: ``device`` when given,
    else the device the group serves on (autosymm.dist_compat.group_device: the current CUDA
    device for NCCL, a mixed 'cpu:gloo,cuda:nccl' group included; the CPU for gloo)."""
    if device is not None:
        return torch.device(device)

    return group_device(group)


def group_size(group=None) -> int:
    """World size of ``group``, 1 when torch.distributed is not initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def max_over_ranks(timing: Timing, group=None, *, device: Optional[torch.device | str] = None) -> Timing:
    """Element-wise MAX of (median, p10, p90, samples) over ``group``: the same Timing on every
    rank. NaN counts as +inf (a failure). Without a process group it returns ``timing``."""
    if group_size(group) <= 1:
        return timing

    values = [timing.median_us, timing.p10_us, timing.p90_us, float(timing.samples)]
    values = [math.inf if math.isnan(v) else v for v in values]
    tensor = torch.tensor(values, dtype=torch.float64, device=comm_device(group, device))
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    median, p10, p90, samples = tensor.tolist()
    return Timing(median, p10, p90, int(samples) if math.isfinite(samples) else 0)
