"""Decision tables of autosymm.dispatch over temporary databases."""

import pytest

from autosymm.backends import Capabilities
from autosymm.configs import AllReduceConfig, MoEConfig
from autosymm.db import Row, TuningDB
from autosymm.backends.triton_moe import DEFAULT_MOE_CONFIG
from autosymm.dispatch import DBSource, decide, open_sources
from autosymm.problem import MODEL_SHAPES, Problem

HW = "nvidia-h200-nvlink"
CAPS = Capabilities(world_size=2, all_reduce_bytes=256 << 20, moe_bytes=256 << 20, has_multicast=False,
                    intra_node=True, torch_symm_ops=True, compute_capability=(9, 0))
ONE_SHOT = AllReduceConfig("one_shot", 2048, 4, 8)
TWO_SHOT = AllReduceConfig("two_shot", 4096, 32, 16)
MULTIMEM = AllReduceConfig("multimem", 4096, 32, 16)


def _row(backend, bucket, us, config=None, mode="eager", dtype="bf16", op="all_reduce", shape="", nccl_us=None):
    return Row(hardware=HW, world_size=2, op=op, dtype=dtype, bucket=bucket, backend=backend, median_us=us,
               shape=shape, mode=mode, config=config, nccl_us=nccl_us, gpu="NVIDIA H200")


@pytest.fixture
def shipped():
    db = TuningDB(":memory:")
    for bucket in (4096, 65536, 1 << 20):
        db.record_many([
            _row("nccl", bucket, 20.0, nccl_us=20.0),
            _row("triton_one_shot", bucket, 5.0 if bucket < (1 << 20) else 12.0, ONE_SHOT, nccl_us=20.0),
            _row("triton_two_shot", bucket, 9.0, TWO_SHOT, nccl_us=20.0),
            _row("triton_multimem", bucket, 3.0, MULTIMEM, nccl_us=20.0),  # fastest, but needs multicast
        ])
    db.record(_row("nccl", 1 << 28, 900.0, nccl_us=900.0))
    db.record(_row("triton_two_shot", 1 << 28, 1000.0, TWO_SHOT, nccl_us=900.0))  # NCCL faster here
    db.record(_row("triton_two_shot", 65536, 4.0, TWO_SHOT, mode="graph", nccl_us=15.0))
    return DBSource(db, "shipped.sqlite")


def _ar(nbytes, dtype="bf16", world_size=2):
    return Problem.all_reduce(nbytes, dtype, world_size)


def test_fastest_servable_row_wins_and_unservable_is_skipped(shipped):
    decision = decide(_ar(4096), "eager", CAPS, [shipped], HW)
    assert decision.backend == "triton_one_shot" and decision.config == ONE_SHOT
    assert decision.expected_us == 5.0 and decision.nccl_us == 20.0
    assert decision.source == "shipped.sqlite"
    assert any(s.startswith("triton_multimem") for s in decision.skipped)


def test_multimem_used_only_with_multicast(shipped):
    caps = Capabilities(**{**CAPS.__dict__, "has_multicast": True})
    assert decide(_ar(4096), "eager", caps, [shipped], HW).backend == "triton_multimem"


def test_nccl_wins_where_it_measured_faster(shipped):
    decision = decide(_ar(1 << 28), "eager", CAPS, [shipped], HW)
    assert decision.backend == "nccl" and decision.expected_us == 900.0


@pytest.mark.parametrize("nbytes, bucket", [(1, 4096), (4097, 65536), (65536, 65536), (70000, 1 << 20),
                                            (3 << 20, 1 << 28), (1 << 30, 1 << 28)])
def test_bucket_rule_next_tuned_or_largest(shipped, nbytes, bucket):
    assert decide(_ar(nbytes), "eager", CAPS, [shipped], HW).bucket == bucket


def test_user_db_comes_before_shipped(shipped):
    user = TuningDB(":memory:")
    user.record(_row("triton_two_shot", 4096, 7.0, TWO_SHOT))
    decision = decide(_ar(4096), "eager", CAPS, [DBSource(user, "user.sqlite"), shipped], HW)
    assert decision.backend == "triton_two_shot" and decision.source == "user.sqlite"


def test_graph_mode_rows_and_mode_fallback(shipped):
    graph = decide(_ar(65536), "graph", CAPS, [shipped], HW)
    assert graph.backend == "triton_two_shot" and graph.expected_us == 4.0 and graph.mode == "graph"
    # graph rows exist only at 64 KiB: the bucket rule takes that row for 4 KiB as well
    assert decide(_ar(4096), "graph", CAPS, [shipped], HW).bucket == 65536
    eager_only = TuningDB(":memory:")
    eager_only.record(_row("triton_one_shot", 4096, 5.0, ONE_SHOT))
    other = decide(_ar(4096), "graph", CAPS, [DBSource(eager_only, "e.sqlite")], HW)
    assert other.backend == "triton_one_shot" and "eager-mode row" in other.reason


def test_other_dtype_uses_bf16_row_of_same_bytes(shipped):
    decision = decide(_ar(4096, dtype="fp32"), "eager", CAPS, [shipped], HW)
    assert decision.backend == "triton_one_shot" and "bf16" in decision.reason


