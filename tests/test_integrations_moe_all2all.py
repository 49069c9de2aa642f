"""AutosymmAll2AllManager on 2 gloo ranks: a bad argument, or a different token count, top-k,
d_model or dtype, on one rank after a first good call raises on every rank within the deadline
(the header every dispatch and combine agree on before their collectives), eagerly and through
the agreement channel used inside a CUDA-graph capture; int64 ids beyond 32 bits are dropped."""

from __future__ import annotations

import contextlib

import pytest
import torch
from _adapter_decisions import adapter_decisions
from _gloo import run_gloo

N_TOKENS, D_MODEL, N_EXPERTS, K = 6, 32, 5, 2


def _inputs(rank, n_tokens=N_TOKENS, k=K, d_model=D_MODEL, seed=0):
    gen = torch.Generator().manual_seed(seed * 10 + rank)
    x = torch.randn(n_tokens, d_model, generator=gen)
    ids = torch.stack([torch.randperm(N_EXPERTS, generator=gen)[:k] for _ in range(n_tokens)])
    return x, ids, torch.rand(n_tokens, k, generator=gen)


def _everyone_raises(rank, bad_rank, call, mine, theirs):
    """``call()`` raises on every rank: ``mine`` (a regex) on ``bad_rank``, ``theirs`` elsewhere."""
    with pytest.raises((ValueError, TypeError), match=mine if rank == bad_rank else theirs):
        call()


def _round_trip(manager, rank, x, ids, weights):
    out = manager.dispatch(x, ids, weights)
    return manager.combine(out.hidden_states, out.handle, reduce=False)


def _faults(manager, rank):
    x, ids, weights = _inputs(rank)
    good = _round_trip(manager, rank, x, ids, weights)  # the first good call
    failed = r"rank\(s\) \[1\] of the group failed their checks of this dispatch"
    cases = [  # (what rank 1 passes, its own error)
        ((x, ids.float(), weights), "topk_ids has shape .* dtype torch.float32"),
        ((x, ids[:4], weights[:4]), r"topk_ids has shape \(4, 2\)"),
        ((x, ids, weights[:, :1]), "topk_weights has shape"),
        ((x, [[0, 1]] * N_TOKENS, weights), "topk_ids must be a torch.Tensor, got list"),
    ]
    for args, error in cases:
        mine = args if rank == 1 else (x, ids, weights)
        _everyone_raises(rank, 1, lambda: manager.dispatch(*mine), error, failed)
    differ = r"dispatch: the ranks' calls differ \(rank 0 6 tokens x top-2, d_model 32, float32, rank 1 "
    for other, said in ((_inputs(rank, n_tokens=5), "5 tokens x top-2"), (_inputs(rank, k=3), "6 tokens x top-3"),
                        (_inputs(rank, d_model=16), "6 tokens x top-2, d_model 16")):
        mine = other if rank == 1 else (x, ids, weights)
        with pytest.raises(ValueError, match=differ + said):
            manager.dispatch(*mine)
    half = (x.half(), ids, weights) if rank == 0 else (x, ids, weights)
    with pytest.raises(ValueError, match="d_model 32, float16, rank 1 6 tokens x top-2, d_model 32, float32"):
        manager.dispatch(*half)
    out = manager.dispatch(x, ids, weights)
    rows = out.hidden_states if rank == 1 else out.hidden_states[:-1]
    _everyone_raises(rank, 0, lambda: manager.combine(rows, out.handle), "combine: expert_output has shape",
                     r"rank\(s\) \[0\] of the group failed their checks of this combine")
    assert torch.equal(_round_trip(manager, rank, x, ids, weights), good)  # every rank still in step
    return good


def _wide_ids(manager, rank):
    x, ids, weights = _inputs(rank, seed=3)
    wide, dropped = ids.clone(), ids.clone()
    wide[::2, 0] += 1 << 32  # an id in range modulo 2**32
    dropped[::2, 0] = -1
    got, want = _round_trip(manager, rank, x, wide, weights), _round_trip(manager, rank, x, dropped, weights)
    assert torch.equal(got, want) and not torch.equal(got, _round_trip(manager, rank, x, ids, weights))


def _captured(manager, rank, monkeypatch_module):
    """Inside a capture the header goes through the agreement channel (no read-back)."""
    x, ids, weights = _inputs(rank)
    monkeypatch_module.stream_capturing = lambda: True
    try:
        mine = (x, ids.float(), weights) if rank == 1 else (x, ids, weights)
        _everyone_raises(rank, 1, lambda: manager.dispatch(*mine), "dtype torch.float32",
                         r"rank\(s\) \[1\] of the group failed")
        other = _inputs(rank, n_tokens=4) if rank == 0 else (x, ids, weights)
        with pytest.raises(ValueError, match=r"rank 0 4 tokens x top-2, d_model 32, float32, rank 1 6 tokens"):
            manager.dispatch(*other)
        channel = __import__("autosymm").api.STATES[None].channel
        assert channel.rounds == {"moe_dispatch": 2}
    finally:
        monkeypatch_module.stream_capturing = __import__("autosymm.runtime.group").runtime.group.stream_capturing


