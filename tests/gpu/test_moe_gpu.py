"""MoE conversions on real GPUs: triton_moe and nccl_all_to_all against the reference, the round
trip, back-to-back calls read by a kernel right after each barrier, CUDA-graph capture, the NCCL
path bit for bit against the kernels (bad indices included), and the MoE workspace room (eager
growth, the graph-capture error, declared plans).

Runs on every local GPU (one process each) through tests/gpu/_dist.run_on_gpus.
"""

from __future__ import annotations

import pytest
import torch

from autosymm.configs import MoEConfig
from autosymm.routing import make_expt_assignment, make_expt_dict_random, random_expt_indx, route
from _moe_ref import reference_dp_to_ep, reference_ep_to_dp, rows_written
from autosymm.problem import DTYPE_NAMES, MoEShape

from ._dist import requires_cuda, run_on_gpus

pytestmark = [requires_cuda, pytest.mark.gpu]

DSV3_LIKE = MoEShape(7168, 256, 8)
CASES = [  # shape, tokens per rank, dtype, drop fraction
    (DSV3_LIKE, 16, torch.bfloat16, 0.0),
    (MoEShape(200, 12, 6), 5, torch.float16, 0.1),  # d_model tail, top-6
    (MoEShape(256, 16, 4), 600, torch.float32, 0.05),  # dp->ep grid > 1024 programs: separate barrier
]
CONFIGS = [MoEConfig(1024, 4), MoEConfig(2048, 8, rows_per_program=2, num_blocks=132), MoEConfig(256, 2, 4)]


def _setup(rank, world_size, shape, n_tokens_local, dtype, drop, device, seed=0):
    """Inputs identical on every rank (CPU copies of every rank's tensors, for the references)."""
    assignment = make_expt_assignment(world_size, shape.n_expts_tot,
                                      make_expt_dict_random(world_size, shape.n_expts_tot, seed=seed), device)
    expt_indx = random_expt_indx(world_size * n_tokens_local, shape.n_expts_tot, shape.n_expts_act, seed=seed + 1,
                                 drop_fraction=drop, device=device)
    gate, topk = route(expt_indx)
    gen = torch.Generator().manual_seed(seed + 2)
    srcs = [torch.randn(n_tokens_local, shape.d_model, generator=gen).to(dtype) for _ in range(world_size)]
    ep_srcs = [torch.randn(world_size * n_tokens_local * shape.n_expts_act, shape.d_model, generator=gen).to(dtype)
               for _ in range(world_size)]
    return assignment, expt_indx, gate, topk, srcs, ep_srcs


def _ctx(rank, world_size):
    import torch.distributed as dist

    from autosymm.backends.base import Capabilities, RunContext
    from autosymm.workspace.symm import get_workspace

    ws = get_workspace(dist.group.WORLD, torch.device("cuda", rank), all_reduce_bytes=1 << 20, moe_bytes=512 << 20)
    return RunContext(group=dist.group.WORLD, workspace=ws), Capabilities(world_size, moe_bytes=ws.capacity("moe"))


def _prepare(backend, op, shape, n_tokens_local, dtype, world_size, config, ctx, caps):
    from autosymm.problem import Problem

    problem = Problem.moe(op, shape, n_tokens_local, DTYPE_NAMES[dtype], world_size)
    assert backend.why_not(problem, caps) is None
    return backend.prepare(problem, config, ctx)