def test_no_rows_falls_back_to_nccl():
    empty = DBSource(TuningDB(":memory:"), "empty.sqlite")
    decision = decide(_ar(4096), "eager", CAPS, [empty], HW)
    assert decision.backend == "nccl" and "no tuned row" in decision.reason
    assert decide(_ar(4096), "eager", CAPS, [], "other-hardware").backend == "nccl"


def test_rows_of_other_hardware_or_world_size_are_not_used(shipped):
    assert decide(_ar(4096), "eager", CAPS, [shipped], "nvidia-h100-nvlink").backend == "nccl"
    caps4 = Capabilities(**{**CAPS.__dict__, "world_size": 4})
    assert decide(_ar(4096, world_size=4), "eager", caps4, [shipped], HW).backend == "nccl"


def test_size_over_workspace_skips_symmetric_backends(shipped):
    small = Capabilities(**{**CAPS.__dict__, "all_reduce_bytes": 1024})
    decision = decide(_ar(4096), "eager", small, [shipped], HW)
    assert decision.backend == "nccl"
    assert any("triton_one_shot" in s for s in decision.skipped)


def test_world_size_one_is_noop_and_multinode_is_nccl(shipped, monkeypatch):
    caps1 = Capabilities(**{**CAPS.__dict__, "world_size": 1})
    assert decide(_ar(4096, world_size=1), "eager", caps1, [shipped], HW).backend == "noop"
    multi = Capabilities(**{**CAPS.__dict__, "intra_node": False})
    assert decide(_ar(4096), "eager", multi, [shipped], HW).reason.startswith("group spans nodes")


def test_disable_env_forces_nccl(shipped, monkeypatch):
    monkeypatch.setenv("AUTOSYMM_DISABLE", "1")
    decision = decide(_ar(4096), "eager", CAPS, [shipped], HW)
    assert decision.backend == "nccl" and "AUTOSYMM_DISABLE" in decision.reason


def test_moe_rows_and_untuned_default():
    shape = MODEL_SHAPES["deepseek-v3"]
    db = TuningDB(":memory:")
    tuned = MoEConfig(2048, 8, 2, 132)
    db.record(_row("triton_moe", 128, 30.0, tuned, op="dp_to_ep", shape=shape.key, nccl_us=400.0))
    db.record(_row("nccl_all_to_all", 128, 400.0, None, op="dp_to_ep", shape=shape.key, nccl_us=400.0))
    source = DBSource(db, "moe.sqlite")
    problem = Problem.moe("dp_to_ep", shape, 100, "bf16", 2)
    decision = decide(problem, "eager", CAPS, [source], HW)
    assert decision.backend == "triton_moe" and decision.config == tuned and decision.bucket == 128
    other_shape = Problem.moe("dp_to_ep", MODEL_SHAPES["mixtral-8x7b"], 100, "bf16", 2)
    fallback = decide(other_shape, "graph", CAPS, [source], HW)
    assert fallback.backend == "triton_moe" and fallback.config == DEFAULT_MOE_CONFIG
    assert "untuned default" in fallback.reason
    no_workspace = Capabilities(world_size=2)
    assert decide(other_shape, "eager", no_workspace, [source], HW).backend == "nccl_all_to_all"


def test_open_sources_skips_missing_and_corrupt(tmp_path):
    good = tmp_path / "good.sqlite"
    TuningDB(good).record(_row("nccl", 4096, 20.0))
    corrupt = tmp_path / "corrupt.sqlite"
    corrupt.write_bytes(b"this is not sqlite" * 100)
    with pytest.warns(UserWarning, match="ignoring tuning database"):
        sources = open_sources(tmp_path / "missing.sqlite", [good, corrupt])
    assert [s.label for s in sources] == [str(good)]


def test_graph_mode_skips_backends_that_cannot_be_captured():
    shape = MODEL_SHAPES["mixtral-8x7b"]
    db = TuningDB(":memory:")
    db.record(_row("nccl_all_to_all", 1, 20.0, None, op="ep_to_dp", shape=shape.key))  # pretend it won eagerly
    db.record(_row("triton_moe", 1, 25.0, MoEConfig(512, 4), op="ep_to_dp", shape=shape.key))
    source = DBSource(db, "moe.sqlite")
    problem = Problem.moe("ep_to_dp", shape, 1, "bf16", 2)
    assert decide(problem, "eager", CAPS, [source], HW).backend == "nccl_all_to_all"
    graph = decide(problem, "graph", CAPS, [source], HW)
    assert graph.backend == "triton_moe" and "nccl_all_to_all: not CUDA-graph capturable" in graph.skipped


def test_rows_of_other_torch_or_triton_versions_serve_and_say_so():
    import torch

    from autosymm.hardware import running_versions

    db = TuningDB(":memory:")
    old = Row(hardware=HW, world_size=2, op="all_reduce", dtype="bf16", bucket=4096, backend="triton_one_shot",
              median_us=5.0, config=ONE_SHOT, torch_version="0.0.1", triton_version=running_versions()[1])
    db.record(old)
    decision = decide(Problem.all_reduce(4096), "eager", CAPS, [DBSource(db, "x")], HW)
    assert decision.backend == "triton_one_shot"
    assert "measured with torch 0.0.1" in decision.reason and f"running torch {torch.__version__}" in decision.reason
    db.record(Row(**{**old.to_dict(), "torch_version": torch.__version__}))
    assert "measured with" not in decide(Problem.all_reduce(4096), "eager", CAPS, [DBSource(db, "x")], HW).reason
