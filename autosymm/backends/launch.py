"""Lean launches of Triton kernels: bind and specialise once, then call the compiled kernel.

``kernel[grid](...)`` binds every argument and looks the compiled kernel up on every call; a
:class:`LeanLauncher` pays that once and afterwards calls ``CompiledKernel.run`` directly (written
against triton 3.6 and 3.9; with a launch hook registered, or anything unexpected, the normal path
is kept, and nothing here raises for it). Also what the two Triton families over the all-reduce
region (autosymm.backends.triton_all_reduce, autosymm.backends.triton_fused) share: the
:class:`Algorithm` record, the checks of ``prepare``'s arguments and of a stage's size, and
:class:`RegionLauncher`, the set-up of their launchers.

Design notes: docs/BACKENDS.md#backends-launch
"""

from __future__ import annotations

import dataclasses
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

from ..geometry import ALL_REDUCE_REGION, DOUBLE_BUFFER_REGION
from ..problem import DTYPES, Problem
from .base import Backend, BackendError, Capabilities, RunContext

_MODE = threading.local()


@contextmanager
def compile_only() -> Iterator[None]:
    """In this thread, LeanLaunchers compile (``JITFunction.warmup``: same specialisation and
    cache as a launch) instead of launching, and stay unbound. Lets the tuner compile a
    problem's candidates in parallel threads by calling their launchers: nothing reaches the
    GPU, so no collective kernel waits for a peer."""
    previous = getattr(_MODE, "compile_only", False)
    _MODE.compile_only = True
    try:
        yield
    finally:
        _MODE.compile_only = previous


def interpreter_active() -> bool:
    """True when triton runs kernels on the CPU (TRITON_INTERPRET, as triton itself reads it)."""
    from triton import knobs  # triton loads at the first launch, not with this module

    return knobs.runtime.interpret


