"""All-reduce backends on real GPUs, checked against NCCL (one process per local GPU).

Every supported backend, a spread of each one's configs, bf16/fp16/fp32, sizes with tails,
zero-copy inputs (Workspace.empty), back-to-back calls of different configs with no host
synchronisation, and CUDA-graph capture replayed with new data. Multicast stays off here
(tests/gpu/_dist.SAFE_ENV), so triton_multimem reports itself unsupported and is skipped.
"""

from __future__ import annotations

import pytest
import torch

from ._dist import requires_cuda, run_on_gpus

pytestmark = [requires_cuda, pytest.mark.gpu]

SIZES = [1, 7, 1000, 4099, 8192, 65539, 1 << 20]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 3e-3, torch.float32: 1e-5}


def _setup(rank, world_size):
    import torch.distributed as dist

    from autosymm.backends.base import Capabilities, RunContext
    from autosymm.backends.nccl_all_reduce import BACKENDS as NCCL
    from autosymm.backends.torch_symm import BACKENDS as TORCH, ops_available
    from autosymm.backends.triton_all_reduce import BACKENDS as TRITON
    from autosymm.workspace.symm import get_workspace

    device = torch.device("cuda", rank)
    ws = get_workspace(dist.group.WORLD, device, all_reduce_bytes=8 << 20, moe_bytes=1 << 20)
    caps = Capabilities(world_size=world_size, all_reduce_bytes=ws.capacity("all_reduce"),
                        moe_bytes=ws.capacity("moe"), has_multicast=ws.has_multicast, intra_node=True,
                        torch_symm_ops=ops_available(), compute_capability=torch.cuda.get_device_capability(device))
    return ws, caps, RunContext(group=dist.group.WORLD, workspace=ws), TRITON + TORCH + NCCL


def _spread(space, count=3):
    """First, middle and last configs of a space (the extremes of block, warps and grid)."""
    if len(space) <= count:
        return list(space)
    return [space[round(i * (len(space) - 1) / (count - 1))] for i in range(count)]


def _check(out, ref, dtype):
    import torch.distributed as dist

    tol = TOLERANCE[dtype] * dist.get_world_size()
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    gathered = [torch.empty_like(out) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, out)
    assert all(torch.equal(g, out) for g in gathered), "ranks disagree on the sum"


def _random(numel, dtype, rank, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed * 1000 + rank)
    return torch.randn(numel, generator=gen, device="cuda", dtype=torch.float32).to(dtype)


def _reference(x):
    import torch.distributed as dist

    ref = x.clone()
    dist.all_reduce(ref)
    return ref


def _all_backends_body(rank, world_size):
    from autosymm.problem import DTYPE_NAMES, Problem

    ws, caps, ctx, backends = _setup(rank, world_size)
    for dtype in DTYPES:
        for numel in SIZES:
            problem = Problem.all_reduce(numel * dtype.itemsize, DTYPE_NAMES[dtype], world_size)
            for backend in backends:
                if backend.why_not(problem, caps):
                    continue
                for config in _spread(backend.search_space(problem)):
                    launcher = backend.prepare(problem, config, ctx)
                    for zero_copy in (False, True) if backend.name.startswith("triton") else (False,):
                        x = ws.empty((numel,), dtype) if zero_copy else torch.empty(numel, dtype=dtype, device="cuda")
                        x.copy_(_random(numel, dtype, rank, seed=numel))
                        ref = _reference(x)
                        assert launcher(x) is x
                        try:
                            _check(x, ref, dtype)
                        except AssertionError as err:
                            raise AssertionError(f"{backend.name} {config} {problem.describe()} "
                                                 f"zero_copy={zero_copy}: {err}") from None
                        ws.reset_empty()


def _back_to_back_body(rank, world_size):
    """Different backends, configs and sizes launched one after another with no host sync."""
    from autosymm.problem import Problem

    ws, caps, ctx, backends = _setup(rank, world_size)
    calls = []
    for numel in (4099, 1 << 20, 8192, 65539):
        problem = Problem.all_reduce(numel * 2, "bf16", world_size)
        for backend in backends:
            if not backend.why_not(problem, caps):
                for config in _spread(backend.search_space(problem), 2):
                    calls.append((backend.prepare(problem, config, ctx), numel))
    inputs = [_random(numel, torch.bfloat16, rank, seed=i) for i, (_, numel) in enumerate(calls)]
    refs = [_reference(x) for x in inputs]
    torch.cuda.synchronize()
    for (launcher, _), x in zip(calls, inputs):
        launcher(x)
    for x, ref in zip(inputs, refs):
        _check(x, ref, torch.bfloat16)


def _graph_body(rank, world_size):
    import torch.distributed as dist

    from autosymm.problem import Problem
    from autosymm.geometry import SIGNAL_BYTES

    ws, caps, ctx, backends = _setup(rank, world_size)
    numel, dtype = 8192 + 5, torch.bfloat16
    problem = Problem.all_reduce(numel * 2, "bf16", world_size)
    for backend in backends:
        if backend.why_not(problem, caps):
            continue
        config = backend.search_space(problem)[0]
        launcher = backend.prepare(problem, config, ctx)
        for zero_copy in (False, True) if backend.name.startswith("triton") else (False,):
            x = ws.empty((numel,), dtype) if zero_copy else torch.empty(numel, dtype=dtype, device="cuda")
            x.copy_(_random(numel, dtype, rank, seed=1))
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                launcher(x)  # warm-up: compile and bind outside the capture
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                launcher(x)
            for trial in range(2):  # replay twice, with new data each time
                x.copy_(_random(numel, dtype, rank, seed=10 + trial))
                ref = _reference(x)
                graph.replay()
                _check(x, ref, dtype)
            torch.cuda.synchronize()
            dist.barrier()
            pads = ws.buffer[:SIGNAL_BYTES]
            assert int(pads.count_nonzero()) == 0, f"{backend.name}: signal pads not back to zero"
            ws.reset_empty()


def test_all_backends_match_nccl():
    run_on_gpus(_all_backends_body)


def test_back_to_back_calls_without_sync():
    run_on_gpus(_back_to_back_body)


def test_cuda_graph_capture_and_replay():
    run_on_gpus(_graph_body)
