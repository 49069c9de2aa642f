"""The ``deterministic`` setting: dispatch over batch-invariant backends only (decision tables over
a temporary database), agreed across ranks (AUTOSYMM_DETERMINISTIC and ``autosymm.init``) and,
end to end on 3 gloo ranks, the same row bits at every size."""

import pytest
import torch

from autosymm.backends import Capabilities
from autosymm.configs import AllReduceConfig
from autosymm.db.store import Row, TuningDB
from autosymm.runtime.dispatch import DBSource, decide, last_resort
from autosymm.problem import MODEL_SHAPES, Problem

from _gloo import run_gloo

HW = "nvidia-h200-nvlink"
CAPS = Capabilities(world_size=4, all_reduce_bytes=256 << 20, moe_bytes=256 << 20, has_multicast=True,
                    intra_node=True, torch_symm_ops=True, compute_capability=(9, 0))
ONE_SHOT = AllReduceConfig("one_shot", 2048, 4, 8)
MULTIMEM = AllReduceConfig("multimem", 4096, 32, 16)


def _row(backend, bucket, us, config=None):
    return Row(hardware=HW, world_size=4, op="all_reduce", dtype="bf16", bucket=bucket, backend=backend,
               median_us=us, shape="", mode="eager", config=config, nccl_us=20.0, gpu="NVIDIA H200")


@pytest.fixture
def rows():
    db = TuningDB(":memory:")
    db.record_many([_row("nccl", 4096, 20.0), _row("triton_multimem", 4096, 3.0, MULTIMEM),
                    _row("torch_one_shot", 4096, 4.0), _row("triton_one_shot", 4096, 5.0, ONE_SHOT)])
    db.record_many([_row("nccl", 1 << 28, 900.0), _row("triton_multimem", 1 << 28, 800.0, MULTIMEM)])
    return DBSource(db, "user.sqlite")


def test_only_batch_invariant_rows_serve(rows):
    problem = Problem.all_reduce(4096, "bf16", 4)
    assert decide(problem, "eager", CAPS, [rows], HW).backend == "triton_multimem"
    decision = decide(problem, "eager", CAPS, [rows], HW, deterministic=True)
    assert decision.backend == "triton_one_shot" and decision.config == ONE_SHOT
    assert {"triton_multimem: not batch-invariant (deterministic)",
            "torch_one_shot: not batch-invariant (deterministic)"} <= set(decision.skipped)


def test_without_an_invariant_row_the_ordered_fallback_serves(rows):
    problem = Problem.all_reduce(1 << 28, "bf16", 4)
    decision = decide(problem, "eager", CAPS, [rows], HW, deterministic=True)
    assert decision.backend == "nccl_ordered" and "batch-invariant backends only" in decision.reason
    assert decide(Problem.all_reduce(1 << 28, "bf16", 4), "eager", CAPS, [], HW, True).backend == "nccl_ordered"
    spans = Capabilities(world_size=4, intra_node=False)
    assert decide(problem, "eager", spans, [rows], HW, deterministic=True).backend == "nccl_ordered"


def test_each_op_has_a_last_resort_that_keeps_the_guarantee():
    fused = Problem.all_reduce_rmsnorm(16, 4096, "bf16", 4)
    moe = Problem.moe("dp_to_ep", MODEL_SHAPES["mixtral-8x7b"], 16, "bf16", 4)
    assert [last_resort(p, True) for p in (Problem.all_reduce(4096), fused, moe)] == \
        ["nccl_ordered", "nccl_ordered_fused", "nccl_all_to_all"]
    assert decide(fused, "eager", CAPS, [], HW, True).backend == "nccl_ordered_fused"
    assert decide(moe, "eager", CAPS, [], HW, True).backend == "triton_moe"  # rows are copied: invariant
    assert [last_resort(p) for p in (Problem.all_reduce(4096), fused)] == ["nccl", "nccl_fused"]
    assert last_resort(Problem("all_gather", "bf16", 4, nbytes=4096), True) == "nccl_all_gather"  # copies
    scatter = Problem("reduce_scatter", "bf16", 4, nbytes=4096)
    assert (last_resort(scatter), last_resort(scatter, True)) == ("nccl_reduce_scatter", "nccl_ordered_reduce_scatter")
    assert decide(scatter, "eager", CAPS, [], HW, True).backend == "nccl_ordered_reduce_scatter"


def test_disable_keeps_the_guarantee(monkeypatch):
    monkeypatch.setenv("AUTOSYMM_DISABLE", "1")
    assert decide(Problem.all_reduce(4096, "bf16", 4), "eager", CAPS, [], HW, True).backend == "nccl_ordered"


TOKENS = (1, 3, 64, 1000, 8192)


