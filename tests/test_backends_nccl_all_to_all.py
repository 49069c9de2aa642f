"""The MoE NCCL path (autosymm.backends.nccl_all_to_all): its exchange plan, from the torch
planning (the CPU path) and from the split kernel (the CUDA path, DeviceSplits), against the
Triton conversion kernels (interpreter, simulated ranks, out-of-range indices included, every row
compared bit for bit), and the real launchers (under the interpreter: the split kernel's path)
over 3 gloo processes against autosymm.routing's references."""

from __future__ import annotations

import os

import pytest
import torch

if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("interpreter tests (CUDA present, TRITON_INTERPRET unset)", allow_module_level=True)
os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported

from autosymm.backends.nccl_all_to_all import (NCCL_ALL_TO_ALL, DeviceSplits, _words, dp_to_ep_splits,
                                               ep_to_dp_splits, owner_table)
from autosymm.configs import MoEConfig  # noqa: E402
from autosymm.routing import (make_expt_assignment, make_expt_dict_random, make_expt_dict_uniform, random_expt_indx,
                              route)
from _moe_ref import reference_dp_to_ep, reference_ep_to_dp, rows_written
from autosymm.workspace.symm import simulated_workspaces  # noqa: E402

from _gloo import run_with_deadline  # noqa: E402
from _moe_sim import bits, check_and_clear, dst_views, poison, presatisfy  # noqa: E402

N_EXPERTS, D_MODEL = 10, 20


def _routing(world_size, n_tokens_local, k, placement, seed, corrupt=False):
    """(assignment, expt_indx, gate, topk); ``corrupt``: ids >= n_experts and < -1, and gate/topk
    entries outside [0, n_pairs), as a buggy router might produce them."""
    make = make_expt_dict_uniform(world_size, N_EXPERTS) if placement == "contiguous" else \
        make_expt_dict_random(world_size, N_EXPERTS, seed=seed)
    assignment = make_expt_assignment(world_size, N_EXPERTS, make)
    expt_indx = random_expt_indx(world_size * n_tokens_local, N_EXPERTS, k, seed=seed, drop_fraction=0.15)
    gate, topk = route(expt_indx, N_EXPERTS)
    if corrupt:
        gen = torch.Generator().manual_seed(seed)
        flat = expt_indx.view(-1)
        n_pairs = flat.numel()
        picks = torch.randperm(n_pairs, generator=gen)
        flat[picks[0]], flat[picks[1]] = N_EXPERTS, N_EXPERTS + 7
        flat[picks[2]] = -3
        gate.view(-1)[picks[3]], gate.view(-1)[picks[4]] = n_pairs, -2
        topk[picks[5]], topk[picks[6]] = n_pairs + 1, -1
    return assignment, expt_indx, gate, topk


def _splits(op, assignment, expt_indx, indx, world_size, planner="torch"):
    """Every rank's Splits of a call, from the torch planning or the split kernel."""
    if planner == "kernel":
        return [DeviceSplits(op, rank, world_size)(assignment.expt_owner, expt_indx, indx)
                for rank in range(world_size)]
    plan = dp_to_ep_splits if op == "dp_to_ep" else ep_to_dp_splits
    table = owner_table(assignment, world_size, {})
    n_tokens_local = expt_indx.shape[0] // world_size
    return [plan(table, expt_indx, indx, n_tokens_local, rank, world_size) for rank in range(world_size)]


def _simulated_nccl(op, srcs, outs, assignment, expt_indx, indx, planner):
    """Every rank's output of the NCCL path, the all-to-all done by hand (one process)."""
    world_size = len(srcs)
    rank_splits = _splits(op, assignment, expt_indx, indx, world_size, planner)
    sent = [list(srcs[r].index_select(0, s.send_rows).split(s.send_counts)) for r, s in enumerate(rank_splits)]
    for rank, split in enumerate(rank_splits):
        recv = torch.cat([sent[sender][rank] for sender in range(world_size)])
        assert [len(sent[sender][rank]) for sender in range(world_size)] == split.recv_counts
        outs[rank].index_copy_(0, split.recv_rows, recv)
    return outs


