"""Eager calls at a stable address: replay a cached one-launch CUDA graph instead of launching.

``wrap_eager(launcher, decision)`` wraps a prepared eager launcher of a Triton backend in an
:class:`EagerReplay` (all-reduce: plans per tensor address) or a :class:`FusedReplay` (the fused
op: plans per (x, residual, weight, out) addresses and eps); others are returned as they are. The
call after ``capture_after - 1`` direct calls at an address captures the bound launch into a graph
and replays it from then on; ``eager_launch='direct'``, no CUDA or ``AUTOSYMM_EAGER_REPLAY=0``: a
bound launch instead. Invariants: a wrapper serves one prepared call, so its launch is a function
of the address and the workspace's ``empty_bytes`` alone; a graph holds only addresses, per-call
state lives on the device; replay and launch are the same kernel with the same arguments, so ranks
need not agree on which. ``HOT`` / ``FUSED_HOT``: the front doors' hot tables (:func:`forget_all`).

Design notes: docs/REPLAY.md#runtime-replay
"""

from __future__ import annotations

import logging
import threading
import types
from collections import OrderedDict
from typing import Any, Callable, NamedTuple, Optional

import torch

from .. import settings
from ..workspace.symm import STAGING_LISTENERS
from ..epilogue import DEFAULT as DEFAULT_EPILOGUE

log = logging.getLogger("autosymm")

#: Graphs cached per prepared call (per live tensor address it serves).
MAX_GRAPHS = 32
#: Graphs cached per prepared fused call (per (x, residual, weight, out) it serves): a model's
#: layers each have their own norm weight, and two outputs alternate (the last one is still held
#: while the next is allocated), so a 32-layer model with two norms a layer has 128 of them.
FUSED_MAX_GRAPHS = 128
#: The call at an address that captures its graph (earlier ones launch directly).
CAPTURE_AFTER = 2


class HotCall:
    """A plan ``autosymm.all_reduce``'s hot path (autosymm.collectives.all_reduce) may call for
    an eager SUM of a tensor at one address: valid for the ``group`` argument, dtype and numel it
    was made for (and a contiguous tensor)."""

    __slots__ = ("group", "dtype", "numel", "device_index", "entry", "plan")

    def __init__(self, group: Any, dtype: torch.dtype, numel: int, device_index: int, entry: Any,
                 plan: Callable[[], None]) -> None:
        self.group, self.dtype, self.numel, self.device_index = group, dtype, numel, device_index
        self.entry, self.plan = entry, plan


#: Tensor address -> its HotCall. Device addresses are unique per process (unified addressing),
#: so the address also fixes the device.
HOT: dict[int, HotCall] = {}


class HotFused:
    """The eager fused call ``autosymm.all_reduce_rmsnorm`` (autosymm.collectives.all_reduce_rmsnorm)
    may make at once on a ``group`` argument: the last one prepared there, valid for its x dtype
    and shape (the call key's); ``call`` is its :class:`FusedReplay`, whose hit path checks the
    rest."""

    __slots__ = ("dtype", "shape", "device_index", "entry", "call")

    def __init__(self, dtype: torch.dtype, shape: torch.Size, device_index: int, entry: Any, call: Any) -> None:
        self.dtype, self.shape, self.device_index, self.entry, self.call = dtype, shape, device_index, entry, call


#: ``group`` argument of autosymm.all_reduce_rmsnorm -> its HotFused (a model's fused calls share
#: one x shape a step, so the last prepared call is the one that repeats).
FUSED_HOT: dict[Any, HotFused] = {}


def forget(addr: int, plan: Callable[[], None]) -> None:
    """Drop the hot call of ``addr`` if it runs ``plan`` (an evicted or replaced plan)."""
    hot = HOT.get(addr)
    if hot is not None and hot.plan is plan:
        HOT.pop(addr, None)


def forget_all() -> None:
    """Drop every hot call (staging limits moved, or autosymm.reset)."""
    HOT.clear()
    FUSED_HOT.clear()


STAGING_LISTENERS.append(forget_all)  # a workspace's new staging limits void every plan


def replay_enabled() -> bool:
    """False when AUTOSYMM_EAGER_REPLAY asks for plain launches (a switch: 0, false, no, off)."""
    return settings.get("AUTOSYMM_EAGER_REPLAY")


class Launched(NamedTuple):
    """What :func:`wrap_eager` reads of a prepared call: its backend, config and mode (a
    Decision has them; the tuner's candidates give them without one)."""

    backend: str
    config: Any
    mode: str


