"""autosymm.kernels.moe_splits through nccl_all_to_all.DeviceSplits, under the interpreter: the
same Splits (rows sent grouped by receiver, rows received grouped by sender, each group in item
order, and the split sizes) as the torch planning (dp_to_ep_splits / ep_to_dp_splits, the CPU
path) on every rank, for both ops, in one program and over several chunks of several tiles."""

from __future__ import annotations

import os

import pytest
import torch

if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("interpreter tests (CUDA present, TRITON_INTERPRET unset)", allow_module_level=True)
os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported

import autosymm.backends.nccl_all_to_all as nccl  # noqa: E402
from autosymm.routing import (make_expt_assignment, make_expt_dict_random, make_expt_dict_uniform, random_expt_indx,
                              route)

N_EXPERTS = 10
MODES = {  # (ONE_PROGRAM_MAX_ITEMS, SPLIT_BLOCK, SPLIT_GRID)
    "one_program": (4096, 2048, 64),  # one launch, one tile
    "one_program_tiles": (4096, 8, 64),  # one launch, a running count over several tiles
    "chunks": (0, 8, 4),  # two launches, 4 programs of 2-3 tiles each
}


def _routing(world_size, n_tokens_local, k, seed, index_dtype, corrupt):
    """(expt_owner, expt_indx, gate, topk); ``corrupt``: expert ids past either end (int64: past the
    int32 range too), gate/topk entries outside [0, n_pairs), an owner outside the group."""
    make = make_expt_dict_random(world_size, N_EXPERTS, seed=seed) if seed % 2 else \
        make_expt_dict_uniform(world_size, N_EXPERTS)
    owner = make_expt_assignment(world_size, N_EXPERTS, make).expt_owner.clone()
    expt_indx = random_expt_indx(world_size * n_tokens_local, N_EXPERTS, k, seed=seed, drop_fraction=0.15)
    gate, topk = route(expt_indx, N_EXPERTS)
    expt_indx, gate, topk = (t.to(index_dtype) for t in (expt_indx, gate, topk))
    if corrupt:
        n_pairs = expt_indx.numel()
        picks = torch.randperm(n_pairs, generator=torch.Generator().manual_seed(seed)).tolist()
        flat = expt_indx.view(-1)
        flat[picks[0]], flat[picks[1]], flat[picks[2]] = N_EXPERTS, -3, N_EXPERTS + 7
        if index_dtype == torch.int64:
            flat[picks[7]], gate.view(-1)[picks[8]], topk[picks[9]] = 2 ** 32 + 1, 2 ** 32, 2 ** 32 + 2
        gate.view(-1)[picks[3]], gate.view(-1)[picks[4]] = n_pairs, -2
        topk[picks[5]], topk[picks[6]] = n_pairs + 1, -1
        owner[int(flat[picks[10]]) % N_EXPERTS] = world_size + 3
    return owner, expt_indx, gate, topk


def _torch_splits(op, owner, expt_indx, indx, rank, world_size):
    table = nccl.owner_table(type("Assignment", (), {"expt_owner": owner})(), world_size, {})
    plan = nccl.dp_to_ep_splits if op == "dp_to_ep" else nccl.ep_to_dp_splits
    return plan(table, expt_indx, indx, expt_indx.shape[0] // world_size, rank, world_size)


@pytest.mark.parametrize("world_size,k,index_dtype,corrupt,mode", [
    (2, 4, torch.int32, False, "one_program"), (2, 6, torch.int64, True, "chunks"),
    (3, 2, torch.int16, True, "one_program_tiles"), (3, 5, torch.int32, False, "chunks"),
    (4, 3, torch.int64, True, "one_program"), (4, 4, torch.int32, True, "chunks"), (1, 3, torch.int32, True, "chunks"),
])
def test_kernel_splits_equal_the_torch_splits(monkeypatch, world_size, k, index_dtype, corrupt, mode):
    for name, value in zip(("ONE_PROGRAM_MAX_ITEMS", "SPLIT_BLOCK", "SPLIT_GRID"), MODES[mode]):
        monkeypatch.setattr(nccl, name, value)
    owner, expt_indx, gate, topk = _routing(world_size, 5, k, world_size + k, index_dtype, corrupt)
    for op, indx in (("dp_to_ep", gate), ("ep_to_dp", topk)):
        for rank in range(world_size):
            want = _torch_splits(op, owner, expt_indx, indx, rank, world_size)
            got = nccl.DeviceSplits(op, rank, world_size)(owner, expt_indx, indx)
            where = f"{op} rank {rank}"
            assert got.send_counts == want.send_counts and got.recv_counts == want.recv_counts, where
            assert torch.equal(got.send_rows, want.send_rows), where
            assert torch.equal(got.recv_rows, want.recv_rows), where


def test_buffers_grow_once_and_launchers_are_made_once_per_specialisation(monkeypatch):
    monkeypatch.setattr(nccl, "SPLIT_BLOCK", 8)
    plan = nccl.DeviceSplits("ep_to_dp", 1, 2)
    for n_tokens_local in (3, 2, 5, 4):
        owner, expt_indx, _, topk = _routing(2, n_tokens_local, 2, 3, torch.int32, False)
        got = plan(owner, expt_indx, topk)
        want = _torch_splits("ep_to_dp", owner, expt_indx, topk, 1, 2)
        assert torch.equal(got.send_rows, want.send_rows) and torch.equal(got.recv_rows, want.recv_rows)
    ((buffers, _),) = plan._buffers.values()
    assert buffers[1].numel() == 32  # next power of two of the largest call (2 * 5 * 2 items)
    assert len(plan._launchers) == 1


def test_bound_launches_pass_the_addresses_of_the_same_tensors():
    """Once a LeanLauncher is bound (on a GPU), DeviceSplits passes int addresses: the kernel then
    sees the very tensors the first, unbound call passed (here: addresses mapped back to them)."""
    plan = nccl.DeviceSplits("dp_to_ep", 1, 3)
    owner, expt_indx, gate, _ = _routing(3, 4, 3, 5, torch.int32, True)
    first = plan(owner, expt_indx, gate)
    want = (first.send_rows.clone(), first.send_counts, first.recv_rows.clone(), first.recv_counts)
    ((buffers, _),) = plan._buffers.values()
    tensors = {t.data_ptr(): t for t in (expt_indx, gate, owner, *buffers)}
    bound = []
    for launcher in (launcher for launchers in plan._launchers.values() for launcher in launchers):
        def direct(*args, launcher=launcher):
            bound.append(args)
            launcher.fn[launcher.grid](*(tensors[arg] for arg in args[:7]), *args[7:], **launcher.constexprs,
                                       **launcher.options)
        launcher._launch = direct
    buffers[1].fill_(-1), buffers[2].fill_(-1), buffers[3].fill_(-1)
    got = plan(owner, expt_indx, gate)
    assert len(bound) == 1 and all(isinstance(arg, int) for arg in bound[0])
    assert torch.equal(got.send_rows, want[0]) and got.send_counts == want[1]
    assert torch.equal(got.recv_rows, want[2]) and got.recv_counts == want[3]
