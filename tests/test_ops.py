"""torch.ops.autosymm.*: fake impls, opcheck, torch.compile(fullgraph=True) over 2 gloo ranks, and
the dist.all_reduce drop-in (ReduceOp, positional op, async_op, DTensor Partial).

One spawn of 2 gloo ranks runs every multi-rank check (a spawn costs seconds)."""

import os
import traceback
from datetime import timedelta
from functools import partial

import pytest
import torch
import torch.distributed as dist
from _gloo import run_with_deadline
from torch._subclasses.fake_tensor import FakeTensorMode

import autosymm  # noqa: F401  (registers the ops)
from autosymm.dist_compat import Work
from autosymm.routing import make_expt_assignment, make_expt_dict_random, random_expt_indx, route

N_EXPTS, TOP_K, TOKENS, D_MODEL = 8, 2, 4, 16


def test_fake_impls_give_the_shapes_dtypes_and_devices():
    assignment = make_expt_assignment(2, N_EXPTS, make_expt_dict_random(2, N_EXPTS))
    tensors = [assignment.expt_bitmask, assignment.expt_boolmask, assignment.expt_map, assignment.expt_owner]
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        x = mode.from_tensor(torch.empty(6, 10, dtype=torch.bfloat16)).t()  # not contiguous
        assert torch.ops.autosymm.all_reduce_(x, "sum", "no-such-group") is None  # groups are not resolved
        y = torch.ops.autosymm.all_reduce(x, "max", "no-such-group")
        assert (y.shape, y.dtype, y.is_contiguous()) == ((10, 6), torch.bfloat16, True)
        src = torch.empty(TOKENS, D_MODEL, dtype=torch.float16)
        expt_indx = torch.zeros(2 * TOKENS, TOP_K, dtype=torch.int32)
        ep = torch.ops.autosymm.dp_to_ep(src, tensors, assignment.n_expts_per_shard, expt_indx, expt_indx, "g")
        assert (ep.shape, ep.dtype) == ((2 * TOKENS * TOP_K, D_MODEL), torch.float16)
        dp = torch.ops.autosymm.ep_to_dp(ep, tensors, assignment.n_expts_per_shard, expt_indx,
                                         expt_indx.flatten(), "g")
        assert (dp.shape, dp.dtype) == ((TOKENS * TOP_K, D_MODEL), torch.float16)


# -- two gloo ranks ---------------------------------------------------------------------------

def _drop_in(rank, world_size, alone):
    """The dist.all_reduce signature: ReduceOp keyword and positional, strings, async_op."""
    x = torch.full((64,), float(rank + 1), dtype=torch.bfloat16)
    assert autosymm.all_reduce(x, op=dist.ReduceOp.SUM) is x and torch.equal(x, torch.full_like(x, 3))
    x = torch.full((64,), float(rank + 1))
    autosymm.all_reduce(x, dist.ReduceOp.SUM)
    assert torch.equal(x, torch.full_like(x, 3))
    for op, want in ((dist.ReduceOp.MAX, 2.0), (dist.ReduceOp.MIN, 1.0), (dist.ReduceOp.AVG, 1.5), ("max", 2.0)):
        x = torch.full((8,), float(rank + 1))
        autosymm.all_reduce(x, op)
        assert torch.equal(x, torch.full_like(x, want)), (op, x)
    with pytest.raises(ValueError, match="PREMUL_SUM"):
        autosymm.all_reduce(x, dist.ReduceOp.PREMUL_SUM)
    with pytest.raises(TypeError, match="pass the group as group="):
        autosymm.all_reduce(x, dist.group.WORLD)  # the signature before dist.all_reduce's
    param = torch.nn.Parameter(torch.full((8,), float(rank + 1)), requires_grad=False)
    assert autosymm.all_reduce(param) is param and torch.equal(param.data, torch.full((8,), 3.0))
    x = torch.full((64,), float(rank + 1), dtype=torch.bfloat16)
    work = autosymm.all_reduce(x, async_op=True)  # NCCL (gloo) serves here: torch's own Work
    assert isinstance(work, dist.Work) and work.wait()
    assert torch.equal(x, torch.full_like(x, 3))
    y = torch.ones(8)
    work = autosymm.all_reduce(y, group=alone, async_op=True)  # one rank: autosymm's no-op, its Work
    assert isinstance(work, Work) and work.is_completed() and work.wait() and torch.equal(y, torch.ones(8))


