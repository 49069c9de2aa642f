"""autosymm.reduce_scatter_tensor / all_gather_into_tensor / reduce_scatterv / all_gatherv on gloo
ranks (the NCCL-fallback path, gloo standing in): results equal torch.distributed's, per-rank
sizes, other ops and dtypes, the rank protocol on bad input, torch.compile(fullgraph=True), the
backward pass against torch.distributed.nn.functional, DTensor redistribute."""

from __future__ import annotations

import pytest
import torch
from _gloo import run_gloo

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _with_db(tmp_path):
    return {"all": {"AUTOSYMM_DB": str(tmp_path / "none.sqlite")}}


def _data(rank, shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    if dtype.is_floating_point:
        return torch.randint(-8, 9, shape, generator=gen).to(dtype).mul_(0.25)
    return torch.randint(-100, 100, shape, generator=gen).to(dtype)


def _matches_torch(rank, world_size):
    import torch.distributed as dist

    import autosymm

    for dtype in DTYPES:
        for rows in (1, 5, 7):  # odd element counts
            x = _data(rank, (world_size * rows, 3), dtype, rows)
            out, want = torch.empty(rows, 3, dtype=dtype), torch.empty(rows, 3, dtype=dtype)
            assert autosymm.reduce_scatter_tensor(out, x) is None
            dist.reduce_scatter_tensor(want, x)
            assert torch.equal(out, want)
            shard = _data(rank, (rows, 3), dtype, rows)
            got, ref = torch.empty(world_size * rows, 3, dtype=dtype), torch.empty(world_size * rows, 3, dtype=dtype)
            autosymm.all_gather_into_tensor(got, shard)
            dist.all_gather_into_tensor(ref, shard)
            assert torch.equal(got, ref)
    for dtype in (torch.int32, torch.int8, torch.int64, torch.bool):  # an all-gather copies any dtype
        shard = _data(rank, (3,), dtype)
        got, ref = torch.empty(3 * world_size, dtype=dtype), torch.empty(3 * world_size, dtype=dtype)
        autosymm.all_gather_into_tensor(got, shard)
        dist.all_gather_into_tensor(ref, shard)
        assert torch.equal(got, ref)
    x = _data(rank, (2 * world_size,), torch.float32)
    for op in (dist.ReduceOp.MAX, "min", dist.ReduceOp.PRODUCT):  # NCCL serves other ops
        out, want = torch.empty(2), torch.empty(2)
        autosymm.reduce_scatter_tensor(out, x, op=op)
        dist.reduce_scatter_tensor(want, x, op=op if not isinstance(op, str) else dist.ReduceOp.MIN)
        assert torch.equal(out, want)
    ints = torch.arange(2 * world_size, dtype=torch.int32) + rank  # an integer sum: NCCL
    out = torch.empty(2, dtype=torch.int32)
    autosymm.reduce_scatter_tensor(out, ints)
    assert out.tolist() == [world_size * (2 * rank + i) + sum(range(world_size)) for i in range(2)]
    work = autosymm.all_gather_into_tensor(torch.empty(world_size), torch.ones(1), async_op=True)
    assert work.wait() and work.is_completed()
    decision = autosymm.explain(problem=autosymm.Problem("reduce_scatter", "bf16", world_size, nbytes=4096),
                                op="reduce_scatter")
    return decision.backend, autosymm.stats()


@pytest.mark.parametrize("world_size", [2, 3])
def test_both_ops_match_torch_distributed(tmp_path, world_size):
    results = run_gloo(_matches_torch, world_size, env=_with_db(tmp_path))
    for backend, stats in results.values():
        assert backend == "nccl_reduce_scatter"
        assert stats["nccl_reduce_scatter"]["calls"] >= 9 and stats["nccl_all_gather"]["calls"] >= 9


def _per_rank_sizes(rank, world_size):
    import torch.distributed as dist

    import autosymm

    for sizes in ([1, 3, 0][:world_size], [4, 2, 5][:world_size], [2] * world_size):
        for dtype in DTYPES:
            full = _data(rank, (sum(sizes), 5), dtype, sum(sizes))
            out = torch.empty(sizes[rank], 5, dtype=dtype)
            assert autosymm.reduce_scatterv(out, full, sizes) is out
            want = torch.empty(sizes[rank], 5, dtype=dtype)
            dist.reduce_scatter(want, list(full.split(sizes)))
            assert torch.equal(out, want)
            shard = _data(rank, (sizes[rank], 5), dtype, 3)
            got = torch.empty(sum(sizes), 5, dtype=dtype)
            assert autosymm.all_gatherv(got, shard, sizes) is got
            shards = [torch.empty(sizes[r], 5, dtype=dtype) for r in range(world_size)]
            for r in range(world_size):  # gloo's list all-gather refuses uneven shards: one broadcast each
                if r == rank:
                    shards[r].copy_(shard)
                dist.broadcast(shards[r], src=r)
            assert torch.equal(got, torch.cat(shards))
    return True


@pytest.mark.parametrize("world_size", [2, 3])
def test_per_rank_sizes_match_torch_distributed(tmp_path, world_size):
    assert all(run_gloo(_per_rank_sizes, world_size, env=_with_db(tmp_path)).values())


def _bad_inputs(rank, world_size):
    from autosymm.runtime.agreement import AgreementError

    import autosymm

    errors = []
    # one rank's output is the wrong size: that rank raises its ValueError, the other an AgreementError
    out = torch.empty(3 if rank == 0 else 4)
    try:
        autosymm.reduce_scatter_tensor(out, torch.ones(8))
    except (ValueError, AgreementError) as exc:
        errors.append(type(exc).__name__ + ": " + str(exc))
    for call, match in [
        (lambda: autosymm.all_gather_into_tensor(torch.empty(5), torch.ones(2)), "world_size=2 times"),
        (lambda: autosymm.reduce_scatter_tensor(torch.empty(2), torch.ones(4, dtype=torch.float16)), "one dtype"),
        (lambda: autosymm.reduce_scatter_tensor(torch.empty(2), torch.ones(4, 2).t()), "not contiguous"),
        (lambda: autosymm.reduce_scatterv(torch.empty(1, 2), torch.ones(3, 2), [1, 1]), "need a full tensor of 2"),
        (lambda: autosymm.all_gatherv(torch.empty(3, 2), torch.ones(1, 2), [1]), "2 non-negative"),
        (lambda: autosymm.all_gatherv(torch.empty(3), torch.ones(1), torch.tensor([1, 2])), "host ints"),
        (lambda: autosymm.reduce_scatter_tensor(torch.empty(2), torch.ones(4), op="nope"), "ReduceOp"),
    ]:
        with pytest.raises((ValueError, TypeError), match=match):
            call()
    # the group still works after every rank raised together
    out = torch.empty(2)
    autosymm.reduce_scatter_tensor(out, torch.ones(4))
    assert torch.equal(out, torch.full((2,), 2.0))
    return errors


def test_bad_input_raises_on_every_rank_and_the_group_goes_on(tmp_path):
    errors = run_gloo(_bad_inputs, 2, env=_with_db(tmp_path))
    assert errors[0][0].startswith("ValueError") and "rank 0's" not in errors[0][0] and "3 elements" in errors[0][0]
    assert errors[1][0].startswith("AgreementError") and "reduce_scatter" in errors[1][0]


def _compiled(rank, world_size):
    import torch.distributed as dist

    import autosymm

    def step(x, y):
        shard = torch.empty(x.shape[0] // world_size, *x.shape[1:], dtype=x.dtype)
        autosymm.reduce_scatter_tensor(shard, x * 2)
        full = torch.empty(world_size * y.shape[0], *y.shape[1:], dtype=y.dtype)
        autosymm.all_gather_into_tensor(full, y + shard)
        return full

    x, y = _data(rank, (4 * world_size, 3), torch.float32), _data(rank, (4, 3), torch.float32, 1)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = compiled(x, y)
    shard = torch.empty(4, 3)
    dist.reduce_scatter_tensor(shard, x * 2)
    want = torch.empty(4 * world_size, 3)
    dist.all_gather_into_tensor(want, y + shard)
    assert torch.equal(got, want) and torch.equal(step(x, y), want)
    return True


def test_a_compiled_function_calling_both_traces_without_a_break(tmp_path):
    assert all(run_gloo(_compiled, 2, env=_with_db(tmp_path), deadline_s=300).values())


def _backward(rank, world_size):
    import torch.distributed as dist
    import torch.distributed.nn.functional as F

    name, n = dist.group.WORLD.group_name, 3
    x0, y0 = _data(rank, (world_size * n, 2), torch.float32), _data(rank, (n, 2), torch.float32, 1)
    weights = _data(rank, (world_size * n, 2), torch.float32, 2)
    grads = []
    for ours in (True, False):
        x, y = x0.clone().requires_grad_(), y0.clone().requires_grad_()
        if ours:
            shard = torch.ops.autosymm.reduce_scatter_tensor(x * x, "sum", world_size, name)
            full = torch.ops.autosymm.all_gather_into_tensor(y * shard, world_size, name)
        else:
            shard = F.reduce_scatter(torch.empty(n, 2), list((x * x).chunk(world_size)))
            full = torch.cat(F.all_gather(y * shard))
        (full * weights).sum().backward()
        grads.append((x.grad, y.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
    return True


def test_backward_through_both_matches_torch_distributed_nn(tmp_path):
    assert all(run_gloo(_backward, 2, env=_with_db(tmp_path)).values())


def _dtensor(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    from autosymm.collectives.dtensor import redistribute

    mesh = init_device_mesh("cpu", (world_size,))
    for rows in (4, 5):  # even and uneven (torch's chunking) shards
        local = _data(rank, (rows, 3), torch.float32)
        partial = DTensor.from_local(local, mesh, [Partial()], run_check=False)
        sharded = redistribute(partial, [Shard(0)])
        assert torch.equal(sharded.to_local(), partial.redistribute(mesh, [Shard(0)]).to_local())
        assert torch.equal(partial.to_local(), local)  # the input keeps its data
        replicated = redistribute(sharded, [Replicate()])
        assert replicated.placements == (Replicate(),)
        assert torch.equal(replicated.to_local(), sharded.redistribute(mesh, [Replicate()]).to_local())
    return True


def test_dtensor_redistribute_partial_to_shard_to_replicate(tmp_path):
    assert all(run_gloo(_dtensor, 2, env=_with_db(tmp_path)).values())


def _placements_differ(rank, world_size):
    import time

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    from autosymm.runtime.agreement import AgreementError
    from autosymm.collectives.dtensor import redistribute

    mesh = init_device_mesh("cpu", (world_size,))
    partial = DTensor.from_local(torch.ones(4, 3), mesh, [Partial()], run_check=False)
    start = time.monotonic()
    with pytest.raises(AgreementError, match=r"redistribute of torch.float32 \(4, 3\) from \(Partial\(sum\),\) to"):
        redistribute(partial, [Shard(0)] if rank == 0 else [Replicate()])  # ours on rank 0, torch's on rank 1
    took = time.monotonic() - start
    with pytest.raises(AgreementError, match="redistribute of"):
        redistribute(partial, [Shard(0)] if rank == 0 else [Shard(0), Shard(0)])  # torch would refuse on rank 1
    sharded = redistribute(partial, [Shard(0)])  # the same on both: served, in step
    assert torch.equal(sharded.to_local(), torch.full((2, 3), 2.0))
    return took


def test_redistribute_agrees_the_placements_before_either_path_runs(tmp_path):
    env = {"all": {"AUTOSYMM_DB": str(tmp_path / "none.sqlite"), "AUTOSYMM_AGREE_TIMEOUT_S": "60"}}
    assert all(took < 10 for took in run_gloo(_placements_differ, 2, env=env, deadline_s=120).values())
