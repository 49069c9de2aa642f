"""``AutosymmServing``: autosymm's half of a stack's custom-all-reduce slot, under names of its own.

The slot objects (:mod:`autosymm.integrations.custom_all_reduce`) hold one as ``.autosymm``; the
stacks' own objects keep their ``all_reduce``, ``reduce_scatter``, ``all_gather``, ``max_size``
and ``disabled`` with their own signatures and meanings, so nothing here may be named into them.

Each ``serves*`` answers whether autosymm's decision for a call is a tuned row's
(``Decision.tuned``) whose backend is neither NCCL's (the op's fallback, or its batch-invariant
fallback) nor the stack's own path (autosymm.backends.stack: the dispatcher keeps it unless a row
measured autosymm faster by the margin): where no row decides, or NCCL's or the stack's won, the
stack runs its own path, exactly what it would run without autosymm. The decision is the
runtime's prepared call, under the door's own call key (autosymm.spec.call_key, the mode the
stack's capture context says) and in the group's cache: its first use is agreed with every rank
and, inside warm-up tuning (autosymm.runtime.warmup), tunes the key. The matching call runs
whatever autosymm decides. ``stop()`` makes every ``serves*`` False.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

from autosymm import settings
from autosymm.api import explain, init
from autosymm.backends import STACK_PATHS
from autosymm.collectives.all_gather import DOOR as ALL_GATHER_DOOR, all_gather_into_tensor
from autosymm.collectives.all_reduce import DOOR as ALL_REDUCE_DOOR, all_reduce
from autosymm.collectives.all_reduce_rmsnorm import DOOR as ALL_REDUCE_RMSNORM_DOOR, all_reduce_rmsnorm
from autosymm.collectives.reduce_scatter import DOOR as REDUCE_SCATTER_DOOR, reduce_scatter_tensor
from autosymm.dist_compat import group_device, group_over
from autosymm.epilogue import DEFAULT
from autosymm.problem import DTYPES
from autosymm.runtime.entry import prepare_call
from autosymm.runtime.group import state_of
from autosymm.spec import ALL_GATHER, ALL_REDUCE, ALL_REDUCE_RMSNORM, REDUCE_SCATTER, call_key

from .groups import serving_backend

_SUPPORTED = frozenset(DTYPES.values())


def check_max_size(max_size) -> Optional[int]:
    """``max_size`` as given when it is None or a positive int (bytes), else a clear error."""
    if max_size is None:
        return None
    if isinstance(max_size, bool) or not isinstance(max_size, int):
        raise TypeError(f"max_size must be a positive int (bytes) or None, got {type(max_size).__name__} "
                        f"{max_size!r}")
    if max_size <= 0:
        raise ValueError(f"max_size must be a positive number of bytes or None, got {max_size}")
    return max_size


class AutosymmServing:
    """Sums, gathers and scatters over a stack's group through autosymm.

    ``group``: the group the stack passes (its CPU/gloo group; None: the world); ``device``: this
    rank's device (int, str or torch.device; default: the group's); ``max_size``: bytes from which
    autosymm declines (None: its databases decide every size); ``device_group``: the group to
    serve on when the caller has it (default: found or created over ``group``'s ranks);
    ``deterministic``: autosymm's batch-invariant setting for the group (None: its default).
    Constructing is collective over the group's ranks (``autosymm.init`` on the device group).
    """

    def __init__(self, group=None, device=None, max_size: Optional[int] = None, *, device_group=None,
                 deterministic: Optional[bool] = None) -> None:
        self.max_size = check_max_size(max_size)
        if not dist.is_initialized():
            raise RuntimeError("autosymm's custom all-reduce needs torch.distributed initialised "
                               "(dist.init_process_group)")
        self.cpu_group = group
        self.device = as_device(device) if device is not None else group_device(group)
        self.group = device_group if device_group is not None else group_over(group, serving_backend(self.device))
        self.world_size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.stopped = False
        self._capturing = False
        # collective: workspace rendezvous and DB agreement, outside any capture
        init(self.group, deterministic=deterministic)

    @contextlib.contextmanager
    def bypassed(self) -> Iterator[None]:
        """Within: every ``serves*`` is False (the stack's own path, timed as a warm-up candidate,
        must not ask autosymm again)."""
        previous = self.stopped
        self.stopped = True
        try:
            yield
        finally:
            self.stopped = previous

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Within: the graph-mode rows decide (a stack's CUDA-graph capture and its warm-ups)."""
        previous = self._capturing
        self._capturing = True
        try:
            yield
        finally:
            self._capturing = previous

    def stop(self) -> None:
        """Serve nothing from now on (every ``serves*`` is False)."""
        self.stopped = True

    def _mode(self) -> str:
        if self._capturing:
            return "graph"
        capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        return "graph" if capturing else "eager"

    def _fits(self, x: torch.Tensor, nbytes: Optional[int] = None, any_dtype: bool = False) -> bool:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"autosymm's custom all-reduce: x must be a torch.Tensor, got {type(x).__name__}")
        nbytes = x.numel() * x.element_size() if nbytes is None else nbytes
        return (not self.stopped and (any_dtype or x.dtype in _SUPPORTED) and x.device == self.device
                and x.is_contiguous() and x.numel() > 0
                and (self.max_size is None or nbytes < self.max_size))

    def _decision(self, door, key: tuple, make_args):
        """The runtime's prepared call of ``key`` on the group (``make_args()``: a call's arguments,
        built on a miss only: its first use is checked and agreed with every rank), its Decision."""
        state = state_of(self.group)
        entry = state.cache.get(key)
        if entry is None:
            entry = prepare_call(state, door, key, make_args())
        return entry.decision

    def serves(self, x: torch.Tensor) -> bool:
        """True when a tuned row decides the sum of ``x`` for something other than NCCL."""
        if not self._fits(x):
            return False
        key = call_key(ALL_REDUCE, x.dtype, x.numel(), x.device, self._mode() == "graph", "sum")
        return serves(self._decision(ALL_REDUCE_DOOR, key, lambda: (x, "sum")), ALL_REDUCE)

    def all_reduce(self, x: torch.Tensor, *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The sum of ``x`` over the group in ``out`` (a new tensor by default); ``x`` unchanged.
        A wrong ``out`` raises after the sum (taken in a scratch tensor), so that no peer is left
        waiting in the collective. Runs whatever autosymm decides (NCCL included)."""
        bad_out = None
        if out is not None and not (isinstance(out, torch.Tensor) and out.shape == x.shape and out.dtype == x.dtype
                                    and out.device == x.device and out.is_contiguous()):
            bad_out = ValueError(f"out {tuple(getattr(out, 'shape', ()))} {getattr(out, 'dtype', type(out).__name__)} "
                                 f"on {getattr(out, 'device', '?')} must be a contiguous {tuple(x.shape)} {x.dtype} "
                                 f"tensor on {x.device}")
            out = None  # this rank still joins the collective (its peers wait in it), then raises
        if out is None:
            out = torch.empty_like(x, memory_format=torch.contiguous_format)
        out.copy_(x)
        all_reduce(out, group=self.group, op="sum")
        if bad_out is not None:
            raise bad_out
        return out

    def serves_fused(self, x: torch.Tensor, epilogue=None, first_use: Optional[Callable[[], None]] = None) -> bool:
        """True when a tuned row decides the fused all-reduce + RMSNorm of ``x`` [tokens, hidden]
        with ``epilogue`` (autosymm.epilogue.Epilogue; None: the default) for something other
        than NCCL. ``first_use()``: run before the key's first decision (the stack's word on how
        it runs this call, for the warm-up's stack path: autosymm.integrations.vllm_warmup)."""
        if not self._fits(x) or x.dim() != 2:
            return False
        epilogue = DEFAULT if epilogue is None else epilogue
        key = call_key(ALL_REDUCE_RMSNORM, x.dtype, x.shape, x.device, self._mode() == "graph", epilogue)

        def call():  # a call of this key (its tensors' shapes, dtype and device: the checks read only those)
            if first_use is not None:
                first_use()
            residual = torch.zeros_like(x) if epilogue.residual else None
            scale = x.new_ones((), dtype=torch.float32) if epilogue.needs_scale else None
            return x, residual, x.new_ones(x.shape[1]), scale, 1e-6, epilogue.gemma, epilogue.quant

        return serves(self._decision(ALL_REDUCE_RMSNORM_DOOR, key, call), ALL_REDUCE_RMSNORM)

    def all_reduce_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rmsnorm(residual + sum(x)) * weight, residual + sum(x))`` through
        autosymm.all_reduce_rmsnorm, whatever it decides; ``residual`` unchanged, ``x`` is scratch."""
        residual_out = residual.clone(memory_format=torch.contiguous_format)
        out = all_reduce_rmsnorm(x, residual_out, weight, eps, group=self.group)
        return out, residual_out

    def serves_all_gather(self, x: torch.Tensor) -> bool:
        """True when a tuned row decides the dim-0 all-gather of every rank's ``x`` for something
        other than NCCL (any dtype: an all-gather copies bytes)."""
        if x.dim() == 0 or not self._fits(x, self.world_size * x.numel() * x.element_size(), any_dtype=True):
            return False
        full = (self.world_size * x.shape[0], *x.shape[1:])
        key = call_key(ALL_GATHER, x.dtype, x.shape, x.device, self._mode() == "graph", (torch.Size(full), None))
        return serves(self._decision(ALL_GATHER_DOOR, key, lambda: (x.new_empty(full), x, None)), ALL_GATHER)

    def serves_reduce_scatter(self, x: torch.Tensor) -> bool:
        """True when ``x``'s dim 0 splits into world_size shards and a tuned row decides their
        reduce-scatter (a sum) for something other than NCCL."""
        if not (isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] % self.world_size == 0) or \
                not self._fits(x):
            return False
        shard = torch.Size((x.shape[0] // self.world_size, *x.shape[1:]))
        key = call_key(REDUCE_SCATTER, x.dtype, x.shape, x.device, self._mode() == "graph", (shard, "sum", None))
        return serves(self._decision(REDUCE_SCATTER_DOOR, key, lambda: (x.new_empty(shard), x, "sum", None)),
                      REDUCE_SCATTER)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` along dim 0 in rank order, a new [world_size * n, ...] tensor, through
        autosymm.all_gather_into_tensor (whatever it decides)."""
        out = x.new_empty((self.world_size * x.shape[0], *x.shape[1:]))
        all_gather_into_tensor(out, x, group=self.group)
        return out

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's dim-0 shard of the sum of ``x`` over the group, a new [n / world_size, ...]
        tensor, through autosymm.reduce_scatter_tensor (whatever it decides)."""
        out = x.new_empty((x.shape[0] // self.world_size, *x.shape[1:]))
        reduce_scatter_tensor(out, x, group=self.group)
        return out

    def __repr__(self) -> str:
        return (f"AutosymmServing(rank={self.rank}, world_size={self.world_size}, device={self.device}, "
                f"max_size={self.max_size}, stopped={self.stopped})")


def serves(decision, record) -> bool:
    """Whether ``decision`` (for an op of spec ``record``) pre-empts the stack's own path: a
    database row decided it, for a backend other than NCCL's (``record.fallback`` or
    ``record.invariant_fallback``) and the stack's own (autosymm.backends.stack). Untuned
    defaults never do."""
    return (decision.tuned and decision.backend not in (record.fallback, record.invariant_fallback)
            and decision.backend not in STACK_PATHS)


def explained(group, record, problem, mode: str):
    """autosymm's decision for ``problem`` (of spec ``record``) on ``group`` in ``mode``, without
    preparing a call (autosymm.explain): what the MoE adapters ask before they build one."""
    return explain(group=group, op=record.name, mode=mode, problem=problem)


def stack_warmup():
    """The plugins' warm-up tuning: ``autosymm.autotune`` with ``AUTOSYMM_STACK_AUTOTUNE``'s budget
    (default 30 s), or nothing where it is off. Every rank of a stack enters it alike."""
    budget = settings.get_or_default("AUTOSYMM_STACK_AUTOTUNE")[0]
    if not budget:
        return contextlib.nullcontext()
    from autosymm.tuning.warmup import autotune  # the tuning side loads only where a stack's warm-up runs

    return autotune(budget)


def as_device(device) -> torch.device:
    """int -> cuda:<int> (as vLLM takes it); 'cuda' -> 'cuda:<current>', so that it compares equal
    to a tensor's device."""
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