def _backends_match_reference(rank, world_size):
    from autosymm.backends.nccl_all_to_all import NCCL_ALL_TO_ALL
    from autosymm.backends.triton_moe import TRITON_MOE

    ctx, caps = _ctx(rank, world_size)
    device = torch.device("cuda", rank)
    for shape, n_tokens_local, dtype, drop in CASES:
        assignment, expt_indx, gate, topk, srcs, ep_srcs = _setup(rank, world_size, shape, n_tokens_local, dtype,
                                                                  drop, device)
        ep_mask = rows_written("dp_to_ep", assignment, expt_indx, gate, world_size)[rank]
        dp_mask = rows_written("ep_to_dp", assignment, expt_indx, topk, world_size)[rank]
        want_ep = reference_dp_to_ep(srcs, assignment, expt_indx, gate)[rank][ep_mask]
        want_dp = reference_ep_to_dp(ep_srcs, assignment, expt_indx, topk)[rank][dp_mask]
        want_round_trip = srcs[rank].repeat_interleave(shape.n_expts_act, 0)[dp_mask]
        src, ep_src = srcs[rank].to(device), ep_srcs[rank].to(device)
        for backend, configs in ((TRITON_MOE, CONFIGS), (NCCL_ALL_TO_ALL, [None])):
            for config in configs:
                what = f"{backend.name} {config} {shape.key} {n_tokens_local} tok {dtype}"
                to_ep = _prepare(backend, "dp_to_ep", shape, n_tokens_local, dtype, world_size, config, ctx, caps)
                to_dp = _prepare(backend, "ep_to_dp", shape, n_tokens_local, dtype, world_size, config, ctx, caps)
                ep = to_ep(src, assignment, expt_indx, gate)
                assert torch.equal(ep[ep_mask].cpu(), want_ep), f"dp->ep {what}"
                dp = to_dp(ep_src, assignment, expt_indx, topk)
                assert torch.equal(dp[dp_mask].cpu(), want_dp), f"ep->dp {what}"
                dp = to_dp(to_ep(src, assignment, expt_indx, gate).clone(), assignment, expt_indx, topk)
                assert torch.equal(dp[dp_mask].cpu(), want_round_trip), f"round trip {what}"


def _conversion(op, ctx, config, fused, shape, n_tokens_local, dtype, world_size):
    """A launcher-like callable over backends.moe.Conversion with the end barrier forced."""
    from autosymm.backends.triton_moe import Conversion
    from autosymm.geometry import dst_rows, moe_buffer

    ws = ctx.workspace
    conversion = Conversion(op, ws, config)
    offset = moe_buffer(op, ws.capacity("moe"), world_size)[0]
    dst = ws.local_view("moe", (dst_rows(op, n_tokens_local, shape.n_expts_act, world_size), shape.d_model), dtype,
                        offset)

    def call(src, assignment, expt_indx, indx):
        conversion(src, assignment.expt_owner, expt_indx, indx, fused)
        return dst

    return call


def _back_to_back_and_graphs(rank, world_size):
    """Many conversions with no host sync, each output read by a kernel right after the call;
    then the same cycle captured in one CUDA graph and replayed with new data. Launchers with
    their default end barrier, then the fused and the separate barrier forced."""
    from autosymm.backends.triton_moe import TRITON_MOE

    ctx, caps = _ctx(rank, world_size)
    device = torch.device("cuda", rank)
    shape, n_tokens_local, dtype = DSV3_LIKE, 32, torch.bfloat16
    assignment, expt_indx, gate, topk, srcs, _ = _setup(rank, world_size, shape, n_tokens_local, dtype, 0.02, device)
    dp_mask = rows_written("ep_to_dp", assignment, expt_indx, topk, world_size)[rank].to(device)
    variants = [
        ("launcher", *(_prepare(TRITON_MOE, op, shape, n_tokens_local, dtype, world_size, CONFIGS[0], ctx, caps)
                       for op in ("dp_to_ep", "ep_to_dp"))),
    ] + [
        (f"fused={fused}", *(_conversion(op, ctx, CONFIGS[1], fused, shape, n_tokens_local, dtype, world_size)
                             for op in ("dp_to_ep", "ep_to_dp")))
        for fused in (True, False)
    ]
    base = srcs[rank].to(device)
    k = shape.n_expts_act
    for name, to_ep, to_dp in variants:

        def cycle(src):
            ep = to_ep(src, assignment, expt_indx, gate)
            dp = to_dp(ep * 2, assignment, expt_indx, topk)  # experts "compute": read ep right away
            return dp.clone()

        errors = torch.zeros((), dtype=torch.int64, device=device)
        for i in range(20):
            src = base + i
            got = cycle(src)
            want = (src * 2).repeat_interleave(k, 0)
            errors += (got[dp_mask] != want[dp_mask]).sum()
        assert int(errors) == 0, f"{name}: {int(errors)} wrong elements over 20 back-to-back cycles"

        static_src = base.clone()
        cycle(static_src)  # warm up (compiles, lean launch) before capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = cycle(static_src)
        for i in range(4):
            static_src.copy_(base - i)
            graph.replay()
            want = ((base - i) * 2).repeat_interleave(k, 0)
            assert torch.equal(static_out[dp_mask], want[dp_mask]), f"graph replay {i} {name}"
            cycle(static_src)  # eager calls between replays keep the signal pads balanced
        torch.cuda.synchronize()


