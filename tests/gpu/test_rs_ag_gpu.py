"""Reduce-scatter and all-gather on real GPUs, checked against NCCL (one process per local GPU).

Every backend of both ops (the Triton pull/push families and the NCCL fallbacks), a spread of each
one's configs, bf16/fp16/fp32 (int32 for the all-gather), element counts with tails, per-rank
counts, zero-copy tensors (Workspace.empty), CUDA-graph capture replayed with new data; the public
entries (autosymm.reduce_scatter_tensor / all_gather_into_tensor / reduce_scatterv / all_gatherv)
as users call them, and the Triton reduce-scatter then all-gather equal to the all-reduce's bits.
"""

from __future__ import annotations

import pytest
import torch

from ._dist import requires_cuda, run_on_gpus

pytestmark = [requires_cuda, pytest.mark.gpu]

SHARD_SIZES = [1, 7, 1000, 4099, 65539]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _setup(rank, world_size):
    import torch.distributed as dist

    from autosymm.backends.base import Capabilities, RunContext
    from autosymm.backends.nccl_ordered import nccl_ordered_reduce_scatter
    from autosymm.backends.nccl_rs_ag import BACKENDS as NCCL
    from autosymm.backends.triton_rs_ag import BACKENDS as TRITON
    from autosymm.workspace.symm import get_workspace

    device = torch.device("cuda", rank)
    ws = get_workspace(dist.group.WORLD, device, all_reduce_bytes=16 << 20, moe_bytes=1 << 20)
    caps = Capabilities(world_size=world_size, all_reduce_bytes=ws.capacity("all_reduce"),
                        moe_bytes=ws.capacity("moe"), intra_node=True,
                        compute_capability=torch.cuda.get_device_capability(device))
    return ws, caps, RunContext(group=dist.group.WORLD, workspace=ws), TRITON + NCCL + (nccl_ordered_reduce_scatter,)


def _spread(space, count=3):
    if len(space) <= count:
        return list(space)
    return [space[round(i * (len(space) - 1) / (count - 1))] for i in range(count)]


def _random(numel, dtype, rank, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed * 1000 + rank)
    if not dtype.is_floating_point:
        return torch.randint(-1000, 1000, (numel,), generator=gen, device="cuda", dtype=dtype)
    return torch.randint(-8, 9, (numel,), generator=gen, device="cuda").to(dtype).mul_(0.25)  # exact sums


def _reference(op, output, input, counts):
    from autosymm.backends.nccl_rs_ag import all_gather_launcher, reduce_scatter_launcher
    import torch.distributed as dist

    ref = torch.empty_like(output)
    if op == "reduce_scatter":
        return reduce_scatter_launcher(dist.group.WORLD, dist.ReduceOp.SUM)(ref, input, counts)
    return all_gather_launcher(dist.group.WORLD)(ref, input, counts)


def _tensors(op, ws, shard, full, dtype, zero_copy):
    """(output, input): the zero-copy one in the workspace where its kernels use it in place."""
    full_t = ws.empty((full,), dtype) if zero_copy else torch.empty(full, dtype=dtype, device="cuda")
    shard_t = torch.empty(shard, dtype=dtype, device="cuda")
    return (shard_t, full_t) if op == "reduce_scatter" else (full_t, shard_t)


def _all_backends_body(rank, world_size):
    from autosymm.problem import DTYPE_NAMES, Problem

    ws, caps, ctx, backends = _setup(rank, world_size)
    for op in ("reduce_scatter", "all_gather"):
        for dtype in DTYPES + ([torch.int32] if op == "all_gather" else []):
            for shard in SHARD_SIZES:
                even = [shard] * world_size
                ragged = [shard + (r % 3) for r in range(world_size)]
                for counts in (None, ragged):
                    full = sum(counts or even)
                    problem = Problem(op, DTYPE_NAMES.get(dtype, "bf16"), world_size, nbytes=full * dtype.itemsize)
                    for backend in backends:
                        if backend.why_not(problem, caps):
                            continue
                        for config in _spread(backend.search_space(problem)):
                            launcher = backend.prepare(problem, config, ctx)
                            for zero_copy in (False, True) if backend.name.startswith("triton") else (False,):
                                mine = (counts or even)[rank]
                                output, input = _tensors(op, ws, mine, full, dtype, zero_copy)
                                input.copy_(_random(input.numel(), dtype, rank, seed=full))
                                ref = _reference(op, output, input, counts)
                                assert launcher(output, input, counts) is output
                                assert torch.equal(output, ref), (f"{backend.name} {config} {problem.describe()} "
                                                                  f"counts={counts} zero_copy={zero_copy}")
                                ws.reset_empty()


