"""The fused all-reduce + RMSNorm backends: configs and their space, the Problem, eligibility,
dispatch from database rows, and the launcher's staging and checks (interpreter, simulated ranks)."""

import pytest
import torch

from autosymm.backends import Capabilities, RunContext, get_backend
from autosymm.backends.base import BackendError
from autosymm.backends.triton_fused import (ALGORITHMS, BACKENDS, FUSED_SPLIT_MAX_PROGRAMS, fused_block_size,
                                            fused_space, split_scratch)
from autosymm.configs import FusedConfig, config_from_json, config_to_json
from autosymm.db.store import Row, TuningDB
from autosymm.runtime.dispatch import DBSource, decide
from autosymm.geometry import DOUBLE_BUFFER_HALF_BYTES, FUSED_SPLIT_MAX_ROWS, FUSED_STASH_BYTES, align
from autosymm.problem import Problem
from autosymm.workspace.symm import simulated_workspaces

from _all_reduce_sim import preset, requires_interpreter
from _fused_ref import check

HW = "nvidia-h200-nvlink"
CAPS = Capabilities(world_size=2, all_reduce_bytes=256 << 20, intra_node=True, compute_capability=(9, 0))


def test_config_validation_names_the_field():
    FusedConfig("two_shot", 8192, 16, 132, 4)
    for kwargs, field in [(dict(algorithm="multimem"), "algorithm"), (dict(block_size=3000), "block_size"),
                          (dict(num_warps=3), "num_warps"), (dict(num_blocks=0), "num_blocks"),
                          (dict(rows_per_program=3), "rows_per_program"), (dict(num_warps=4, rows_per_program=2),
                                                                          "rows_per_program"),
                          (dict(algorithm="two_shot", double_buffer=True), "double_buffer"),
                          (dict(num_blocks=True), "num_blocks"), (dict(block_size=256, num_warps=16), "block_size")]:
        with pytest.raises(ValueError, match=field):
            FusedConfig(**{**dict(algorithm="one_shot", block_size=8192, num_warps=8, num_blocks=8), **kwargs})
    config = FusedConfig("one_shot_push", 8192, 8, 16, 2, True)
    assert config_from_json(config_to_json(config)) == config
    assert "row_split" not in config_to_json(config), "a whole-row config's JSON reads as before split rows"


def test_row_split_validation_names_the_setting():
    config = FusedConfig("one_shot_push", 8192, 4, 8, 1, True, row_split=8)
    assert config_from_json(config_to_json(config)) == config and '"row_split": 8' in config_to_json(config)
    base = dict(algorithm="one_shot", block_size=8192, num_warps=4, num_blocks=8)
    for kwargs, match in [(dict(row_split=3), "row_split=3 must be a power of two"),
                          (dict(row_split=16), "row_split=16 must be a power of two in 1..8"),
                          (dict(row_split=0), "row_split=0"), (dict(row_split=2.5), "row_split"),
                          (dict(row_split=2, algorithm="two_shot"), "row_split=2 is only for the one-shots"),
                          (dict(row_split=2, rows_per_program=2, num_warps=8), "row_split=2 needs rows_per_program=1"),
                          (dict(row_split=8, block_size=512), "row_split=8 leaves block_size=512")]:
        with pytest.raises(ValueError, match=match):
            FusedConfig(**{**base, **kwargs})


