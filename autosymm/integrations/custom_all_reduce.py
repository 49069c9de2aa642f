"""``AutosymmCustomAllReduce``: autosymm behind the custom-all-reduce interface serving stacks call.

Method names and semantics follow vLLM's ``CustomAllreduce`` (and SGLang's copy of it), so a
stack can hold one of these where it holds its own:

* ``should_custom_ar(x) -> bool``: True when autosymm's decision for x's (dtype, numel, mode)
  is not plain NCCL, i.e. a tuned kernel (or the world-size-1 no-op) would serve it. Decided
  with the tuned databases through the dispatcher, cached per (dtype, numel, mode); never a size
  threshold of its own.
* ``custom_all_reduce(x) -> Optional[Tensor]``: a new tensor holding the sum over the group (x is
  left as it was), or None when the stack should use its own path (NCCL) instead.
* ``capture()``: context manager around a stack's CUDA-graph capture (its warm-up runs
  included). Inside it the graph-mode rows decide, so warm-up calls run, and compile, the same
  kernels the capture records. Unlike vLLM's, warm-up calls return the real sum, not an
  uninitialised tensor. The group is initialised (collectively) on construction, never inside a
  capture.
* ``close()``: stop serving (``disabled`` becomes True); the workspace belongs to autosymm's group
  state and stays for other users of the group.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.distributed as dist

import autosymm
from autosymm.backends import FALLBACK
from autosymm.problem import DTYPES

_SUPPORTED = frozenset(DTYPES.values())


class AutosymmCustomAllReduce:
    """Out-of-place sum over ``group`` through autosymm, for a stack's custom-all-reduce slot.

    ``group``: the process group (None: the default group); ``device``: this rank's device (a
    CUDA device for NCCL groups; CPU for gloo, where autosymm never beats the fallback and
    ``should_custom_ar`` is False). Constructing is collective: every rank of ``group`` must
    construct its adapter together (it runs ``autosymm.init(group)``).
    """

    def __init__(self, group=None, device=None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("AutosymmCustomAllReduce needs torch.distributed initialised (dist.init_process_group)")
        self.group = group
        self.device = _normalise(torch.device(device)) if device is not None else _group_device(group)
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.disabled = False
        self._capturing = False
        self._use: dict[tuple, bool] = {}
        autosymm.init(group)  # collective: workspace rendezvous and DB agreement, outside any capture

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Wrap a CUDA-graph capture (and its warm-up runs): the graph-mode rows decide inside."""
        previous = self._capturing
        self._capturing = True
        try:
            yield
        finally:
            self._capturing = previous

    def _mode(self) -> str:
        if self._capturing:
            return "graph"
        capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        return "graph" if capturing else "eager"

    def should_custom_ar(self, x: torch.Tensor) -> bool:
        """True when autosymm would serve ``x`` with something other than plain NCCL."""
        if (self.disabled or x.dtype not in _SUPPORTED or x.device != self.device or not x.is_contiguous()
                or x.numel() == 0):
            return False
        key = (x.dtype, x.numel(), self._mode())
        use = self._use.get(key)
        if use is None:
            decision = autosymm.explain(x, group=self.group, mode=key[2])
            use = self._use[key] = decision.backend != FALLBACK["all_reduce"]
        return use

    def all_reduce(self, x: torch.Tensor, *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The sum of ``x`` over the group in ``out`` (a new tensor by default); ``x`` unchanged.

        Runs whatever autosymm decides (NCCL included); ``custom_all_reduce`` is the gated call.
        """
        if out is None:
            out = torch.empty_like(x, memory_format=torch.contiguous_format)
        elif out.shape != x.shape or out.dtype != x.dtype or out.device != x.device or not out.is_contiguous():
            raise ValueError(f"out {tuple(out.shape)} {out.dtype} on {out.device} must be a contiguous "
                             f"{tuple(x.shape)} {x.dtype} tensor on {x.device}")
        out.copy_(x)
        autosymm.all_reduce(out, group=self.group, op="sum")
        return out

    def custom_all_reduce(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """A new tensor with the sum of ``x`` over the group, or None when the caller should use
        its own all-reduce (disabled, or autosymm would run plain NCCL for this call)."""
        if not self.should_custom_ar(x):
            return None
        return self.all_reduce(x)

    def close(self) -> None:
        """Stop serving: ``custom_all_reduce`` returns None from now on."""
        self.disabled = True
        self._use.clear()

    def __repr__(self) -> str:
        return (f"AutosymmCustomAllReduce(rank={self.rank}, world_size={self.world_size}, device={self.device}, "
                f"disabled={self.disabled})")


def _group_device(group) -> torch.device:
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _normalise(device: torch.device) -> torch.device:
    """'cuda' -> 'cuda:<current>' so that it compares equal to a tensor's device."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
