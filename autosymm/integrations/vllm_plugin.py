"""vLLM plugin: autosymm first in the tensor-parallel all-reduce chain (checked against vLLM 0.33.0).

Installing autosymm declares the ``vllm.platform_plugins`` entry point ``autosymm`` ->
:func:`platform_plugin`, which names :class:`AutosymmCudaPlatform` where vLLM's CUDA platform
would activate: vLLM's platform whose communicator (:class:`AutosymmCudaCommunicator`) puts, on
each ``tp`` group of more than one rank, autosymm in vLLM's own ``ca_comm`` slot and first in
``all_reduce`` and the dim-0 ``all_gather`` / ``reduce_scatter`` where a tuned row decides the call
for something other than NCCL; else vLLM's own chain runs unchanged (it is also the stack path
warm-up tuning times, autosymm.integrations.vllm_warmup, whose ``AutosymmWorker`` the platform names
as vLLM's worker). It stays out under ``--disable-custom-all-reduce`` and ``--enable-elastic-ep``;
under ``VLLM_BATCH_INVARIANT=1`` only batch-invariant tuned rows serve. ``VLLM_PLUGINS`` selects
plugins; nothing here imports vLLM until vLLM asks for a class.

Design notes: docs/INTEGRATIONS.md#integrations-vllm-plugin
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

from autosymm.runtime.group import state_of

from . import vllm_fusion  # registers torch.ops.autosymm.vllm_all_reduce_rmsnorm in every vLLM process
from . import vllm_warmup
from .custom_all_reduce import wrap
from .serving import AutosymmServing
from .vllm_all2all import install as install_all2all

PLATFORM_QUALNAME = "autosymm.integrations.vllm_plugin.AutosymmCudaPlatform"
COMMUNICATOR_QUALNAME = "autosymm.integrations.vllm_plugin.AutosymmCudaCommunicator"
WORKER_QUALNAME = "autosymm.integrations.vllm_plugin.AutosymmWorker"
VLLM_WORKER = "vllm.v1.worker.gpu_worker.Worker"  # what vLLM's CUDA platform names (platforms/cuda.py:330-331)


def platform_plugin() -> Optional[str]:
    """The ``vllm.platform_plugins`` entry point: :data:`PLATFORM_QUALNAME` where vLLM's CUDA
    platform plugin activates (a CUDA device), else None (vLLM's detection goes on)."""
    from vllm.platforms import cuda_platform_plugin  # vLLM is optional: imported only when vLLM runs

    return PLATFORM_QUALNAME if cuda_platform_plugin() is not None else None


def attach(comm, deterministic: Optional[bool] = None) -> Optional[AutosymmServing]:
    """Put autosymm on a vLLM communicator (``cpu_group``, ``device``, ``device_group``,
    ``unique_name``, ``world_size``, ``ca_comm``) and return its serving half; None where vLLM has no
    custom all-reduce there (not a ``tp`` group of more than one rank, or
    ``--disable-custom-all-reduce``: ``ca_comm`` None, and autosymm stays out too). vLLM's
    ``ca_comm`` becomes the slot (:func:`~autosymm.integrations.custom_all_reduce.wrap`: in place
    where it is enabled). ``deterministic``: autosymm's batch-invariant setting (None: its default).
    Collective over the group's ranks (vLLM builds every rank's communicator together)."""
    if comm.unique_name.split(":")[0] != "tp" or comm.world_size <= 1 or comm.ca_comm is None:
        return None
    comm.ca_comm = wrap(comm.ca_comm, group=comm.cpu_group, device=comm.device, device_group=comm.device_group,
                        deterministic=deterministic)
    return comm.ca_comm.autosymm


def batch_invariant() -> Optional[bool]:
    """True under vLLM's batch-invariant mode (``vllm.envs.VLLM_BATCH_INVARIANT``, which vLLM's
    own communicators read), else None (autosymm's own default)."""
    import vllm.envs as envs  # vLLM is optional: imported only when vLLM runs

    return True if envs.VLLM_BATCH_INVARIANT else None


def elastic_ep() -> bool:
    """True when the current vLLM config enables elastic EP (``--enable-elastic-ep``)."""
    from vllm.config import get_current_vllm_config_or_none  # vLLM is optional: imported only when vLLM runs

    config = get_current_vllm_config_or_none()
    return bool(config is not None and config.parallel_config.enable_elastic_ep)


def serve_first(adapter: Optional[AutosymmServing], x: torch.Tensor,
                chain: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """autosymm's out-of-place sum of ``x`` where a tuned row serves it, else ``chain(x)`` (vLLM's own)."""
    if adapter is not None and adapter.serves(x):
        return adapter.all_reduce(x)
    return chain(x)


def gather_first(adapter: Optional[AutosymmServing], x: torch.Tensor, dim: int,
                 chain: Callable[[torch.Tensor, int], torch.Tensor]) -> torch.Tensor:
    """autosymm's all-gather of ``x`` along dim 0 where it serves, else ``chain(x, dim)`` (vLLM's)."""
    if adapter is None:
        return chain(x, dim)
    return _dim0_first(adapter.serves_all_gather, adapter.all_gather, x, dim, chain)


def scatter_first(adapter: Optional[AutosymmServing], x: torch.Tensor, dim: int,
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
    # vLLM is optional: imported only when vLLM runs
    from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator

    class AutosymmCudaCommunicator(CudaCommunicator):
        """vLLM's CudaCommunicator with autosymm first in ``all_reduce`` (module docstring)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.autosymm = attach(self, deterministic=batch_invariant())
            if self.autosymm is not None:  # vLLM's own path: the default to beat (autosymm.backends.stack)
                state_of(self.autosymm.group).attach_stack(vllm_warmup.stack_path(self, self.autosymm))
            install_all2all(self)  # MoE: autosymm's subclass of vLLM's default all2all manager

        def destroy(self):
            if getattr(self, "autosymm", None) is not None:
                self.autosymm.stop()
                self.autosymm = None
            super().destroy()

        def all_reduce(self, input_):
            return serve_first(self.autosymm, input_, super().all_reduce)

        def all_gather(self, input_, dim=-1):
            return gather_first(self.autosymm, input_, dim, super().all_gather)

        def reduce_scatter(self, input_, dim=-1):
            return scatter_first(self.autosymm, input_, dim, super().reduce_scatter)

    AutosymmCudaCommunicator.__module__ = __name__
    AutosymmCudaCommunicator.__qualname__ = "AutosymmCudaCommunicator"  # pickled by reference: __getattr__
    return AutosymmCudaCommunicator


@functools.cache
def _platform_class():
    from vllm.platforms.cuda import CudaPlatform  # vLLM is optional: imported only when vLLM runs

    class AutosymmCudaPlatform(CudaPlatform):
        """vLLM's CUDA platform with :class:`AutosymmCudaCommunicator` as its device communicator."""

        @classmethod
        def get_device_communicator_cls(cls) -> str:
            # Elastic EP's StatelessGroupCoordinator asserts that this names CudaCommunicator
            # itself (vllm/distributed/stateless_coordinator.py:189-193): vLLM's own class there.
            return super().get_device_communicator_cls() if elastic_ep() else COMMUNICATOR_QUALNAME

        @classmethod
        def check_and_update_config(cls, vllm_config) -> None:
            """vLLM's, then autosymm's fusion pass ahead of vLLM's (vllm_fusion.install: not where
            vLLM turned its own all-reduce fusion off as an opt-out); vLLM calls this after its
            optimization-level defaults (config/vllm.py:1855, 2067)."""
            super().check_and_update_config(vllm_config)
            vllm_fusion.install(vllm_config)
            parallel = vllm_config.parallel_config
            if parallel.worker_cls == VLLM_WORKER:  # vLLM's own, as it chose it: its warm-up tunes autosymm's keys
                parallel.worker_cls = WORKER_QUALNAME

    AutosymmCudaPlatform.__module__ = __name__
    AutosymmCudaPlatform.__qualname__ = "AutosymmCudaPlatform"
    return AutosymmCudaPlatform


def __getattr__(name: str):
    """The classes vLLM resolves by qualified name, built (importing vLLM) on first access."""
    if name == "AutosymmCudaPlatform":
        return _platform_class()
    if name == "AutosymmCudaCommunicator":
        return _communicator_class()
    if name == "AutosymmWorker":
        return vllm_warmup.worker_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
