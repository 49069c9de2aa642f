"""``AutosymmServing``: autosymm's half of a stack's custom-all-reduce slot, under names of its own.

The slot objects (:mod:`autosymm.integrations.custom_all_reduce`) hold one as ``.autosymm``; the
stacks' own objects keep their ``all_reduce``, ``reduce_scatter``, ``all_gather``, ``max_size``
and ``disabled`` with their own signatures and meanings, so nothing here may be named into them.

Each ``serves*`` answers whether autosymm's decision for a call (dtype, bytes, eager or graph
mode; asked once per key, with the tuned databases) is a tuned row's (``Decision.tuned``) whose
backend is not NCCL's (the op's fallback, or its batch-invariant fallback): where no row decides,
or NCCL's row won, the stack runs its own path, exactly what it would run without autosymm. The
matching call runs whatever autosymm decides. ``stop()`` makes every ``serves*`` False.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from autosymm.api import explain, init
from autosymm.collectives.all_gather import all_gather_into_tensor
from autosymm.collectives.all_reduce import all_reduce
from autosymm.collectives.all_reduce_rmsnorm import all_reduce_rmsnorm
from autosymm.collectives.reduce_scatter import reduce_scatter_tensor
from autosymm.spec import ALL_GATHER, ALL_REDUCE, ALL_REDUCE_RMSNORM, REDUCE_SCATTER
from autosymm.dist_compat import group_device, group_over
from autosymm.problem import DTYPES, Problem, dtype_name

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
        self._use: dict[tuple, bool] = {}
        # collective: workspace rendezvous and DB agreement, outside any capture
        init(self.group, deterministic=deterministic)

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
        self._use.clear()

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

    def _decides(self, key: tuple, record, problem: Optional[Problem], x=None) -> bool:
        """True when a tuned row decides ``key`` (cached) for a backend other than ``record``'s NCCL
        fallbacks (module docstring)."""
        use = self._use.get(key)
        if use is None:
            if problem is None:
                decision = explain(x, group=self.group, mode=key[-1])
            else:
                decision = explain(group=self.group, op=record.name, mode=key[-1], problem=problem)
            use = self._use[key] = serves(decision, record)
        return use

    def serves(self, x: torch.Tensor) -> bool:
        """True when a tuned row decides the sum of ``x`` for something other than NCCL."""
        if not self._fits(x):
            return False
        return self._decides((x.dtype, x.numel(), self._mode()), ALL_REDUCE, None, x)

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

    def serves_fused(self, x: torch.Tensor, epilogue=None) -> bool:
        """True when a tuned row decides the fused all-reduce + RMSNorm of ``x`` [tokens, hidden]
        with ``epilogue`` (autosymm.epilogue.Epilogue; None: the default) for something other
        than NCCL."""
        if not self._fits(x) or x.dim() != 2:
            return False
        problem = Problem.all_reduce_rmsnorm(x.shape[0], x.shape[1], dtype_name(x.dtype), self.world_size,
                                             epilogue=epilogue)
        return self._decides(("all_reduce_rmsnorm", x.dtype, tuple(x.shape), epilogue, self._mode()),
                             ALL_REDUCE_RMSNORM, problem)

    def all_reduce_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rmsnorm(residual + sum(x)) * weight, residual + sum(x))`` through
        autosymm.all_reduce_rmsnorm, whatever it decides; ``residual`` unchanged, ``x`` is scratch."""
        residual_out = residual.clone(memory_format=torch.contiguous_format)
        out = all_reduce_rmsnorm(x, residual_out, weight, eps, group=self.group)
        return out, residual_out

    def _serves_sharded(self, record, x: torch.Tensor, full_bytes: int) -> bool:
        """True when a tuned row decides ``record``'s call of a ``full_bytes`` full tensor for
        something other than NCCL (a reduce-scatter sums bf16/fp16/fp32 only; an all-gather copies
        any dtype)."""
        if x.dim() == 0 or not self._fits(x, full_bytes, any_dtype=record is ALL_GATHER):
            return False
        dtype = dtype_name(x.dtype) if x.dtype in _SUPPORTED else "bf16"  # the all-gather's keying
        problem = Problem(record.name, dtype, self.world_size, nbytes=full_bytes)
        return self._decides((record.name, x.dtype, full_bytes, self._mode()), record, problem)

    def serves_all_gather(self, x: torch.Tensor) -> bool:
        """True when a tuned row decides the dim-0 all-gather of every rank's ``x`` for something
        other than NCCL."""
        return self._serves_sharded(ALL_GATHER, x, self.world_size * x.numel() * x.element_size())

    def serves_reduce_scatter(self, x: torch.Tensor) -> bool:
        """True when ``x``'s dim 0 splits into world_size shards and a tuned row decides their
        reduce-scatter for something other than NCCL."""
        return (isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] % self.world_size == 0
                and self._serves_sharded(REDUCE_SCATTER, x, x.numel() * x.element_size()))

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
    """Whether ``decision`` (autosymm.explain's, for an op of spec ``record``) pre-empts the stack's
    own path: a database row decided it, for a backend other than NCCL's (``record.fallback`` or
    ``record.invariant_fallback``). Untuned defaults never do."""
    return decision.tuned and decision.backend not in (record.fallback, record.invariant_fallback)


def as_device(device) -> torch.device:
    """int -> cuda:<int> (as vLLM takes it); 'cuda' -> 'cuda:<current>', so that it compares equal
    to a tensor's device."""
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
