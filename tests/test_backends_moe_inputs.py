"""autosymm.backends.moe_inputs: one index contract on every MoE path. The checks themselves;
expert ids of any width (an int64 id of 2**32 or more is dropped, never wrapped) written alike
by the Triton kernels (interpreter, simulated ranks) and the NCCL path's plans; and the public
calls over gloo (the NCCL path) refusing a bad owner table, indices that are not a permutation
or ids that differ across ranks, on every rank."""

from __future__ import annotations

import os

import pytest
import torch

if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("interpreter tests (CUDA present, TRITON_INTERPRET unset)", allow_module_level=True)
os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported

from autosymm.backends.base import BackendError  # noqa: E402
from autosymm.backends.moe_inputs import check_index_ranges, check_inputs  # noqa: E402
from autosymm.backends.nccl_all_to_all import dp_to_ep_splits, ep_to_dp_splits, owner_table  # noqa: E402
from autosymm.configs import MoEConfig  # noqa: E402
from autosymm.problem import MoEShape, Problem  # noqa: E402
from autosymm.routing import make_expt_assignment, make_expt_dict_random, random_expt_indx, route  # noqa: E402
from autosymm.workspace.symm import simulated_workspaces  # noqa: E402

from _gloo import run_gloo  # noqa: E402
from _moe_sim import bits, dst_views, poison, run_all_ranks  # noqa: E402

N_EXPERTS, D_MODEL, K = 10, 16, 2


def _routing(world_size, n_tokens_local, seed=0):
    assignment = make_expt_assignment(world_size, N_EXPERTS, make_expt_dict_random(world_size, N_EXPERTS, seed=seed))
    expt_indx = random_expt_indx(world_size * n_tokens_local, N_EXPERTS, K, seed=seed, dtype=torch.int64)
    return assignment, expt_indx


# -- the checks ---------------------------------------------------------------------------------

def test_owners_outside_the_group_are_refused():
    assignment, expt_indx = _routing(2, 3)
    gate, _ = route(expt_indx, N_EXPERTS)
    check_index_ranges("dp_to_ep", expt_indx, gate, assignment.expt_owner, 2)
    for bad in (2, -1, 7):
        owners = assignment.expt_owner.clone()
        owners[4] = bad
        with pytest.raises(BackendError, match=rf"dp_to_ep: assignment.expt_owner holds ranks in \[-?\d+, \d+\], "
                                               r"outside the group's \[0, 2\); build it with "
                                               r"autosymm.make_expt_assignment\(2, ...\)"):
            check_index_ranges("dp_to_ep", expt_indx, gate, owners, 2)


@pytest.mark.parametrize("op", ["dp_to_ep", "ep_to_dp"])
def test_indices_that_are_not_a_permutation_are_refused(op):
    assignment, expt_indx = _routing(2, 3)
    gate, topk = route(expt_indx, N_EXPERTS)
    indx = (gate if op == "dp_to_ep" else topk).clone()
    check_index_ranges(op, expt_indx, indx, assignment.expt_owner, 2)
    flat = indx.view(-1)
    flat[5] = flat[2]  # pair/row flat[2] twice, the old flat[5] never
    name = "gate_indx" if op == "dp_to_ep" else "topk_indx"
    with pytest.raises(BackendError, match=rf"{op}: {name} is not a permutation of \[0, 12\) \(n_tokens_global \* k\): "
                                           rf"1 value\(s\) missing, {int(flat[2])} given 2 times"):
        check_index_ranges(op, expt_indx, indx, assignment.expt_owner, 2)
    flat[5] = 12
    with pytest.raises(BackendError, match=rf"{name} holds values in \[0, 12\], outside \[0, 12\)"):
        check_index_ranges(op, expt_indx, indx, assignment.expt_owner, 2)


def test_an_owner_table_of_another_size_is_refused():
    assignment, expt_indx = _routing(2, 3)
    gate, _ = route(expt_indx, N_EXPERTS)
    assignment.expt_owner = assignment.expt_owner[:-1].clone()
    problem = Problem.moe("dp_to_ep", MoEShape(D_MODEL, N_EXPERTS, K), 3, "fp32", 2)
    with pytest.raises(BackendError, match=r"assignment.expt_owner has shape \(9,\), expected \[10\] "
                                           r"\(one owner per expert\)"):
        check_inputs(problem, torch.device("cpu"), 2, torch.ones(3, D_MODEL), assignment, expt_indx, gate)


# -- expert ids of any width: the same rows on both paths ---------------------------------------

def _plan_rows_sent(op, assignment, expt_indx, indx, world_size):
    plan = dp_to_ep_splits if op == "dp_to_ep" else ep_to_dp_splits
    table = owner_table(assignment, world_size, {})
    n_tokens_local = expt_indx.shape[0] // world_size
    return [plan(table, expt_indx, indx, n_tokens_local, rank, world_size) for rank in range(world_size)]


def _triton_outputs(op, wss, srcs, assignment, expt_indx, indx, n_tokens_local):
    outs = dst_views(wss, op, n_tokens_local, K, D_MODEL, torch.float32)
    poison(outs, seed=3)
    run_all_ranks(op, wss, MoEConfig(32, 1, rows_per_program=2), srcs, assignment, expt_indx, indx)
    return [out.clone() for out in outs]