def _end_to_end(rank, world_size):
    """AUTOSYMM_DETERMINISTIC=1: all_reduce and the fused op take the ordered fallbacks, and a
    token's row has the same bits in every call."""
    import autosymm
    from autosymm.backends.nccl_ordered import ordered_reduce, ordered_rmsnorm, ordered_sum

    hidden = 24
    gen = torch.Generator().manual_seed(3)
    bank = torch.randn(world_size, max(TOKENS), hidden, generator=gen).to(torch.bfloat16)
    residual_bank = torch.randn(max(TOKENS), hidden, generator=gen).to(torch.bfloat16)
    weight = torch.ones(hidden, dtype=torch.bfloat16)
    first = []
    for n in TOKENS:
        x = bank[rank, :n].clone()
        assert autosymm.explain(x).backend == "nccl_ordered"
        autosymm.all_reduce(x)
        assert torch.equal(x.view(torch.int16), ordered_sum(bank[:, :n]).to(torch.bfloat16).view(torch.int16))
        residual = residual_bank[:n].clone()
        out = autosymm.all_reduce_rmsnorm(bank[rank, :n].clone(), residual, weight)
        s = ordered_sum(bank[:, :n]) + residual_bank[:n].float()
        assert torch.equal(out.view(torch.int16), ordered_rmsnorm(s, weight, 1e-6).to(torch.bfloat16).view(torch.int16))
        first.append((x[0].clone(), out[0].clone()))
        full = bank[:, :n].repeat(1, world_size, 1)  # [rank, W * n, hidden]: segment s is the bank's n rows
        shard = torch.empty(n, hidden, dtype=torch.bfloat16)
        autosymm.reduce_scatter_tensor(shard, full[rank].clone())
        assert torch.equal(shard.view(torch.int16), x.view(torch.int16)), "a shard: the all-reduce's bits"
    assert all(torch.equal(a, first[0][0]) and torch.equal(b, first[0][1]) for a, b in first)
    # the other floating-point reductions: the ordered formula, not NCCL's
    for op, dtype in (("avg", torch.bfloat16), ("product", torch.float32), ("sum", torch.float64)):
        x = bank[rank, :5].to(dtype)
        want = ordered_reduce(bank[:, :5].to(dtype), op).to(dtype)
        assert torch.equal(autosymm.all_reduce(x.clone(), op=op), want), f"{op} {dtype}"
        shard = torch.empty(5, hidden, dtype=dtype)
        autosymm.reduce_scatter_tensor(shard, x.repeat(world_size, 1), op=op)
        assert torch.equal(shard, want), f"reduce-scatter {op} {dtype}"
    autosymm.all_reduce(torch.full((4,), 3.0), op="max")  # exact in any order: NCCL's own
    calls = {backend: agg["calls"] for backend, agg in autosymm.stats().items()}
    assert calls == {"nccl_ordered": len(TOKENS) + 3, "nccl_ordered_fused": len(TOKENS),
                     "nccl_ordered_reduce_scatter": len(TOKENS) + 3, "nccl": 1}, calls
    return True


def test_the_setting_end_to_end_on_three_gloo_ranks():
    assert run_gloo(_end_to_end, 3, env={"all": {"AUTOSYMM_DETERMINISTIC": "1"}}, deadline_s=180) == \
        {0: True, 1: True, 2: True}


def _init_argument(rank, world_size):
    import autosymm
    from autosymm.runtime.agreement import AgreementError
    from autosymm.runtime.group import state_of

    x = torch.ones(8)
    assert autosymm.explain(x).backend == "nccl"
    autosymm.init(deterministic=True)
    assert state_of(None).deterministic and autosymm.explain(x).backend == "nccl_ordered"
    assert torch.equal(autosymm.all_reduce(x), torch.full((8,), 2.0))
    with pytest.raises(AgreementError, match="deterministic"):
        autosymm.init(deterministic=rank == 0)  # the ranks disagree: every rank raises
    autosymm.init(deterministic=False)
    return autosymm.explain(x).backend


def test_init_sets_it_for_a_group_agreed_by_every_rank():
    assert run_gloo(_init_argument, 2, deadline_s=120) == {0: "nccl", 1: "nccl"}


def _disagreeing_env(rank, world_size):
    import autosymm
    from autosymm.runtime.group import state_of

    x = torch.ones(4)
    autosymm.all_reduce(x)
    state = state_of(None)
    return state.deterministic, state.safe_reason is not None, autosymm.explain(x).backend


def test_ranks_that_disagree_all_take_the_same_safe_path():
    """AUTOSYMM_DETERMINISTIC on rank 0 only: the setting is agreed, so every rank is on NCCL."""
    out = run_gloo(_disagreeing_env, 2, env={0: {"AUTOSYMM_DETERMINISTIC": "1"}}, deadline_s=120)
    assert out == {0: (False, True, "nccl"), 1: (False, True, "nccl")}
