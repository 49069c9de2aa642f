"""autosymm.integrations.vllm_fusion on 2 gloo ranks, with stand-ins of vLLM 0.33.0's ops (vLLM
does not import on the CPU): ``vllm::all_reduce(Tensor tensor, str group_name) -> Tensor`` and
``vllm_ir::fused_add_rms_norm(Tensor x, Tensor x_residual, Tensor? weight, float epsilon, SymInt?
variance_size=None) -> (Tensor, Tensor)`` with the native formula of
``vllm/ir/ops/layernorm.py``. torch.compile (inductor) with the pass puts
``autosymm.vllm_all_reduce_rmsnorm`` into the compiled code with the unfused outputs; at run time
the group's adapter decides: vLLM's two calls where autosymm's decision is NCCL (gloo),
autosymm's fused op where it is not; what the pass must leave alone stays."""

from __future__ import annotations

import types

import torch
from _adapter_decisions import adapter_decisions
from _gloo import run_gloo
from _vllm_stand_ins import FUSED, check_fused_step, compiled, define_vllm_stand_ins, layer

HIDDEN = 32
def _body(rank, world_size):
    import torch.distributed as dist

    from autosymm.integrations import vllm_fusion, vllm_ops
    from autosymm.integrations.serving import AutosymmServing

    define_vllm_stand_ins()
    cpu_group = dist.new_group(list(range(world_size)), backend="gloo")
    adapter = AutosymmServing(group=cpu_group, device=torch.device("cpu"))  # what attach puts on the communicator
    coordinator = types.SimpleNamespace(device_communicator=types.SimpleNamespace(autosymm=adapter),
                                        all_reduce=lambda t: torch.ops.vllm.all_reduce(t, "tp:0"))
    vllm_ops.group_coordinator = lambda name: coordinator if name == "tp:0" else None

    gen = torch.Generator().manual_seed(7)
    x = torch.randn(5, 16, generator=gen) + rank  # each rank its own activations
    proj, residual, weight = (torch.randn(16, HIDDEN, generator=gen), torch.randn(5, HIDDEN, generator=gen),
                              torch.randn(HIDDEN, generator=gen))
    args = (x, proj, residual, weight)
    with torch.no_grad():
        ran = check_fused_step(args, rtol=1e-5, atol=1e-5)
        assert ran == ["vllm.all_reduce", "vllm_ir.fused_add_rms_norm"]  # gloo: NCCL decision, vLLM's own calls
        with adapter_decisions(backend="triton_fused_one_shot"):  # a tuned node: autosymm's decision is not NCCL
            assert check_fused_step(args, rtol=1e-5, atol=1e-5) == []  # autosymm's fused op: no vLLM op ran

        for variant in (layer(variance_size=8), layer(reuse_sum=True)):  # not the simple case: left alone
            fusion = vllm_fusion.VllmAllReduceRMSNormPass()
            got, code = compiled(variant, fusion, *args)
            assert FUSED not in code and fusion.rewrites == 0
            for g, w in zip(got, variant(*args)):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    return True


def test_the_pass_fuses_vllms_all_reduce_and_norm_on_two_gloo_ranks():
    assert run_gloo(_body, 2, deadline_s=300) == {0: True, 1: True}


def test_the_hook_vllm_resolves_is_a_top_level_attribute():
    """vLLM 0.33.0 resolves ``inductor_passes`` names by ``__import__(module).__dict__[name]``:
    the top-level package's own namespace."""
    import autosymm

    assert "vllm_fusion_pass" in __import__("autosymm").__dict__ and callable(autosymm.vllm_fusion_pass)


def test_the_installed_pass_survives_vllms_deepcopy_and_pickling():
    """VllmBackend deep-copies the inductor config (vLLM 0.33.0 compilation/backends.py:893) and
    vLLM pickles configs to its workers: the pass stays the process's one (its counts are the
    compiles'), and its uuid is the str vLLM's JSON config hash takes."""
    import copy
    import json
    import pickle

    from autosymm.integrations import vllm_fusion

    config = {vllm_fusion.PRE_PASS_KEY: vllm_fusion.PASS}
    assert copy.deepcopy(config)[vllm_fusion.PRE_PASS_KEY] is vllm_fusion.PASS
    assert pickle.loads(pickle.dumps(config))[vllm_fusion.PRE_PASS_KEY] is vllm_fusion.PASS
    assert json.loads(json.dumps({"pass": vllm_fusion.PASS.uuid()})) == {"pass": vllm_fusion.PASS.uuid()}