@pytest.mark.parametrize("op", ["dp_to_ep", "ep_to_dp"])
def test_int64_ids_beyond_32_bits_are_dropped_by_the_kernels_and_the_nccl_plans_alike(op):
    world_size, n_tokens_local = 2, 4
    assignment, expt_indx = _routing(world_size, n_tokens_local, seed=1)
    wide = expt_indx.clone()
    picks = [0, 3, 9, 14]
    wide.view(-1)[picks] += torch.tensor([1 << 32, 1 << 32, 3 << 32, 1 << 40])  # in range mod 2**32
    dropped = expt_indx.clone()
    dropped.view(-1)[picks] = -1
    gate, topk = route(wide, N_EXPERTS)
    assert torch.equal(route(dropped, N_EXPERTS)[0], gate)  # route already treats them as dropped
    indx = gate if op == "dp_to_ep" else topk
    gen = torch.Generator().manual_seed(5)
    rows = n_tokens_local if op == "dp_to_ep" else world_size * n_tokens_local * K
    srcs = [torch.randn(rows, D_MODEL, generator=gen) for _ in range(world_size)]
    wss = simulated_workspaces(world_size, moe_bytes=1 << 20)
    got = _triton_outputs(op, wss, srcs, assignment, wide, indx, n_tokens_local)
    want = _triton_outputs(op, wss, srcs, assignment, dropped, indx, n_tokens_local)
    for rank in range(world_size):
        assert torch.equal(bits(got[rank]), bits(want[rank])), f"{op} rank {rank}: a wide id was wrapped"
    sent = [sum(s.send_counts) for s in _plan_rows_sent(op, assignment, wide, indx, world_size)]
    assert sent == [sum(s.send_counts) for s in _plan_rows_sent(op, assignment, dropped, indx, world_size)]
    assert sum(sent) == expt_indx.numel() - len(picks)


# -- the public calls over gloo (the NCCL path): every rank learns ------------------------------

def _expect(error_type, match, fn):
    with pytest.raises(error_type, match=match):
        fn()


def _public_calls(rank, world_size):
    import autosymm
    from autosymm.runtime.agreement import AgreementError

    n_tokens_local = 3
    assignment, expt_indx = _routing(world_size, n_tokens_local, seed=2)
    src = torch.randn(n_tokens_local, D_MODEL, generator=torch.Generator().manual_seed(rank))
    gate, topk = route(expt_indx, N_EXPERTS)
    bad_owner = make_expt_assignment(world_size, N_EXPERTS, make_expt_dict_random(world_size, N_EXPERTS, seed=2))
    bad_owner.expt_owner[3] = world_size  # on every rank
    _expect(BackendError, r"expt_owner holds ranks in \[0, 2\]",
            lambda: autosymm.convert_dp_to_ep(src, bad_owner, expt_indx, gate))
    twice = gate.clone()
    twice.view(-1)[1] = twice.view(-1)[0]
    mine = twice if rank == 1 else gate  # on one rank only: it raises its error, the peer names it
    _expect(BackendError if rank == 1 else AgreementError, "gate_indx is not a permutation",
            lambda: autosymm.convert_dp_to_ep(src, assignment, expt_indx, mine))
    other = expt_indx.clone()
    other[0] = other[0].flip(0)  # one rank's ids differ from its peer's
    mine = other if rank == 1 else expt_indx
    _expect(AgreementError, r"expt_indx digest [0-9a-f]{12}', rank 1 .*expt_indx digest [0-9a-f]{12}'",
            lambda: autosymm.convert_dp_to_ep(src, assignment, mine, route(mine, N_EXPERTS)[0]))
    wide = expt_indx.clone()
    wide.view(-1)[::5] += 1 << 32  # dropped, never wrapped: the round trip returns only the others
    gate, topk = route(wide, N_EXPERTS)
    ep = autosymm.convert_dp_to_ep(src, assignment, wide, gate).clone()
    bad_topk = topk.clone()
    bad_topk[0] = bad_topk[1]
    _expect(BackendError, "topk_indx is not a permutation",
            lambda: autosymm.convert_ep_to_dp(ep, assignment, wide, bad_topk))
    dp = autosymm.convert_ep_to_dp(ep, assignment, wide, topk)
    mine = slice(rank * n_tokens_local * K, (rank + 1) * n_tokens_local * K)
    kept = ((wide.view(-1) >= 0) & (wide.view(-1) < N_EXPERTS))[mine]
    assert int(kept.sum()) < n_tokens_local * K  # pairs 0, 5 and 10 are dropped
    assert torch.equal(dp[kept], src.repeat_interleave(K, 0)[kept])
    return autosymm.explain(problem=Problem.moe("dp_to_ep", MoEShape(D_MODEL, N_EXPERTS, K), n_tokens_local, "fp32",
                                                world_size), op="dp_to_ep").backend


def test_the_public_calls_refuse_bad_owners_and_indices_on_every_rank(tmp_path):
    env = {"all": {"AUTOSYMM_DB": str(tmp_path / "none.sqlite"), "AUTOSYMM_AGREE_TIMEOUT_S": "10"}}
    assert run_gloo(_public_calls, 2, env=env, deadline_s=120) == {0: "nccl_all_to_all", 1: "nccl_all_to_all"}
