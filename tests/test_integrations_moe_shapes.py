"""torchtitan's dispatcher and vLLM's gathered-rows layout (autosymm.integrations.moe_shapes /
moe_rows) on 2 gloo ranks: their own checks of a call failing on one rank after a first good call
raise on every rank, through the manager's agreed header, instead of leaving the peer in a
collective."""

from __future__ import annotations

import pytest
import torch
from _gloo import run_gloo

N_TOKENS, D_MODEL, N_EXPERTS, K = 4, 16, 4, 2


def _inputs(rank):
    gen = torch.Generator().manual_seed(rank)
    ids = torch.stack([torch.randperm(N_EXPERTS, generator=gen)[:K] for _ in range(N_TOKENS)])
    return torch.randn(N_TOKENS, D_MODEL, generator=gen), torch.rand(N_TOKENS, K, generator=gen), ids


def _everyone_raises(rank, bad_rank, call, mine, call_name):
    theirs = rf"rank\(s\) \[{bad_rank}\] of the group failed their checks of this {call_name}"
    with pytest.raises(ValueError, match=mine if rank == bad_rank else theirs):
        call()


def _gathered(rank, x, ids):
    from autosymm.integrations import GatheredRows

    layout = GatheredRows(N_EXPERTS)
    sizes = [N_TOKENS, N_TOKENS - 1]
    mine = slice(0, sizes[rank])
    hs, _, call = layout.dispatch(x[mine], ids[mine], sizes)
    good = layout.combine(hs, call)
    wrong = [N_TOKENS, N_TOKENS] if rank == 1 else sizes  # rank 1's own count is 3
    _everyone_raises(rank, 1, lambda: layout.dispatch(x[mine], ids[mine], wrong), r"sizes=\[4, 4\]", "dispatch")
    hs, _, call = layout.dispatch(x[mine], ids[mine], sizes)
    rows = hs[:-1] if rank == 0 else hs
    _everyone_raises(rank, 0, lambda: layout.combine(rows, call), "combine: partial has shape", "combine")
    hs, _, call = layout.dispatch(x[mine], ids[mine], sizes)
    assert torch.equal(layout.combine(hs, call), good)  # still in step


def _titan(rank, x, weights, ids):
    from autosymm.integrations import TitanTokenDispatcher

    titan = TitanTokenDispatcher(N_EXPERTS)
    counts = torch.zeros(N_EXPERTS, dtype=torch.int64)
    routed, _, metadata = titan.dispatch(x, weights, ids, counts)
    good = titan.combine(routed, metadata, x)
    bad_counts = counts[:-1] if rank == 1 else counts
    _everyone_raises(rank, 1, lambda: titan.dispatch(x, weights, ids, bad_counts),
                     "num_local_tokens_per_expert_E has shape", "dispatch")
    routed, _, metadata = titan.dispatch(x, weights, ids, counts)
    bad_routed = routed.new_zeros(routed.shape[0] + 1, D_MODEL) if rank == 0 else routed
    _everyone_raises(rank, 0, lambda: titan.combine(bad_routed, metadata, x), "routed_output_RD has shape",
                     "combine")
    routed, _, metadata = titan.dispatch(x, weights, ids, counts)
    short = N_TOKENS - 1 if rank == 1 else N_TOKENS  # fewer rows than x_TD's tokens
    _everyone_raises(rank, 1, lambda: titan.combine(routed, metadata, x, num_local_tokens_after_padding=short),
                     "num_local_tokens_after_padding=3 is fewer than x_TD's 4 tokens", "combine")
    routed, _, metadata = titan.dispatch(x, weights, ids, counts)
    assert torch.equal(titan.combine(routed, metadata, x), good)


def _body(rank, world_size):
    x, weights, ids = _inputs(rank)
    _gathered(rank, x, ids)
    _titan(rank, x, weights, ids)
    return True


def test_a_bad_call_on_one_rank_raises_on_every_rank(tmp_path):
    env = {"all": {"AUTOSYMM_DB": str(tmp_path / "none.sqlite"), "AUTOSYMM_AGREE_TIMEOUT_S": "10"}}
    assert run_gloo(_body, 2, env=env, deadline_s=120) == {0: True, 1: True}