def test_backends_match_the_reference():
    run_on_gpus(_backends_match_reference)


def test_back_to_back_calls_and_cuda_graphs():
    run_on_gpus(_back_to_back_and_graphs)


def test_one_rank():
    run_on_gpus(_backends_match_reference, world_size=1)


# -- the NCCL path against the kernels, bad indices included -------------------------------------

def _poison(t, seed):
    """Fill ``t`` with the same random bytes on every call with ``seed`` (NaNs included)."""
    gen = torch.Generator().manual_seed(seed)
    raw = t.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))


def _bits(t):
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _corrupt(expt_indx, gate, topk, n_expts_tot):
    """Out-of-range expert ids and gate/topk entries, as a buggy router might make them."""
    flat, n_pairs = expt_indx.view(-1), expt_indx.numel()
    flat[0], flat[5], flat[9] = n_expts_tot, n_expts_tot + 3, -2
    gate.view(-1)[3], gate.view(-1)[11] = n_pairs, -5
    topk[2], topk[7] = n_pairs + 2, -1


def _nccl_path_matches_the_kernels(rank, world_size):
    """Every row of nccl_all_to_all's output equals triton_moe's, bit for bit, from the same
    poisoned start: the same rows written, the same (dropped, out-of-range) rows left alone."""
    import torch.distributed as dist

    from autosymm.backends.nccl_all_to_all import NCCL_ALL_TO_ALL
    from autosymm.backends.triton_moe import TRITON_MOE

    ctx, caps = _ctx(rank, world_size)
    device = torch.device("cuda", rank)
    shape, n_tokens_local, dtype = MoEShape(200, 12, 6), 50, torch.bfloat16
    assignment, expt_indx, gate, topk, srcs, ep_srcs = _setup(rank, world_size, shape, n_tokens_local, dtype, 0.1,
                                                              device, seed=5)
    _corrupt(expt_indx, gate, topk, shape.n_expts_tot)
    for op, src, indx in (("dp_to_ep", srcs[rank], gate), ("ep_to_dp", ep_srcs[rank], topk)):
        triton, nccl = (_prepare(backend, op, shape, n_tokens_local, dtype, world_size, config, ctx, caps)
                        for backend, config in ((TRITON_MOE, CONFIGS[1]), (NCCL_ALL_TO_ALL, None)))
        src = src.to(device)
        outs = [triton(src, assignment, expt_indx, indx), nccl(src, assignment, expt_indx, indx)]
        torch.cuda.synchronize()
        dist.barrier()
        for out in outs:
            _poison(out, seed=rank)
        torch.cuda.synchronize()
        dist.barrier()  # every rank's buffers are poisoned before any peer writes again
        assert triton(src, assignment, expt_indx, indx) is outs[0]
        assert nccl(src, assignment, expt_indx, indx) is outs[1]
        torch.cuda.synchronize()
        assert torch.equal(_bits(outs[0]), _bits(outs[1])), f"{op}: nccl_all_to_all differs from triton_moe"
        dist.barrier()


# -- MoE room: eager growth, graph capture, declared plans ----------------------------------------

def _api_calls(rank, world_size, shape, n_tokens_local, device):
    """dp->ep and ep->dp through the public API, checked against the references; the dp->ep output."""
    import torch.distributed as dist

    import autosymm

    assignment, expt_indx, gate, topk, srcs, ep_srcs = _setup(rank, world_size, shape, n_tokens_local,
                                                              torch.bfloat16, 0.05, device, seed=n_tokens_local)
    ep = autosymm.convert_dp_to_ep(srcs[rank].to(device), assignment, expt_indx, gate)
    mask = rows_written("dp_to_ep", assignment, expt_indx, gate, world_size)[rank]
    assert torch.equal(ep[mask].cpu(), reference_dp_to_ep(srcs, assignment, expt_indx, gate)[rank][mask])
    dp = autosymm.convert_ep_to_dp(ep_srcs[rank].to(device), assignment, expt_indx, topk)
    mask = rows_written("ep_to_dp", assignment, expt_indx, topk, world_size)[rank]
    assert torch.equal(dp[mask].cpu(), reference_ep_to_dp(ep_srcs, assignment, expt_indx, topk)[rank][mask])
    dist.barrier()  # no peer's next call writes into this rank's buffers before its checks are done
    return ep