def wrap_eager(launcher: Any, decision: Any, *, capture: Optional[Callable[[Callable[[], None], Any], Any]] = None,
               max_graphs: Optional[int] = None, capture_after: int = CAPTURE_AFTER) -> Any:
    """The launcher a group state (autosymm.runtime.group) runs for an eager call of ``decision``:
    an :class:`EagerReplay` around a Triton all-reduce launcher (one that has ``bind`` and a
    ``workspace``), a :class:`FusedReplay` around one that returns a new tensor (``eager_call = "new_output"``:
    the fused op's), else ``launcher`` itself (graph mode, NCCL, torch's ops, MoE).
    ``capture(launch, device) -> graph`` (``graph.replay()``) defaults to
    :func:`capture_cuda_graph` on CUDA devices; none (CPU, AUTOSYMM_EAGER_REPLAY=0, or a config
    whose ``eager_launch`` is 'direct': autosymm.configs.EAGER_LAUNCHES): bound launches are memoised
    instead of replayed. ``max_graphs``: the wrapper's default (:data:`MAX_GRAPHS`,
    :data:`FUSED_MAX_GRAPHS`).

    Contract: the caller hands the result only tensors of one prepared call (all-reduce: one
    (dtype, numel) of contiguous tensors; fused: one x dtype and shape), as their call keys
    (autosymm.spec.CallKey) guarantee. Read at prepare time: set AUTOSYMM_EAGER_REPLAY
    before a size's first call."""
    if getattr(decision, "mode", None) != "eager" or not str(getattr(decision, "backend", "")).startswith("triton_"):
        return launcher
    if not callable(getattr(launcher, "bind", None)) or getattr(launcher, "workspace", None) is None:
        return launcher
    if not replay_enabled() or eager_launch(getattr(decision, "config", None)) == "direct":
        capture = None
    elif capture is None and launcher.workspace.device.type == "cuda":
        capture = capture_cuda_graph
    if getattr(launcher, "epilogue", None) not in (None, DEFAULT_EPILOGUE):
        return launcher  # FusedReplay plans the default epilogue's call (one out of x's dtype, no scale)
    cls = FusedReplay if getattr(launcher, "eager_call", "in_place") == "new_output" else EagerReplay
    return cls(launcher, capture, max_graphs=max_graphs or cls.MAX_GRAPHS, capture_after=capture_after)


def eager_launch(config: Any) -> str:
    """How an eager call of ``config`` launches (one of EAGER_LAUNCHES): the config's
    ``eager_launch`` field (Triton configs), 'replay' for configs without one."""
    return getattr(config, "eager_launch", "replay")


