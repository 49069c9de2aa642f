"""The public runtime with real process groups (gloo on the CPU): agreement, fallbacks, bad input."""

import pytest
import torch

from autosymm.spec import ALL_REDUCE, call_key
from _gloo import run_gloo

from autosymm.db.store import Row, TuningDB


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
    TuningDB(path).record_many([_cpu_row(11.0)])
    out = _run(2, [path, path], _sum_and_explain)
    assert out[0][:2] == out[1][:2] == ("nccl", str(path))
    assert out[0][3]["nccl"] == {"calls": 1, "bytes": 4096}


def test_differing_databases_fall_back_on_every_rank(tmp_path):
    paths = [tmp_path / "a.sqlite", tmp_path / "b.sqlite"]
    TuningDB(paths[0]).record_many([_cpu_row(11.0)])
    TuningDB(paths[1]).record_many([_cpu_row(99.0)])
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


def _one_rank_ops(rank, world_size, autosymm):
    """Over one rank the shards are the whole tensor and the fused op is add + rms_norm: no
    collective runs, and explain says what the calls do."""
    from autosymm import Problem

    x, residual = torch.randn(6, 16).bfloat16(), torch.randn(6, 16).bfloat16()
    weight, before, expected_residual = torch.randn(16).bfloat16(), x.clone(), residual + x
    out = autosymm.all_reduce_rmsnorm(x, residual, weight)
    assert torch.equal(x, before) and torch.equal(residual, expected_residual)
    assert torch.equal(out, torch.nn.functional.rms_norm(expected_residual, (16,), weight, 1e-6))
    shard, full = torch.empty(6, 16).bfloat16(), torch.empty(6, 16).bfloat16()
    autosymm.reduce_scatter_tensor(shard, x)
    autosymm.all_gather_into_tensor(full, shard)
    assert torch.equal(shard, x) and torch.equal(full, x)
    plans = [autosymm.explain(problem=p, op=p.op).backend for p in (
        Problem.all_reduce_rmsnorm(6, 16, "bf16", 1), Problem("reduce_scatter", "bf16", 1, nbytes=192),
        Problem("all_gather", "bf16", 1, nbytes=192))]
    stats = autosymm.stats()
    autosymm.init(deterministic=True)  # the fused op's ordered norm then serves, even over one rank
    assert autosymm.explain(problem=Problem.all_reduce_rmsnorm(6, 16, "bf16", 1),
                            op="all_reduce_rmsnorm").backend == "nccl_ordered_fused"
    return plans, stats


def test_the_other_ops_over_one_rank_run_no_collective(tmp_path):
    plans, stats = _run(1, [tmp_path / "none.sqlite"], _one_rank_ops)[0]
    assert plans == ["noop"] * 3
    assert stats == {"noop": {"calls": 3, "bytes": 3 * 192}}


def _bad_inputs(rank, world_size, autosymm):
    import torch.distributed as dist

    base = torch.randn(64, 64).bfloat16()
    autosymm.all_reduce(base)  # a contiguous call of the same size first: its cache entry must not serve
    transposed, want = base.t(), base.t().contiguous()  # accepted as dist.all_reduce accepts it
    dist.all_reduce(want)
    assert autosymm.all_reduce(transposed) is transposed and torch.equal(transposed, want)
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
    TuningDB(path).record_many([_cpu_row(11.0)])
    out = _run(2, [path, path], _disabled, env={"AUTOSYMM_DISABLE": "1"})
    assert out[0] == out[1] == "AUTOSYMM_DISABLE=1"


def test_a_graph_mode_call_only_a_non_capturable_backend_serves_is_a_clear_error(monkeypatch):
    """Inside a capture, a MoE call that only NCCL's all_to_all path could serve (e.g. its rows do
    not fit the workspace) must say so, not fail deep inside torch with a capture error."""
    from autosymm import api
    from autosymm.spec import ALL_REDUCE, call_key
    from autosymm.runtime.dispatch import Decision
    from autosymm.problem import MoEShape, Problem

    from autosymm.runtime.group import GroupState

    state = object.__new__(GroupState)
    decision = Decision("nccl_all_to_all", None, "no tuned backend can serve the call", mode="graph",
                        skipped=("triton_moe: the output needs 939524096 bytes",))
    monkeypatch.setattr(state, "decide", lambda problem, mode: decision, raising=False)
    problem = Problem.moe("dp_to_ep", MoEShape(7168, 256, 8), 4096, "bf16", 2)
    with pytest.raises(RuntimeError, match=r"cannot be captured in a CUDA graph: only nccl_all_to_all.*"
                                           r"triton_moe: the output needs 939524096 bytes.*AUTOSYMM_WORKSPACE_BYTES"):
        state.prepare(problem, "graph")


# ------------------------------------------------------------------------------------------
# The eager hit path (replay.HOT), in process on a 1-rank gloo group with a fake launcher
# ------------------------------------------------------------------------------------------


