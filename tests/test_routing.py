"""Expert placement, routing, references, and the launchers' input validation (autosymm.routing)."""

from __future__ import annotations

import pytest
import torch

from autosymm.backends.base import BackendError, RunContext
from autosymm.backends.triton_moe import TRITON_MOE
from autosymm.configs import MoEConfig
from autosymm.routing import (ExptAssignment, make_expt_assignment, make_expt_dict_random, make_expt_dict_uniform,
                              random_expt_indx, route)
from _moe_ref import reference_dp_to_ep, reference_ep_to_dp, rows_written
from autosymm.problem import MoEShape, Problem
from autosymm.workspace.symm import simulated_workspaces


# -- placement ---------------------------------------------------------------------------------

def test_uniform_placement_is_contiguous_and_spreads_the_remainder():
    assert make_expt_dict_uniform(2, 4) == {0: [0, 1], 1: [2, 3]}
    assert make_expt_dict_uniform(3, 8) == {0: [0, 1, 2], 1: [3, 4, 5], 2: [6, 7]}
    with pytest.raises(ValueError, match="n_expt_tot=2"):
        make_expt_dict_uniform(3, 2)


def test_random_placement_is_a_reproducible_partition():
    a, b = make_expt_dict_random(4, 64, seed=7), make_expt_dict_random(4, 64, seed=7)
    assert a == b and a != make_expt_dict_random(4, 64, seed=8)
    assert sorted(e for experts in a.values() for e in experts) == list(range(64))
    assert all(len(experts) > 0 for experts in a.values())
    assert make_expt_dict_random(1, 3) == {0: [0, 1, 2]}