def _graph_body(rank, world_size):
    from autosymm.problem import Problem

    ws, caps, ctx, backends = _setup(rank, world_size)
    shard, dtype = 4099, torch.bfloat16
    for op in ("reduce_scatter", "all_gather"):
        problem = Problem(op, "bf16", world_size, nbytes=shard * world_size * 2)
        for backend in backends:
            if backend.why_not(problem, caps, "graph"):
                continue
            launcher = backend.prepare(problem, backend.search_space(problem)[0], ctx)
            output, input = _tensors(op, ws, shard, shard * world_size, dtype, False)
            input.copy_(_random(input.numel(), dtype, rank, seed=1))
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                launcher(output, input)  # warm-up: compile and bind outside the capture
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                launcher(output, input)
            for trial in range(2):
                input.copy_(_random(input.numel(), dtype, rank, seed=10 + trial))
                ref = _reference(op, output, input, None)
                graph.replay()
                assert torch.equal(output, ref), f"{backend.name} graph replay {trial}"
            torch.cuda.synchronize()


def _api_body(rank, world_size):
    import torch.distributed as dist

    import autosymm
    from autosymm.backends import RunContext, get_backend
    from autosymm.backends.triton_all_reduce import triton_one_shot
    from autosymm.problem import Problem

    for dtype in DTYPES:
        x = _random(world_size * 1001 * 3, dtype, rank, seed=5).view(world_size * 1001, 3)
        out, want = torch.empty(1001, 3, dtype=dtype, device="cuda"), torch.empty(1001, 3, dtype=dtype, device="cuda")
        autosymm.reduce_scatter_tensor(out, x)
        dist.reduce_scatter_tensor(want, x)
        assert torch.equal(out, want)
        full = torch.empty(world_size * 1001, 3, dtype=dtype, device="cuda")
        autosymm.all_gather_into_tensor(full, out)
        gathered = torch.empty_like(full)
        dist.all_gather_into_tensor(gathered, want)
        assert torch.equal(full, gathered)
    sizes = [3 + r for r in range(world_size)]
    x = _random(sum(sizes) * 4, torch.bfloat16, rank, seed=6).view(sum(sizes), 4)
    shard = torch.empty(sizes[rank], 4, dtype=torch.bfloat16, device="cuda")
    autosymm.reduce_scatterv(shard, x, sizes)
    back = torch.empty_like(x)
    autosymm.all_gatherv(back, shard, sizes)
    summed = x.clone()
    dist.all_reduce(summed)
    assert torch.equal(back, summed)
    # the Triton reduce-scatter then the Triton all-gather: the Triton all-reduce's bits
    state = autosymm.api.state_of(None)
    if state.workspace is None:  # a one-rank group makes no workspace: the emulated-rank tests run these kernels
        assert world_size == 1
        return
    numel = world_size * 4096
    x = torch.randn(numel, device="cuda").bfloat16()
    ctx = RunContext(group=dist.group.WORLD, workspace=state.workspace)
    problems = {op: Problem(op, "bf16", world_size, nbytes=numel * 2) for op in ("reduce_scatter", "all_gather")}
    rs, ag = (get_backend(name) for name in ("triton_reduce_scatter_pull", "triton_all_gather_push"))
    shard = rs.prepare(problems["reduce_scatter"], rs.search_space(problems["reduce_scatter"])[0], ctx)(
        torch.empty(numel // world_size, dtype=torch.bfloat16, device="cuda"), x)
    full = ag.prepare(problems["all_gather"], ag.search_space(problems["all_gather"])[0], ctx)(
        torch.empty(numel, dtype=torch.bfloat16, device="cuda"), shard)
    problem = Problem.all_reduce(numel * 2, "bf16", world_size)
    summed = triton_one_shot.prepare(problem, triton_one_shot.search_space(problem)[0], ctx)(x.clone())
    assert torch.equal(full, summed)


def test_every_backend_of_both_ops_matches_nccl():
    run_on_gpus(_all_backends_body)


def test_cuda_graph_capture_and_replay():
    run_on_gpus(_graph_body)


def test_the_public_entries_and_the_all_reduce_bits():
    run_on_gpus(_api_body)
