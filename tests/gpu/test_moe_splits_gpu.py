"""The split-planning kernel (autosymm.kernels.moe_splits, through nccl_all_to_all.DeviceSplits)
on one real GPU: the same Splits as the torch planning on the same CUDA tensors, for every rank of
simulated groups of 2-8, both ops, in one program and over many chunks (calls up to 24k items),
bad indices included. No process group needed."""

from __future__ import annotations

import pytest
import torch

from autosymm.routing import make_expt_assignment, make_expt_dict_random, random_expt_indx, route

from ._dist import requires_cuda

pytestmark = [requires_cuda, pytest.mark.gpu]

CASES = [(2, 256, 8, 8, torch.int32), (2, 1536, 160, 6, torch.int64), (3, 100, 12, 4, torch.int16),
         (8, 384, 256, 8, torch.int32)]  # world size, tokens per rank, experts, top-k, index dtype


@pytest.mark.parametrize("world_size,n_tokens_local,n_expts,k,index_dtype", CASES)
def test_kernel_splits_equal_the_torch_splits_on_cuda(world_size, n_tokens_local, n_expts, k, index_dtype):
    from autosymm.backends.nccl_all_to_all import DeviceSplits, dp_to_ep_splits, ep_to_dp_splits, owner_table

    device = torch.device("cuda", 0)
    assignment = make_expt_assignment(world_size, n_expts, make_expt_dict_random(world_size, n_expts, seed=k), device)
    expt_indx = random_expt_indx(world_size * n_tokens_local, n_expts, k, seed=k, drop_fraction=0.1, device=device)
    gate, topk = route(expt_indx)
    expt_indx.view(-1)[::13] += n_expts  # out-of-range ids
    gate.view(-1)[5::17] = -1  # out-of-range gate / topk entries
    topk[7::19] = expt_indx.numel()
    expt_indx, gate, topk = (t.to(index_dtype) for t in (expt_indx, gate, topk))
    table = owner_table(assignment, world_size, {})
    for op, indx, plan in (("dp_to_ep", gate, dp_to_ep_splits), ("ep_to_dp", topk, ep_to_dp_splits)):
        for rank in range(world_size):
            want = plan(table, expt_indx, indx, n_tokens_local, rank, world_size)
            got = DeviceSplits(op, rank, world_size)(assignment.expt_owner, expt_indx, indx)
            assert got.send_counts == want.send_counts and got.recv_counts == want.recv_counts, (op, rank)
            assert torch.equal(got.send_rows, want.send_rows), (op, rank)
            assert torch.equal(got.recv_rows, want.recv_rows), (op, rank)