def test_assignment_tensors_agree():
    n_shard, n_tot = 3, 40  # words not full, bit 31 set (negative int32 word)
    experts = make_expt_dict_random(n_shard, n_tot, seed=1)
    a = make_expt_assignment(n_shard, n_tot, experts)
    assert isinstance(a, ExptAssignment) and a.n_expt_shard == n_shard and a.n_expts_tot == n_tot
    assert a.expt_bitmask.dtype == a.expt_map.dtype == a.expt_owner.dtype == torch.int32
    assert a.expt_bitmask.shape == (n_shard, 2)
    for shard, owned in experts.items():
        assert a.n_expts_per_shard[shard] == len(owned)
        for e in range(n_tot):
            mine = e in owned
            assert bool(a.expt_boolmask[shard, e]) == mine
            assert bool((int(a.expt_bitmask[shard, e // 32]) >> (e % 32)) & 1) == mine
            assert int(a.expt_map[shard, e]) == (sorted(owned).index(e) if mine else -1)
            if mine:
                assert int(a.expt_owner[e]) == shard


@pytest.mark.parametrize("experts,match", [
    ({0: [0, 1], 1: [1, 2, 3]}, "expert 1 is owned by two shards: 0 and 1"),
    ({0: [0, 1], 1: [2]}, "expert 3 is owned by no shard"),
    ({0: [0, 1, 2, 3], 1: []}, "shard 1 owns no expert"),
    ({0: [0, 1, 2, 3]}, "shard 1 owns no expert"),
    ({0: [0, 1], 1: [2, 7]}, "expert id 7 of shard 1 out of range"),
    ({0: [0, -1], 1: [2, 3]}, "expert id -1 of shard 0 out of range"),
    ({0: [0, 1], 2: [2, 3]}, "shard 2 out of range"),
])
def test_assignment_rejects_bad_placements(experts, match):
    with pytest.raises(ValueError, match=match):
        make_expt_assignment(2, 4, experts)


def test_assignment_rejects_non_integer_ids():
    with pytest.raises(TypeError, match="expert ids must be ints"):
        make_expt_assignment(2, 4, {0: [0, 1.0], 1: [2, 3]})
    with pytest.raises(TypeError, match="list of expert ids"):
        make_expt_assignment(2, 4, {0: {0, 1}, 1: [2, 3]})


# -- routing -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.int16, torch.int32, torch.int64])
def test_route_is_a_stable_sort_and_its_inverse(dtype):
    expt_indx = random_expt_indx(24, 10, 3, seed=4, dtype=dtype)
    gate, topk = route(expt_indx)
    assert gate.dtype == topk.dtype == torch.int32 and gate.shape == (24, 3) and topk.shape == (72,)
    assert gate.device == topk.device == expt_indx.device
    flat = expt_indx.flatten().long()
    assert torch.equal(topk.long(), torch.argsort(flat, stable=True))
    assert torch.equal(gate.flatten()[topk.long()].long(), torch.arange(72))
    assert bool((flat[topk.long()].diff() >= 0).all())


def test_route_sorts_invalid_pairs_last():
    expt_indx = torch.tensor([[2, -1], [0, 5], [-1, 1]], dtype=torch.int32)
    gate, topk = route(expt_indx, n_expts_tot=4)
    assert topk.tolist() == [2, 5, 0, 1, 3, 4]  # experts 0, 1, 2 then the pairs of -1, -1, 5 in pair order
    assert route(expt_indx)[1].tolist() == [2, 5, 0, 3, 1, 4]  # without n_expts_tot only < 0 is invalid


def test_route_rejects_bad_shapes_and_dtypes():
    with pytest.raises(ValueError, match=r"\[n_tokens, k\]"):
        route(torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="integer"):
        route(torch.zeros(4, 2))


def test_random_expt_indx_has_distinct_experts_and_drops():
    indx = random_expt_indx(50, 16, 6, seed=2, drop_fraction=0.25)
    assert indx.shape == (50, 6) and indx.dtype == torch.int32
    for row in indx.tolist():
        kept = [e for e in row if e >= 0]
        assert len(set(kept)) == len(kept)
    assert 0 < int((indx < 0).sum()) < indx.numel()
    assert torch.equal(indx, random_expt_indx(50, 16, 6, seed=2, drop_fraction=0.25))


# -- references --------------------------------------------------------------------------------

def test_references_on_a_hand_example():
    # 2 ranks, 1 token each, k = 2, experts {0, 1} on rank 0 and {2, 3} on rank 1.
    a = make_expt_assignment(2, 4, {0: [0, 1], 1: [2, 3]})
    expt_indx = torch.tensor([[3, 0], [1, -1]], dtype=torch.int32)  # pairs 0..3
    gate, topk = route(expt_indx)  # sorted: pair1 (e0), pair2 (e1), pair0 (e3), pair3 (dropped)
    assert topk.tolist() == [1, 2, 0, 3]
    srcs = [torch.tensor([[10.0]]), torch.tensor([[20.0]])]
    ep = reference_dp_to_ep(srcs, a, expt_indx, gate, out=[torch.full((4, 1), -1.0)] * 2)
    assert ep[0].flatten().tolist() == [10.0, 20.0, -1.0, -1.0]
    assert ep[1].flatten().tolist() == [-1.0, -1.0, 10.0, -1.0]
    dp = reference_ep_to_dp(ep, a, expt_indx, topk, out=[torch.full((2, 1), -1.0)] * 2)
    assert dp[0].flatten().tolist() == [10.0, 10.0] and dp[1].flatten().tolist() == [20.0, -1.0]
    assert [m.tolist() for m in rows_written("dp_to_ep", a, expt_indx, gate, 2)] == \
        [[True, True, False, False], [False, False, True, False]]
    assert [m.tolist() for m in rows_written("ep_to_dp", a, expt_indx, topk, 2)] == [[True, True], [True, False]]
    with pytest.raises(ValueError, match="op="):
        rows_written("all_reduce", a, expt_indx, gate, 2)


# -- launcher input validation -------------------------------------------------------------------

D, K, E, R, T = 64, 2, 4, 2, 3  # d_model, top-k, experts, world size, tokens per rank


def _launcher(op="dp_to_ep", device="cpu", n_tokens_local=T, moe_bytes=1 << 20):
    ws = simulated_workspaces(R, moe_bytes=moe_bytes, device=device)[0]
    problem = Problem.moe(op, MoEShape(D, E, K), n_tokens_local, "bf16", R)
    return TRITON_MOE.prepare(problem, MoEConfig(256, 1), RunContext(workspace=ws))


def _inputs(op="dp_to_ep", n_tokens_local=T, k=K, shards=R):
    a = make_expt_assignment(shards, E, make_expt_dict_uniform(shards, E))
    expt_indx = random_expt_indx(R * n_tokens_local, E, k)
    gate, topk = route(expt_indx)
    rows = n_tokens_local if op == "dp_to_ep" else R * n_tokens_local * k
    return torch.randn(rows, D).bfloat16(), a, expt_indx, gate if op == "dp_to_ep" else topk


@pytest.mark.parametrize("mutate,match", [
    (lambda s, a, e, i: (s.float(), a, e, i), "src has dtype torch.float32, expected torch.bfloat16"),
    (lambda s, a, e, i: (torch.randn(D, T).bfloat16().t(), a, e, i), "src of shape .* is not contiguous"),
    (lambda s, a, e, i: (s[:, : D // 2].contiguous(), a, e, i), r"src has shape \(3, 32\), expected \[3, 64\]"),
    (lambda s, a, e, i: (s[:2], a, e, i), r"n_tokens_global=6 must be world size 2 \* n_tokens_local"),
    (lambda s, a, e, i: (s, a, e[:, :1].contiguous(), i),
     r"expt_indx has shape \(6, 1\), expected \[n_tokens_global, 2\]"),
    (lambda s, a, e, i: (s, a, e[:5], i), "n_tokens_global=5 is not a multiple of world size 2"),
    (lambda s, a, e, i: (s, a, e.float(), i), "expt_indx has dtype torch.float32"),
    (lambda s, a, e, i: (s, a, e, i[:2]), "index tensor of shape .* has 4 entries, expected n_tokens_global"),
    (lambda s, a, e, i: (s, a, e, i.t()), "gate_indx of shape .* is not contiguous"),
    (lambda s, a, e, i: (s, make_expt_assignment(4, E, make_expt_dict_uniform(4, E)), e, i),
     "assignment has 4 shards, the group 2 ranks"),
    (lambda s, a, e, i: (s, make_expt_assignment(2, 8, make_expt_dict_uniform(2, 8)), e, i),
     "assignment has 8 experts, the problem 4"),
    (lambda s, a, e, i: (s, {"expt_owner": a.expt_owner}, e, i), "must be an ExptAssignment"),
    (lambda s, a, e, i: ("src", a, e, i), "src must be a torch.Tensor"),
])
def test_launcher_rejects_bad_inputs(mutate, match):
    launcher = _launcher()
    with pytest.raises(BackendError, match=match):
        launcher(*mutate(*_inputs()))


def test_launcher_rejects_ep_to_dp_src_of_wrong_rows():
    src, a, e, topk = _inputs("ep_to_dp")
    with pytest.raises(BackendError, match=r"src has shape \(11, 64\), expected \[12, 64\] \(\[n_tokens_global \* k"):
        _launcher("ep_to_dp")(src[:11], a, e, topk)


def test_launcher_rejects_tensors_on_another_device():
    with pytest.raises(BackendError, match="src is on cpu, the group's device is meta"):
        _launcher(device="meta")(*_inputs())


def test_launcher_rejects_outputs_larger_than_the_moe_buffer():
    # dp->ep needs R * T' * K * D * 2 bytes: 2 * 64 * 2 * 64 * 2 = 32 KiB > 2/3 of a 16 KiB region.
    launcher = _launcher(moe_bytes=16 << 10)
    with pytest.raises(BackendError, match=r"needs 32768 bytes, the MoE workspace buffer has \d+"):
        launcher(*_inputs(n_tokens_local=64))


def test_prepare_needs_a_workspace_a_config_and_the_same_world_size():
    problem = Problem.moe("dp_to_ep", MoEShape(D, E, K), T, "bf16", R)
    ws = simulated_workspaces(R)[0]
    with pytest.raises(BackendError, match="needs a symmetric-memory workspace"):
        TRITON_MOE.prepare(problem, MoEConfig(256, 1), RunContext())
    with pytest.raises(BackendError, match="needs a MoEConfig"):
        TRITON_MOE.prepare(problem, None, RunContext(workspace=ws))
    with pytest.raises(BackendError, match="workspace has world size 4, the problem 2"):
        TRITON_MOE.prepare(problem, MoEConfig(256, 1), RunContext(workspace=simulated_workspaces(4)[0]))