def _dtensor(rank, world_size, alone):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    mesh = init_device_mesh("cpu", (world_size,))
    partial_sum = DTensor.from_local(torch.full((4,), float(rank + 1)), mesh, [Partial()])
    out = autosymm.all_reduce(partial_sum)
    assert out.placements == (Replicate(),) and torch.equal(out.to_local(), torch.full((4,), 3.0))
    partial_max = DTensor.from_local(torch.full((4,), float(rank + 1)), mesh, [Partial("max")])
    assert torch.equal(autosymm.all_reduce(partial_max).full_tensor(), torch.full((4,), 2.0))
    with pytest.raises(ValueError, match=r"op='max' differs from the placement Partial\(sum\)"):
        autosymm.all_reduce(DTensor.from_local(torch.ones(4), mesh, [Partial()]), dist.ReduceOp.MAX)
    with pytest.raises(ValueError, match=r"placements \(Shard\(dim=0\),\) has no Partial"):
        autosymm.all_reduce(DTensor.from_local(torch.ones(4), mesh, [Shard(0)]))


def _compiled(rank, world_size, alone):
    """fullgraph=True (a graph break raises) with aot_eager and inductor; the ops run the runtime."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from autosymm.dist_compat import group_name

    def f(x):
        y = x * 2
        autosymm.all_reduce(y)  # in place: auto_functionalize
        z = torch.ops.autosymm.all_reduce(y + 1, "sum", group_name())
        w = y.clone()
        autosymm.all_reduce(w, dist.ReduceOp.MAX)
        return y, z, w

    x = torch.full((16,), float(rank + 1))
    counter = CompileCounterWithBackend("aot_eager")
    y, z, w = torch.compile(f, fullgraph=True, backend=counter)(x)
    assert counter.frame_count == 1
    assert (y[0].item(), z[0].item(), w[0].item()) == (6.0, 14.0, 6.0)
    calls = autosymm.stats()["nccl"]["calls"]

    def g(x):  # no pointwise op: inductor compiles no C++ kernel (fast on the CPU)
        y = torch.ops.autosymm.all_reduce(x, "sum", group_name())
        autosymm.all_reduce(y)
        return y

    y = torch.compile(g, fullgraph=True, backend="inductor")(x)
    assert torch.equal(y, torch.full_like(x, 6.0)) and torch.equal(x, torch.full_like(x, float(rank + 1)))
    assert autosymm.stats()["nccl"]["calls"] == calls + 2  # the compiled calls went through the runtime
    keys = set(autosymm.api.STATES[None].cache)
    torch.compile(g, fullgraph=True, backend="inductor")(x)
    assert set(autosymm.api.STATES[None].cache) == keys  # decided once per (op, dtype, size, mode)
    _captured_calls_take_graph_rows(torch.compile(g, fullgraph=True, backend="aot_eager"), x)
    from torch.fx.experimental.proxy_tensor import make_fx

    traced = make_fx(lambda t: autosymm.all_reduce(t * 1), tracing_mode="fake")(x)  # FakeTensors: the op
    assert "torch.ops.autosymm.all_reduce_.default" in traced.code


def _captured_calls_take_graph_rows(compiled, x):
    """The op reads the mode when it runs, not when it is traced: a compiled call made while the
    stream "captures" (stubbed: no CUDA here) is prepared with the graph-mode rows."""
    from autosymm import api
    from autosymm.spec import ALL_REDUCE, call_key

    from autosymm.collectives import all_reduce as door

    capturing = door.stream_capturing
    door.stream_capturing = lambda: True
    try:
        compiled(x)
    finally:
        door.stream_capturing = capturing
    entry = api.STATES[None].cache[call_key(ALL_REDUCE, x.dtype, x.numel(), x.device, True, "sum")]
    assert entry.decision.mode == "graph" and entry.calls == 2  # g's two reductions of x's size


def _compiled_moe(rank, world_size, alone):
    """The conversions compiled (fullgraph, aot_eager): owned results equal to eager's rows."""
    assignment = make_expt_assignment(world_size, N_EXPTS, make_expt_dict_random(world_size, N_EXPTS, seed=3))
    expt_indx = random_expt_indx(world_size * TOKENS, N_EXPTS, TOP_K, seed=4)
    gate, topk = route(expt_indx)
    src = torch.randn(TOKENS, D_MODEL, generator=torch.Generator().manual_seed(rank))

    def round_trip(src):
        ep = autosymm.convert_dp_to_ep(src, assignment, expt_indx, gate)
        return ep, autosymm.convert_ep_to_dp(ep * 1, assignment, expt_indx, topk)

    ep, dp = torch.compile(round_trip, fullgraph=True, backend="aot_eager")(src)
    mine = assignment.expt_boolmask[rank][expt_indx.long().flatten()]  # pairs owned here
    rows = gate.long().flatten()[mine]
    assert torch.equal(ep[rows], autosymm.convert_dp_to_ep(src, assignment, expt_indx, gate)[rows])
    assert torch.equal(dp, src.repeat_interleave(TOP_K, 0))