def _one_rank_has_no_room_to_grow(state, device):
    """A one-rank group gets no symmetric workspace (nothing to exchange): every size, small or
    large, is served eagerly by the NCCL path's local copy and is right; a capture (declared or
    not) is refused with the clear error naming the only backend, not capturable."""
    import autosymm

    assert state.workspace is None and state.caps.moe_bytes == 0
    shape = MoEShape(1024, 32, 4)
    for n_tokens in (64, 600, 64, 2000):
        _api_calls(0, 1, shape, n_tokens, device)
    assert set(autosymm.stats()) == {"nccl_all_to_all"}
    assignment, expt_indx, gate, _, srcs, _ = _setup(0, 1, shape, 64, torch.bfloat16, 0.05, device)
    static_src = srcs[0].to(device)
    autosymm.init(moe=[autosymm.MoEPlan(shape, 64, torch.bfloat16)])
    with pytest.raises(RuntimeError, match="cannot be captured in a CUDA graph: only nccl_all_to_all"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            autosymm.convert_dp_to_ep(static_src, assignment, expt_indx, gate)
    torch.cuda.synchronize()


def _room_grows_in_eager_and_is_declared_for_graphs(rank, world_size):
    import os

    import torch.distributed as dist

    import autosymm
    from autosymm import api
    from autosymm.backends.triton_moe import region_bytes_for
    from autosymm.problem import Problem

    os.environ["AUTOSYMM_WORKSPACE_BYTES"] = "16MiB"  # an 8 MiB MoE region: the calls below outgrow it
    autosymm.init()
    device = torch.device("cuda", rank)
    state = api.STATES[None]
    if world_size == 1:
        return _one_rank_has_no_room_to_grow(state, device)
    ws, first = state.workspace, state.workspace.capacity("moe")
    kept = autosymm.empty((4096,), torch.float32)
    kept.fill_(rank + 1)
    shape = MoEShape(1024, 32, 4)
    small = _api_calls(rank, world_size, shape, 64, device)  # 1 MiB of dp->ep rows: fits
    small_before = small.clone()
    _api_calls(rank, world_size, shape, 600, device)  # ~10 MB of dp->ep rows: the region grows
    assert ws.capacity("moe") > first and state.caps.moe_bytes == ws.capacity("moe")
    assert torch.equal(small, small_before), "the old region stays alive, untouched"
    again = _api_calls(rank, world_size, shape, 64, device)  # the cached launcher, prepared again
    assert ws.offset_in_region(again, "moe") is not None and ws.offset_in_region(small, "moe") is None
    assert set(autosymm.stats()) == {"triton_moe"}
    autosymm.all_reduce(kept)  # autosymm.empty tensors still live in the (unmoved) all-reduce region
    assert torch.equal(kept, torch.full_like(kept, world_size * (world_size + 1) / 2))

    n_big = 2000
    problem = Problem.moe("dp_to_ep", shape, n_big, "bf16", world_size)
    assignment, expt_indx, gate, topk, srcs, _ = _setup(rank, world_size, shape, n_big, torch.bfloat16, 0.05, device)
    static_src = srcs[rank].to(device)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match=rf"region of {region_bytes_for(problem)} bytes.*autosymm.init\(group, "
                                           rf"moe=\[autosymm.MoEPlan\('d1024_e32_k4', max_tokens_per_rank={n_big}"):
        with torch.cuda.graph(graph):
            autosymm.convert_dp_to_ep(static_src, assignment, expt_indx, gate)
    torch.cuda.synchronize()

    autosymm.init(moe=[autosymm.MoEPlan(shape, n_big, torch.bfloat16)])  # declared: grows now, on every rank
    assert ws.capacity("moe") >= region_bytes_for(problem)
    _api_calls(rank, world_size, shape, n_big, device)  # eager warm-up (compiles)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ep = autosymm.convert_dp_to_ep(static_src, assignment, expt_indx, gate)
    mask = rows_written("dp_to_ep", assignment, expt_indx, gate, world_size)[rank]
    for i in range(3):
        new = [s + i for s in srcs]
        static_src.copy_(new[rank].to(device))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(ep[mask].cpu(), reference_dp_to_ep(new, assignment, expt_indx, gate)[rank][mask])
        dist.barrier()


def test_nccl_path_matches_the_kernels_bit_for_bit():
    run_on_gpus(_nccl_path_matches_the_kernels)


def test_moe_room_grows_in_eager_and_is_declared_for_graphs():
    run_on_gpus(_room_grows_in_eager_and_is_declared_for_graphs)