def _body(rank, world_size):
    from autosymm.integrations import AutosymmAll2AllManager
    from autosymm.integrations import moe_all2all

    manager = AutosymmAll2AllManager(N_EXPERTS)
    _faults(manager, rank)
    _wide_ids(manager, rank)
    _captured(manager, rank, moe_all2all)
    return True


def _titan_reference(rank, world_size, xs, scores, ids, padded, seq_len, sp_size, sp_rank):
    """torchtitan's AllToAllTokenDispatcher.combine on this rank's tokens, every expert's output
    being its input scaled by (expert id + 1): out[global(t)] += score * (e + 1) * x[t]."""
    x, score, expert = xs[rank], scores[rank], ids[rank]
    out = torch.zeros(padded * sp_size, x.shape[1])
    for t in range(x.shape[0]):
        g = t if sp_size == 1 else (t // seq_len) * seq_len * sp_size + sp_rank * seq_len + t % seq_len
        for j in range(expert.shape[1]):
            if 0 <= int(expert[t, j]) < N_EXPERTS:
                out[g] += score[t, j] * (int(expert[t, j]) + 1) * x[t]
    return out


@contextlib.contextmanager
def _moe_calls(group):
    """Within: the count of autosymm's MoE conversion calls on ``group`` (autosymm.api.stats)."""
    from autosymm.api import stats

    def total():
        return sum(v["calls"] for v in stats(group).values())

    before, box = total(), [0]
    counter = type("Calls", (), {"__eq__": lambda self, n: box[0] == n, "__repr__": lambda self: str(box[0])})()
    try:
        yield counter
    finally:
        box[0] = total() - before


def _titan_signature(rank, world_size):
    import inspect

    from autosymm.integrations import TitanTokenDispatcher

    params = inspect.signature(TitanTokenDispatcher.combine).parameters
    assert [p.kind for p in params.values()][-2:] == [inspect.Parameter.KEYWORD_ONLY] * 2
    assert list(params)[-2:] == ["num_local_tokens_after_padding", "local_seq_len_after_padding"]
    xs, ids, scores = map(torch.stack, zip(*[_inputs(r, seed=5) for r in range(world_size)]))
    counts = torch.bincount(ids[rank].flatten(), minlength=N_EXPERTS)
    # (padded tokens, local sequence length, sp_size): none, padding rows, two SP ranks of 2 x 4
    for padded, seq_len, sp_size in ((N_TOKENS, N_TOKENS, 1), (8, 8, 1), (8, 4, 2)):
        titan = TitanTokenDispatcher(N_EXPERTS, sp_size=sp_size, sp_rank=rank % sp_size)
        got = []
        # no tuned row (no database): torchtitan's own all-to-all; a tuned one: autosymm's conversions
        for decisions in (contextlib.nullcontext(), adapter_decisions(backend="triton_moe")):
            with decisions, _moe_calls(titan.manager.group) as conversions:
                titan._decided.clear()
                routed, per_expert, metadata = titan.dispatch(xs[rank], scores[rank], ids[rank], counts)
                assert per_expert.shape == (len(titan.manager.local_experts),)
                assert int(per_expert.sum()) == routed.shape[0]
                expert_of = torch.repeat_interleave(torch.tensor(titan.manager.local_experts), per_expert)
                out = titan.combine(routed * (expert_of + 1)[:, None], metadata, xs[rank],
                                    num_local_tokens_after_padding=padded, local_seq_len_after_padding=seq_len)
            want = _titan_reference(rank, world_size, xs, scores, ids, padded, seq_len, sp_size, rank % sp_size)
            torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
            got.append((routed, per_expert, out, conversions))
        (routed, per_expert, out, untuned), (routed2, per_expert2, out2, served) = got
        assert untuned == 0 and served == 2  # autosymm's dp->ep and ep->dp ran only where a row decides
        assert torch.equal(routed, routed2) and torch.equal(per_expert, per_expert2) and torch.equal(out, out2)
    with pytest.raises(TypeError):  # keyword-only, as torchtitan declares them
        titan.combine(routed, metadata, xs[rank], 8, 4)
    return True


def test_titan_combine_takes_torchtitans_padding_keywords(tmp_path):
    env = {"all": {"AUTOSYMM_DB": str(tmp_path / "none.sqlite"), "AUTOSYMM_AGREE_TIMEOUT_S": "10"}}
    assert run_gloo(_titan_signature, 2, env=env, deadline_s=120) == {0: True, 1: True}


def test_one_ranks_bad_or_different_dispatch_raises_on_every_rank(tmp_path):
    env = {"all": {"AUTOSYMM_DB": str(tmp_path / "none.sqlite"), "AUTOSYMM_AGREE_TIMEOUT_S": "10"}}
    assert run_gloo(_body, 2, env=env, deadline_s=150) == {0: True, 1: True}
