"""The batch-invariant fallbacks ``nccl_ordered`` / ``nccl_ordered_fused`` /
``nccl_ordered_reduce_scatter`` on 3 gloo ranks: a row's bits are the fp32 in-order sum rounded
once (the Triton kernels' formula) and do not change with the call's size (1..8192 tokens); the
fused residual is the Triton fused kernels' formula and its out follows the fixed pairwise tree;
a reduce-scatter's shard is the ordered all-reduce's segment, equal or per-rank segments; the
other floating-point reductions (avg, product, fp64) follow :func:`ordered_reduce`; the tree
itself is checked on the CPU."""

import pytest
import torch

from autosymm import spec
from autosymm.backends import get_backend
from autosymm.backends.base import RunContext
from autosymm.backends.nccl_ordered import (needs_ordering, ordered_all_reduce_launcher, ordered_reduce,
                                            ordered_reduce_scatter_launcher, ordered_rmsnorm, ordered_sum,
                                            pairwise_row_sum)
from autosymm.problem import Problem

from _gloo import run_gloo

TOKENS = (1, 3, 64, 1000, 8192)
BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def _rows(rank_or_all, tokens, hidden, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    bank = torch.randn(3, tokens, hidden, generator=gen).to(dtype)
    return bank if rank_or_all is None else bank[rank_or_all]


def test_pairwise_row_sum_is_the_fixed_tree():
    values = torch.tensor([[1e8, 1.0, -1e8, 1.0, 3.0]])
    # ((1e8 + 1) + (-1e8 + 1)) + ((3 + 0) + (0 + 0)): the pairs by column index, zero-padded to 8
    want = (torch.tensor(1e8) + 1.0) + (torch.tensor(-1e8) + 1.0) + 3.0
    assert pairwise_row_sum(values).item() == want.item() == 3.0  # a left-to-right fp32 sum gives 4.0
    wide = torch.randn(5, 1000)
    padded = torch.nn.functional.pad(wide, (0, 24))
    assert torch.equal(pairwise_row_sum(wide), pairwise_row_sum(padded)), "zero padding changes nothing"
    assert torch.equal(pairwise_row_sum(wide)[2:3], pairwise_row_sum(wide[2:3])), "a row alone: the same bits"


def test_ordered_sum_starts_from_positive_zero_in_rank_order():
    gathered = torch.tensor([[-0.0, 1e8], [-0.0, 1.0], [-0.0, -1e8]])
    got = ordered_sum(gathered)
    assert got[0].item() == 0.0 and not torch.signbit(got[0])  # +0.0, as the Triton kernels' fp32 acc
    assert got[1].item() == 0.0  # (1e8 + 1) - 1e8 in fp32: the 1 is lost, in this order


def _all_reduce_rows(rank, world_size):
    backend = get_backend("nccl_ordered")
    out = {}
    for dtype, hidden in ((torch.bfloat16, 8), (torch.float32, 5)):
        bank = _rows(None, max(TOKENS), hidden, dtype, seed=hidden)
        for n_tokens in TOKENS:
            x = bank[rank, :n_tokens].reshape(-1).clone()
            problem = Problem.all_reduce(x.numel() * x.element_size(), {torch.bfloat16: "bf16"}.get(dtype, "fp32"),
                                         world_size)
            got = backend.prepare(problem, None, RunContext(group=None))(x)
            want = ordered_sum(bank[:, :n_tokens].reshape(world_size, -1)).to(dtype)
            assert torch.equal(got.view(BITS[dtype]), want.view(BITS[dtype])), f"{dtype} at {n_tokens} tokens"
            out[(dtype, n_tokens)] = got.view(n_tokens, hidden)[:1].clone()
    for dtype in (torch.bfloat16, torch.float32):  # token 0's row: the same bits in every call
        rows = [out[(dtype, n)].view(BITS[dtype]) for n in TOKENS]
        assert all(torch.equal(r, rows[0]) for r in rows)
    return True


def _fused_rows(rank, world_size):
    backend = get_backend("nccl_ordered_fused")
    hidden, eps, dtype = 40, 1e-6, torch.bfloat16
    bank = _rows(None, max(TOKENS), hidden, dtype, seed=1)
    residual_bank = _rows(0, max(TOKENS), hidden, dtype, seed=2)
    weight = (1 + 0.5 * _rows(1, 1, hidden, torch.float32, seed=3)[0]).to(dtype)
    firsts = []
    for n_tokens in TOKENS:
        x, residual = bank[rank, :n_tokens].clone(), residual_bank[:n_tokens].clone()
        launcher = backend.prepare(Problem.all_reduce_rmsnorm(n_tokens, hidden, "bf16", world_size), None,
                                   RunContext(group=None))
        out = launcher(x, residual, weight, eps)
        s = ordered_sum(bank[:, :n_tokens]) + residual_bank[:n_tokens].float()
        assert torch.equal(residual.view(torch.int16), s.to(dtype).view(torch.int16)), f"residual at {n_tokens}"
        assert torch.equal(out.view(torch.int16), ordered_rmsnorm(s, weight, eps).to(dtype).view(torch.int16))
        assert torch.equal(x, bank[rank, :n_tokens]), "x is left unchanged"
        exact = s.double() * torch.rsqrt(s.double().pow(2).mean(-1, keepdim=True) + eps) * weight.double()
        torch.testing.assert_close(out.double(), exact, rtol=1e-2, atol=1e-2)
        firsts.append((residual[:1].clone(), out[:1].clone()))
    assert all(torch.equal(r.view(torch.int16), firsts[0][0].view(torch.int16)) and
               torch.equal(o.view(torch.int16), firsts[0][1].view(torch.int16)) for r, o in firsts)
    return True


def _reduce_scatter_rows(rank, world_size):
    """Shards of [W * n_tokens, hidden] (equal) and of per-rank row counts: each is the ordered
    sum of its segment, the same bits as the ordered all-reduce's rows there; segment s's token j
    has the same inputs in every call, so its bits must not change with the size."""
    backend = get_backend("nccl_ordered_reduce_scatter")
    hidden, dtype = 8, torch.bfloat16
    gen = torch.Generator().manual_seed(4)
    bank = torch.randn(world_size, world_size, max(TOKENS), hidden, generator=gen).to(dtype)  # [rank, segment]
    firsts = []
    for n_tokens in TOKENS:
        full = bank[:, :, :n_tokens].reshape(world_size, world_size * n_tokens, hidden)  # [rank, rows, hidden]
        problem = Problem("reduce_scatter", "bf16", world_size, nbytes=full[0].numel() * 2)
        launcher = backend.prepare(problem, None, RunContext(group=None))
        shard = torch.empty(n_tokens, hidden, dtype=dtype)
        assert launcher(shard, full[rank].clone()) is shard
        reduced = ordered_sum(full).to(dtype)  # the ordered all-reduce of the whole tensor
        assert torch.equal(shard.view(torch.int16), reduced[rank * n_tokens:(rank + 1) * n_tokens].view(torch.int16))
        firsts.append(shard[:1].clone())
    assert all(torch.equal(f.view(torch.int16), firsts[0].view(torch.int16)) for f in firsts)
    rows = [2, 0, 5][:world_size]  # per-rank segments, one empty
    full = bank[:, 0, :sum(rows)]
    shard = torch.empty(rows[rank], hidden, dtype=dtype)
    launcher(shard, full[rank].clone(), [r * hidden for r in rows])
    start = sum(rows[:rank])
    assert torch.equal(shard.view(torch.int16), ordered_sum(full)[start:start + rows[rank]].to(dtype).view(torch.int16))
    return True


def _other_reductions(rank, world_size):
    """avg, product and an fp64 sum: the gathered copies reduced by :func:`ordered_reduce`."""
    bank = _rows(None, 16, 5, torch.float32, seed=5)
    for op, dtype in (("avg", torch.bfloat16), ("product", torch.float16), ("sum", torch.float64)):
        x = bank[rank].to(dtype)
        want = ordered_reduce(bank.to(dtype), op).to(dtype)
        got = ordered_all_reduce_launcher(None, world_size, op)(x.clone())
        assert torch.equal(got, want), f"all-reduce {op} {dtype}"
        full = x.reshape(-1)[:15]  # 15 elements: 5 a rank
        shard = torch.empty(5, dtype=dtype)
        ordered_reduce_scatter_launcher(None, world_size, rank, op)(shard, full.clone())
        assert torch.equal(shard, want.reshape(-1)[5 * rank:5 * rank + 5]), f"reduce-scatter {op} {dtype}"
    return True


def test_ordered_reduce_formulas():
    gathered = torch.tensor([[3.0, 1e8], [5.0, 1.0], [7.0, -1e8]], dtype=torch.bfloat16)
    assert ordered_reduce(gathered, "avg").tolist()[0] == 5.0
    assert ordered_reduce(gathered, "product").tolist()[0] == 105.0 and ordered_reduce(gathered, "product").dtype \
        == torch.float32
    assert ordered_reduce(gathered.double(), "sum").dtype == torch.float64  # fp64 keeps its precision
    assert ordered_reduce(torch.ones(2, 3, dtype=torch.complex64), "sum").dtype == torch.complex64
    assert needs_ordering("avg", torch.bfloat16) and needs_ordering("sum", torch.float64)
    assert not needs_ordering("max", torch.float32) and not needs_ordering("sum", torch.int32)  # exact: NCCL's own


@pytest.mark.parametrize("body", [_all_reduce_rows, _fused_rows, _reduce_scatter_rows, _other_reductions],
                         ids=["all_reduce", "all_reduce_rmsnorm", "reduce_scatter", "avg_product_fp64"])
def test_rows_have_the_same_bits_at_every_size_on_three_gloo_ranks(body):
    assert run_gloo(body, 3, deadline_s=180) == {0: True, 1: True, 2: True}


def test_both_declare_batch_invariance_and_serve_their_op_only():
    for name, op in (("nccl_ordered", "all_reduce"), ("nccl_ordered_fused", "all_reduce_rmsnorm"),
                     ("nccl_ordered_reduce_scatter", "reduce_scatter")):
        backend = get_backend(name)
        assert backend.batch_invariant and [r.name for r in spec.ALL if backend.serves(r)] == [op]