@pytest.mark.parametrize("algorithm", ["one_shot", "one_shot_push", "two_shot"])
@pytest.mark.parametrize("n_tokens", [1, 4, 16, 64, 128, 1024])
@pytest.mark.parametrize("hidden", [4096, 5120, 8192])
def test_space_splits_few_rows_of_the_one_shots(algorithm, n_tokens, hidden):
    """Split rows: one-shots only, at most FUSED_SPLIT_MAX_PROGRAMS programs (one per row part
    holding columns), every split distinct; whole-row configs as before."""
    space = fused_space(algorithm, n_tokens, hidden, 2, 2)
    split = [c for c in space if c.row_split > 1]
    whole = [c for c in space if c.row_split == 1]
    assert whole and all(c.num_blocks <= 8 or c.num_blocks // 2 < -(-n_tokens // c.rows_per_program)
                         for c in whole if algorithm != "two_shot")
    if algorithm == "two_shot" or n_tokens * 2 > FUSED_SPLIT_MAX_PROGRAMS:
        assert not split
        return
    assert {c.row_split for c in split} >= {2}
    fits = ALGORITHMS[algorithm].stage_bytes(n_tokens * hidden * 2, 2) <= DOUBLE_BUFFER_HALF_BYTES
    assert all(c.double_buffer == fits for c in split), "split rows: double-buffered wherever that fits"
    for c in split:
        parts = -(-hidden // (c.block_size // c.row_split))
        assert parts >= 2 and c.num_blocks == n_tokens * parts <= FUSED_SPLIT_MAX_PROGRAMS
        assert n_tokens * c.row_split <= FUSED_SPLIT_MAX_PROGRAMS and c.rows_per_program == 1


@pytest.mark.parametrize("algorithm", ["one_shot", "one_shot_push", "two_shot"])
@pytest.mark.parametrize("n_tokens, hidden", [(1, 8192), (3, 5120), (128, 4104), (8192, 7168)])
def test_space_whole_rows_useful_grids_double_buffer_where_it_fits(algorithm, n_tokens, hidden):
    space = fused_space(algorithm, n_tokens, hidden, 2, 2)
    assert space and len(space) == len(set(space)) and len(space) <= 200
    assert {c.block_size for c in space} == {fused_block_size(hidden)} and fused_block_size(hidden) >= hidden
    rows = -(-n_tokens // 2) if algorithm == "two_shot" else n_tokens
    assert all(c.num_blocks <= 8 or c.num_blocks // 2 < -(-rows // c.rows_per_program) for c in space
               if c.row_split == 1)
    fits = ALGORITHMS[algorithm].stage_bytes(n_tokens * hidden * 2, 2) <= DOUBLE_BUFFER_HALF_BYTES
    assert any(c.double_buffer for c in space) == (fits and algorithm != "two_shot")


def test_problem_keys_by_hidden_and_token_bucket():
    p = Problem.all_reduce_rmsnorm(300, 8192, "bf16", 2)
    assert (p.bucket, p.shape_key, p.nbytes, p.numel) == (300, "h8192", 300 * 8192 * 2, 300 * 8192)
    assert p.describe() == "all_reduce_rmsnorm bf16 ws=2 h8192 tokens/rank=300"
    with pytest.raises(ValueError, match="hidden"):
        Problem("all_reduce_rmsnorm", "bf16", 2, n_tokens_local=4, hidden=-1)
    empty = Problem("all_reduce_rmsnorm", "bf16", 2, n_tokens_local=4)  # no columns: nothing to exchange
    assert empty.record.empty_reason(empty) == "no rows: nothing to exchange"
    with pytest.raises(ValueError, match="dtype"):
        Problem.all_reduce_rmsnorm(4, 8192, "int8")


def test_eligibility():
    p = Problem.all_reduce_rmsnorm(4096, 8192, "bf16", 2)
    barrier_backends = [b for b in BACKENDS if not b.record.lamport]
    assert all(b.why_not(p, CAPS) is None for b in barrier_backends)
    # the Lamport variant: x within one slot of its receive buffers (64 MiB of x is not)
    lamport = get_backend("triton_fused_lamport")
    assert "Lamport" in lamport.why_not(p, CAPS)
    assert lamport.why_not(Problem.all_reduce_rmsnorm(8, 8192, "bf16", 2), CAPS) is None
    assert get_backend("nccl_fused").why_not(p, Capabilities(world_size=2)) is None
    assert BACKENDS[0].why_not(p, Capabilities(world_size=2)) == "no symmetric workspace"
    small = Capabilities(world_size=2, all_reduce_bytes=96 << 20)
    assert "exceeds" in BACKENDS[2].why_not(p, small) and BACKENDS[0].why_not(p, small) is None
    assert BACKENDS[0].why_not(Problem.all_reduce(4096), CAPS) == "does not serve all_reduce"


def test_dispatch_takes_the_fastest_servable_row_and_falls_back_to_nccl():
    db = TuningDB(":memory:")
    config = FusedConfig("one_shot", 8192, 16, 8)
    for backend, us, cfg in (("nccl_fused", 30.0, None), ("triton_fused_one_shot", 8.0, config)):
        db.record_many([Row(hardware=HW, world_size=2, op="all_reduce_rmsnorm", dtype="bf16", bucket=8, shape="h8192",
                       backend=backend, median_us=us, config=config_to_json(cfg), nccl_us=30.0)])
    source = [DBSource(db, "x.sqlite")]
    decision = decide(Problem.all_reduce_rmsnorm(5, 8192), "graph", CAPS, source, HW)
    assert (decision.backend, decision.config, decision.bucket) == ("triton_fused_one_shot", config, 8)
    assert decide(Problem.all_reduce_rmsnorm(5, 8192), "eager", Capabilities(world_size=2), source,
                  HW).backend == "nccl_fused"
    assert decide(Problem.all_reduce_rmsnorm(5, 4096), "eager", CAPS, source, HW).backend == "nccl_fused"


def _launch_two_shot(n_tokens, hidden):
    """Both simulated ranks' two-shot launchers, run phase by phase."""
    wss = simulated_workspaces(2, all_reduce_bytes=1 << 18, moe_bytes=256, double_buffer_bytes=1 << 17)
    problem = Problem.all_reduce_rmsnorm(n_tokens, hidden, "bf16", 2)
    config = FusedConfig("two_shot", fused_block_size(hidden), 4, 2, 1)
    gen = torch.Generator().manual_seed(hidden)
    xs = [torch.randn(n_tokens, hidden, generator=gen).bfloat16() for _ in range(2)]
    residual_in, weight = torch.randn(n_tokens, hidden, generator=gen).bfloat16(), torch.ones(hidden).bfloat16()
    launchers = [BACKENDS[2].prepare(problem, config, RunContext(workspace=ws)) for ws in wss]
    residuals = [residual_in.clone() for _ in wss]
    preset([ws.buffer for ws in wss], 2, 3)
    outs = [torch.full_like(x, float("nan")) for x in xs]
    for phase in (1, 2, 3):
        for rank in (0, 1):
            assert launchers[rank](xs[rank], residuals[rank], weight, 1e-6, phase=phase, out=outs[rank]) is outs[rank]
    return launchers, xs, residuals, residual_in, weight, outs


@requires_interpreter
def test_two_shot_launcher_stages_at_the_top_of_the_region():
    launchers, xs, residuals, residual_in, weight, outs = _launch_two_shot(3, 200)
    for rank in (0, 1):
        check(residuals[rank], outs[rank], xs, residual_in, weight, 1e-6)
    capacity = launchers[0].capacity
    assert launchers[0]._stage(3 * 200 * 2)[2] == (capacity - 2 * align(1200), capacity - align(1200))


@requires_interpreter
def test_one_rank_one_shot_launchers_and_bad_input():
    """World size 1 (no peer to wait for): the pull and push one-shots, single and double
    buffered, end to end through the launcher; bad tensors are BackendErrors naming them."""
    (ws,) = simulated_workspaces(1, all_reduce_bytes=1 << 16, moe_bytes=256, double_buffer_bytes=1 << 15)
    problem = Problem.all_reduce_rmsnorm(5, 136, "bf16", 1)
    gen = torch.Generator().manual_seed(0)
    x, residual_in = torch.randn(5, 136, generator=gen).bfloat16(), torch.randn(5, 136, generator=gen).bfloat16()
    weight = torch.randn(136, generator=gen).bfloat16()
    for backend in BACKENDS[:2]:
        for double in (False, True):
            launcher = backend.prepare(problem, FusedConfig(backend.algorithm, 256, 4, 3, 2, double),
                                       RunContext(workspace=ws))
            residual = residual_in.clone()
            check(residual, launcher(x, residual, weight, 1e-6), [x], residual_in, weight, 1e-6)
    for bad, match in [((x.float(), residual_in, weight), "x dtype"), ((x, residual_in[:, :128], weight), "residual"),
                       ((x, residual_in, weight[:8]), "weight"), ((x.t(), residual_in.t(), weight), "strides")]:
        with pytest.raises(BackendError, match=match):
            launcher(*bad)
    inside = ws.local_view("all_reduce", (5, 136), torch.bfloat16, ws.capacity("all_reduce") - align(5 * 136 * 2))
    with pytest.raises(BackendError, match="overlaps"):
        BACKENDS[0].prepare(problem, FusedConfig("one_shot", 256, 4, 3), RunContext(workspace=ws))(
            inside, residual_in.clone(), weight)
    with pytest.raises(BackendError, match="block_size=128 must be >= hidden=136"):
        BACKENDS[0].prepare(problem, FusedConfig("one_shot", 128, 4, 3), RunContext(workspace=ws))


@requires_interpreter
def test_split_launcher_replays_and_takes_whole_rows_beyond_its_scratch():
    """One rank (no peer to wait for), push and pull, a split-row config through the launcher:
    called twice (the scratch's counters are 0 again after each call), then with more rows than
    the stash holds for this hidden size, which run with whole rows (SPLIT=1) on the same grid."""
    (ws,) = simulated_workspaces(1, all_reduce_bytes=2 << 20, moe_bytes=256, double_buffer_bytes=1 << 15)
    hidden = 4096
    stash_rows = FUSED_STASH_BYTES // (4 * hidden)
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(hidden, generator=gen).half()
    for backend in BACKENDS[:2]:
        config = FusedConfig(backend.algorithm, 4096, 4, 6, 1, row_split=4)
        launcher = backend.prepare(Problem.all_reduce_rmsnorm(3, hidden, "fp16", 1), config, RunContext(workspace=ws))
        assert launcher.split_rows == stash_rows < FUSED_SPLIT_MAX_ROWS
        for n_rows in (3, 3, stash_rows + 1):
            x = torch.randn(n_rows, hidden, generator=gen).half()
            residual_in = torch.randn(n_rows, hidden, generator=gen).half()
            residual = residual_in.clone()
            check(residual, launcher(x, residual, weight, 1e-6), [x], residual_in, weight, 1e-6)
            assert int(split_scratch(ws)[0].count_nonzero()) == 0
        assert sorted({key[2] for key in launcher._variants}) == [1, 4], "split at 3 rows, whole rows beyond"


def test_lamport_spin_config_space_and_constexpr(monkeypatch):
    """FusedConfig.spin: the Lamport algorithm's alone, never in the tuner's space; the launcher's SPIN is spin_pack of a thread's share of
    the tile on a GPU at world size 2 (0 under the interpreter: the CTA-uniform wait)."""
    import dataclasses

    import autosymm.backends.launch as launch
    import autosymm.backends.triton_fused as module

    with pytest.raises(ValueError, match="spin=True is only for the Lamport"):
        FusedConfig("one_shot_push", 8192, 8, 1, spin=True)
    spin = FusedConfig("lamport", 8192, 16, 1, spin=True)
    assert config_from_json(config_to_json(spin)) == spin
    # not in the tuner's space (its FP8 case gave up waits on H200): the bench asks for it by config
    assert not any(c.spin for c in fused_space("lamport", 1, 8192, 2, 2))
    assert not any(c.spin for c in fused_space("lamport", 1, 8192, 4, 2))
    assert not any(c.spin for c in fused_space("one_shot_push", 1, 8192, 2, 2))
    recorded = []

    class FakeLean:
        def __init__(self, fn, grid, constexprs, **options):
            recorded.append(constexprs)

    monkeypatch.setattr(module, "LeanLauncher", FakeLean)
    wss = simulated_workspaces(2, all_reduce_bytes=1 << 16, moe_bytes=256)
    problem = Problem.all_reduce_rmsnorm(1, 8192, "bf16", 2)
    for config, interpreted, want in [(spin, False, 8), (spin, True, 0),  # 8192 / 512 threads: 16 a thread
                                      (dataclasses.replace(spin, num_warps=4, row_split=8), False, 8),
                                      (dataclasses.replace(spin, spin=False), False, 0)]:
        monkeypatch.setattr(launch, "interpreter_active", lambda: interpreted)
        launcher = get_backend("triton_fused_lamport").prepare(problem, config, RunContext(workspace=wss[0]))
        launcher._variant((False, 0, config.row_split, True, True, True, True, True, True))
        assert recorded[-1]["SPIN"] == want and recorded[-1]["LAMPORT"] is True  # the record's flags
