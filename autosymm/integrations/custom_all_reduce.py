"""``AutosymmCustomAllReduce``: autosymm in the custom-all-reduce slot of vLLM and SGLang.

Built the way the stacks build theirs: vLLM 0.33.0 ``CustomAllreduce(group=cpu_group,
device=device, symm_mem_enabled=..., register_graph_buffers=...)``
(``distributed/device_communicators/cuda_communicator.py``), SGLang 0.5.23
``CAClass(group=cpu_group, device=device)`` (``srt/distributed/parallel_state.py``). The group
they pass is the CPU (gloo) group; the adapter serves on the device group over the same ranks
(:func:`autosymm.integrations.groups.device_group_for`: found, or created collectively).

What their code calls on the slot:

* ``disabled``, ``should_custom_ar(x) -> bool``, ``custom_all_reduce(x) -> Optional[Tensor]``:
  autosymm serves ``x`` when its decision for x's (dtype, numel, mode) is not plain NCCL (decided
  with the tuned databases, cached per key; never a size threshold of its own, but below
  ``max_size`` bytes when one is given). Otherwise the stack's own object, when the adapter wraps
  one (``fallback``), answers; else None: the stack's next path (NCCL) runs.
* ``capture()``: context manager around a stack's CUDA-graph capture, warm-up runs included.
  Inside it the graph-mode rows decide, so warm-ups prepare, and compile, what the capture
  records; the wrapped object's ``capture()`` is entered too. Unlike vLLM's, warm-up calls
  return the real sum, not an uninitialised tensor.
* ``fused_allreduce_rmsnorm(x, residual, weight, eps) -> Optional[(out, residual_out)]``: SGLang's
  fused convention (``GroupCoordinator.fused_allreduce_rmsnorm``): ``residual_out = residual +
  all_reduce(x)`` (a new tensor; ``residual`` unchanged, ``x`` is scratch) and ``out =
  rmsnorm(residual_out) * weight``; None where autosymm's decision is NCCL and nothing wrapped serves.
* ``custom_all_gather(x) -> Optional[Tensor]`` ([world_size * n, ...]) and
  ``custom_reduce_scatter(x) -> Optional[Tensor]`` ([n / world_size, ...]), vLLM's signatures
  (``CudaCommunicator.custom_all_gather`` / ``custom_reduce_scatter``), with
  ``should_custom_all_gather`` / ``should_custom_reduce_scatter``: autosymm's
  ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` where its decision for the full tensor's
  bytes is not NCCL; else the wrapped object's; else None. ``serves_all_gather(x)`` /
  ``serves_reduce_scatter(x)`` and ``all_gather(x)`` / ``reduce_scatter(x)`` are autosymm's half
  alone (the vLLM plugin's ``all_gather`` / ``reduce_scatter`` slots).
* ``fully_connected`` and every other attribute (``mnnvl_*``, ``_IS_CAPTURING``, ...): the wrapped
  object's. Without one, ``fully_connected`` is False.
* ``close()``: stop serving (``disabled`` becomes True) and close the wrapped object; the
  workspace belongs to autosymm's group state and stays for other users of the group.

Constructing is collective over the group's ranks (``autosymm.init`` on the device group).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.distributed as dist

import autosymm
from autosymm.collectives import ALL_GATHER, ALL_REDUCE, ALL_REDUCE_RMSNORM, REDUCE_SCATTER
from autosymm.dist_compat import group_device
from autosymm.problem import DTYPES, Problem, dtype_name

from .groups import device_group_for, serving_backend

_SUPPORTED = frozenset(DTYPES.values())
#: Keyword arguments of vLLM's CustomAllreduce that size or configure its own buffers: accepted,
#: with no effect here (autosymm's workspace is sized by AUTOSYMM_WORKSPACE_BYTES).
STACK_OPTIONS = frozenset({"max_all_gather_size", "max_mnnvl_all_gather_size", "max_reduce_scatter_size",
                           "max_mnnvl_reduce_scatter_size", "max_mnnvl_multimem_reduce_scatter_size",
                           "symm_mem_enabled", "register_graph_buffers"})
#: What the stacks read on the slot where no stack object is wrapped: autosymm's value.
#: (vLLM's DeepSeek mHC path asks for the MNNVL multicast mailbox: autosymm creates none.)
_OWN_VALUES = {"mnnvl_lamport_ag_multicast_ptr": 0}


class AutosymmCustomAllReduce:
    """Out-of-place sums over a stack's group through autosymm, for its custom-all-reduce slot.

    ``group``: the group the stack passes (its CPU/gloo group; None: the world); ``device``: this
    rank's device (int, str or torch.device; default: the group's); ``max_size``: bytes from which
    autosymm declines (None: its databases decide every size); ``device_group``: the group to
    serve on when the caller has it (default: found or created over ``group``'s ranks);
    ``fallback``: the stack's own custom all-reduce, asked where autosymm would run NCCL.
    ``stack_options``: the other keywords of vLLM's constructor (:data:`STACK_OPTIONS`).
    """

    def __init__(self, group=None, device=None, max_size: Optional[int] = None, *, device_group=None,
                 fallback=None, **stack_options) -> None:
        unknown = sorted(set(stack_options) - STACK_OPTIONS)
        if unknown:
            raise TypeError(f"AutosymmCustomAllReduce got unexpected keyword arguments {unknown}; "
                            f"it takes group, device, max_size, device_group, fallback and {sorted(STACK_OPTIONS)}")
        if not dist.is_initialized():
            raise RuntimeError("AutosymmCustomAllReduce needs torch.distributed initialised (dist.init_process_group)")
        self.fallback = fallback
        self.cpu_group = group
        self.device = _as_device(device) if device is not None else group_device(group)
        self.group = device_group if device_group is not None else device_group_for(group,
                                                                                   serving_backend(self.device))
        self.max_size = max_size
        self.world_size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.disabled = False
        self._capturing = False
        self._use: dict[tuple, bool] = {}
        autosymm.init(self.group)  # collective: workspace rendezvous and DB agreement, outside any capture

    def __getattr__(self, name: str):
        fallback = self.__dict__.get("fallback")
        if fallback is None and name in _OWN_VALUES:
            return _OWN_VALUES[name]
        if fallback is None or name.startswith("__"):
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r} (and wraps no stack object)")
        return getattr(fallback, name)

    @property
    def fully_connected(self) -> bool:
        """The wrapped object's (the stacks read it to pick their custom all-gather); else False."""
        return bool(getattr(self.fallback, "fully_connected", False))

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Wrap a CUDA-graph capture (and its warm-up runs): the graph-mode rows decide inside."""
        previous = self._capturing
        self._capturing = True
        try:
            with contextlib.ExitStack() as stack:
                if self.fallback is not None:
                    stack.enter_context(self.fallback.capture())
                yield
        finally:
            self._capturing = previous

    def _mode(self) -> str:
        if self._capturing:
            return "graph"
        capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        return "graph" if capturing else "eager"

    def _fits(self, x: torch.Tensor) -> bool:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"AutosymmCustomAllReduce: x must be a torch.Tensor, got {type(x).__name__}")
        return (not self.disabled and x.dtype in _SUPPORTED and x.device == self.device and x.is_contiguous()
                and x.numel() > 0 and (self.max_size is None or x.numel() * x.element_size() < self.max_size))

    def serves(self, x: torch.Tensor) -> bool:
        """True when autosymm itself (not the wrapped object) would serve ``x`` with something
        other than plain NCCL."""
        if not self._fits(x):
            return False
        key = (x.dtype, x.numel(), self._mode())
        use = self._use.get(key)
        if use is None:
            decision = autosymm.explain(x, group=self.group, mode=key[2])
            use = self._use[key] = decision.backend != ALL_REDUCE.fallback
        return use

    def should_custom_ar(self, x: torch.Tensor) -> bool:
        """True when autosymm, or the wrapped object, serves ``x``."""
        if self.serves(x):
            return True
        return self.fallback is not None and not self.disabled and self.fallback.should_custom_ar(x)

    def all_reduce(self, x: torch.Tensor, *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The sum of ``x`` over the group in ``out`` (a new tensor by default); ``x`` unchanged.
        A wrong ``out`` raises after the sum (taken in a scratch tensor), so that no peer is left
        waiting in the collective.

        Runs whatever autosymm decides (NCCL included); ``custom_all_reduce`` is the gated call.
        """
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
        autosymm.all_reduce(out, group=self.group, op="sum")
        if bad_out is not None:
            raise bad_out
        return out

    def custom_all_reduce(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """A new tensor with the sum of ``x`` over the group, or None when the caller should use
        its own all-reduce (disabled, or neither autosymm nor the wrapped object serves it)."""
        if self.serves(x):
            return self.all_reduce(x)
        if self.fallback is not None and not self.disabled and self.fallback.should_custom_ar(x):
            return self.fallback.custom_all_reduce(x)
        return None

    def serves_fused(self, x: torch.Tensor) -> bool:
        """True when autosymm's decision for the fused all-reduce + RMSNorm of ``x`` [tokens,
        hidden] is not its NCCL fallback."""
        if not self._fits(x) or x.dim() != 2:
            return False
        key = ("all_reduce_rmsnorm", x.dtype, tuple(x.shape), self._mode())
        use = self._use.get(key)
        if use is None:
            problem = Problem.all_reduce_rmsnorm(x.shape[0], x.shape[1], dtype_name(x.dtype), self.world_size)
            decision = autosymm.explain(group=self.group, op="all_reduce_rmsnorm", mode=key[3], problem=problem)
            use = self._use[key] = decision.backend != ALL_REDUCE_RMSNORM.fallback
        return use

    def fused_allreduce_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                eps: float) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """SGLang's fused call: ``(rmsnorm(residual + sum(x)) * weight, residual + sum(x))`` as new
        tensors, or None for the caller's own path (see the module docstring)."""
        if self.serves_fused(x):
            return self.all_reduce_rmsnorm(x, residual, weight, eps)
        return self._wrapped("fused_allreduce_rmsnorm", x, residual, weight, eps)

    def all_reduce_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, residual_out)`` through autosymm.all_reduce_rmsnorm, whatever it decides;
        ``residual`` is left as it was (``x`` is scratch)."""
        residual_out = residual.clone(memory_format=torch.contiguous_format)
        out = autosymm.all_reduce_rmsnorm(x, residual_out, weight, eps, group=self.group)
        return out, residual_out

    def _serves_sharded(self, record, x: torch.Tensor, full_bytes: int) -> bool:
        """True when autosymm's decision for ``record``'s call of a ``full_bytes`` full tensor is not
        its NCCL fallback (a reduce-scatter sums bf16/fp16/fp32 only; an all-gather copies any dtype)."""
        if not (not self.disabled and x.device == self.device and x.is_contiguous() and x.dim() > 0
                and x.numel() > 0 and (record is ALL_GATHER or x.dtype in _SUPPORTED)
                and (self.max_size is None or full_bytes < self.max_size)):
            return False
        key = (record.name, x.dtype, full_bytes, self._mode())
        use = self._use.get(key)
        if use is None:
            dtype = dtype_name(x.dtype) if x.dtype in _SUPPORTED else "bf16"  # the all-gather's keying
            problem = Problem(record.name, dtype, self.world_size, nbytes=full_bytes)
            decision = autosymm.explain(group=self.group, op=record.name, mode=key[3], problem=problem)
            use = self._use[key] = decision.backend != record.fallback
        return use

    def serves_all_gather(self, x: torch.Tensor) -> bool:
        """True when autosymm's decision for the dim-0 all-gather of every rank's ``x`` is not NCCL."""
        return self._serves_sharded(ALL_GATHER, x, self.world_size * x.numel() * x.element_size())

    def serves_reduce_scatter(self, x: torch.Tensor) -> bool:
        """True when ``x``'s dim 0 splits into world_size shards and autosymm's decision for their
        reduce-scatter is not NCCL."""
        return (x.dim() > 0 and x.shape[0] % self.world_size == 0
                and self._serves_sharded(REDUCE_SCATTER, x, x.numel() * x.element_size()))

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` along dim 0 in rank order, a new [world_size * n, ...] tensor, through
        autosymm.all_gather_into_tensor (whatever it decides)."""
        out = x.new_empty((self.world_size * x.shape[0], *x.shape[1:]))
        autosymm.all_gather_into_tensor(out, x, group=self.group)
        return out

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's dim-0 shard of the sum of ``x`` over the group, a new [n / world_size, ...]
        tensor, through autosymm.reduce_scatter_tensor (whatever it decides)."""
        out = x.new_empty((x.shape[0] // self.world_size, *x.shape[1:]))
        autosymm.reduce_scatter_tensor(out, x, group=self.group)
        return out

    def should_custom_all_gather(self, x: torch.Tensor) -> bool:
        return self.serves_all_gather(x) or bool(self._wrapped("should_custom_all_gather", x))

    def custom_all_gather(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """:meth:`all_gather` where autosymm serves ``x``, else the wrapped object's, else None for
        the caller's own path (disabled, or neither serves it)."""
        return self.all_gather(x) if self.serves_all_gather(x) else self._wrapped("custom_all_gather", x)

    def should_custom_reduce_scatter(self, x: torch.Tensor) -> bool:
        return self.serves_reduce_scatter(x) or bool(self._wrapped("should_custom_reduce_scatter", x))

    def custom_reduce_scatter(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """:meth:`reduce_scatter` where autosymm serves ``x``, else as :meth:`custom_all_gather`."""
        return self.reduce_scatter(x) if self.serves_reduce_scatter(x) else self._wrapped("custom_reduce_scatter", x)

    def _wrapped(self, name: str, *args):
        """The wrapped object's method ``name`` of ``args``; None while disabled or where it has none."""
        method = getattr(self.fallback, name, None)
        return method(*args) if method is not None and not self.disabled else None

    def close(self) -> None:
        """Stop serving: ``custom_all_reduce`` returns None from now on; closes the wrapped object."""
        self.disabled = True
        self._use.clear()
        if self.fallback is not None and hasattr(self.fallback, "close"):
            self.fallback.close()

    def __repr__(self) -> str:
        return (f"AutosymmCustomAllReduce(rank={self.rank}, world_size={self.world_size}, device={self.device}, "
                f"disabled={self.disabled}, fallback={type(self.fallback).__name__ if self.fallback else None})")


def _as_device(device) -> torch.device:
    """int -> cuda:<int> (as vLLM takes it); 'cuda' -> 'cuda:<current>', so that it compares equal
    to a tensor's device."""
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
