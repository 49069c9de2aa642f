"""vLLM plugin: autosymm first in the tensor-parallel all-reduce chain (checked against vLLM 0.33.0).

Installing autosymm declares the ``vllm.platform_plugins`` entry point ``autosymm`` ->
:func:`platform_plugin`. Where vLLM's own CUDA platform would activate, it names
:class:`AutosymmCudaPlatform`: vLLM's CUDA platform whose ``get_device_communicator_cls()`` is
:class:`AutosymmCudaCommunicator`, vLLM's ``CudaCommunicator`` with, on each ``tp`` group of
more than one rank (the groups vLLM gives its custom all-reduce):

* an :class:`~autosymm.integrations.AutosymmCustomAllReduce` built on the communicator's CPU
  group, device and device group, wrapping vLLM's own ``ca_comm`` and put in its place (vLLM's
  graph capture enters its ``capture()``, which enters the wrapped one's);
* ``all_reduce(x)``: autosymm's sum where autosymm's decision is not NCCL, else vLLM's own chain
  unchanged (NCCL symmetric memory, FlashInfer, custom all-reduce, symm_mem, pynccl);
* ``all_gather(x, dim)`` / ``reduce_scatter(x, dim)`` (what ``GroupCoordinator.all_gather`` /
  ``reduce_scatter`` and their ``torch.ops.vllm`` ops reach: sequence parallelism's gather before
  the GEMM and scatter after it): at dim 0, autosymm's where its decision is not NCCL, else vLLM's
  own (NCCL symmetric memory, pynccl) unchanged; other dims always vLLM's;
* ``custom_all_gather`` / ``custom_reduce_scatter``: vLLM's, which ask ``ca_comm`` (the adapter:
  autosymm's where it serves, else vLLM's custom all-reduce's, else None).

vLLM's allow-list selects plugins: ``VLLM_PLUGINS=autosymm`` (or a list without it to leave
autosymm out). Nothing here imports vLLM until vLLM asks for a class.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

from . import vllm_fusion  # noqa: F401  (registers torch.ops.autosymm.vllm_all_reduce_rmsnorm in every vLLM process)
from .custom_all_reduce import AutosymmCustomAllReduce

PLATFORM_QUALNAME = "autosymm.integrations.vllm_plugin.AutosymmCudaPlatform"
COMMUNICATOR_QUALNAME = "autosymm.integrations.vllm_plugin.AutosymmCudaCommunicator"


def platform_plugin() -> Optional[str]:
    """The ``vllm.platform_plugins`` entry point: :data:`PLATFORM_QUALNAME` where vLLM's CUDA
    platform plugin activates (a CUDA device), else None (vLLM's detection goes on)."""
    from vllm.platforms import cuda_platform_plugin

    return PLATFORM_QUALNAME if cuda_platform_plugin() is not None else None


def attach(comm) -> Optional[AutosymmCustomAllReduce]:
    """Put autosymm on a vLLM communicator (``cpu_group``, ``device``, ``device_group``,
    ``unique_name``, ``world_size``, ``ca_comm``): on a ``tp`` group of more than one rank, an
    adapter wrapping ``comm.ca_comm`` becomes ``comm.ca_comm`` and is returned; else None.
    Collective over the group's ranks (vLLM builds every rank's communicator together)."""
    if comm.unique_name.split(":")[0] != "tp" or comm.world_size <= 1:
        return None
    adapter = AutosymmCustomAllReduce(group=comm.cpu_group, device=comm.device, device_group=comm.device_group,
                                      fallback=comm.ca_comm)
    comm.ca_comm = adapter
    return adapter


def serve_first(adapter: Optional[AutosymmCustomAllReduce], x: torch.Tensor,
                chain: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """autosymm's out-of-place sum of ``x`` where it serves, else ``chain(x)`` (vLLM's own)."""
    if adapter is not None and adapter.serves(x):
        return adapter.all_reduce(x)
    return chain(x)


def gather_first(adapter: Optional[AutosymmCustomAllReduce], x: torch.Tensor, dim: int,
                 chain: Callable[[torch.Tensor, int], torch.Tensor]) -> torch.Tensor:
    """autosymm's all-gather of ``x`` along dim 0 where it serves, else ``chain(x, dim)`` (vLLM's)."""
    if adapter is None:
        return chain(x, dim)
    return _dim0_first(adapter.serves_all_gather, adapter.all_gather, x, dim, chain)


def scatter_first(adapter: Optional[AutosymmCustomAllReduce], x: torch.Tensor, dim: int,
                  chain: Callable[[torch.Tensor, int], torch.Tensor]) -> torch.Tensor:
    """autosymm's reduce-scatter of ``x`` along dim 0 where it serves, else ``chain(x, dim)``."""
    if adapter is None:
        return chain(x, dim)
    return _dim0_first(adapter.serves_reduce_scatter, adapter.reduce_scatter, x, dim, chain)


def _dim0_first(serves, run, x: torch.Tensor, dim: int, chain) -> torch.Tensor:
    """``run(x)`` (contiguous) where ``dim`` is x's first and ``serves`` says so, else ``chain(x, dim)``."""
    if dim in (0, -x.dim()):
        contiguous = x.contiguous()
        if serves(contiguous):
            return run(contiguous)
    return chain(x, dim)


@functools.cache
def _communicator_class():
    from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator

    class AutosymmCudaCommunicator(CudaCommunicator):
        """vLLM's CudaCommunicator with autosymm first in ``all_reduce`` (module docstring)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.autosymm = attach(self)
            from .vllm_all2all import install  # MoE: autosymm's subclass of vLLM's default all2all manager

            install(self)

        def all_reduce(self, input_):
            return serve_first(self.autosymm, input_, super().all_reduce)

        def all_gather(self, input_, dim=-1):
            return gather_first(self.autosymm, input_, dim, super().all_gather)

        def reduce_scatter(self, input_, dim=-1):
            return scatter_first(self.autosymm, input_, dim, super().reduce_scatter)

    AutosymmCudaCommunicator.__module__ = __name__
    return AutosymmCudaCommunicator


@functools.cache
def _platform_class():
    from vllm.platforms.cuda import CudaPlatform

    class AutosymmCudaPlatform(CudaPlatform):
        """vLLM's CUDA platform with :class:`AutosymmCudaCommunicator` as its device communicator."""

        @classmethod
        def get_device_communicator_cls(cls) -> str:
            return COMMUNICATOR_QUALNAME

    AutosymmCudaPlatform.__module__ = __name__
    return AutosymmCudaPlatform


def __getattr__(name: str):
    """The classes vLLM resolves by qualified name, built (importing vLLM) on first access."""
    if name == "AutosymmCudaPlatform":
        return _platform_class()
    if name == "AutosymmCudaCommunicator":
        return _communicator_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