def spin_constexpr(config: Any, world_size: int, tile_elems: int, threads: int, elem_bytes: int) -> int:
    """The SPIN constexpr of a Lamport kernel (autosymm.kernels.lamport_all_reduce.spin_pack): the
    words a thread waits on together in its per-thread spin when ``config.spin`` asks for it at
    world size 2 on a GPU (the inline PTX handles one peer); 0 (the CTA-uniform wait, today's path)
    otherwise, always under the interpreter. ``tile_elems``: the elements of a program's tile."""
    if not getattr(config, "spin", False) or world_size != 2 or interpreter_active():
        return 0
    from ..kernels.lamport_all_reduce import spin_pack  # the kernels (and triton) load at the first launch

    return spin_pack(max(1, tile_elems // threads), elem_bytes)


def _stream_source() -> tuple[Callable[[int], int], int]:
    """(get_stream(device) -> raw stream, current device index), as triton's launches use them."""
    from triton.runtime import driver  # triton loads at the first launch, not with this module

    return driver.active.get_current_stream, driver.active.get_current_device()


def _direct_launch(compiled: Any, grid: tuple[int, int, int], tail: tuple[Any, ...]) -> Optional[Callable[..., None]]:
    """A function ``launch(*args)`` calling ``compiled`` on the current stream, or None."""
    try:
        from triton import knobs  # triton loads at the first launch, not with this module

        runner = compiled[grid]  # the public path, for launch hooks
        run = compiled.run  # loads the module on first access
        function, metadata = compiled.function, compiled.packed_metadata
        get_stream, device = _stream_source()
        hooks = knobs.runtime
        enter, leave = hooks.launch_enter_hook, hooks.launch_exit_hook
    except Exception:  # an unexpected triton: keep the normal path
        return None
    if function is None or not callable(run) or not callable(runner):
        return None
    gx, gy, gz = grid

    if isinstance(getattr(enter, "calls", None), list) and isinstance(getattr(leave, "calls", None), list):
        # triton >= 3.4: hooks are HookChains, registered with .add(); empty lists mean none.
        enter_calls, leave_calls = enter.calls, leave.calls

        def launch(*args: Any) -> None:
            if enter_calls or leave_calls:
                runner(*args, *tail)
            else:
                run(gx, gy, gz, get_stream(device), function, metadata, None, None, None, *args, *tail)
    else:

        def launch(*args: Any) -> None:
            if hooks.launch_enter_hook is None and hooks.launch_exit_hook is None:
                run(gx, gy, gz, get_stream(device), function, metadata, None, None, None, *args, *tail)
            else:
                runner(*args, *tail)

    return launch


class LeanLauncher:
    """Launch one ``@triton.jit`` kernel with a fixed grid, constexprs, options and specialisation.

    ``launcher(*args)`` passes the non-constexpr parameters, in order. Make one LeanLauncher per
    specialisation: whenever triton would compile the call differently (for pointer arguments,
    whether they are 16-byte aligned; for integers not marked ``do_not_specialize``, divisibility
    by 16 and equality to 1), use another instance. The kernels of autosymm mark every integer
    ``do_not_specialize`` with a type annotation, so only pointer alignment remains. The first
    call takes the normal path (compiling if needed); later ones launch the compiled kernel on
    the current stream of the device current at the first call.
    """

    def __init__(self, fn: Any, grid: Sequence[int], constexprs: dict[str, Any], **options: Any) -> None:
        self.fn = fn
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.constexprs = dict(constexprs)
        self.options = options
        names = list(getattr(fn, "arg_names", ()))
        trailing = names[len(names) - len(self.constexprs):] if len(names) >= len(self.constexprs) else []
        self._tail: Optional[tuple[Any, ...]] = None
        if trailing and set(trailing) == set(self.constexprs):
            self._tail = tuple(self.constexprs[name] for name in trailing)
        self._launch: Optional[Callable[..., None]] = None
        #: False when every call takes the normal path (interpreter, unknown kernel layout).
        self.fast = self._tail is not None and not interpreter_active()

    def __call__(self, *args: Any) -> None:
        launch = self._launch
        if launch is not None:
            launch(*args)
            return
        if getattr(_MODE, "compile_only", False):
            if not interpreter_active():  # nothing to compile under the interpreter
                self.fn.warmup(*args, grid=self.grid, **self.constexprs, **self.options)
            return
        compiled = self.fn[self.grid](*args, **self.constexprs, **self.options)
        if self.fast and compiled is not None:
            self._launch = _direct_launch(compiled, self.grid, self._tail)

    @property
    def is_bound(self) -> bool:
        """True once calls skip triton's argument binding."""
        return self._launch is not None

    @property
    def direct(self) -> Optional[Callable[..., None]]:
        """Once bound, the launch function itself (None before): ``direct(*args)`` as ``self(*args)``
        minus one Python call. Pointer arguments may then be int addresses: triton's C launcher
        takes an int as is, where for a tensor it calls ``data_ptr()`` and ``cuPointerGetAttribute``
        (about 0.2-0.5 us each on an H200 VM). The caller vouches for the device and alignment."""
        return self._launch


# -- the Triton families over the all-reduce region ----------------------------------------------

MAX_NUMEL = 2**31 - 1  # the kernels index with int32


@dataclass(frozen=True, eq=False)
class Algorithm:
    """One kernel algorithm of a Triton family (``ALGORITHMS`` of autosymm.backends.triton_all_reduce
    and autosymm.backends.triton_fused, by name): what its configs may ask for, what a call
    stages, which kernel runs it and the knobs of its search space.

    ``kernel`` is the ``@triton.jit`` function, launched with the constexprs ``flags`` fixed.
    ``stage_bytes(nbytes, world_size)``: bytes of the all-reduce region a call of an ``nbytes``
    tensor stages in (autosymm.geometry). ``splits_by_rank``: each rank reduces 1/world_size of
    the data (elements, or rows) and gathers the rest from its peers; its kernel runs in phases
    the launcher can run one at a time (tests). ``push``: peers write their x into one slot each
    of this rank's stage, and x is only read locally. ``double_buffer``: configs may stage in the
    double buffer, without an end barrier; the search space offers it for stages of at most
    ``double_buffer_space_bytes``. ``row_split``: programs may share a row (fused). ``multicast``:
    needs the workspace's multicast address (multimem, sm_90). ``min_thread_bytes``: bytes per
    thread below which the all-reduce space keeps only the fewest warps of a BLOCK.
    ``batch_invariant``: its result element is the fp32 sum of ranks 0..W-1 in order, rounded
    once, whatever the call's size and config (Backend.batch_invariant; tests/test_batch_invariance).
    ``lamport``: peers store into the workspace's Lamport region (no barrier; at most
    autosymm.geometry.LAMPORT_SLOT_BYTES of x a call), not into the all-reduce region.
    """

    name: str
    kernel: Any
    stage_bytes: Callable[[int, int], int]
    flags: Mapping[str, Any] = field(default_factory=dict)
    splits_by_rank: bool = False
    push: bool = False
    double_buffer: bool = False
    double_buffer_space_bytes: int = 0
    row_split: bool = False
    multicast: bool = False
    min_thread_bytes: int = 8
    batch_invariant: bool = False
    lamport: bool = False

    def share(self, count: int, world_size: int) -> int:
        """How many of ``count`` elements (or rows) one rank's programs reduce."""
        return -(-count // world_size) if self.splits_by_rank else count


def with_spin(space: list, record: Algorithm, world_size: int) -> list:
    """``space``, and for a Lamport record at world size 2 every config again with ``spin=True``
    (appended: the first configs, and the fallback, keep the CTA-uniform wait): the per-thread
    spin handles one peer (autosymm.kernels.lamport_all_reduce)."""
    if not record.lamport or world_size != 2:
        return space
    return space + [dataclasses.replace(config, spin=True) for config in space]


def stage_limits(need: int, problem: Problem, caps: Capabilities) -> Optional[str]:
    """Why a Triton kernel staging ``need`` bytes in the all-reduce region cannot serve
    ``problem`` (the region too small, or more elements than int32 indexing reaches), or None."""
    if need > caps.all_reduce_bytes:
        return f"a {need}-byte stage exceeds the {caps.all_reduce_bytes}-byte all-reduce region"
    if problem.numel > MAX_NUMEL:
        return f"{problem.numel} elements exceed int32 indexing"
    return None


def prepared_workspace(backend: Backend, problem: Problem, config: Any, config_type: type, ctx: RunContext):
    """``ctx.workspace`` once a Triton backend's ``prepare`` arguments fit: a workspace of the
    problem's world size and a ``config_type`` config of the backend's algorithm (BackendError)."""
    ws = ctx.workspace
    if ws is None:
        raise BackendError(f"{backend.name} needs a symmetric workspace (ctx.workspace is None)")
    if not isinstance(config, config_type) or config.algorithm != backend.algorithm:
        raise BackendError(f"{backend.name} needs {config_type.__name__}(algorithm={backend.algorithm!r}, ...), "
                           f"got {config!r}")
    if ws.world_size != problem.world_size:
        raise BackendError(f"{problem.describe()} does not match the workspace's world size {ws.world_size}")
    return ws


class RegionLauncher:
    """What a Triton all-reduce or fused launcher is bound to: one workspace's all-reduce region
    and signal channel, its double buffer when the config asks for it, the config and its
    :class:`Algorithm`, and the kernel specialisations made so far (``_variants``: key ->
    LeanLauncher of the record's kernel, its flags among the constexprs; ``_direct``: key -> its
    bound launch, called with int addresses)."""

    def __init__(self, problem: Problem, config: Any, workspace) -> None:
        self.config, self.record, self.algorithm = config, config.record, config.algorithm
        self.workspace = workspace
        self.dtype, self.elem_bytes = DTYPES[problem.dtype], problem.elem_bytes
        self.device, self.rank, self.world_size = workspace.device, workspace.rank, workspace.world_size
        region = workspace.regions[ALL_REDUCE_REGION]
        self.capacity = workspace.capacity(ALL_REDUCE_REGION)
        self.region_start = int(workspace.buffer.data_ptr()) + region.offset
        self.region_ptrs = workspace.region_ptrs(ALL_REDUCE_REGION)
        self.signal_ptrs = workspace.signal_ptrs(ALL_REDUCE_REGION)
        # Double buffer: halves at this offset from the region base (same buffer, same offsets on
        # every rank) and half_bytes apart; only configs that ask for it use them.
        self.half_bytes = workspace.double_buffer_half_bytes if config.double_buffer else 0
        self.double_offset = 0
        if self.half_bytes:
            self.double_offset = workspace.regions[DOUBLE_BUFFER_REGION].offset - region.offset
        self._variants: dict[tuple, LeanLauncher] = {}
        self._direct: dict[tuple, Callable[..., None]] = {}
        self._region_addr = int(self.region_ptrs.data_ptr())  # the workspace keeps these tensors alive
        self._signal_addr = int(self.signal_ptrs.data_ptr())
