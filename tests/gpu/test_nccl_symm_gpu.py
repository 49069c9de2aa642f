"""Backend nccl_symm on real GPUs: the workspace registered as a symmetric NCCL window of torch's
communicator, NCCL's all-reduce on staged tensors, on ``Workspace.empty`` tensors (zero-copy)
and inside a CUDA graph replayed with new data; every result equals plain NCCL's sum of the
same data (within a bf16 rounding of each: the symmetric kernels may add in another order) and
is bit-identical on every rank. On one rank the window is registered and the sum is x itself
(the backend's eligibility says "one rank" there: a dispatcher never picks it)."""

from __future__ import annotations

import pytest
import torch

from ._dist import requires_cuda, run_on_gpus

pytestmark = [requires_cuda, pytest.mark.gpu]


def _check(launcher, x, world_size, seed):
    import torch.distributed as dist

    gen = torch.Generator(device="cuda").manual_seed(seed + dist.get_rank())
    x.copy_(torch.randn(x.shape, generator=gen, device="cuda").to(x.dtype))
    want = x.clone()
    dist.all_reduce(want)
    launcher(x)
    torch.testing.assert_close(x.float(), want.float(), rtol=1e-2 * world_size, atol=1e-2 * world_size)
    gathered = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(gathered, x)
    assert all(torch.equal(g, x) for g in gathered), "ranks disagree on the sum"


def _body(rank, world_size):
    import torch.distributed as dist

    from autosymm.backends.base import Capabilities, RunContext
    from autosymm.backends.nccl_symm import nccl_symm, nccl_version, registered
    from autosymm.problem import Problem
    from autosymm.workspace.symm import get_workspace

    group, device = dist.group.WORLD, torch.device("cuda", rank)
    ws = get_workspace(group, device, all_reduce_bytes=32 << 20, moe_bytes=1 << 20)
    caps = Capabilities.of(world_size, workspace=ws, compute_capability=torch.cuda.get_device_capability())
    problem = Problem.all_reduce(1 << 20, "bf16", world_size)
    reason = nccl_symm.why_not(problem, caps)
    assert (reason is None) == (world_size > 1), f"NCCL {nccl_version()}: {reason}"
    launcher = nccl_symm.prepare(problem, None, RunContext(group=group, workspace=ws))
    assert registered(group, ws.buffer)
    assert nccl_symm.prepare(problem, None, RunContext(group=group, workspace=ws)) is not None  # registered once
    for seed, numel in enumerate((4099, 1 << 19, 3 << 20)):  # a tail, 1 MiB, 6 MiB (bf16)
        _check(launcher, torch.empty(numel, dtype=torch.bfloat16, device=device), world_size, seed)
    zero_copy = ws.empty((1 << 16,), torch.float32)
    for seed in range(3):
        _check(launcher, zero_copy, world_size, 10 + seed)
    static = torch.zeros(12345, dtype=torch.bfloat16, device=device)
    launcher(static)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launcher(static)
    for seed in range(3):
        _check(lambda t: (static.copy_(t), graph.replay(), t.copy_(static)),
               torch.empty_like(static), world_size, 20 + seed)
    ws.reset_empty()


def test_nccl_symmetric_window_all_reduce():
    run_on_gpus(_body)
