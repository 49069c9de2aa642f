"""The public runtime with real process groups (gloo on the CPU): agreement, fallbacks, bad input."""

import pytest
import torch
from _gloo import run_gloo

from autosymm.db import Row, TuningDB


def _cpu_row(median_us):
    return Row(hardware="cpu", world_size=2, op="all_reduce", dtype="bf16", bucket=4096, backend="nccl",
               median_us=median_us, config=None, nccl_us=median_us, gpu="cpu")


def _run(world_size, db_paths, body, env=None):
    """``body(rank, world_size, autosymm)`` on gloo ranks, rank r reading the user DB db_paths[r]."""
    per_rank = {r: {**(env or {}), "AUTOSYMM_DB": str(db_paths[r])} for r in range(world_size)}
    return run_gloo(_with_autosymm, world_size, body, env=per_rank)


def _with_autosymm(rank, world_size, body):
    import autosymm

    return body(rank, world_size, autosymm)


def _sum_and_explain(rank, world_size, autosymm):
    x = torch.full((2048,), float(rank + 1), dtype=torch.bfloat16)
    y = autosymm.all_reduce(x)
    assert y is x
    assert torch.equal(x, torch.full_like(x, sum(range(1, world_size + 1))))
    decision = autosymm.explain(x)
    return decision.backend, decision.source, decision.reason, autosymm.stats()


def test_matching_databases_use_the_row(tmp_path):
    path = tmp_path / "user.sqlite"
    TuningDB(path).record(_cpu_row(11.0))
    out = _run(2, [path, path], _sum_and_explain)
    assert out[0][:2] == out[1][:2] == ("nccl", str(path))
    assert out[0][3]["nccl"] == {"calls": 1, "bytes": 4096}


def test_differing_databases_fall_back_on_every_rank(tmp_path):
    paths = [tmp_path / "a.sqlite", tmp_path / "b.sqlite"]
    TuningDB(paths[0]).record(_cpu_row(11.0))
    TuningDB(paths[1]).record(_cpu_row(99.0))
    out = _run(2, paths, _sum_and_explain)
    for rank in (0, 1):
        backend, source, reason, _ = out[rank]
        assert backend == "nccl" and source == "" and "disagree" in reason


def _world_size_one(rank, world_size, autosymm):
    import torch.distributed as dist

    x = torch.randn(1000).bfloat16()
    before = x.clone()
    assert autosymm.all_reduce(x) is x and torch.equal(x, before)
    # any op over one rank is the identity; the world group under its own name shares the state
    ints = torch.arange(7, dtype=torch.int32)
    assert torch.equal(autosymm.all_reduce(ints, dist.ReduceOp.MAX, group=dist.group.WORLD), torch.arange(7))
    assert autosymm.api.state_of(dist.group.WORLD) is autosymm.api.state_of(None)
    assert autosymm.stats() == {"noop": {"calls": 2, "bytes": 2000 + 28}}
    assert autosymm.barrier_errors() == 0  # no workspace on gloo: nothing can have failed
    autosymm.reset_barriers()
    return autosymm.explain(x).backend


def test_world_size_one_is_a_noop(tmp_path):
    assert _run(1, [tmp_path / "none.sqlite"], _world_size_one)[0] == "noop"


def _bad_inputs(rank, world_size, autosymm):
    base = torch.randn(64, 64).bfloat16()
    autosymm.all_reduce(base)  # a contiguous call of the same size first: its cache entry must not serve
    with pytest.raises(ValueError, match="not contiguous"):
        autosymm.all_reduce(base.t())
    with pytest.raises(ValueError, match="op='xor'"):
        autosymm.all_reduce(torch.ones(8), op="xor")
    ints = torch.full((16,), rank + 1, dtype=torch.int32)
    autosymm.all_reduce(ints)  # no tuned kernel for int32: NCCL (gloo here) on every rank
    assert torch.equal(ints, torch.full_like(ints, 3))
    mx = torch.full((16,), float(rank), dtype=torch.float32)
    autosymm.all_reduce(mx, op="max")
    assert torch.equal(mx, torch.ones(16))
    return True


def test_bad_input_errors_and_rank_consistent_fallbacks(tmp_path):
    assert all(_run(2, [tmp_path / "x.sqlite"] * 2, _bad_inputs).values())


def _disabled(rank, world_size, autosymm):
    x = torch.ones(100, dtype=torch.bfloat16)
    autosymm.all_reduce(x)
    assert torch.equal(x, torch.full_like(x, 2))
    return autosymm.explain(x).reason


def test_disable_env_forces_nccl(tmp_path):
    path = tmp_path / "user.sqlite"
    TuningDB(path).record(_cpu_row(11.0))
    out = _run(2, [path, path], _disabled, env={"AUTOSYMM_DISABLE": "1"})
    assert out[0] == out[1] == "AUTOSYMM_DISABLE=1"


def test_a_graph_mode_call_only_a_non_capturable_backend_serves_is_a_clear_error(monkeypatch):
    """Inside a capture, a MoE call that only NCCL's all_to_all path could serve (e.g. its rows do
    not fit the workspace) must say so, not fail deep inside torch with a capture error."""
    from autosymm import api
    from autosymm.dispatch import Decision
    from autosymm.problem import MoEShape, Problem

    state = object.__new__(api.GroupState)
    decision = Decision("nccl_all_to_all", None, "no tuned backend can serve the call", mode="graph",
                        skipped=("triton_moe: the output needs 939524096 bytes",))
    monkeypatch.setattr(state, "decide", lambda problem, mode: decision, raising=False)
    problem = Problem.moe("dp_to_ep", MoEShape(7168, 256, 8), 4096, "bf16", 2)
    with pytest.raises(RuntimeError, match=r"cannot be captured in a CUDA graph: only nccl_all_to_all.*"
                                           r"triton_moe: the output needs 939524096 bytes.*AUTOSYMM_WORKSPACE_BYTES"):
        state.prepare(problem, "graph")
