"""The plain MoE path's bookkeeping (autosymm.bench.moe_plain.plain_rows) against the routing
layout of the reference conversions, over 3 simulated ranks. The plain callables themselves run
over gloo in tests/tuning/test_bench.py (checked against the NCCL path through plain_rows)."""

import pytest
import torch

from autosymm.routing import make_expt_assignment, make_expt_dict_random, random_expt_indx, route
from autosymm.bench.moe_plain import plain, plain_rows
from _moe_ref import reference_dp_to_ep, reference_ep_to_dp

WORLD, TOKENS, EXPERTS, K, D = 3, 5, 7, 2, 4


@pytest.fixture(scope="module")
def routing():
    assignment = make_expt_assignment(WORLD, EXPERTS, make_expt_dict_random(WORLD, EXPERTS, seed=3))
    expt_indx = random_expt_indx(WORLD * TOKENS, EXPERTS, K, seed=4)
    gate, topk = route(expt_indx)
    owner = assignment.expt_owner.long()[expt_indx.reshape(-1).long()]
    return assignment, expt_indx, gate, topk, owner


def _arrivals(sends):
    """What all_to_all_single delivers to each rank: ``sends[s][r]`` (sender s's rows for r, in
    s's order), concatenated over senders in rank order."""
    return [torch.cat([sends[s][r] for s in range(WORLD)]) for r in range(WORLD)]


def test_dp_to_ep_rows_in_arrival_order(routing):
    assignment, expt_indx, gate, _, owner = routing
    srcs = [torch.randn(TOKENS, D, generator=torch.Generator().manual_seed(r)) for r in range(WORLD)]
    n_pairs_local = TOKENS * K
    sends = [[srcs[s][torch.nonzero(owner[s * n_pairs_local:(s + 1) * n_pairs_local] == r).flatten() // K]
              for r in range(WORLD)] for s in range(WORLD)]
    layouts = reference_dp_to_ep(srcs, assignment, expt_indx, gate)
    for rank, arrived in enumerate(_arrivals(sends)):
        rows = plain_rows("dp_to_ep", assignment, expt_indx, gate, rank, WORLD)
        assert rows.numel() == int((owner == rank).sum()) and torch.equal(layouts[rank][rows], arrived)


def test_ep_to_dp_rows_in_arrival_order(routing):
    assignment, expt_indx, gate, topk, owner = routing
    n_rows, n_pairs_local = WORLD * TOKENS * K, TOKENS * K
    srcs = [torch.randn(n_rows, D, generator=torch.Generator().manual_seed(10 + r)) for r in range(WORLD)]
    pair = topk.long()  # sorted row s holds pair pair[s]; its home rank is pair // n_pairs_local
    sends = [[srcs[s][torch.nonzero((owner[pair] == s) & (pair // n_pairs_local == r)).flatten()]
              for r in range(WORLD)] for s in range(WORLD)]
    layouts = reference_ep_to_dp(srcs, assignment, expt_indx, topk)
    for rank, arrived in enumerate(_arrivals(sends)):
        rows = plain_rows("ep_to_dp", assignment, expt_indx, topk, rank, WORLD)
        assert sorted(rows.tolist()) == list(range(n_pairs_local)) and torch.equal(layouts[rank][rows], arrived)


def test_unknown_op_is_named():
    with pytest.raises(ValueError, match="op='all_reduce'"):
        plain("all_reduce", 0, 2)
    with pytest.raises(ValueError, match="op='x'"):
        plain_rows("x", None, torch.zeros(2, 1, dtype=torch.int32), torch.zeros(2), 0, 2)