class EagerReplay:
    """``launcher(x) -> x`` for one prepared eager call; plans cached per tensor address."""

    MAX_GRAPHS = MAX_GRAPHS

    def __init__(self, launcher: Any, capture: Optional[Callable[[Callable[[], None], Any], Any]], *,
                 max_graphs: int = MAX_GRAPHS, capture_after: int = CAPTURE_AFTER) -> None:
        if max_graphs < 1 or capture_after < 1:
            raise ValueError(f"max_graphs={max_graphs} and capture_after={capture_after} must be >= 1")
        self.launcher = launcher
        self.capture = capture
        self.max_graphs = max_graphs
        self.capture_after = capture_after
        self._workspace = launcher.workspace
        device = launcher.workspace.device
        self.device = device
        # Tensor.get_device() of tensors on the launcher's device (-1: CPU, simulated ranks); an int
        # compare, no torch.device per call. The launcher's own checks tell CPU from CUDA.
        self.device_index = device.index if device.type == "cuda" else -1
        self._empty_bytes = self._workspace.empty_bytes  # host state the plans depend on
        self._plans: "OrderedDict[Any, Callable[[], None]]" = OrderedDict()  # address -> replay or launch
        self._seen: dict[Any, int] = {}  # address -> calls so far, before its capture
        self._lock = threading.Lock()  # the cold path only
        self.captures = 0
        self.evictions = 0

    @property
    def capturing(self) -> bool:
        """True while new addresses still get a graph (not off, not thrashing)."""
        return self.capture is not None and self.evictions < self.max_graphs

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        addr = x.data_ptr()
        plans = self._plans
        plan = plans.get(addr)
        if (plan is not None and x.get_device() == self.device_index
                and self._workspace.empty_bytes == self._empty_bytes):
            plans.move_to_end(addr)  # least recently used first out
            plan()
            return x
        return self._miss(x)

    def plan_for(self, addr: int) -> Optional[Callable[[], None]]:
        """The plan of ``addr`` (a graph replay or a bound launch), if it has one now."""
        return self._plans.get(addr)

    def _miss(self, x: torch.Tensor) -> torch.Tensor:
        """A call without a valid plan: through the launcher (all checks), or, at an address's
        ``capture_after``-th call, capture (or bind) its launch and plan it from then on."""
        with self._lock:
            self._replan_if_moved()
            if x.get_device() != self.device_index:
                return self.launcher(x)  # it raises, naming the device
            addr = x.data_ptr()
            plan = self._plans.get(addr)
            if plan is not None:  # another thread planned it meanwhile
                plan()
                return x
            calls = self._seen.get(addr, 0) + 1
            if calls < self.capture_after:
                self.launcher(x)  # checks, compiles and binds the variant
                if len(self._seen) >= 4 * self.max_graphs:
                    self._seen.clear()  # addresses that never repeat: forget them
                self._seen[addr] = calls
                return x
            self._seen.pop(addr, None)
            if not self.capturing:
                self.launcher(x)
                launch = self.launcher.bind(x)
                if launch is not None:
                    self._remember(addr, launch)
                return x
            return self._capture_and_replay(x, addr)

    def _capture_and_replay(self, x: torch.Tensor, addr: int) -> torch.Tensor:
        launch = self.launcher.bind(x)  # the launcher's checks run here, before any capture
        if launch is None:  # nothing to launch (one rank, empty tensor) or no bound variant yet
            return self.launcher(x)
        self._plan_launch(addr, launch)()
        return x

    def _plan_launch(self, key: Any, launch: Callable[[], None]) -> Callable[[], None]:
        """The plan of ``key``, remembered: a replay of ``launch`` captured in a graph, or the
        bound launch itself when capturing fails (then never again for this call)."""
        try:
            graph = self.capture(launch, self.device)
        except Exception as exc:  # noqa: BLE001 - any capture failure: launch instead, from now on
            log.warning("autosymm: eager replay off for %s: capturing its launch failed (%s: %s)",
                        getattr(self.launcher, "algorithm", "this call"), type(exc).__name__, exc)
            self.capture = None
            self._remember(key, launch)
            return launch
        self.captures += 1
        replay = replay_function(graph)
        self._remember(key, replay)
        return replay

    def _replan_if_moved(self) -> None:
        """Drop every plan when the staging limits (``empty_bytes``) moved since they were made."""
        if self._workspace.empty_bytes != self._empty_bytes:
            for key, plan in self._plans.items():
                forget(key, plan)
            self._plans.clear()
            self._seen.clear()
            self._empty_bytes = self._workspace.empty_bytes

    def _remember(self, key: Any, plan: Callable[[], None]) -> None:
        plans = self._plans
        plans[key] = plan
        plans.move_to_end(key)
        while len(plans) > self.max_graphs:
            dropped, old = plans.popitem(last=False)  # a dropped graph is freed once its replays complete
            forget(dropped, old)
            self.evictions += 1


