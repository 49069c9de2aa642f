"""autosymm's MoE all-to-all manager against the real vLLM 0.33.0 sources: vLLM's config cannot
name a new backend (so autosymm serves under its default), the manager is a subclass of vLLM's
own AgRsAll2AllManager resolved and pickled by its module-level qualname, and it overrides only
the calls it serves, with vLLM's signatures; every other method vLLM calls is vLLM's."""

from __future__ import annotations

import inspect
import pickle

import pytest
import stubs

stubs.require_real_sources()

from vllm.config import ParallelConfig  # noqa: E402
from vllm.distributed.device_communicators.all2all import AgRsAll2AllManager  # noqa: E402
from vllm.distributed.device_communicators.base_device_communicator import All2AllManagerBase  # noqa: E402
from vllm.utils.import_utils import resolve_obj_by_qualname  # noqa: E402

from autosymm.integrations import vllm_all2all  # noqa: E402

#: what vLLM calls on a manager (base_device_communicator.py:34-189; callers cited in the module)
CALLED = ("dispatch", "dispatch_router_logits", "combine", "allocate_combine_input", "combine_into_output",
          "max_sms_used", "set_num_sms", "checkpoint_prepare", "checkpoint_restore", "mask_remote_ranks",
          "stage_ep_size", "commit_ep_size", "destroy")


def test_vllms_config_rejects_a_new_backend_name_and_defaults_to_agrs():
    with pytest.raises(Exception, match="all2all_backend"):
        ParallelConfig(all2all_backend="autosymm")
    assert ParallelConfig().all2all_backend == "allgather_reducescatter"
    assert ParallelConfig(all2all_backend="naive").all2all_backend == "allgather_reducescatter"


def test_the_manager_is_vllms_agrs_subclass_by_module_level_qualname():
    cls = resolve_obj_by_qualname(vllm_all2all.MANAGER_QUALNAME)
    assert cls is vllm_all2all.AutosymmAgRsAll2AllManager
    assert issubclass(cls, AgRsAll2AllManager) and issubclass(cls, All2AllManagerBase)
    assert cls.__qualname__ == "AutosymmAgRsAll2AllManager" and pickle.loads(pickle.dumps(cls)) is cls


def test_every_called_method_keeps_vllms_signature():
    cls = vllm_all2all.AutosymmAgRsAll2AllManager
    for name in CALLED:
        ours, base = getattr(cls, name), getattr(All2AllManagerBase, name)
        assert list(inspect.signature(ours).parameters) == list(inspect.signature(base).parameters), name
    overridden = {name for name in CALLED if getattr(cls, name) is not getattr(AgRsAll2AllManager, name)}
    assert overridden == {"dispatch", "dispatch_router_logits", "combine", "combine_into_output", "destroy"}


def test_layout_from_vllms_moe_configs():
    """moe_layout reads vLLM's own FusedMoEConfig / FusedMoEParallelConfig of the registered layers
    (stand-in: the runner holding them, whose construction needs CUDA kernels)."""
    from types import SimpleNamespace

    from vllm.config import CompilationConfig
    from vllm.model_executor.layers.fused_moe.config import FusedMoEParallelConfig

    def runner(n_experts, use_ep=True, ep_size=2):
        parallel = FusedMoEParallelConfig(tp_size=1, pcp_size=1, dp_size=2, ep_size=ep_size, tp_rank=0, pcp_rank=0,
                                          dp_rank=0, ep_rank=0, sp_size=1, use_ep=use_ep,
                                          all2all_backend="allgather_reducescatter", enable_eplb=False)
        return SimpleNamespace(moe_config=SimpleNamespace(num_experts=n_experts, moe_parallel_config=parallel))

    def config(*runners):
        compilation = CompilationConfig()
        for i, layer in enumerate(runners):
            compilation.static_forward_context[f"layers.{i}.mlp"] = layer
            compilation.static_all_moe_layers.append(f"layers.{i}.mlp")
        return SimpleNamespace(compilation_config=compilation)

    assert vllm_all2all.moe_layout(config(runner(8), runner(8)), 2) == (8, "")
    assert vllm_all2all.moe_layout(config(), 2)[0] is None
    assert "differ" in vllm_all2all.moe_layout(config(runner(8), runner(6)), 2)[1]
    assert "not expert-parallel" in vllm_all2all.moe_layout(config(runner(8, use_ep=False)), 2)[1]
    assert "not expert-parallel" in vllm_all2all.moe_layout(config(runner(8, ep_size=4)), 2)[1]


def test_dispatch_stays_vllms_where_autosymm_cannot_serve():
    """why_not_dispatch's reasons, each decided from what every rank shares (stand-ins: the
    manager's state and vLLM's GroupCoordinator, which need a process group)."""
    from types import SimpleNamespace

    import torch

    def manager(reason="", ranks=(0, 1), layout=(8, "")):
        served = vllm_all2all.Served(None, list(ranks), reason)
        served.layout = layout
        return SimpleNamespace(autosymm=served, vllm_config=None)

    dp = SimpleNamespace(ranks=[0, 1], unique_name="dp:0")
    x, ids = torch.zeros(4, 16), torch.zeros(4, 2, dtype=torch.int32)
    assert vllm_all2all.why_not_dispatch(manager("the group spans nodes"), dp, x, ids, [4, 4])[0] == \
        "the group spans nodes"
    assert "not the EP group's ranks" in vllm_all2all.why_not_dispatch(manager(ranks=(1, 0)), dp, x, ids, [4, 4])[0]
    assert vllm_all2all.why_not_dispatch(manager(layout=(None, "no MoE layer registered")), dp, x, ids,
                                         [4, 4])[0] == "no MoE layer registered"
    odd = torch.zeros(4, 15, dtype=torch.uint8)  # 1-byte rows of odd length: not moved as 2-byte words
    assert "rows autosymm moves" in vllm_all2all.why_not_dispatch(manager(), dp, odd, ids, [4, 4])[0]


def _gate(rank, world_size):
    """why_not_dispatch on a gloo group: untuned (no database) and with a tuned row stubbed."""
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist
    from _adapter_decisions import adapter_decisions

    group = dist.new_group(list(range(world_size)), backend="gloo")
    served = vllm_all2all.Served(group, list(range(world_size)))
    served.layout = (8, "")
    manager = SimpleNamespace(autosymm=served, vllm_config=None)
    dp = SimpleNamespace(ranks=list(range(world_size)), unique_name="dp:0")
    x, ids = torch.randn(4, 16), torch.zeros(4, 2, dtype=torch.int32)
    why, rows = vllm_all2all.why_not_dispatch(manager, dp, x, ids, [4, 4])
    with adapter_decisions(backend="triton_moe"):
        served.tuned.clear()
        why_tuned, rows_tuned = vllm_all2all.why_not_dispatch(manager, dp, x, ids, [4, 4])
    return why, rows is None, why_tuned, type(rows_tuned).__name__


def test_untuned_dispatch_is_vllms_own_and_a_tuned_row_is_autosymms(tmp_path):
    """No row decides (gloo, no database): vLLM's AgRsAll2AllManager collectives serve, not
    autosymm's untuned Triton conversion; a tuned row for both conversions: autosymm's."""
    from _gloo import run_gloo

    env = {"all": {"AUTOSYMM_DB": str(tmp_path / "none.sqlite")}}
    out = run_gloo(_gate, 2, env=env, deadline_s=180)
    want = ("no tuned row decides this call for autosymm's conversion: vLLM's own collectives", True, "",
            "GatheredRows")
    assert out == {0: want, 1: want}