@pytest.mark.parametrize("world_size,k,placement,corrupt,index_dtype", [
    (2, 4, "random", False, torch.int32), (3, 2, "contiguous", False, torch.int64),
    (4, 3, "random", True, torch.int32), (3, 6, "contiguous", True, torch.int16),
])
@pytest.mark.parametrize("planner", ["torch", "kernel"])
def test_exchange_plan_writes_exactly_what_the_triton_kernels_write(world_size, k, placement, corrupt, index_dtype,
                                                                     planner):
    """Same rows written, same rows left alone (poisoned before), bit for bit, for both ops."""
    n_tokens_local, dtype = 3, torch.bfloat16
    routing = _routing(world_size, n_tokens_local, k, placement, seed=k, corrupt=corrupt)
    assignment, expt_indx, gate, topk = routing[0], *(t.to(index_dtype) for t in routing[1:])
    gen = torch.Generator().manual_seed(7)
    srcs = {"dp_to_ep": [torch.randn(n_tokens_local, D_MODEL, generator=gen).to(dtype) for _ in range(world_size)],
            "ep_to_dp": [torch.randn(world_size * n_tokens_local * k, D_MODEL, generator=gen).to(dtype)
                         for _ in range(world_size)]}
    wss = simulated_workspaces(world_size, moe_bytes=1 << 20)
    from autosymm.backends.triton_moe import launch

    for op, indx in (("dp_to_ep", gate), ("ep_to_dp", topk)):
        triton_out = dst_views(wss, op, n_tokens_local, k, D_MODEL, dtype)
        before = poison(triton_out, seed=world_size)
        presatisfy(wss, op)
        for ws, src in zip(wss, srcs[op]):
            launch(op, ws, MoEConfig(32, 1, rows_per_program=2), src, assignment.expt_owner, expt_indx, indx)
        check_and_clear(wss, op)
        nccl_out = _simulated_nccl(op, srcs[op], [b.clone() for b in before], assignment, expt_indx, indx, planner)
        for rank in range(world_size):
            assert torch.equal(bits(nccl_out[rank]), bits(triton_out[rank])), f"{op} rank {rank}"
        if not corrupt:  # and what routing's reference says
            reference = reference_dp_to_ep if op == "dp_to_ep" else reference_ep_to_dp
            want = reference(srcs[op], assignment, expt_indx, indx, out=before)
            assert all(torch.equal(bits(a), bits(b)) for a, b in zip(nccl_out, want)), op


def test_the_owner_table_is_made_once_per_assignment_and_maps_bad_ids_to_skip():
    assignment = make_expt_assignment(3, 5, make_expt_dict_uniform(3, 5))
    cache = {}
    table = owner_table(assignment, 3, cache)
    assert table.tolist() == [3, 0, 0, 1, 1, 2, 3] and owner_table(assignment, 3, cache) is table
    assignment.expt_owner[4] = 7  # changed in place (a new version): made again; an owner outside the group skips
    assert owner_table(assignment, 3, cache).tolist() == [3, 0, 0, 1, 1, 3, 3] and len(cache) == 1


def test_rows_travel_as_the_widest_words_that_tile_them():
    x = torch.zeros(3, 12, dtype=torch.bfloat16)
    assert _words(x).dtype == torch.int64 and _words(x).shape == (3, 3)
    assert _words(torch.zeros(3, 6, dtype=torch.bfloat16)).dtype == torch.int32
    assert _words(torch.zeros(3, 5, dtype=torch.float16)).dtype == torch.float16
    assert _words(torch.zeros(4, 12, dtype=torch.float32)[1:]).dtype == torch.int64  # 48-byte offset
    assert _words(torch.zeros(4, 3, dtype=torch.float32)[1:]).dtype == torch.float32  # 12-byte row
    assert torch.equal(_words(x), x.view(torch.int64))


def test_no_row_is_sent_for_dropped_or_out_of_range_items():
    world_size, k = 3, 4
    assignment, expt_indx, gate, topk = _routing(world_size, 5, k, "random", seed=1, corrupt=True)
    for op, indx, planner in (("dp_to_ep", gate, "torch"), ("ep_to_dp", topk, "torch"), ("dp_to_ep", gate, "kernel"),
                              ("ep_to_dp", topk, "kernel")):
        rank_splits = _splits(op, assignment, expt_indx, indx, world_size, planner)
        n_sent = sum(sum(s.send_counts) for s in rank_splits)
        assert n_sent == sum(sum(s.recv_counts) for s in rank_splits) == _kernel_rows_written(op, expt_indx, indx)
        assert n_sent < expt_indx.numel()