class FusedReplay(EagerReplay):
    """``launcher(x, residual, weight, eps) -> out`` for one prepared eager fused call (a launcher
    with ``bind(x, residual, weight, out, eps)``); plans cached per (x, residual, weight, out)
    addresses and eps.

    ``out`` is a new tensor every call, allocated as the launcher allocates it
    (``torch.empty_like(x)``, the caller's stream) *before* the plan is looked up: its address is
    part of the key, so a plan only ever writes the tensor this call returns. A result the caller
    still holds keeps its memory, so the next call's ``out`` has another address (another plan,
    or the checked launcher); when the caller drops it, the caching allocator hands the block out
    again and the same plan serves. A graph holds the one launch on existing buffers (nothing is
    allocated while capturing), so it pins no memory. The hit checks what the cache key does not
    fix: residual's and weight's dtype and shape, the three tensors' contiguity, x's device and
    the workspace's ``empty_bytes``; any miss takes the launcher's checks."""

    MAX_GRAPHS = FUSED_MAX_GRAPHS

    def __init__(self, launcher: Any, capture: Optional[Callable[[Callable[[], None], Any], Any]], *,
                 max_graphs: int = FUSED_MAX_GRAPHS, capture_after: int = CAPTURE_AFTER) -> None:
        super().__init__(launcher, capture, max_graphs=max_graphs, capture_after=capture_after)
        self._weight_shape = (launcher.hidden,)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,  # type: ignore[override]
                 eps: float = 1e-6) -> torch.Tensor:
        out = _empty_like(x)
        key = (x.data_ptr(), residual.data_ptr(), weight.data_ptr(), out.data_ptr(), eps)
        plans = self._plans
        plan = plans.get(key)
        if (plan is not None and residual.shape == x.shape and residual.dtype is x.dtype and weight.dtype is x.dtype
                and weight.shape == self._weight_shape and x.is_contiguous() and residual.is_contiguous()
                and weight.is_contiguous() and x.get_device() == self.device_index
                and self._workspace.empty_bytes == self._empty_bytes):
            plans.move_to_end(key)
            plan()
            return out
        return self._miss_fused(key, x, residual, weight, eps, out)

    def _miss_fused(self, key: tuple, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                    out: torch.Tensor) -> torch.Tensor:
        """A call without a valid plan: no aliasing of its tensors (checked before anything runs),
        then the launcher (all checks), or at the key's ``capture_after``-th call its bound launch
        (checked by ``bind``), captured or memoised."""
        check_disjoint(x, residual, weight)
        launcher = self.launcher
        with self._lock:
            self._replan_if_moved()
            calls = self._seen.get(key, 0) + 1
            if calls < self.capture_after or x.get_device() != self.device_index:
                launcher(x, residual, weight, eps, out=out)  # checks (raises, naming the bad tensor), binds
                if len(self._seen) >= 4 * self.max_graphs:
                    self._seen.clear()  # keys that never repeat (outputs the caller keeps): forget them
                self._seen[key] = calls
                return out
            self._seen.pop(key, None)
            if not self.capturing:
                launcher(x, residual, weight, eps, out=out)
                launch = launcher.bind(x, residual, weight, out, eps)
                if launch is not None:
                    self._remember(key, launch)
                return out
            launch = launcher.bind(x, residual, weight, out, eps)  # the checks, before any capture
            if launch is None:  # no rows, or no bound variant yet
                return launcher(x, residual, weight, eps, out=out)
            self._plan_launch(key, launch)()
            return out


_empty_like = torch.empty_like

#: Why the fused op refuses tensors that share memory (its checks' and :func:`check_disjoint`'s).
OVERLAP_ERROR = ("x, residual and weight must not overlap in memory (residual += all_reduce(x) reads x while writing "
            "residual, and the NCCL path writes x): pass distinct tensors")




def check_disjoint(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
                   what: str = "all_reduce_rmsnorm") -> None:
    """ValueError unless the memory spans of the three tensors (any layout) are disjoint: the check of
    autosymm.collectives.fused_checks.check_args that the launchers' own checks do not make."""
    spans = sorted(_span(t) for t in (x, residual, weight) if t is not None and t.numel())
    if any(end > start for (_, end), (start, _) in zip(spans, spans[1:])):
        raise ValueError(f"autosymm.{what}: {OVERLAP_ERROR}")


def _span(t: torch.Tensor) -> tuple[int, int]:
    """[first byte, last byte + 1) of ``t``'s elements (non-negative strides)."""
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()



def capture_cuda_graph(launch: Callable[[], None], device: torch.device) -> "torch.cuda.CUDAGraph":
    """A CUDA graph of ``launch()`` (kernel launches on the current stream only), captured on a
    side stream of ``device`` in thread_local mode (allocations during it: the graph's private pool)."""
    stream = _side_stream(device)
    graph = torch.cuda.CUDAGraph()
    # No stream sync: capturing runs nothing (the replays run on the caller's stream, in order),
    # and what the capture allocates belongs to the graph's private pool.
    with _CAPTURE_LOCK, torch.cuda.device(device):  # one capture per side stream at a time
        with torch.cuda.stream(stream):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                launch()
            finally:
                graph.capture_end()
    return graph


def replay_function(graph: Any) -> Callable[[], None]:
    """``graph.replay`` as the extension's own method: torch's Python ``CUDAGraph.replay`` (a
    liveness-tracker check we do not use, then ``super().replay()``) costs a frame per call on
    some versions. Falls back to ``graph.replay`` where the class has no such method."""
    for cls in type(graph).__mro__:
        method = cls.__dict__.get("replay")
        if method is not None and not isinstance(method, types.FunctionType) and hasattr(method, "__get__"):
            bound = method.__get__(graph, type(graph))
            if callable(bound):
                return bound
    return graph.replay


_SIDE_STREAMS: dict[Any, Any] = {}
_CAPTURE_LOCK = threading.Lock()


def _side_stream(device: torch.device) -> "torch.cuda.Stream":
    """One capture stream per device (captures are rare and hold it only while capturing)."""
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return stream