def _opchecks(rank, world_size, alone):
    """torch.library.opcheck: schema, fake impl and AOT dispatch (the ops run collectives, so every
    rank runs the same checks); the conversions on a one-rank group, where every row is written."""
    from autosymm.dist_compat import group_name

    x = torch.full((32,), float(rank + 1))
    torch.library.opcheck(torch.ops.autosymm.all_reduce_.default, (x, "sum", group_name()))
    torch.library.opcheck(torch.ops.autosymm.all_reduce.default, (x, "max", group_name()))
    assignment = make_expt_assignment(1, N_EXPTS, make_expt_dict_random(1, N_EXPTS))
    tensors = [assignment.expt_bitmask, assignment.expt_boolmask, assignment.expt_map, assignment.expt_owner]
    expt_indx = random_expt_indx(TOKENS, N_EXPTS, TOP_K, seed=5)
    gate, topk = route(expt_indx)
    src = torch.randn(TOKENS, D_MODEL)
    ep_src = torch.randn(TOKENS * TOP_K, D_MODEL)
    for op, args in ((torch.ops.autosymm.dp_to_ep, (src, tensors, [N_EXPTS], expt_indx, gate, group_name(alone))),
                     (torch.ops.autosymm.ep_to_dp, (ep_src, tensors, [N_EXPTS], expt_indx, topk, group_name(alone)))):
        torch.library.opcheck(op.default, args)


CHECKS = (_drop_in, _dtensor, _compiled, _compiled_moe, _opchecks)


def _worker(db_path, rank, world_size, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), AUTOSYMM_DB=db_path)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    done = []
    try:
        alone = [dist.new_group([r]) for r in range(world_size)][rank]  # every rank makes every group
        for check in CHECKS:
            check(rank, world_size, alone)
            done.append(check.__name__)
        out.put((rank, done, None))
    except BaseException:
        out.put((rank, None, traceback.format_exc()))
    finally:
        autosymm.reset()
        dist.destroy_process_group()


def test_two_gloo_ranks_compile_and_drop_in(tmp_path):
    reports = run_with_deadline(partial(_worker, str(tmp_path / "none.sqlite")), 2, deadline_s=240.0)
    for rank in (0, 1):
        assert reports[rank] == [check.__name__ for check in CHECKS]
