"""vLLM 0.33.0's real ``VllmConfig`` / ``CompilationConfig`` / ``PassConfig`` at their defaults with
the plugin's platform (``AutosymmCudaPlatform``) current: vLLM turns on ``fuse_allreduce_rms``
(config/vllm.py:179-203, 302, 323) and the platform's ``check_and_update_config`` (called by
``VllmConfig.__post_init__``, config/vllm.py:2067) puts autosymm's pass in inductor's post-grad
pre pass, which inductor runs before vLLM's ``PostGradPassManager`` (the post pass, where vLLM's
``AllReduceFusionPass`` runs; torch/_inductor/fx_passes/post_grad.py).

Only the device probes vLLM's own code asks are patched, each in a fresh process (vLLM's config
modules bind ``current_platform`` at import): ``CudaPlatform.get_device_capability`` -> 9.0 (sm90),
``CudaPlatform.device_count`` -> 2 (ParallelConfig's check that TP 2 fits the node) and
``vllm.utils.flashinfer.has_flashinfer`` -> True (FlashInfer is a dependency of vLLM's wheel).
"""

from __future__ import annotations

import pytest
import stubs
from _gloo import run_gloo

stubs.require_real_sources()


def _config(rank, world_size, tp, compile_mode, flashinfer):
    """vLLM's config at defaults but ``tp`` (and ``compile_mode`` where given) with autosymm's
    platform current on sm90; a summary of what vLLM and the plugin decided."""
    import vllm.platforms
    import vllm.utils.flashinfer
    from vllm.platforms.cuda import CudaPlatform
    from vllm.platforms.interface import DeviceCapability

    from autosymm.integrations import vllm_fusion, vllm_plugin

    CudaPlatform.get_device_capability = classmethod(lambda cls, device_id=0: DeviceCapability(9, 0))
    CudaPlatform.device_count = classmethod(lambda cls: 2)
    vllm.utils.flashinfer.has_flashinfer = lambda: flashinfer
    platform = vllm_plugin.AutosymmCudaPlatform()
    vllm.platforms._current_platform = platform
    from vllm.config import CompilationConfig, CompilationMode, ParallelConfig, VllmConfig
    from vllm.config.vllm import enable_allreduce_rms_fusion

    kwargs = {} if compile_mode is None else {"compilation_config": CompilationConfig(mode=CompilationMode[compile_mode])}
    config = VllmConfig(parallel_config=ParallelConfig(tensor_parallel_size=tp), **kwargs)
    compilation = config.compilation_config
    installed = compilation.inductor_compile_config.get(vllm_fusion.PRE_PASS_KEY)
    platform.check_and_update_config(config)  # vLLM calls it again on a config it has built: no second pass
    again = compilation.inductor_compile_config.get(vllm_fusion.PRE_PASS_KEY)
    assert platform.pass_key == "post_grad_custom_post_pass" != vllm_fusion.PRE_PASS_KEY  # vLLM's pass manager's hook
    hashed = compilation.compute_hash()  # what vLLM's compile and its worker's start-up plan key by (JSON)
    return dict(hash=hashed, mode=compilation.mode.name, level=int(config.optimization_level), decided=enable_allreduce_rms_fusion(config),
                fuse_allreduce_rms=compilation.pass_config.fuse_allreduce_rms, installed=installed is vllm_fusion.PASS,
                unchanged=again is installed, other_pre=installed not in (None, vllm_fusion.PASS))


def _run(tp=2, compile_mode=None, flashinfer=True, env=None) -> dict:
    (out,) = run_gloo(_config, 1, tp, compile_mode, flashinfer, env={"all": env or {}}, deadline_s=240).values()
    return out


def test_defaults_at_tp2_on_sm90_fuse_and_install_autosymms_pass_once():
    out = _run()
    assert isinstance(out["hash"], str) and out["hash"] == _run()["hash"]  # the same in another process
    assert out["mode"] == "VLLM_COMPILE" and out["level"] == 2  # vLLM's defaults
    assert out["decided"] and out["fuse_allreduce_rms"]  # vLLM's own AllReduceFusionPass is on
    assert out["installed"] and out["unchanged"] and not out["other_pre"]


def test_without_flashinfer_vllm_does_not_fuse_and_autosymms_pass_still_serves():
    out = _run(flashinfer=False)
    assert not out["decided"] and not out["fuse_allreduce_rms"]
    assert out["installed"] and out["unchanged"]


@pytest.mark.parametrize("tp,compile_mode", [(1, None), (2, "NONE")], ids=["tp1", "compilation-off"])
def test_no_pass_at_tp1_or_with_compilation_off(tp, compile_mode):
    out = _run(tp, compile_mode)
    assert not out["installed"] and not out["other_pre"] and out["unchanged"]
    if tp == 1:
        assert not out["decided"] and not out["fuse_allreduce_rms"]


def test_inductor_runs_the_pre_pass_before_vllms_post_pass():
    """The order autosymm's placement relies on: post_grad_passes applies the custom pre pass before
    the custom post pass (where vLLM's PostGradPassManager, and its AllReduceFusionPass, sit)."""
    import inspect

    from torch._inductor.fx_passes import post_grad

    source = inspect.getsource(post_grad.post_grad_passes)
    assert 0 < source.index("config.post_grad_custom_pre_pass") < source.index("config.post_grad_custom_post_pass")


def test_batch_invariance_keeps_vllms_fusion_off_and_autosymms_pass_out():
    """``VLLM_BATCH_INVARIANT=1``: vLLM turns its all-reduce + RMSNorm fusion off (config/vllm.py:184-186,
    the fused path is not batch-invariant); autosymm's pass stays out too (vllm_fusion.opted_out)."""
    out = _run(env={"VLLM_BATCH_INVARIANT": "1"})
    assert not out["decided"] and not out["fuse_allreduce_rms"]
    assert not out["installed"] and not out["other_pre"] and out["unchanged"]
