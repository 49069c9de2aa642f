"""autosymm.integrations on real GPUs (every local GPU, one process each): the custom-all-reduce
adapter eagerly and inside a CUDA-graph capture through ``capture()``, the MoE manager eagerly
and captured, all bit-equal to NCCL / to a reference on the gathered data.

Data are small integers (and weights multiples of 1/8), so every sum is exact in any order and
bit-equality holds at any world size.
"""

from __future__ import annotations

import pytest
import torch

from ._dist import requires_cuda, run_on_gpus

pytestmark = [requires_cuda, pytest.mark.gpu]

SIZES = (1024, 4096 + 8, 1 << 16, 1 << 20, 3 * (1 << 20) + 64)  # elements


def _ints(shape, seed: int, dtype, device, low: int = -4, high: int = 5) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, shape, generator=gen).to(dtype).to(device)


def _nccl_sum(x: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    want = x.clone()
    dist.all_reduce(want)
    return want


def _same_on_every_rank(value) -> None:
    import torch.distributed as dist

    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    assert all(v == values[0] for v in values), f"ranks disagree: {values}"


def _custom_all_reduce_body(rank, world_size):
    from autosymm.integrations import AutosymmCustomAllReduce

    device = torch.device("cuda", rank)
    car = AutosymmCustomAllReduce(device=device)
    gates = {}
    for numel in SIZES:
        for dtype in (torch.bfloat16, torch.float32):
            x = _ints((numel,), numel + rank, dtype, device)
            before, want = x.clone(), _nccl_sum(x)
            assert torch.equal(car.autosymm.all_reduce(x), want) and torch.equal(x, before), (numel, dtype)
            out = car.custom_all_reduce(x)
            gates[(numel, str(dtype))] = out is not None
            assert out is None or torch.equal(out, want), (numel, dtype)
            assert torch.equal(x, before)
    _same_on_every_rank(gates)
    _captured_custom_all_reduce(rank, car, device)
    car.close()
    assert car.custom_all_reduce(torch.ones(1024, device=device)) is None


def _captured_custom_all_reduce(rank, car, device):
    """vLLM's pattern: inside capture(), warm-up runs on a side stream, then the capture; the
    graph replays with new data and matches NCCL bit for bit."""
    static = _ints((1 << 16,), 1000 + rank, torch.bfloat16, device)

    def call():
        out = car.custom_all_reduce(static)
        return (out, True) if out is not None else (car.autosymm.all_reduce(static), False)

    with car.capture():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                call()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, gated = call()
    _same_on_every_rank(gated)
    for seed in (2000, 3000):
        static.copy_(_ints(static.shape, seed + rank, torch.bfloat16, device))
        want = _nccl_sum(static)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want), f"replay with seed {seed} (adapter gated {gated})"


@requires_cuda
def test_custom_all_reduce_adapter_eager_and_captured():
    run_on_gpus(_custom_all_reduce_body)


# ------------------------------------------------------------------------------------------
# MoE manager
# ------------------------------------------------------------------------------------------

N_EXPERTS, TOP_K, D_MODEL, N_TOKENS_LOCAL = 256, 8, 7168, 16


def _moe_inputs(world_size, seed, device):
    """Every rank's tokens, ids (10 % dropped) and weights (multiples of 1/8), from one seed."""
    gen = torch.Generator().manual_seed(seed)
    n_global = world_size * N_TOKENS_LOCAL
    x = torch.randint(-4, 5, (n_global, D_MODEL), generator=gen).to(torch.bfloat16)
    ids = torch.rand(n_global, N_EXPERTS, generator=gen).topk(TOP_K, dim=1).indices
    ids[torch.rand(ids.shape, generator=gen) < 0.1] = -1
    weights = torch.randint(1, 9, (n_global, TOP_K), generator=gen) / 8.0
    return x.to(device), ids.to(torch.int32).to(device), weights.to(device)


def _expert(rows, local_ids, owned_global):
    """Expert e multiplies by (e % 4) + 1; rows of other ranks' experts become 0."""
    scale = (owned_global[local_ids.clamp(min=0).long()] % 4 + 1).to(rows.dtype)
    return torch.where((local_ids >= 0)[:, None], rows * scale[:, None], 0)


def _want(rank, x, ids, weights):
    """The combined tokens of ``rank``, computed with torch on the gathered data."""
    sl = slice(rank * N_TOKENS_LOCAL, (rank + 1) * N_TOKENS_LOCAL)
    valid = ids[sl] >= 0
    factor = torch.where(valid, weights[sl] * (ids[sl].clamp(min=0) % 4 + 1), 0.0)
    return (x[sl].float()[:, None, :] * factor[..., None]).sum(1).to(x.dtype)


def _moe_body(rank, world_size):
    from autosymm.integrations import AutosymmAll2AllManager

    device = torch.device("cuda", rank)
    manager = AutosymmAll2AllManager(N_EXPERTS)
    owned_global = torch.tensor(manager.local_experts, device=device)
    sl = slice(rank * N_TOKENS_LOCAL, (rank + 1) * N_TOKENS_LOCAL)
    x, ids, weights = _moe_inputs(world_size, 1, device)
    out = manager.dispatch(x[sl], ids[sl], weights[sl])
    mine = out.local_expert_ids >= 0
    flat = ids.reshape(-1).long()
    order = torch.argsort(torch.where(flat >= 0, flat, N_EXPERTS), stable=True)  # pairs by expert id
    owned_pairs = order[torch.isin(flat[order], owned_global)]
    assert torch.equal(out.hidden_states[mine], x[owned_pairs // TOP_K])
    combined = manager.combine(_expert(out.hidden_states, out.local_expert_ids, owned_global), out.handle)
    assert torch.equal(combined, _want(rank, x, ids, weights))

    # Captured: dispatch -> experts -> combine in one CUDA graph, replayed with new routing.
    static_x, static_ids, static_w = x[sl].clone(), ids[sl].clone(), weights[sl].clone()
    graph = torch.cuda.CUDAGraph()
    if world_size == 1:  # no workspace on one rank: only the eager NCCL path serves, and says so
        with pytest.raises(RuntimeError, match="cannot be captured in a CUDA graph: only nccl_all_to_all"):
            with torch.cuda.graph(graph):
                manager.dispatch(static_x, static_ids, static_w)
        return
    with torch.cuda.graph(graph):
        captured = manager.dispatch(static_x, static_ids, static_w)
        result = manager.combine(_expert(captured.hidden_states, captured.local_expert_ids, owned_global),
                                 captured.handle)
    for seed in (2, 3):
        x, ids, weights = _moe_inputs(world_size, seed, device)
        static_x.copy_(x[sl])
        static_ids.copy_(ids[sl])
        static_w.copy_(weights[sl])
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(result, _want(rank, x, ids, weights)), f"replay with seed {seed}"


@requires_cuda
def test_moe_all2all_manager_eager_and_captured():
    run_on_gpus(_moe_body)