@pytest.fixture
def hot_group(tmp_path, monkeypatch):
    """A 1-rank gloo world whose bf16 x 64 eager SUM entry runs an EagerReplay of a fake
    launcher (capture after 2 calls); yields (autosymm, the all-reduce's front door module, fake
    launcher, slow-path calls)."""
    import torch.distributed as dist

    import autosymm
    from autosymm.collectives import all_reduce as api
    from autosymm.spec import ALL_REDUCE, call_key
    from autosymm.runtime import replay
    from test_replay import FakeGraph, FakeLauncher

    monkeypatch.setenv("AUTOSYMM_DB", str(tmp_path / "user.sqlite"))
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    autosymm.reset()
    try:
        x = torch.zeros(64, dtype=torch.bfloat16)
        autosymm.all_reduce(x)  # prepares the entry (world size 1: the identity)
        entry = api.STATES[None].cache[call_key(ALL_REDUCE, torch.bfloat16, 64, torch.device("cpu"), False, "sum")]
        launcher = FakeLauncher()
        entry.launcher = replay.EagerReplay(launcher, lambda launch, device: FakeGraph(launch, launcher.log))
        slow = []
        real = api._all_reduce_sum
        monkeypatch.setattr(api, "_all_reduce_sum", lambda t, g: slow.append(t.data_ptr()) or real(t, g))
        yield autosymm, api, launcher, slow
    finally:
        autosymm.reset()
        dist.destroy_process_group()


def test_a_planned_address_takes_the_hot_path(hot_group):
    autosymm, api, launcher, slow = hot_group
    x = torch.zeros(64, dtype=torch.bfloat16)
    addr = x.data_ptr()
    for _ in range(2):  # checked call, then capture + replay: the plan exists afterwards
        assert autosymm.all_reduce(x) is x
    assert len(slow) == 2 and addr in api.HOT
    calls = api.STATES[None].cache[call_key(ALL_REDUCE, torch.bfloat16, 64, torch.device("cpu"), False, "sum")].calls
    before = len(launcher.log)
    assert autosymm.all_reduce(x) is x
    assert len(slow) == 2 and launcher.log[before:] == ["replay", ("bound", addr)]  # the plan ran
    key = call_key(ALL_REDUCE, torch.bfloat16, 64, torch.device("cpu"), False, "sum")
    assert api.STATES[None].cache[key].calls == calls + 1  # stats count it


def test_the_hot_path_refuses_another_dtype_layout_group_or_a_capture(hot_group, monkeypatch):
    import torch.distributed as dist

    autosymm, api, launcher, slow = hot_group
    base = torch.zeros(64, dtype=torch.bfloat16)
    for _ in range(2):
        autosymm.all_reduce(base)
    n = len(slow)
    autosymm.all_reduce(base.view(torch.float16))  # same address and numel, other dtype
    strided = base.view(8, 8).t()  # same address and numel, not contiguous: copied in and out, not the plan
    assert autosymm.all_reduce(strided) is strided
    autosymm.all_reduce(base[:32])  # same address, other numel
    autosymm.all_reduce(base, group=dist.group.WORLD)  # the same state under another name
    assert len(slow) == n + 4
    monkeypatch.setattr(api, "current_raw_stream", lambda index: 1234)  # a side stream ...
    monkeypatch.setattr(api, "stream_capturing", lambda: True)  # ... that captures
    autosymm.all_reduce(base, group=dist.group.WORLD)  # graph mode: its own key
    assert len(slow) == n + 5 and call_key(ALL_REDUCE, torch.bfloat16, 64, torch.device("cpu"), True, "sum") in api.STATES[None].cache


def test_hot_plans_are_forgotten_on_eviction_new_staging_limits_and_reset(hot_group):
    autosymm, api, launcher, slow = hot_group
    wrapper = api.STATES[None].cache[call_key(ALL_REDUCE, torch.bfloat16, 64, torch.device("cpu"), False, "sum")].launcher
    wrapper.max_graphs = 1
    x, y = torch.zeros(64, dtype=torch.bfloat16), torch.zeros(64, dtype=torch.bfloat16)
    for _ in range(2):
        autosymm.all_reduce(x)
    assert x.data_ptr() in api.HOT
    for _ in range(2):
        autosymm.all_reduce(y)  # y's plan evicts x's
    assert x.data_ptr() not in api.HOT and y.data_ptr() in api.HOT
    launcher.workspace.empty_bytes = 256  # as autosymm.empty does, which also forgets every hot plan
    from autosymm.runtime.replay import forget_all

    forget_all()
    n = len(slow)
    autosymm.all_reduce(y)
    assert len(slow) == n + 1 and y.data_ptr() not in api.HOT  # replanned from scratch
    for _ in range(2):
        autosymm.all_reduce(y)
    assert y.data_ptr() in api.HOT
    autosymm.reset()
    assert not api.HOT
