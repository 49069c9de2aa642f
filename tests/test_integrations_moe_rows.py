"""GatheredRows (vLLM's gathered-rows MoE layout over autosymm's conversions) on 2 gloo ranks:
uneven token counts (one rank with none), FP8 rows moved bit for bit, and the combine equal to
the reduce-scatter of every rank's partials that vLLM's all-gather/reduce-scatter manager runs."""

from __future__ import annotations

import torch
from _gloo import run_gloo

D_MODEL, N_EXPERTS, K = 16, 6, 2


def _everyone(sizes, seed):
    """Every rank's tokens and ids (some dropped), from one seed."""
    gen = torch.Generator().manual_seed(seed)
    n = sum(sizes)
    x = torch.randn(n, D_MODEL, generator=gen)
    ids = torch.rand(n, N_EXPERTS, generator=gen).topk(K, dim=1).indices.to(torch.int32)
    ids[torch.rand(ids.shape, generator=gen) < 0.2] = -1
    return x, ids


def _partials(hs, ids, owned):
    """This rank's partial per gathered token: its own experts' outputs, expert e scaling by e + 1."""
    local = torch.tensor([[int(e) in owned for e in row] for row in ids])
    factor = torch.where(local, (ids.float() + 1), 0.0).sum(1, keepdim=True)
    return hs * factor


def _body(rank, world_size):
    import torch.distributed as dist

    from autosymm.integrations import GatheredRows

    layout = GatheredRows(N_EXPERTS)
    owned = set(layout.manager.local_experts)
    for seed, sizes in ((0, [5, 3]), (1, [4, 0]), (2, [2, 2])):
        x, ids = _everyone(sizes, seed)
        start = sum(sizes[:rank])
        mine = slice(start, start + sizes[rank])
        hs, got_ids, call = layout.dispatch(x[mine], ids[mine], sizes)
        assert torch.equal(got_ids, ids) and got_ids.dtype == torch.int32
        routed_here = torch.tensor([any(int(e) in owned for e in row) for row in ids])
        assert torch.equal(hs[routed_here], x[routed_here]) and not hs[~routed_here].any()
        partial = _partials(hs, ids, owned)
        got = layout.combine(partial, call)
        # vLLM's combine: the reduce-scatter (sum over ranks, this rank's rows) of every partial
        everyone = [torch.zeros_like(partial) for _ in range(world_size)]
        dist.all_gather(everyone, partial)
        torch.testing.assert_close(got, torch.stack(everyone).sum(0)[mine], rtol=1e-6, atol=1e-6)
        fp8 = x[mine].to(torch.float8_e4m3fn)
        hs8, _, _ = layout.dispatch(fp8, ids[mine], sizes)
        assert hs8.dtype == torch.float8_e4m3fn
        assert torch.equal(hs8[routed_here].view(torch.uint8), x[routed_here].to(torch.float8_e4m3fn).view(torch.uint8))
    return True


def test_gathered_rows_uneven_sizes_and_fp8(tmp_path):
    env = {"all": {"AUTOSYMM_DB": str(tmp_path / "none.sqlite"), "AUTOSYMM_AGREE_TIMEOUT_S": "10"}}
    assert run_gloo(_body, 2, env=env, deadline_s=150) == {0: True, 1: True}
