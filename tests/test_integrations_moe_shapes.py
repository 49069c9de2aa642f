"""The vLLM and torchtitan MoE shapes (autosymm.integrations.moe_shapes) on 2 gloo ranks: their own
checks of a call failing on one rank after a first good call raise on every rank, through the
manager's agreed header, instead of leaving the peer in a collective."""

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


def _body(rank, world_size):
    import torch.distributed as dist

    from autosymm.integrations import TitanTokenDispatcher, VllmAll2AllManager

    x, weights, ids = _inputs(rank)
    vllm = VllmAll2AllManager(dist.new_group([0, 1], backend="gloo"), n_experts=N_EXPERTS, device=torch.device("cpu"))
    hs = vllm.dispatch(x, weights, ids)[0]
    good = vllm.combine(hs)
    short = weights[:, :1] if rank == 1 else weights
    _everyone_raises(rank, 1, lambda: vllm.dispatch(x, short, ids), "topk_weights .* and topk_ids", "dispatch")
    hs = vllm.dispatch(x, weights, ids)[0]
    rows = hs[:-1] if rank == 0 else hs
    _everyone_raises(rank, 0, lambda: vllm.combine(rows), "combine: hidden_states has shape", "combine")
    assert torch.equal(vllm.combine(vllm.dispatch(x, weights, ids)[0]), good)  # still in step

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
    assert torch.equal(titan.combine(routed, metadata, x), good)
    return True


def test_a_bad_call_on_one_rank_raises_on_every_rank(tmp_path):
    env = {"all": {"AUTOSYMM_DB": str(tmp_path / "none.sqlite"), "AUTOSYMM_AGREE_TIMEOUT_S": "10"}}
    assert run_gloo(_body, 2, env=env, deadline_s=120) == {0: True, 1: True}
