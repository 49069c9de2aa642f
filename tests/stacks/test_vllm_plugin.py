"""autosymm's vLLM plugin against vLLM 0.33.0's own classes: the generated platform and communicator
classes (module-level names, pickled by reference), elastic EP's ``StatelessGroupCoordinator``
construction on 2 gloo ranks (its ``assert device_comm_cls == CudaCommunicator`` holds with the
plugin; without the fix it fails), and the real ``CudaCommunicator`` subclass on 2 gloo ranks:
no autosymm under ``--disable-custom-all-reduce``, the batch-invariant mode mapped to autosymm's
deterministic setting, ``destroy()`` stopping autosymm."""

from __future__ import annotations

import inspect
import pickle

import pytest
import stubs
import torch
from _adapter_decisions import adapter_decisions
from _gloo import run_gloo

stubs.require_real_sources()


def test_generated_classes_pickle_by_reference():
    from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator
    from vllm.platforms.cuda import CudaPlatform
    from vllm.utils.import_utils import resolve_obj_by_qualname

    from autosymm.integrations import vllm_plugin

    platform, communicator = vllm_plugin.AutosymmCudaPlatform, vllm_plugin.AutosymmCudaCommunicator
    assert issubclass(platform, CudaPlatform) and issubclass(communicator, CudaCommunicator)
    for cls, qualname in ((platform, vllm_plugin.PLATFORM_QUALNAME), (communicator, vllm_plugin.COMMUNICATOR_QUALNAME)):
        assert f"{cls.__module__}.{cls.__qualname__}" == qualname and "<locals>" not in cls.__qualname__
        assert pickle.loads(pickle.dumps(cls)) is cls
        assert resolve_obj_by_qualname(qualname) is cls  # how vLLM finds them
    assert type(pickle.loads(pickle.dumps(platform()))) is platform
    assert resolve_obj_by_qualname(platform.get_device_communicator_cls()) is communicator  # no config: autosymm's


def _elastic_config():
    """vLLM's config with ``--enable-elastic-ep`` (the field it sets), set after validation:
    ParallelConfig's EPLB checks, which elastic EP requires, refuse a CPU platform."""
    from vllm.config import VllmConfig

    config = VllmConfig()
    config.parallel_config.enable_elastic_ep = True
    return config


def _stateless_coordinator(rank, world_size, elastic):
    """vLLM's StatelessGroupCoordinator (elastic EP's DP/EP groups) built as vLLM builds it, with
    autosymm's platform current; CudaCommunicator's constructor records instead of opening NCCL."""
    import vllm.platforms
    from torch.distributed import TCPStore
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed.device_communicators import cuda_communicator
    from vllm.distributed.stateless_coordinator import StatelessGroupCoordinator
    from vllm.utils.import_utils import resolve_obj_by_qualname

    from autosymm.integrations import vllm_plugin
    from autosymm.tuning.workers import free_port

    built = []
    cuda_communicator.CudaCommunicator.__init__ = lambda self, **kwargs: built.append(type(self))
    vllm.platforms._current_platform = vllm_plugin.AutosymmCudaPlatform()
    import torch.distributed as dist

    port = [free_port() if rank == 0 else 0]
    dist.broadcast_object_list(port, src=0)
    store = TCPStore("127.0.0.1", port[0], world_size, is_master=rank == 0)
    with set_current_vllm_config(_elastic_config() if elastic else VllmConfig()):
        named = resolve_obj_by_qualname(vllm.platforms.current_platform.get_device_communicator_cls())
        assert vllm_plugin.elastic_ep() is elastic
        assert named is (cuda_communicator.CudaCommunicator if elastic else vllm_plugin.AutosymmCudaCommunicator)
        try:
            group = StatelessGroupCoordinator(group_ranks=[list(range(world_size))], local_rank=rank,
                                              torch_distributed_backend="gloo", use_device_communicator=True,
                                              coord_store=store, group_name="ep", global_rank=rank,
                                              global_world_size=world_size)
        except AssertionError:
            return "assertion"
    group.device_communicator = None  # the recording stand-in opened nothing
    group.destroy()
    return [cls.__name__ for cls in built]


