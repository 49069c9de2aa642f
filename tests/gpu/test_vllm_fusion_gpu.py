"""The vLLM fusion pass (autosymm.integrations.vllm_fusion) on real GPUs (every local GPU, one
process each), with stand-ins of vLLM's two ops (tests/_vllm_stand_ins): inductor's CUDA code
calls ``autosymm.vllm_all_reduce_rmsnorm``, whose outputs match the unfused step eagerly and in
replays of a CUDA graph of the compiled step with new data; the group's adapter decides which
path runs (autosymm's fused op where its decision is not NCCL: at one rank, ``noop``)."""

from __future__ import annotations

import types

import pytest
import torch

from ._dist import requires_cuda, run_on_gpus

pytestmark = [requires_cuda, pytest.mark.gpu]


def _body(rank, world_size):
    import torch.distributed as dist

    from _vllm_stand_ins import check_fused_step, compile_options, define_vllm_stand_ins, layer
    from autosymm.integrations import vllm_fusion
    from autosymm.integrations.serving import AutosymmServing

    define_vllm_stand_ins()
    device = torch.device("cuda", rank)
    adapter = AutosymmServing(group=dist.new_group(backend="gloo"), device=device,
                              device_group=dist.group.WORLD)  # what attach puts on the communicator
    coordinator = types.SimpleNamespace(device_communicator=types.SimpleNamespace(autosymm=adapter),
                                        all_reduce=lambda t: torch.ops.vllm.all_reduce(t, "tp:0"))
    vllm_fusion.group_coordinator = lambda name: coordinator
    gen = torch.Generator(device=device).manual_seed(3 + rank)
    tokens, hidden = 7, 4096
    args = [torch.randn(tokens, 512, generator=gen, device=device, dtype=torch.bfloat16),
            torch.randn(512, hidden, generator=gen, device=device, dtype=torch.bfloat16) / 16,
            torch.randn(tokens, hidden, generator=gen, device=device, dtype=torch.bfloat16),
            torch.randn(hidden, generator=gen, device=device, dtype=torch.bfloat16)]
    with torch.no_grad():
        ran = check_fused_step(args, rtol=2e-2, atol=2e-2)
        served = adapter.serves_fused(args[0] @ args[1])
        assert (ran == []) == served, ran  # autosymm's op, or vLLM's two calls
        fusion = vllm_fusion.VllmAllReduceRMSNormPass()
        step = torch.compile(layer(), dynamic=False, options=compile_options(fusion))
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step(*args)  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with adapter.capture(), torch.cuda.graph(graph):
            outs = step(*args)
        for trial in range(2):
            args[0].copy_(torch.randn(tokens, 512, generator=gen, device=device, dtype=torch.bfloat16))
            graph.replay()
            torch.cuda.synchronize()
            for g, w in zip(outs, layer()(*args)):
                torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2, msg=f"replay {trial}")


def test_the_fused_call_compiles_runs_and_replays_on_gpus():
    run_on_gpus(_body)