def _kernel_rows_written(op, expt_indx, indx):
    """Rows the kernels write over all ranks: items whose expert id and gate/topk entry are in range."""
    n_pairs = expt_indx.numel()
    e = expt_indx.reshape(-1).long()
    expert_ok = (e >= 0) & (e < N_EXPERTS)
    flat = indx.reshape(-1).long()
    in_range = (flat >= 0) & (flat < n_pairs)
    if op == "dp_to_ep":
        return int((expert_ok & in_range).sum())
    return int(expert_ok[flat[in_range]].sum())


# -- the launchers over gloo -------------------------------------------------------------------

GLOO_CASES = [  # k, dtype, placement, drop fraction, tokens per rank
    (6, torch.bfloat16, "random", 0.1, 5), (2, torch.float32, "contiguous", 0.0, 4),
    (8, torch.float16, "random", 0.3, 1), (3, torch.bfloat16, "contiguous", 0.2, 7),
]


def _gloo_rank(rank, world_size, port, queue):
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        import torch.distributed as dist

        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        try:
            _launchers_match_the_reference(rank, world_size)
        finally:
            dist.barrier()
            dist.destroy_process_group()
        queue.put((rank, "ok", None))
    except BaseException:
        import traceback

        queue.put((rank, None, traceback.format_exc()))


def _launchers_match_the_reference(rank, world_size):
    import torch.distributed as dist

    from autosymm.backends.base import RunContext
    from autosymm.problem import DTYPE_NAMES, MoEShape, Problem

    ctx = RunContext(group=dist.group.WORLD)
    for k, dtype, placement, drop, n_tokens_local in GLOO_CASES:
        make = make_expt_dict_uniform(world_size, N_EXPERTS) if placement == "contiguous" else \
            make_expt_dict_random(world_size, N_EXPERTS, seed=k)
        assignment = make_expt_assignment(world_size, N_EXPERTS, make)
        expt_indx = random_expt_indx(world_size * n_tokens_local, N_EXPERTS, k, seed=k, drop_fraction=drop)
        expt_indx.view(-1)[::7] += N_EXPERTS  # out-of-range ids: dropped like -1
        gate, topk = route(expt_indx, N_EXPERTS)
        gen = torch.Generator().manual_seed(100 + k)
        srcs = [torch.randn(n_tokens_local, D_MODEL, generator=gen).to(dtype) for _ in range(world_size)]
        shape = MoEShape(D_MODEL, N_EXPERTS, k)
        to_ep, to_dp = (NCCL_ALL_TO_ALL.prepare(Problem.moe(op, shape, n_tokens_local, DTYPE_NAMES[dtype],
                                                            world_size), None, ctx)
                        for op in ("dp_to_ep", "ep_to_dp"))
        ep = to_ep(srcs[rank], assignment, expt_indx, gate)
        before = [poison([ep], seed=r)[0] for r in range(world_size)]  # the same poison on every rank
        poison([ep], seed=rank)
        assert to_ep(srcs[rank], assignment, expt_indx, gate) is ep  # one buffer, reused
        want = reference_dp_to_ep(srcs, assignment, expt_indx, gate, out=before)[rank]
        assert torch.equal(bits(ep), bits(want)), f"dp->ep {k} {placement}: rows differ or dropped rows changed"
        ep_srcs = [torch.randn(ep.shape, generator=gen).to(dtype) for _ in range(world_size)]
        dp = to_dp(ep_srcs[rank], assignment, expt_indx, topk)
        mask = rows_written("ep_to_dp", assignment, expt_indx, topk, world_size)[rank]
        want = reference_ep_to_dp(ep_srcs, assignment, expt_indx, topk)[rank]
        assert torch.equal(dp[mask], want[mask]), f"ep->dp {k} {placement}"
        dp = to_dp(ep.clone(), assignment, expt_indx, topk)  # the round trip
        assert torch.equal(dp[mask], srcs[rank].repeat_interleave(k, 0)[mask]), f"round trip {k} {placement}"


def test_launchers_over_gloo_match_the_reference():
    run_with_deadline(_gloo_rank, 3, deadline_s=120)