def test_elastic_ep_construction_holds_vllms_assertion(tmp_path):
    env = {"all": {"AUTOSYMM_DB": str(tmp_path / "none.sqlite")}}
    assert run_gloo(_stateless_coordinator, 2, True, env=env, deadline_s=180) == {0: ["CudaCommunicator"],
                                                                                 1: ["CudaCommunicator"]}
    # without elastic EP the platform names autosymm's class, which that assertion refuses: the crash fixed above
    assert run_gloo(_stateless_coordinator, 2, False, env=env, deadline_s=180) == {0: "assertion", 1: "assertion"}


def _communicator(rank, world_size):
    import torch.distributed as dist
    from vllm.distributed import parallel_state
    from vllm.distributed.device_communicators.custom_all_reduce import CustomAllreduce

    from autosymm.api import state_of
    from autosymm.integrations import vllm_plugin
    from autosymm.integrations.custom_all_reduce import AutosymmCustomAllReduce
    from autosymm.integrations.serving import AutosymmServing

    cpu_group = dist.new_group(list(range(world_size)), backend="gloo")

    def build(name="tp:0"):
        return vllm_plugin.AutosymmCudaCommunicator(cpu_group=cpu_group, device=torch.device("cpu"),
                                                    device_group=cpu_group, unique_name=name)

    parallel_state.set_custom_all_reduce(False)  # --disable-custom-all-reduce
    off = build()
    assert off.ca_comm is None and off.autosymm is None
    parallel_state.set_custom_all_reduce(True)
    assert build("dp:0").autosymm is None  # not a TP group: vLLM builds no custom all-reduce there
    comm = build()
    serving = comm.autosymm
    assert isinstance(serving, AutosymmServing) and comm.ca_comm.autosymm is serving
    # vLLM's CustomAllreduce is disabled on a CPU (no custom all-reduce library): the standalone slot over it
    assert isinstance(comm.ca_comm, AutosymmCustomAllReduce) and isinstance(comm.ca_comm.fallback, CustomAllreduce)
    deterministic = state_of(serving.group).deterministic
    x = torch.full((256,), float(rank + 1))
    want = torch.full_like(x, float(sum(range(1, world_size + 1))))
    assert torch.equal(comm.all_reduce(x), want)  # gloo: autosymm's decision is NCCL, vLLM's chain sums
    with adapter_decisions():
        assert serving.serves(x) and torch.equal(comm.all_reduce(x), want)  # autosymm's sum
        comm.destroy()
        assert serving.stopped and comm.autosymm is None and comm.ca_comm is None
        assert not serving.serves(x) and torch.equal(comm.all_reduce(x), want)  # vLLM's chain, autosymm stopped
    return deterministic


@pytest.mark.parametrize("invariant", ["0", "1"])
def test_communicator_opt_outs_batch_invariance_and_destroy(tmp_path, invariant):
    env = {"all": {"AUTOSYMM_DB": str(tmp_path / "none.sqlite"), "VLLM_BATCH_INVARIANT": invariant,
                   "VLLM_DISABLE_PYNCCL": "1"}}
    assert run_gloo(_communicator, 2, env=env, deadline_s=180) == {0: invariant == "1", 1: invariant == "1"}


def test_vllms_custom_allreduce_in_place_keeps_its_own_methods():
    """The in-place slot class over vLLM's CustomAllreduce: its slot calls with vLLM's signatures,
    everything else (``all_reduce(inp, *, out=None, registered=False)``, ...) vLLM's own."""
    from vllm.distributed.device_communicators.custom_all_reduce import CustomAllreduce

    from autosymm.integrations.custom_all_reduce import slot_class

    cls = slot_class(CustomAllreduce)
    assert issubclass(cls, CustomAllreduce) and pickle.loads(pickle.dumps(cls)) is cls
    overridden = {"should_custom_ar", "custom_all_reduce", "should_custom_all_gather", "custom_all_gather",
                  "should_custom_reduce_scatter", "custom_reduce_scatter", "capture", "close"}
    assert overridden <= set(vars(cls))
    for name in overridden:
        assert inspect.signature(getattr(cls, name)) == inspect.signature(getattr(CustomAllreduce, name)), name
    for name in vars(CustomAllreduce):  # all_reduce, max_size's users, the MNNVL paths, ...: not redefined
        if name not in overridden and not name.startswith("__"):
            assert name not in vars(cls), name
